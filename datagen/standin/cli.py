"""Command line of the stand-in: SGLang 0.5.23's flags (the subset this project uses), same names and defaults."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ATTENTION_BACKEND_CHOICES",
    "LINEAR_ATTN_BACKEND_CHOICES",
    "build_parser",
    "human_readable_int",
    "main",
    "parse_args",
    "redacted_argv",
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
SAMPLING_BACKEND_CHOICES = ("flashinfer", "pytorch", "ascend")
REASONING_PARSER_CHOICES = (
    "auto",
    "deepseek-r1",
    "deepseek-v3",
    "glm45",
    "gpt-oss",
    "interns1",
    "kimi",
    "kimi_k2",
    "minimax",
    "minimax-append-think",
    "nano_v3",
    "qwen3",
    "qwen3-thinking",
    "step3",
)
TOOL_CALL_PARSER_CHOICES = (
    "deepseekv3",
    "deepseekv31",
    "glm",
    "glm45",
    "gpt-oss",
    "kimi_k2",
    "llama3",
    "mistral",
    "pythonic",
    "qwen",
    "qwen25",
    "qwen3_coder",
    "step3",
)
LOAD_FORMAT_CHOICES = (
    "auto",
    "pt",
    "safetensors",
    "npcache",
    "dummy",
    "sharded_state",
    "gguf",
    "bitsandbytes",
    "layered",
    "flash_rl",
    "remote",
    "remote_instance",
    "fastsafetensors",
    "private",
)
MAMBA_STRATEGY_CHOICES = ("auto", "no_buffer", "extra_buffer", "extra_buffer_lazy")
MAMBA_SSM_DTYPE_CHOICES = ("float32", "bfloat16", "float16")
CUDA_GRAPH_BACKEND_CHOICES = ("full", "breakable", "disabled")
SPECULATIVE_ALGORITHM_CHOICES = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO")

_SECRET_FLAGS = ("--api-key", "--admin-api-key")
_HUMAN_INT = re.compile(r"(?P<num>\d+(?:\.\d+)?)(?P<suffix>[kKmMgGtT](?:i)?)?")
_MULTIPLIERS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def human_readable_int(value: str) -> int:
    """Parse 32768, 32k (32000) or 32Ki (32768) like SGLang's `utils/common.py: human_readable_int`."""
    match = _HUMAN_INT.fullmatch(value.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid integer value: {value!r} (use e.g. 32768, 32k or 32Ki)")
    number = float(match["num"])
    suffix = match["suffix"] or ""
    factor = 1
    if suffix:
        table = _BINARY if suffix.endswith("i") else _MULTIPLIERS
        factor = table[suffix[0].lower()]
    result = number * factor
    if result != int(result):
        raise argparse.ArgumentTypeError(f"invalid integer value: {value!r} (not a whole number)")
    return int(result)


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return parsed


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
    add("--speculative-algorithm", default=None, choices=SPECULATIVE_ALGORITHM_CHOICES)
    add("--speculative-num-steps", type=int, default=None)
    add("--speculative-eagle-topk", type=int, default=None)
    add("--speculative-num-draft-tokens", type=int, default=None)
    # OpenAI-compatible API behaviour.
    add("--reasoning-parser", default=None, choices=REASONING_PARSER_CHOICES, help="Reasoning parser (qwen3).")
    add("--tool-call-parser", default=None, choices=TOOL_CALL_PARSER_CHOICES)
    add(
        "--default-chat-template-kwargs",
        type=_json_object,
        default=None,
        help="JSON, e.g. '{\"enable_thinking\": true}'.",
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
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; argparse errors exit with code 2 as SGLang's do."""
    return build_parser().parse_args(list(argv) if argv is not None else None)


def redacted_argv(argv: Sequence[str]) -> list[str]:
    """The command line with API key values masked (for logs and /server_info)."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        flag = arg.split("=", 1)[0]
        # Abbreviations (--api-k) count too: argparse accepts them.
        secret = next((s for s in _SECRET_FLAGS if len(flag) > 5 and s.startswith(flag)), None)
        if secret is not None and "=" in arg:
            out.append(f"{flag}=***")
        elif secret is not None:
            out.append(arg)
            hide_next = True
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m datagen.standin`: parse, load, serve; returns the exit code."""
    args = parse_args(argv)
    # Heavy imports (transformers, numpy, uvicorn) only after the flags are known to be valid,
    # so `--help` and flag errors stay fast.
    from datagen.standin.server import serve

    raw = list(argv) if argv is not None else sys.argv[1:]
    return serve(args, raw)
