"""Command line of the stand-in: SGLang 0.5.23's flags (the subset this project uses), same names and defaults."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path

__all__ = [
    "ATTENTION_BACKEND_CHOICES",
    "LANGUAGE_MODEL_ONLY_ARCHITECTURES",
    "LINEAR_ATTN_BACKEND_CHOICES",
    "build_parser",
    "human_readable_int",
    "main",
    "merge_config",
    "parse_args",
    "resolve_settings",
]

# sglang/srt/arg_groups/choices.py: ATTENTION_BACKEND_CHOICES (0.5.23).
ATTENTION_BACKEND_CHOICES = (
    "triton",
    "torch_native",
    "flex_attention",
    "dsa",
    "nsa",
    "qsa",
    "dsv4",
    "compressed",
    "fa3",
    "fa4",
    "flashinfer",
    "llada2_cfg_flashinfer",
    "flashmla",
    "trtllm_mla",
    "cutedsl_mla",
    "tokenspeed_mla",
    "trtllm_mha",
    "hpc_ops",
    "minicpm_flashattn",
    "minicpm_flashinfer",
    "aiter",
    "wave",
    "intel_amx",
    "ascend",
    "intel_xpu",
)
LINEAR_ATTN_BACKEND_CHOICES = (
    "triton",
    "cutedsl",
    "flashinfer",
    "flashkda",
    "nvidia_kda",
    "ptx_kda",
    "helion",
    "intel_xpu",
)
SCHEDULE_POLICY_CHOICES = (
    "lpm",
    "random",
    "fcfs",
    "dfs-weight",
    "lof",
    "priority",
    "routing-key",
    "hrrn",
    "shortest-prefill-first",
)
SAMPLING_BACKEND_CHOICES = ("flashinfer", "pytorch", "ascend", "intel_xpu")
# server_args.py: "auto" + the reasoning parser registry (0.5.23); tests/conformance compares them.
REASONING_PARSER_CHOICES = (
    "auto",
    "apertus2509",
    "beam",
    "deepseek-r1",
    "deepseek-v3",
    "deepseek-v4",
    "deepseek-v41",
    "dots",
    "glm45",
    "ling3",
    "hunyuan",
    "gpt-oss",
    "k2_horizon",
    "kimi",
    "kimi_k2",
    "kimi_k3",
    "mimo",
    "muse",
    "poolside_v1",
    "qwen3",
    "qwen3-thinking",
    "minimax",
    "minimax-append-think",
    "minimax-m3",
    "nanbeige",
    "step3",
    "step3p5",
    "mistral",
    "nemotron_3",
    "granite_thinking_parser",
    "interns1",
    "gemma4",
    "inkling",
    "iquest_q1",
    "cohere_command4",
    "gigachat35",
    "response_template",
)
# server_args.py: "auto" + the function-call parser registry (0.5.23).
TOOL_CALL_PARSER_CHOICES = (
    "auto",
    "apertus2509",
    "beam",
    "cohere_command4",
    "deepseekv3",
    "deepseekv31",
    "deepseekv32",
    "deepseekv4",
    "deepseekv41",
    "dots",
    "glm",
    "glm45",
    "glm47",
    "gpt-oss",
    "k2_horizon",
    "kimi_k2",
    "kimi_k3",
    "lfm2",
    "ling3",
    "llama3",
    "mimo",
    "minicpm5",
    "mistral",
    "muse",
    "poolside_v1",
    "pythonic",
    "qwen",
    "qwen25",
    "qwen3_coder",
    "spark25",
    "step3",
    "step3p5",
    "minimax-m2",
    "minimax-m3",
    "nanbeige",
    "trinity",
    "interns1",
    "hermes",
    "hunyuan",
    "gigachat3",
    "gigachat35",
    "gemma4",
    "inkling",
    "iquest_q1",
    "response_template",
)
LOAD_FORMAT_CHOICES = (
    "auto",
    "pt",
    "safetensors",
    "instanttensor",
    "npcache",
    "dummy",
    "sharded_state",
    "presharded",
    "gguf",
    "expert_pack",
    "bitsandbytes",
    "mistral",
    "layered",
    "flash_rl",
    "remote",
    "remote_instance",
    "fastsafetensors",
    "private",
    "runai_streamer",
)
MAMBA_STRATEGY_CHOICES = ("auto", "no_buffer", "extra_buffer", "extra_buffer_lazy")
MAMBA_SSM_DTYPE_CHOICES = ("float32", "bfloat16", "float16")
CUDA_GRAPH_BACKEND_CHOICES = ("full", "breakable", "disabled")
# Not argparse choices in 0.5.23 (any string parses); resolution takes these, in any case
# (`SpeculativeAlgorithm.from_string`: the enum's members plus the alias NEXTN), and rejects the rest.
SPECULATIVE_ALGORITHM_CHOICES = (
    "DFLASH",
    "UNO",
    "DSPARK",
    "EAGLE",
    "EAGLE3",
    "FROZEN_KV_MTP",
    "STANDALONE",
    "NGRAM",
    "NONE",
    "NEXTN",
)
# ServerArgs.LANGUAGE_MODEL_ONLY_ARCHITECTURES (0.5.23): Qwen3.6 is not among them.
LANGUAGE_MODEL_ONLY_ARCHITECTURES = (
    "DeepseekV4ForCausalLM",
    "MuseGlimmerForConditionalGeneration",
    "Cosmos3ForConditionalGeneration",
    "Cosmos3EdgeForConditionalGeneration",
)

_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")
_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def human_readable_int(value: str) -> int:
    """32768, 32k (32000), 25.6k or 32Ki (32768), case-sensitive, as SGLang's `utils/common.py` parses them."""
    value = value.strip()
    match = _HUMAN_INT.fullmatch(value)
    if match:
        number, suffix = match.groups()
        if suffix in _IEC:
            if "." in number:
                raise argparse.ArgumentTypeError(
                    f"Decimals are not allowed with IEC suffixes like '{suffix}'. "
                    f"Use an integer IEC value such as '{int(Decimal(number))}{suffix}', "
                    f"or an SI value such as '{number}{suffix[0]}'."
                )
            return int(number) * _IEC[suffix]
        return int(Decimal(number) * _SI[suffix])
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"Invalid integer value: '{value}'. "
            "Use a plain integer, SI suffixes (1k, 1M), or IEC suffixes (1Ki, 1Mi). "
            "Suffixes are case-sensitive."
        ) from None


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser; `--help` output is argparse's standard one so flag checkers can parse it."""
    p = argparse.ArgumentParser(
        prog="sglang serve",
        description="CPU stand-in for SGLang 0.5.23's HTTP server (datagen). Same flags, synthetic outputs.",
        allow_abbrev=True,
    )
    add = p.add_argument
    # Model and serving.
    add("--model-path", "--model", dest="model_path", required=True, help="Model directory (tokenizer + template).")
    add("--served-model-name", default=None, help="Name returned by /v1/models (default: the model path).")
    add("--host", default="127.0.0.1", help="Address to bind.")
    add("--port", type=int, default=30000, help="Port to bind.")
    add("--api-key", default=None, help="Require `Authorization: Bearer <key>` on all but health/ready/metrics.")
    add("--admin-api-key", default=None, help="Key for admin endpoints (e.g. /flush_cache).")
    add("--trust-remote-code", action="store_true", help="Accepted for compatibility; no effect.")
    add("--load-format", default="auto", choices=LOAD_FORMAT_CHOICES, help="Weight format (no weights are loaded).")
    add("--context-length", type=human_readable_int, default=None, help="Context length (32768, 32k, 32Ki).")
    add("--language-model-only", action="store_true", help="Skip the vision tower.")
    # Parallelism and devices.
    add("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1, help="Tensor parallel size.")
    add("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1, help="Data parallel replicas.")
    add("--base-gpu-id", type=int, default=0, help="First GPU id.")
    add("--gpu-id-step", type=int, default=1, help="GPU id step.")
    add("--nccl-port", type=int, default=None, help="NCCL port.")
    add("--random-seed", type=int, default=None, help="Random seed.")
    add("--watchdog-timeout", type=float, default=300.0, help="Seconds a forward batch may take.")
    # Memory and scheduling.
    add("--mem-fraction-static", type=float, default=None, help="Fraction of GPU memory for weights and pools.")
    add("--max-running-requests", type=int, default=None, help="Maximum running requests (per DP rank).")
    add("--max-queued-requests", type=int, default=None, help="Maximum waiting requests; beyond it 503.")
    add("--chunked-prefill-size", type=int, default=None, help="Chunked prefill size (-1 disables).")
    add("--schedule-policy", default="fcfs", choices=SCHEDULE_POLICY_CHOICES, help="Scheduling policy.")
    add("--disable-overlap-schedule", action="store_true", help="No CPU/GPU overlap (mamba no_buffer needs it).")
    add("--disable-radix-cache", action="store_true", help="Disable the prefix cache.")
    add("--enable-hierarchical-cache", "--enable-hicache", dest="enable_hierarchical_cache", action="store_true")
    # Kernels.
    add("--attention-backend", default=None, choices=ATTENTION_BACKEND_CHOICES, help="Attention backend.")
    add("--prefill-attention-backend", default=None, choices=ATTENTION_BACKEND_CHOICES)
    add("--decode-attention-backend", default=None, choices=ATTENTION_BACKEND_CHOICES)
    add("--linear-attn-backend", default="triton", choices=LINEAR_ATTN_BACKEND_CHOICES)
    add("--sampling-backend", default=None, choices=SAMPLING_BACKEND_CHOICES, help="Sampling backend.")
    add("--cuda-graph-max-bs-decode", type=int, default=None, help="Largest decode batch captured in a CUDA graph.")
    add("--cuda-graph-backend-decode", default=None, choices=CUDA_GRAPH_BACKEND_CHOICES)
    add("--cuda-graph-backend-prefill", default=None, choices=CUDA_GRAPH_BACKEND_CHOICES)
    add("--disable-decode-cuda-graph", action="store_true")
    add("--disable-cuda-graph", action="store_true", help="Deprecated: disables both CUDA graph backends.")
    # Hybrid (mamba / linear attention) cache.
    add("--mamba-radix-cache-strategy", default="auto", choices=MAMBA_STRATEGY_CHOICES)
    add("--mamba-track-interval", type=int, default=256)
    add("--mamba-ssm-dtype", default=None, choices=MAMBA_SSM_DTYPE_CHOICES)
    add("--max-mamba-cache-size", type=int, default=None)
    add("--mamba-full-memory-ratio", type=float, default=0.9)
    # Speculative decoding.
    add("--speculative-algorithm", default=None, help=f"One of {', '.join(SPECULATIVE_ALGORITHM_CHOICES)}.")
    add("--speculative-num-steps", type=int, default=None)
    add("--speculative-eagle-topk", type=int, default=None)
    add("--speculative-num-draft-tokens", type=int, default=None)
    # OpenAI-compatible API behaviour.
    add("--reasoning-parser", default=None, choices=REASONING_PARSER_CHOICES, help="Reasoning parser (qwen3).")
    add("--tool-call-parser", default=None, choices=TOOL_CALL_PARSER_CHOICES)
    add(
        "--default-chat-template-kwargs",
        type=json.loads,  # any JSON parses; resolution insists on an object
        default=None,
        help="JSON object, e.g. '{\"enable_thinking\": true}'.",
    )
    add("--sampling-defaults", default="model", choices=("model", "openai"))
    add("--allow-auto-truncate", action="store_true", help="Truncate over-long inputs instead of 400.")
    add("--skip-server-warmup", action="store_true", help="Go Up immediately, without a warmup request.")
    # Observability.
    add("--log-level", default="info", help="Logging level.")
    add("--log-level-http", default=None, help="Logging level of the HTTP server (default: --log-level).")
    add("--log-requests", action="store_true", help="Log every request.")
    add("--log-requests-level", type=int, default=2, choices=(0, 1, 2, 3))
    add("--enable-metrics", action="store_true", help="Serve Prometheus /metrics.")
    add("--enable-cache-report", action="store_true", help="Report cached tokens in OpenAI usage.")
    add(
        "--config",
        type=str,
        help="Read CLI options from a config file. Must be a YAML file with configuration options.",
    )
    return p


def _config_keys(action: argparse.Action) -> set[str]:
    return {action.dest} | {o[2:].replace("-", "_") for o in action.option_strings if o.startswith("--")}


def merge_config(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """`argv` with a `--config FILE.yaml` replaced by its options placed first, as SGLang 0.5.23 merges it.

    `utils/server_args_config_parser.py: ConfigArgumentMerger`: only the exact token `--config` counts, one at
    most; YAML keys become `--<key>` as written (so `api-key`, not `api_key`); true store_true keys add the flag,
    false ones nothing; lists add their items, mappings their JSON, scalars `str(value)`. Command-line flags
    after the merge win (argparse keeps the last).
    """
    argv = list(argv)
    at = [i for i, a in enumerate(argv) if a == "--config"]
    if not at:
        return argv
    if len(at) > 1:
        raise ValueError("Multiple config files specified! Only one allowed.")
    if at[0] == len(argv) - 1:
        raise ValueError("No config file specified after --config flag!")
    path = Path(argv[at[0] + 1])
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ValueError(f"Config file must be YAML format, got: {path.suffix}")
    if not path.exists():
        raise ValueError(f"Config file not found: {path}")
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError("Config file must contain a dictionary at root level")
    store_true = {k for a in parser._actions if isinstance(a, argparse._StoreTrueAction) for k in _config_keys(a)}
    merged: list[str] = []
    for key, value in data.items():
        if isinstance(value, bool):
            if key.replace("-", "_") not in store_true:
                merged += [f"--{key}", str(value).lower()]
            elif value:
                merged.append(f"--{key}")
        elif isinstance(value, list):
            if value:
                merged += [f"--{key}", *(str(v) for v in value)]
        elif isinstance(value, dict):
            merged += [f"--{key}", json.dumps(value)]
        else:
            merged += [f"--{key}", str(value)]
    return merged + argv[: at[0]] + argv[at[0] + 2 :]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (a `--config` file merged first, as SGLang does); errors exit with code 2."""
    parser = build_parser()
    args = list(argv) if argv is not None else sys.argv[1:]
    return parser.parse_args(merge_config(parser, args))


# configs/hybrid_arch.py: hybrid_gdn_config (Qwen3-Next, Qwen3.5/3.6 dense and MoE), by config type.
_HYBRID_GDN_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe"})


def _model_config(model_path: str) -> dict[str, object]:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def _architectures(config: dict[str, object]) -> list[str]:
    archs = config.get("architectures")
    return [str(a) for a in archs] if isinstance(archs, list) else []


def _check_mamba_radix_cache(args: argparse.Namespace, config: dict[str, object]) -> None:
    """overrides.py: _mamba_radix_cache_resolution, then mamba_hook.py: validate_mamba_no_buffer."""
    if args.disable_radix_cache or config.get("model_type") not in _HYBRID_GDN_MODEL_TYPES:
        return
    strategy, no_overlap = args.mamba_radix_cache_strategy, args.disable_overlap_schedule
    if strategy == "auto":
        strategy = "no_buffer" if no_overlap else "extra_buffer"  # auto + no_buffer also turns overlap off
        no_overlap = True
    if strategy != "no_buffer":
        return
    if not no_overlap:
        raise AssertionError("no_buffer do not support overlap schedule. Try to set disable_overlap_schedule=True.")
    if args.attention_backend == "trtllm_mha":
        raise AssertionError("no_buffer do not support trtllm_mha attention backend.")


def resolve_settings(args: argparse.Namespace) -> None:
    """The checks of SGLang 0.5.23's settings resolution that the stand-in reproduces (same error and text).

    Real SGLang parses first and rejects combinations only while resolving (`ServerArgs.resolve_once`), so
    these pass argparse and still stop the server; tests/conformance compares both on the same argv.
    """
    # serving_hook.py: handle_other_validations
    if args.default_chat_template_kwargs is not None and not isinstance(args.default_chat_template_kwargs, dict):
        raise ValueError("--default-chat-template-kwargs must decode to a JSON object")
    # speculative/spec_info.py: SpeculativeAlgorithm.from_string (case-insensitive)
    if args.speculative_algorithm is not None:
        name = str(args.speculative_algorithm).upper()
        if name not in SPECULATIVE_ALGORITHM_CHOICES:
            raise ValueError(f"Unknown speculative algorithm name: {args.speculative_algorithm}")
        args.speculative_algorithm = None if name == "NONE" else name
    config = _model_config(args.model_path)
    # model_hook.py: handle_language_model_only
    if args.language_model_only:
        architectures = _architectures(config)
        if not any(a in LANGUAGE_MODEL_ONLY_ARCHITECTURES for a in architectures):
            raise ValueError(
                f"--language-model-only does not support {architectures}. "
                f"Supported: {list(LANGUAGE_MODEL_ONLY_ARCHITECTURES)}."
            )
    _check_mamba_radix_cache(args, config)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m datagen.standin`: parse, load, serve; returns the exit code."""
    args = parse_args(argv)
    resolve_settings(args)  # a ValueError ends the process with its traceback and exit code 1, as in SGLang
    # Heavy imports (transformers, numpy, uvicorn) only after the flags are known to be valid,
    # so `--help` and flag errors stay fast.
    from datagen.standin.server import serve

    raw = list(argv) if argv is not None else sys.argv[1:]
    # SGLang's launch_command is the argv after the config merge (`prepare_server_args`).
    return serve(args, merge_config(build_parser(), raw))
