"""Which SGLang launch flags a run may set: tuning only; what the box manages or what loads code is refused.

`RunSpec.server_args` reach every server's command line. SGLang 0.5.23's parser lets the last spelling of a
flag win and accepts unambiguous abbreviations (`argparse`'s default `allow_abbrev`), so a run that could
pass any flag could rebind the servers (`--host 0.0.0.0`), drop their key (`--api-key=`), take their port,
or make them run code (`--trust-remote-code`, `--enable-custom-logit-processor`: requests then carry
`dill`-serialized functions). A run's flags are therefore judged here, at RunSpec validation and again in the
launcher, before SGLang's own parser judges their values (`datagen check`):

- every option is written in full (`--flag value` or `--flag=value`); abbreviations and other spellings
  are refused, since a prefix can stand for a managed flag;
- a managed flag is refused with the reason (MANAGED_FLAGS);
- anything else must be on the allow-list of tuning flags (TUNING_FLAGS, documented in docs/real-engine.md).

`tests/conformance/test_launch_conformance.py` checks both lists against the real parser: every name is a
real flag, and every alias of a managed flag is managed too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["MANAGED_FLAGS", "TUNING_FLAGS", "ServerArgsError", "check_server_args"]

_BOX = "set by the box (its Settings), never by a run"
_RUNSPEC = "set from the run spec's own field"
_LOADED = "changes what the servers load; the model, its tokenizer and weights are the box's"
_CODE = "makes the servers run code a run supplies"
_GPU = "one server per GPU is how the box is laid out"

# Managed: the launcher sets these, or they load code or change what is loaded (reason shown in the refusal).
MANAGED_FLAGS: dict[str, str] = {
    "--model-path": f"the model directory is RunSpec.model_path ({_RUNSPEC}, confined to DATAGEN_MODEL_ROOTS)",
    "--model": "alias of --model-path: the model directory is RunSpec.model_path",
    "--tokenizer-path": f"{_LOADED}; prompts are rendered with the model's own tokenizer",
    "--tokenizer-mode": _LOADED,
    "--served-model-name": f"RunSpec.served_model_name ({_RUNSPEC})",
    "--host": f"servers bind to DATAGEN_SERVER_HOST ({_BOX})",
    "--port": f"the fleet assigns each server its port (DATAGEN_BASE_PORT, {_BOX})",
    "--api-key": f"the servers' key is DATAGEN_SGLANG_API_KEY or a random per-run key ({_BOX})",
    "--admin-api-key": f"admin access to the servers is {_BOX}",
    "--nccl-port": "the fleet assigns each server a distinct free NCCL port",
    "--config": "a YAML file of launch flags could set any managed flag; the launcher uses it for the key",
    "--context-length": f"RunSpec.context_length ({_RUNSPEC})",
    "--reasoning-parser": "the pipeline reads Qwen3 reasoning (qwen3)",
    "--trust-remote-code": f"{_CODE} (Python files of the model directory)",
    "--enable-custom-logit-processor": f"{_CODE} (requests carry dill-serialized logit processors)",
    "--tp-size": _GPU,
    "--tensor-parallel-size": _GPU,
    "--dp-size": _GPU,
    "--data-parallel-size": _GPU,
    "--base-gpu-id": _GPU,
    "--gpu-id-step": _GPU,
    "--load-format": _LOADED,
    "--revision": _LOADED,
    "--dtype": f"{_LOADED} (the data must be the target model's own outputs at its own precision)",
    "--quantization": f"{_LOADED} (the data must be the target model's own outputs at its own precision)",
    "--json-model-override-args": _LOADED,
    "--language-model-only": _LOADED,
    "--chat-template": f"{_LOADED}; prompts are rendered with the model's own chat template",
    "--enable-lora": _LOADED,
    "--lora-paths": _LOADED,
    "--speculative-draft-model-path": _LOADED,
    "--speculative-draft-model": "alias of --speculative-draft-model-path: " + _LOADED,
    "--custom-weight-loader": _CODE,
    "--forward-hooks": _CODE,
}

# Tuning: memory plan, scheduling, kernels, speculative decoding, observability. Values are judged by the
# engine's own parser (`datagen check`). Documented in docs/real-engine.md ("Run-spec server_args").
TUNING_FLAGS: frozenset[str] = frozenset(
    {
        # memory plan
        "--mem-fraction-static",
        "--max-running-requests",
        "--max-queued-requests",
        "--max-total-tokens",
        "--chunked-prefill-size",
        "--max-prefill-tokens",
        "--page-size",
        "--disable-radix-cache",
        "--radix-eviction-policy",
        "--kv-cache-dtype",
        "--mamba-ssm-dtype",
        "--mamba-full-memory-ratio",
        "--max-mamba-cache-size",
        "--mamba-radix-cache-strategy",
        "--mamba-track-interval",
        "--enable-hierarchical-cache",
        "--enable-hicache",
        "--hicache-ratio",
        "--hicache-size",
        # scheduling
        "--schedule-policy",
        "--schedule-conservativeness",
        "--disable-overlap-schedule",
        "--num-continuous-decode-steps",
        "--enable-mixed-chunk",
        "--skip-server-warmup",
        "--watchdog-timeout",
        "--random-seed",
        "--enable-deterministic-inference",
        # kernels and CUDA graphs
        "--attention-backend",
        "--prefill-attention-backend",
        "--decode-attention-backend",
        "--linear-attn-backend",
        "--sampling-backend",
        "--cuda-graph-max-bs-decode",
        "--cuda-graph-max-bs-prefill",
        "--cuda-graph-backend-decode",
        "--cuda-graph-backend-prefill",
        "--disable-decode-cuda-graph",
        "--disable-prefill-cuda-graph",
        "--disable-cuda-graph",
        "--disable-cuda-graph-padding",
        "--enable-torch-compile",
        "--torch-compile-max-bs",
        # speculative decoding (the model's own MTP head: no draft model path)
        "--speculative-algorithm",
        "--speculative-num-steps",
        "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
        "--speculative-accept-threshold-single",
        "--speculative-accept-threshold-acc",
        "--speculative-attention-mode",
        "--speculative-draft-attention-backend",
        # observability and the OpenAI-compatible surface (the pipeline sends token ids to /generate)
        "--log-level",
        "--log-level-http",
        "--log-requests",
        "--log-requests-level",
        "--enable-metrics",
        "--enable-cache-report",
        "--decode-log-interval",
        "--default-chat-template-kwargs",
    }
)

# argparse reads a token that looks like a negative number as a value, anything else starting with "-" as an option.
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class ServerArgsError(ValueError):
    """A run's server_args hold a flag the run may not set; the message names it and says why."""


def _refusal(token: str, name: str) -> str | None:
    """Why `token` (an option whose name is `name`) is refused, or None when it is an allowed tuning flag."""
    if name in TUNING_FLAGS:
        return None
    if name in MANAGED_FLAGS:
        return f"{token!r}: {name} is managed by the pipeline: {MANAGED_FLAGS[name]}"
    dashed = "--" + name[2:].replace("_", "-") if name.startswith("--") else name
    meant = sorted(
        {f for f in (*MANAGED_FLAGS, *TUNING_FLAGS) if f == dashed or (len(name) > 2 and f.startswith(name))}
    )
    managed = [f for f in meant if f in MANAGED_FLAGS]
    if managed:
        return (
            f"{token!r} could stand for {', '.join(managed)}, which the pipeline manages: {MANAGED_FLAGS[managed[0]]}"
        )
    if meant:
        return (
            f"{token!r}: write tuning flags in full as SGLang names them (did you mean {', '.join(meant)}?); "
            "SGLang's parser also accepts abbreviations, so a short spelling could stand for a managed flag"
        )
    return f"{token!r} is not on the allow-list of tuning flags (docs/real-engine.md, 'Run-spec server_args')"


def check_server_args(args: Sequence[str]) -> None:
    """Raise ServerArgsError naming every option of `args` a run may not set (values are the engine's to judge)."""
    problems: list[str] = []
    for token in args:
        if not token.startswith("-") or _NEGATIVE_NUMBER.match(token):
            continue  # a value
        if token == "--" or not token.startswith("--"):
            problems.append(f"{token!r}: only long options (--flag value or --flag=value) are accepted")
            continue
        why = _refusal(token, token.split("=", 1)[0])
        if why is not None:
            problems.append(why)
    if problems:
        raise ServerArgsError("server_args: " + "; ".join(problems))
