"""Startup of the stand-in as SGLang does it: resolve args, "load" (port closed), serve, warm up, go Up."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import traceback
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

from datagen.engine.memory_plan import (
    EngineFlags,
    GpuMemory,
    ModelShape,
    Sizing,
    decode_graph_max_bs,
    is_hybrid_gdn,
    sglang_sizing,
)
from datagen.standin.knobs import KnobError, Knobs
from datagen.standin.prefix_cache import PrefixCache

_GIB = 1 << 30

__all__ = ["check_gpu_arch", "resolve_args", "serve"]

logger = logging.getLogger("datagen.standin")

_HYBRID_GDN_ARCHS = frozenset({"Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"})
_BLACKWELL_HYBRID_ALLOWED = {
    12: {"triton", "trtllm_mha", "flashinfer"},
    10: {"triton", "trtllm_mha", "fa4", "flashinfer"},
}
_WARMUP_TEXT = "The capital city of France is"


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    # SGLang's format: "[2026-01-01 12:00:00] message".
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _gpu_major(arch: str | None) -> int | None:
    if not arch:
        return None
    try:
        return int(float(arch))
    except ValueError:
        return None


def check_gpu_arch(args: argparse.Namespace, architectures: list[str], gpu_arch: str | None) -> str:
    """Resolve the attention backend; raise AssertionError as SGLang does for a backend the GPU cannot run."""
    major = _gpu_major(gpu_arch)
    hybrid = bool(_HYBRID_GDN_ARCHS.intersection(architectures))
    backend = args.attention_backend
    if backend is None:
        # model_override_base.get_default_attn_backend: fa3 on Hopper, trtllm_mha on SM100, else flashinfer.
        backend = {9: "fa3", 10: "trtllm_mha"}.get(major or 0, "flashinfer")
        logger.info("Attention backend not specified. Use %s backend by default.", backend)
    prefill = args.prefill_attention_backend or backend
    decode = args.decode_attention_backend or backend
    if hybrid and major in _BLACKWELL_HYBRID_ALLOWED:
        allowed = _BLACKWELL_HYBRID_ALLOWED[major]
        for chosen in (prefill, decode):
            assert chosen in allowed, (
                f"Only {allowed} backends are supported on Blackwell GPUs for hybrid GDN models. Got {chosen}"
            )
    if major is not None and major >= 10 and "fa3" in (prefill, decode):
        raise AssertionError(
            "FlashAttention v3 Backend requires SM>=80 and SM<=90. Please use `--attention-backend flashinfer`"
        )
    return str(backend)


def resolve_args(args: argparse.Namespace, config: dict[str, Any], knobs: Knobs, attention: str) -> dict[str, Any]:
    """Server args after SGLang-like defaulting, as /server_info shows them.

    Secrets are NOT masked: real SGLang's `ServerArgs.resolved_dict()` masks only watermark keys, so its startup
    log and /server_info carry `api_key` in clear. The stand-in does the same so tests can see a leak.
    """
    # `--config` is the parser's, not a ServerArgs field: `ServerArgs.from_cli_args` keeps only fields.
    resolved = {k: v for k, v in vars(args).items() if k != "config"}
    context = args.context_length or int(config.get("max_position_embeddings") or 262144)
    spec = "EAGLE" if args.speculative_algorithm == "NEXTN" else args.speculative_algorithm
    sizing = _emulated_sizing(args, config, knobs) if spec is None else None
    if sizing is not None:
        max_running = sizing.max_running_requests
    elif args.max_running_requests is not None:
        max_running = args.max_running_requests
    elif spec in ("EAGLE", "EAGLE3"):
        max_running = 48  # speculative_hook._handle_eagle_family forces 48 when the flag is absent
    else:
        max_running = knobs.max_running
    strategy = args.mamba_radix_cache_strategy
    if strategy == "auto" and not args.disable_radix_cache:
        # overrides.py _mamba_radix_cache_resolution: extra_buffer with the overlap scheduler (default), else
        # no_buffer (page size is 1 here).
        strategy = "no_buffer" if getattr(args, "disable_overlap_schedule", False) else "extra_buffer"
    resolved.update(
        served_model_name=args.served_model_name or args.model_path,
        tokenizer_path=args.model_path,
        context_length=context,
        max_running_requests=max_running,
        attention_backend=attention,
        prefill_attention_backend=args.prefill_attention_backend or attention,
        decode_attention_backend=args.decode_attention_backend or attention,
        sampling_backend=args.sampling_backend or "flashinfer",
        chunked_prefill_size=args.chunked_prefill_size if args.chunked_prefill_size is not None else 8192,
        mem_fraction_static=(
            sizing.mem_fraction_static
            if sizing is not None
            else args.mem_fraction_static
            if args.mem_fraction_static is not None
            else 0.85
        ),
        speculative_algorithm=spec,
        mamba_radix_cache_strategy=strategy,
        log_level_http=args.log_level_http or args.log_level,
        random_seed=args.random_seed if args.random_seed is not None else knobs.seed,
    )
    if spec is not None and args.speculative_num_steps is None:
        resolved.update(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    return resolved


def _emulated_sizing(args: argparse.Namespace, config: dict[str, Any], knobs: Knobs) -> Sizing | None:
    """SGLang 0.5.23's pools and running-request cap for these flags on the emulated GPU (None: not emulated)."""
    if knobs.gpu_memory_bytes is None or not is_hybrid_gdn(config):
        return None
    flags = EngineFlags(
        disable_radix_cache=args.disable_radix_cache,
        mamba_radix_cache_strategy=args.mamba_radix_cache_strategy,
        disable_overlap_schedule=args.disable_overlap_schedule,
        mamba_full_memory_ratio=args.mamba_full_memory_ratio,
        max_mamba_cache_size=args.max_mamba_cache_size,
        max_running_requests=args.max_running_requests,
        mem_fraction_static=args.mem_fraction_static,
        cuda_graph_max_bs_decode=args.cuda_graph_max_bs_decode,
        chunked_prefill_size=args.chunked_prefill_size,
    )
    return sglang_sizing(
        ModelShape.from_config(config, mamba_ssm_dtype=args.mamba_ssm_dtype), _emulated_gpu(knobs), flags
    )


def _outside_pools(
    args: argparse.Namespace, knobs: Knobs, resolved: dict[str, Any]
) -> tuple[int, int, int, int] | None:
    """Free memory after the pools, P (1 - fraction), what the prefill and decode CUDA graphs take of it, and the
    largest decode batch captured.

    None when the emulated card models no activations or graphs (the knobs are 0).
    """
    if not (knobs.activation_bytes or knobs.prefill_graph_bytes or knobs.decode_graph_bytes_per_batch):
        return None
    pre = _emulated_gpu(knobs).pre_model_load_bytes
    free = round(pre * (1 - float(resolved["mem_fraction_static"])))
    flags = EngineFlags(
        max_running_requests=args.max_running_requests, cuda_graph_max_bs_decode=args.cuda_graph_max_bs_decode
    )
    batch = decode_graph_max_bs(flags, _emulated_gpu(knobs).total_bytes)
    return free, knobs.prefill_graph_bytes, knobs.decode_graph_bytes_per_batch * batch, batch


def _emulated_gpu(knobs: Knobs) -> GpuMemory:
    """The emulated card (DATAGEN_STANDIN_GPU_MEMORY_BYTES), with the engine's own reservation taken first."""
    assert knobs.gpu_memory_bytes is not None
    return GpuMemory(
        knobs.gpu_memory_bytes,
        knobs.gpu_memory_bytes,
        knobs.weights_bytes,
        engine_reserved_bytes=knobs.engine_reserved_bytes,
    )


def _read_config(model_path: Path) -> dict[str, Any]:
    path = model_path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_path}: no config.json (is the model staged there?)")
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def serve(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the server until SIGINT/SIGTERM; returns the process exit code."""
    _setup_logging(args.log_level)
    # SGLang: `server_args._launch_command = " ".join(argv)` over sys.argv[1:], API keys in clear.
    launch = " ".join(argv)
    try:
        knobs = Knobs.from_env()
    except KnobError as exc:
        logger.error("Invalid stand-in setting: %s", exc)
        return 1
    if args.served_model_name and ":" in args.served_model_name:
        logger.error("served_model_name must not contain ':' (it separates base model and LoRA adapter).")
        return 1
    try:
        config = _read_config(Path(args.model_path))
    except (OSError, ValueError) as exc:
        logger.error("Failed to load the model config: %s", exc)
        return 1
    failure: str | None = None
    try:
        attention = check_gpu_arch(args, list(config.get("architectures") or []), knobs.gpu_arch)
    except AssertionError:
        failure = traceback.format_exc()
        attention = args.attention_backend or "flashinfer"
    resolved = resolve_args(args, config, knobs, attention)
    # SGLang's engine logs `server_args={resolved_dict()}` (a dict repr, api_key in clear) before it starts
    # the scheduler processes, so this line is in the log even when the scheduler then dies.
    logger.info("server_args=%r", resolved)
    if failure is not None:
        # SGLang: the scheduler subprocess dies with the traceback, then the launcher tears everything down.
        logger.error("Scheduler hit an exception: %s", failure)
        logger.error("Received sigquit from a child process. It usually means the child failed.")
        return 1
    started = time.monotonic()
    # Free memory before and after the weights, as SGLang logs them: the emulated card's when one is set (the
    # launcher's pool check reads them), else fixed figures.
    emulated = _emulated_gpu(knobs) if knobs.gpu_memory_bytes is not None else None
    pre_gib = emulated.pre_model_load_bytes / _GIB if emulated is not None else 94.50
    weights_gib = emulated.weights_bytes / _GIB if emulated is not None else 52.40
    logger.info("Load weight begin. avail mem=%.2f GB", pre_gib)
    try:
        from datagen.chat import ChatTokenizer

        tokenizer = ChatTokenizer.from_model_dir(args.model_path)
    except Exception as exc:  # any failure to load is fatal, as in SGLang
        logger.error("Failed to load the tokenizer/chat template from %s: %s", args.model_path, exc)
        return 1
    from datagen.standin.synthetic import SyntheticModel

    model = SyntheticModel(tokenizer, knobs)
    # The port stays closed while "loading", like SGLang before its schedulers report ready.
    time.sleep(max(0.0, knobs.load_s - (time.monotonic() - started)))
    arch = (config.get("architectures") or ["?"])[0]
    logger.info(
        "Load weight end. type=%s, dtype=torch.bfloat16, avail mem=%.2f GB, mem usage=%.2f GB.",
        arch,
        pre_gib - weights_gib,
        weights_gib,
    )
    return asyncio.run(_serve_http(args, knobs, config, tokenizer, model, resolved, launch))


async def _serve_http(
    args: argparse.Namespace,
    knobs: Knobs,
    config: dict[str, Any],
    tokenizer: Any,
    model: Any,
    resolved: dict[str, Any],
    launch: str,
) -> int:
    import uvicorn

    from datagen.standin.app import build_app
    from datagen.standin.scheduler import Req, Scheduler
    from datagen.standin.state import ServerState, Status

    per_dp = int(resolved["max_running_requests"])
    context = int(resolved["context_length"])
    sizing = _emulated_sizing(args, config, knobs) if resolved["speculative_algorithm"] is None else None
    max_total = sizing.max_total_num_tokens if sizing is not None else knobs.max_total_tokens
    scheduler = Scheduler(
        knobs, max_running=per_dp * args.dp_size, max_queued=args.max_queued_requests, max_total_tokens=max_total
    )
    state = ServerState(
        args=args,
        knobs=knobs,
        config=config,
        tokenizer=tokenizer,
        model=model,
        scheduler=scheduler,
        resolved=resolved,
        launch_command=launch,
        context_len=context,
        max_req_input_len=min(context, max_total) - 6,
        max_running_per_dp=per_dp,
    )
    state.fault_rng.seed(knobs.seed)
    state.prefix_cache = PrefixCache(max_total, enabled=not args.disable_radix_cache)
    if sizing is not None:
        # memory_pool.py's line (sizes not modelled), then resolve_max_num_reqs' warning when the state pool binds.
        logger.info("Mamba Cache is allocated. max_mamba_cache_size: %d", sizing.max_mamba_cache_size)
        if sizing.capped_by_state_pool:
            logger.warning(
                "max_running_requests is capped to %d by the mamba state cache (max_mamba_cache_size=%d, %d state "
                "slots per request).",
                sizing.max_running_requests,
                sizing.max_mamba_cache_size,
                sizing.slots_per_request,
            )
    logger.info("KV Cache is allocated. #tokens: %d, K size: 10.70 GB, V size: 10.70 GB", max_total)
    outside = _outside_pools(args, knobs, resolved) if sizing is not None else None
    if outside is not None:
        free, prefill_graphs, decode_graphs, batch = outside
        logger.info("Memory pool end. avail mem=%.2f GB", free / _GIB)
        for phase, used in (("prefill", prefill_graphs), ("decode", decode_graphs)):
            if used > free:
                logger.error(
                    "Scheduler hit an exception: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                    "%.2f GiB (capturing %s CUDA graphs). GPU 0 has %.2f GiB free.",
                    used / _GIB,
                    phase,
                    free / _GIB,
                )
                logger.error("Received sigquit from a child process. It usually means the child failed.")
                return 1
            if phase == "decode":  # SGLang's line names the batch sizes it captures, up to the largest
                sizes = sorted({b for b in (1, 2, 4, 8, 12, 16, *range(24, batch + 1, 8)) if b <= batch} | {batch})
                logger.info(
                    "Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, bs=%s, avail "
                    "mem=%.2f GB",
                    sizes,
                    free / _GIB,
                )
            free -= used
            logger.info(
                "Capture target %s CUDA graph end. elapsed=0.00 s, mem usage=%.2f GB, avail mem=%.2f GB.",
                phase,
                used / _GIB,
                free / _GIB,
            )
        chunk = int(resolved["chunked_prefill_size"])
        scheduler.activation_budget = (free, knobs.activation_bytes / chunk, chunk)
    logger.info(
        "max_total_num_tokens=%d, chunked_prefill_size=%s, max_running_requests=%d, context_len=%d, "
        "available_gpu_mem=%.2f GB",
        max_total,
        resolved["chunked_prefill_size"],
        per_dp,
        context,
        free / _GIB if outside is not None else 20.10,
    )

    async def warmup() -> None:
        if not args.skip_server_warmup:
            await asyncio.sleep(knobs.warmup_s)
            prompt = tokenizer.encode(_WARMUP_TEXT)
            plan = model.plan(prompt, max_new_tokens=8)
            req = Req(
                rid=f"warmup-{id(plan)}",
                prompt_len=len(prompt),
                plan=plan,
                future=asyncio.get_running_loop().create_future(),
            )
            scheduler.submit([req])
            await req.future
        state.status = Status.UP
        logger.info("The server is fired up and ready to roll!")

    @asynccontextmanager
    async def lifespan(_: object) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(scheduler.run()), asyncio.create_task(warmup())]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with suppress(asyncio.CancelledError):
                    await t

    app = build_app(state, lifespan)
    http_level = (args.log_level_http or args.log_level).lower()
    config_ = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        log_level=http_level,
        access_log=http_level in ("debug", "info"),
        timeout_keep_alive=5,
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config_)
    await server.serve()
    # uvicorn reports a failed bind by setting should_exit without having started.
    return 0 if server.started else 1
