"""The stand-in's HTTP API (starlette): SGLang 0.5.23's routes, bodies, status codes and error shapes."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from datagen.chat import TemplateError
from datagen.records import Message
from datagen.standin.contract import ContractError, check_generate_body, check_sampling_values
from datagen.standin.scheduler import QueueFullError, Req
from datagen.standin.state import SGLANG_VERSION, ServerState, Status
from datagen.standin.synthetic import OutputPlan

__all__ = ["build_app"]

logger = logging.getLogger("datagen.standin.http")

_OPEN_PREFIXES = ("/health", "/ready", "/metrics")
# Routes SGLang marks @auth_level(AuthLevel.ADMIN_OPTIONAL) among those the stand-in serves.
_ADMIN_OPTIONAL_PATHS = frozenset({"/flush_cache", "/abort_request"})
_FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


# --- errors -----------------------------------------------------------------------------------
def _error_response(message: str, status: int, err_type: str) -> JSONResponse:
    """OpenAI-style ErrorResponse (chat route, 503 and 500 paths)."""
    body = {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
    return JSONResponse(body, status_code=status)


def _queue_full() -> JSONResponse:
    return _error_response("The request queue is full.", 503, "503")


def _internal_error() -> JSONResponse:
    msg = "Internal server error: injected fault (DATAGEN_STANDIN_ERROR_RATE)"
    return _error_response(msg, 500, "InternalServerError")


class _ApiKeyMiddleware:
    """SGLang's `decide_request_auth`: 401 {"error": "Unauthorized"} unless `Authorization: Bearer <key>`.

    Health, readiness and metrics paths (by prefix) and OPTIONS stay open. Admin-optional routes take the
    admin key when one is set (the plain key is then refused), else the plain key. Empty keys count as unset.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    @staticmethod
    def _bearer_matches(header: str | None, expected: str) -> bool:
        # Exactly SGLang's parse: one split on the first space, no stripping of the token.
        if not header:
            return False
        parts = header.split(" ", 1)
        if len(parts) != 2 or parts[0].lower() != "bearer":
            return False
        return hmac.compare_digest(parts[1].encode(), expected.encode())

    def _authorized(self, scope: Scope) -> bool:
        path: str = scope["path"]
        if scope["method"] == "OPTIONS" or path.startswith(_OPEN_PREFIXES):
            return True
        raw = dict(scope["headers"]).get(b"authorization")
        header = raw.decode("latin-1") if raw is not None else None
        if path in _ADMIN_OPTIONAL_PATHS and self.admin_api_key:
            return self._bearer_matches(header, self.admin_api_key)
        if self.api_key:
            return self._bearer_matches(header, self.api_key)
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._authorized(scope):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


# --- generation core ------------------------------------------------------------------------------
@dataclass(slots=True)
class _Item:
    rid: str
    prompt_ids: list[int]
    params: dict[str, Any]


def _check_lengths(state: ServerState, item: _Item) -> None:
    """SGLang's length checks, in its order and with its bounds and texts.

    TokenizerManager._validate_one_request: input >= context length, then input + max_new_tokens > context
    length (each truncating instead with --allow-auto-truncate); then the scheduler's validate_input_length:
    input >= max_req_input_len (min(context, KV pool) - 6).
    """
    ctx = state.context_len
    n = len(item.prompt_ids)
    if n >= ctx:
        if not state.args.allow_auto_truncate:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens).")
        logger.warning(
            "The input (%d tokens) is longer than the model's context length (%d tokens). Truncating the input.",
            n,
            ctx,
        )
        item.prompt_ids = item.prompt_ids[:ctx]
        n = len(item.prompt_ids)
    max_new = item.params.get("max_new_tokens")  # SGLang reads the raw dict: absent means no total check
    if isinstance(max_new, int) and max_new + n > ctx:
        if not state.args.allow_auto_truncate:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {max_new + n} tokens: {n} tokens from the input messages and "
                f"{max_new} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit."
            )
        logger.warning(
            "Requested token count (%d input + %d new) exceeds the model's context length (%d tokens). "
            "Truncating max_new_tokens.",
            n,
            max_new,
            ctx,
        )
        item.params["max_new_tokens"] = max(0, ctx - n)


def _check_scheduler_length(state: ServerState, item: _Item) -> None:
    """The scheduler's validate_input_length (after the sampling checks): input >= max_req_input_len."""
    limit = state.max_req_input_len
    if len(item.prompt_ids) >= limit:
        if state.args.allow_auto_truncate:
            logger.warning(
                "Request length is longer than the KV cache pool size or the max context length. Truncated. "
                "len(req.origin_input_ids)=%d, max_req_input_len=%d.",
                len(item.prompt_ids),
                limit,
            )
            item.prompt_ids = item.prompt_ids[:limit]
            return
        raise ValueError(
            f"Input length ({len(item.prompt_ids)} tokens) exceeds the maximum allowed length ({limit} tokens). "
            "Use a shorter input or enable --allow-auto-truncate."
        )


def _plan(state: ServerState, item: _Item) -> OutputPlan:
    p = item.params
    max_new = p.get("max_new_tokens", 128)
    if max_new is None:  # no cap: until the context is full
        max_new = state.context_len - len(item.prompt_ids)
    plan = state.model.plan(
        item.prompt_ids,
        max_new_tokens=max_new,
        sampling_seed=p.get("sampling_seed"),
        min_new_tokens=p.get("min_new_tokens", 0),
        ignore_eos=bool(p.get("ignore_eos", False)),
        stop_token_ids=p.get("stop_token_ids"),
    )
    stop = p.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return state.model.cut_at_stop_strings(plan, [s for s in stops if s])


def _prepare(state: ServerState, items: Sequence[_Item]) -> list[Req]:
    """Validate every item (any failure fails the whole batch) and plan its output."""
    for item in items:
        if not item.prompt_ids:
            raise ValueError("input_ids cannot be empty.")
        if item.params.get("n", 1) not in (1, None):
            raise ValueError("n > 1 is not supported by the datagen stand-in.")
        _check_lengths(state, item)
        check_sampling_values(item.params, state.vocab_size)
        _check_scheduler_length(state, item)
    loop = asyncio.get_running_loop()
    return [
        Req(
            rid=item.rid,
            prompt_len=len(item.prompt_ids),
            plan=_plan(state, item),
            future=loop.create_future(),
            cached=state.prefix_cache.match(item.prompt_ids),
        )
        for item in items
    ]


async def _until_disconnect(request: Request) -> None:
    # After the body is read, the ASGI server's receive() only returns on client disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _await_reqs(state: ServerState, request: Request, reqs: list[Req]) -> bool:
    """Wait until every request finishes; False if the client went away first (then they are aborted)."""
    everything: asyncio.Future[Any] = asyncio.gather(*(r.future for r in reqs))
    gone: asyncio.Future[Any] = asyncio.ensure_future(_until_disconnect(request))
    done, _ = await asyncio.wait({everything, gone}, return_when=asyncio.FIRST_COMPLETED)
    if everything in done:
        gone.cancel()
        return True
    for r in reqs:
        state.scheduler.abort(r.rid)
    await everything
    return False


def _output_text(state: ServerState, req: Req, params: dict[str, Any]) -> tuple[list[int], str]:
    out = req.plan.ids[: req.pos].tolist()
    skip = bool(params.get("skip_special_tokens", True))
    finish = req.finish_reason or {}
    matched = finish.get("matched")
    no_trim = bool(params.get("no_stop_trim", False))
    if finish.get("type") == "stop" and isinstance(matched, int) and not no_trim:
        return out, state.tokenizer.decode(out[:-1], skip_special_tokens=skip)
    text = state.tokenizer.decode(out, skip_special_tokens=skip)
    if finish.get("type") == "stop" and isinstance(matched, str) and not no_trim:
        text = text[: text.find(matched)]
    return out, text


def _meta_info(state: ServerState, req: Req, out: list[int], reasoning: int) -> dict[str, Any]:
    now = time.time()
    return {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": req.prompt_len,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": reasoning,
        "completion_tokens": len(out),
        "cached_tokens": req.cached,
        "e2e_latency": now - req.created,
        "response_sent_to_client_ts": now,
    }


def _after_success(state: ServerState) -> BackgroundTask:
    """Runs after the response bytes are sent: the crash knob fires only once the client has its answer."""

    def count() -> None:
        state.completed_requests += 1
        limit = state.knobs.crash_after
        if limit is not None and state.completed_requests >= limit:
            logger.error(
                "Scheduler hit an exception: RuntimeError: injected crash after %d completed requests "
                "(DATAGEN_STANDIN_CRASH_AFTER). Exiting abruptly.",
                state.completed_requests,
            )
            logging.shutdown()
            os._exit(1)

    return BackgroundTask(count)


async def _faults(state: ServerState, request: Request) -> Response | None:
    """Stall and error-rate injection for a generation request; None when it should be served."""
    state.generation_requests += 1
    if state.stalled:
        if not state.stall_logged:
            logger.error("Injected stall (DATAGEN_STANDIN_STALL_AFTER): new generation requests hang.")
            state.stall_logged = True
        await _until_disconnect(request)
        return Response(status_code=499)
    if state.knobs.error_rate and state.fault_rng.random() < state.knobs.error_rate:
        return _internal_error()
    return None


# --- /generate -------------------------------------------------------------------------------------
async def _generate(state: ServerState, request: Request) -> Response:
    try:
        body = check_generate_body(json.loads(await request.body()))
    except json.JSONDecodeError as exc:
        return JSONResponse({"error": f"{exc.msg} at line {exc.lineno} column {exc.colno}"}, status_code=400)
    except ContractError as exc:
        return JSONResponse({"error": str(exc)}, status_code=400)
    fault = await _faults(state, request)
    if fault is not None:
        return fault
    if body.get("stream"):
        return JSONResponse({"error": {"message": "stream is not supported by the datagen stand-in."}}, 400)
    try:
        items, is_batch = _generate_items(state, body)
        reqs = _prepare(state, items)
        state.scheduler.submit(reqs)
    except QueueFullError:
        return _queue_full()
    except ValueError as exc:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
    if not await _await_reqs(state, request, reqs):
        return Response(status_code=499)
    results = []
    for item, req in zip(items, reqs, strict=True):
        out, text = _output_text(state, req, item.params)
        state.prefix_cache.insert([*item.prompt_ids, *out[:-1]])  # per server, as SGLang's radix cache
        reasoning = req.plan.reasoning_tokens if body.get("require_reasoning") else 0
        reasoning = min(reasoning, len(out))
        results.append({"text": text, "output_ids": out, "meta_info": _meta_info(state, req, out, reasoning)})
    return JSONResponse(results if is_batch else results[0], background=_after_success(state))


def _generate_items(state: ServerState, body: dict[str, Any]) -> tuple[list[_Item], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if isinstance(text, list) else [text]
        prompts = state.tokenizer.encode_batch(texts) if texts else []
    elif input_ids is not None:
        is_batch = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
    else:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    if not prompts:
        raise ValueError("input_ids cannot be empty.")
    n = len(prompts)
    sp = body.get("sampling_params") or {}
    if isinstance(sp, list):
        if len(sp) != n:
            raise ValueError(f"The length of sampling_params ({len(sp)}) does not match the batch size ({n}).")
        params = [dict(p) for p in sp]
    else:
        params = [dict(sp) for _ in range(n)]
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(n)] if is_batch else [rid]
    else:
        if len(rid) != n:
            raise ValueError("The rid should be a list of the same length as the batch.")
        rids = list(rid)
    items = [_Item(r, list(p), ps) for r, p, ps in zip(rids, prompts, params, strict=True)]
    return items, is_batch


# --- /v1/chat/completions ---------------------------------------------------------------------------
class _ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None


class _ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    messages: list[_ChatMessage]
    model: str = "default"
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    rid: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    reasoning_effort: str | None = None


def _flat_content(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")


async def _chat(state: ServerState, request: Request) -> Response:
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        return _error_response("Unsupported Media Type: Only 'application/json' is allowed", 400, "Bad Request")
    try:
        raw = json.loads(await request.body())
        req = _ChatRequest.model_validate(raw)
    except json.JSONDecodeError as exc:
        return _error_response(f"JSON decode error: {exc}", 400, "Bad Request")
    except ValidationError as exc:
        return _error_response(f"{exc} {exc.errors(include_url=False)}", 400, "Bad Request")
    fault = await _faults(state, request)
    if fault is not None:
        return fault
    try:
        item, thinking = _chat_item(state, req)
        reqs = _prepare(state, [item])
        state.scheduler.submit(reqs)
    except QueueFullError:
        return _queue_full()
    except ValueError as exc:  # TemplateError is a ValueError too
        return _error_response(str(exc), 400, "BadRequestError")
    if not await _await_reqs(state, request, reqs):
        return Response(status_code=499)
    return JSONResponse(_chat_body(state, req, item, reqs[0], thinking), background=_after_success(state))


def _chat_item(state: ServerState, req: _ChatRequest) -> tuple[_Item, bool]:
    if not req.messages:
        raise ValueError("Messages cannot be empty.")
    if req.stream:
        raise ValueError("stream is not supported by the datagen stand-in.")
    kwargs = {**(state.args.default_chat_template_kwargs or {}), **(req.chat_template_kwargs or {})}
    if "chat_template" in (req.chat_template_kwargs or {}):
        raise ValueError("Request-supplied chat_template is not allowed. Use the server's chat template.")
    thinking = kwargs.get("enable_thinking", True) is not False and req.reasoning_effort != "none"
    messages = []
    for m in req.messages:
        msg = {"role": m.role, "content": _flat_content(m.content)}
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        messages.append(Message.from_dict(msg))
    try:
        prompt_ids = state.tokenizer.prompt_ids(messages, enable_thinking=thinking)
    except TemplateError as exc:
        raise ValueError(str(exc)) from exc
    max_new = req.max_completion_tokens or req.max_tokens
    if max_new is not None and max_new > state.context_len:
        raise ValueError(
            f"max_completion_tokens is too large: {max_new}.This model supports at most "
            f"{state.context_len} completion tokens."
        )
    params: dict[str, Any] = {
        "max_new_tokens": max_new,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "min_new_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "no_stop_trim": req.no_stop_trim,
        "skip_special_tokens": req.skip_special_tokens,
        "n": req.n,
    }
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop", "stop_token_ids"):
        if getattr(req, key) is not None:
            params[key] = getattr(req, key)
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    return _Item(req.rid or uuid.uuid4().hex, prompt_ids, params), thinking


def _chat_body(state: ServerState, req: _ChatRequest, item: _Item, r: Req, thinking: bool) -> dict[str, Any]:
    out, text = _output_text(state, r, item.params)
    state.prefix_cache.insert([*item.prompt_ids, *out[:-1]])
    split = thinking and req.separate_reasoning and state.args.reasoning_parser is not None
    reasoning_text: str | None = None
    content = text
    if split:
        # The qwen3 detector in forced-reasoning mode: cut exactly at </think>, no whitespace stripping.
        head, sep, tail = text.partition("</think>")
        reasoning_text, content = (head, tail) if sep else (text, "")
    reasoning_tokens = min(r.plan.reasoning_tokens, len(out)) if thinking else 0
    finish = r.finish_reason or {}
    kind = finish.get("type")
    finish_reason = {"stop": "stop", "length": "length"}.get(str(kind), "abort")
    usage: dict[str, Any] = {
        "prompt_tokens": r.prompt_len,
        "total_tokens": r.prompt_len + len(out),
        "completion_tokens": len(out),
        "prompt_tokens_details": {"cached_tokens": r.cached} if state.args.enable_cache_report else None,
        "reasoning_tokens": reasoning_tokens,
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens} if reasoning_tokens else None,
    }
    return {
        "id": r.rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "reasoning_content": reasoning_text or None},
                "logprobs": None,
                "finish_reason": finish_reason,
                "matched_stop": finish.get("matched") if kind == "stop" else None,
            }
        ],
        "usage": usage,
        "metadata": {"weight_version": "default"},
    }


# --- info, load and admin routes ---------------------------------------------------------------------
def _model_info(state: ServerState) -> dict[str, Any]:
    args = state.args
    return {
        "model_path": args.model_path,
        "served_model_name": state.served_model_name,
        "tokenizer_path": args.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": args.load_format,
        "reasoning_parser": args.reasoning_parser,
        "tool_call_parser": args.tool_call_parser,
        "disaggregation_mode": "null",
        "has_image_understanding": "vision_config" in state.config and not args.language_model_only,
        "has_audio_understanding": False,
        "model_type": state.config.get("model_type"),
        "architectures": state.architectures,
    }


def _internal_states(state: ServerState) -> list[dict[str, Any]]:
    """One entry per DP rank, as SchedulerInternalStateController: the resolved args plus live fields."""
    return [
        {
            **state.resolved,  # SGLang starts from resolved_server_args_dict(): api_key in clear here too
            "world_size": state.args.dp_size * state.args.tp_size,
            "startup_time": state.startup_time,
            "effective_max_running_requests_per_dp": state.max_running_per_dp,
            "last_gen_throughput": state.scheduler.last_gen_throughput / state.args.dp_size,
            "memory_usage": {
                "weight": 51.2,
                "kvcache": 21.4,
                "startup_available": 94.5,
                "token_capacity": state.scheduler.max_total_tokens,
                "token_capacity_swa": None,
                "graph": {"decode": 1.3},
            },
            "disaggregation_mode": "null",
        }
        for _ in range(state.args.dp_size)
    ]


def _server_info(state: ServerState) -> dict[str, Any]:
    """SGLang's build_server_info: resolved args, launch_command, the scheduler's init info, then live state."""
    return {
        **state.resolved,
        "launch_command": state.launch_command,
        # scheduler.get_init_info(): "status" is the handshake's "ready", not the server's Up/Starting.
        "status": "ready",
        "max_total_num_tokens": state.scheduler.max_total_tokens,
        "max_req_input_len": state.max_req_input_len,
        "kv_events": None,
        "startup_time": state.startup_time,
        "internal_states": _internal_states(state),
        "version": SGLANG_VERSION,
        "frontend": "python",
    }


def _split(total: int, parts: int, index: int) -> int:
    return total // parts + (1 if index < total % parts else 0)


_LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def _loads(state: ServerState, include: set[str] | None) -> list[dict[str, Any]]:
    """Per-DP-rank entries as SGLang's `LoadSnapshot.to_dict(include)` (None or "all": every section set)."""
    if include is not None and not include <= _LOAD_SECTIONS:
        raise ValueError(
            f"Invalid include sections: {include - _LOAD_SECTIONS}. Valid options: {sorted(_LOAD_SECTIONS)}"
        )
    s = state.scheduler
    dp = state.args.dp_size
    used = s.num_used_tokens
    throughput = s.gen_throughput
    include_all = include is None or "all" in include
    entries = []
    for rank in range(dp):
        running = _split(len(s.running), dp, rank)
        waiting = _split(len(s.waiting), dp, rank)
        used_rank = _split(used, dp, rank)
        entry: dict[str, Any] = {
            "timestamp": time.time(),
            "dp_rank": rank,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": _split(sum(r.prompt_len for r in s.waiting), dp, rank),
            "num_used_tokens": used_rank,
            "num_total_tokens": used_rank,  # used + tokens of disaggregation queues (none here)
            "num_active_tokens": used_rank,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": s.max_total_tokens,
            "max_running_requests": state.max_running_per_dp,
            "token_usage": round(used_rank / s.max_total_tokens, 4),
            "gen_throughput": round(throughput / dp, 2),
            "cache_hit_rate": 0.0,
            "utilization": round(running / state.max_running_per_dp, 4),
            "total_prefill_uncached_tokens": _split(s.prefill_tokens_total, dp, rank),
            "total_prefill_busy_us": 0,
            "decode_moments": None,
        }
        if include == {"core"}:
            entries.append(entry)
            continue
        # SGLang's sections that are set on a plain server: memory, disaggregation (mode "null"), queues;
        # speculative and lora stay None there and are left out.
        sections = {
            "memory": (
                "memory",
                {"weight_gb": 51.2, "kv_cache_gb": 21.4, "graph_gb": 1.3, "token_capacity": s.max_total_tokens},
            ),
            "disaggregation": (
                "disagg",
                {
                    "mode": "null",
                    "prefill_bootstrap_queue_reqs": 0,
                    "prefill_inflight_queue_reqs": 0,
                    "decode_prealloc_queue_reqs": 0,
                    "decode_transfer_queue_reqs": 0,
                    "decode_retracted_queue_reqs": 0,
                    "kv_transfer_speed_gb_s": 0.0,
                    "kv_transfer_latency_ms": 0.0,
                },
            ),
            "queues": (
                "queues",
                {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0},
            ),
        }
        for field_name, (include_name, section) in sections.items():
            if include_all or (include is not None and include_name in include):
                entry[field_name] = section
        entries.append(entry)
    return entries


def _loads_prometheus(loads: list[dict[str, Any]]) -> str:
    """SGLang's `_format_loads_prometheus`: one gauge per scalar, sections flattened as sglang_<prefix>_<key>."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, Any]]] = {}
    for load in loads:
        entry = dict(load)
        dp_rank = entry.pop("dp_rank")
        for key, value in entry.items():
            if isinstance(value, dict):
                prefix = prefixes.get(key, key)
                for sub_key, sub_value in value.items():
                    if isinstance(sub_value, int | float):
                        samples.setdefault(f"sglang_{prefix}_{sub_key}", []).append((dp_rank, sub_value))
            elif isinstance(value, int | float):
                samples.setdefault(f"sglang_{key}", []).append((dp_rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values]
    return "\n".join(lines) + "\n"


async def _v1_loads(state: ServerState, request: Request) -> Response:
    raw_include = request.query_params.get("include")
    include = {p.strip() for p in raw_include.split(",")} if raw_include else None
    try:
        loads = _loads(state, include)
    except ValueError as exc:
        return _error_response(str(exc), 400, "400")
    dp_rank = request.query_params.get("dp_rank")
    if dp_rank is not None:
        loads = [e for e in loads if str(e["dp_rank"]) == dp_rank]
    if request.query_params.get("format") == "prometheus":
        return PlainTextResponse(_loads_prometheus(loads), media_type="text/plain; version=0.0.4; charset=utf-8")
    body = {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": SGLANG_VERSION,
        "accelerator": None,  # SGLang: the device's marketing name, None when unavailable (no GPU here)
        "num_accelerators": state.args.tp_size,  # per DP rank: tp x pp (no attention-DP)
        "loads": loads,
    }
    return JSONResponse(body)


def _metrics_text(state: ServerState) -> str:
    s = state.scheduler
    name = state.served_model_name
    labels = f'model_name="{name}",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
    # TokenizerMetricsCollector's request counters carry is_streaming (the stand-in never streams).
    tokenizer_labels = f'model_name="{name}",engine_type="unified",is_streaming="false"'
    gauges = {
        "num_running_reqs": ("The number of running requests.", len(s.running)),
        "num_queue_reqs": ("The number of requests in the waiting queue.", len(s.waiting)),
        "gen_throughput": ("The generation throughput (token/s).", s.gen_throughput),
        "token_usage": ("The token usage.", s.num_used_tokens / s.max_total_tokens),
        "num_used_tokens": ("The number of used tokens.", s.num_used_tokens),
        "max_total_num_tokens": ("Maximum total number of tokens in the KV cache.", s.max_total_tokens),
        "context_len": ("The context length.", state.context_len),
        "cache_hit_rate": ("The prefix cache hit rate.", 0.0),
        "utilization": ("The utilization.", len(s.running) / state.max_running_per_dp / state.args.dp_size),
    }
    counters = {
        "prompt_tokens": ("Number of prefill tokens processed.", s.prompt_tokens_total),
        "generation_tokens": ("Number of generation tokens processed.", s.generation_tokens_total),
        "num_requests": ("The number of processed requests.", s.num_requests_total),
        "num_aborted_requests": ("Number of requests aborted.", s.num_aborted_total),
    }
    lines: list[str] = []
    for key, (doc, value) in gauges.items():
        lines += [
            f"# HELP sglang:{key} {doc}",
            f"# TYPE sglang:{key} gauge",
            f"sglang:{key}{{{labels}}} {float(value)}",
        ]
    for key, (doc, value) in counters.items():
        lines += [
            f"# HELP sglang:{key}_total {doc}",
            f"# TYPE sglang:{key}_total counter",
            f"sglang:{key}_total{{{tokenizer_labels}}} {float(value)}",
        ]
    return "\n".join(lines) + "\n"


async def _abort_request(state: ServerState, request: Request) -> Response:
    try:
        body = json.loads(await request.body() or b"{}")
    except json.JSONDecodeError:
        body = {}
    if isinstance(body, dict):
        state.scheduler.abort(str(body.get("rid") or ""), abort_all=bool(body.get("abort_all")))
    return Response(status_code=200)


async def _http_exception(request: Request, exc: Exception) -> Response:
    # FastAPI's shape (SGLang is a FastAPI app): {"detail": "Not Found"} rather than starlette's plain text.
    assert isinstance(exc, HTTPException)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)


def build_app(
    state: ServerState, lifespan: Callable[[Starlette], AbstractAsyncContextManager[None]] | None = None
) -> ASGIApp:
    """The ASGI app of the stand-in (routes + API-key middleware)."""
    s = state

    def flag_status() -> int:
        # /ready and /ping: a flag check (is_ready / is_healthy), no generation.
        return 200 if s.status == Status.UP else 503

    async def flag(request: Request) -> Response:
        return Response(status_code=flag_status())

    async def health(request: Request) -> Response:
        """SGLang's health_generate: 503 while Starting, else a one-token probe polled once a second.

        The probe succeeds (200, status Up) when the scheduler answers within SGLANG_HEALTH_CHECK_TIMEOUT
        (20 s) and fails (503, status UnHealthy) when it does not: a stalled stand-in answers 503 only then.
        With SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false, /health (not /health_generate) is a plain 200.
        """
        if s.status == Status.STARTING:
            return Response(status_code=503)
        generation = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() in ("1", "true")
        if not generation and request.url.path == "/health":
            return Response(status_code=200)
        timeout = int(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
        tic = time.time()
        while time.time() < tic + timeout:
            await asyncio.sleep(1)
            if not s.stalled:
                s.status = Status.UP
                return Response(status_code=200)
        logger.error(
            "Health check failed. Server couldn't get a response from detokenizer for last %d seconds.", timeout
        )
        s.status = Status.UNHEALTHY
        return Response(status_code=503)

    async def root(request: Request) -> Response:
        return PlainTextResponse("SGLang is running")

    async def model_info(request: Request) -> Response:
        if request.url.path == "/get_model_info":
            logger.warning("Endpoint '/get_model_info' is deprecated and will be removed. Use '/model_info'.")
        return JSONResponse(_model_info(s))

    async def server_info(request: Request) -> Response:
        if request.url.path == "/get_server_info":
            logger.warning("Endpoint '/get_server_info' is deprecated and will be removed. Use '/server_info'.")
        return JSONResponse(_server_info(s))

    def model_card() -> dict[str, Any]:
        name = s.served_model_name
        created = int(s.startup_time)
        return {"id": name, "object": "model", "created": created, "owned_by": "sglang", "root": name}

    async def models(request: Request) -> Response:
        card = {**model_card(), "parent": None, "max_model_len": s.context_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def one_model(request: Request) -> Response:
        wanted = request.path_params["model"]
        if wanted != s.served_model_name:
            error = {
                "message": f"The model '{wanted}' does not exist",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return JSONResponse({"error": error}, status_code=404)
        return JSONResponse({**model_card(), "parent": None, "max_model_len": s.context_len})

    async def metrics(request: Request) -> Response:
        if not s.args.enable_metrics:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return PlainTextResponse(_metrics_text(s), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def flush_cache(request: Request) -> Response:
        idle = not s.scheduler.running and not s.scheduler.waiting
        return PlainTextResponse(_FLUSH_TEXT, status_code=200 if idle else 400)

    def bound(fn: Callable[[ServerState, Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await fn(s, request)

        return endpoint

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/ready", flag, methods=["GET"]),
        Route("/ping", flag, methods=["GET"]),
        Route("/", root, methods=["GET", "HEAD"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", one_model, methods=["GET"]),
        Route("/v1/loads", bound(_v1_loads), methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/abort_request", bound(_abort_request), methods=["POST"]),
        Route("/generate", bound(_generate), methods=["POST", "PUT"]),
        Route("/v1/chat/completions", bound(_chat), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_exception})
    return _ApiKeyMiddleware(app, s.args.api_key, s.args.admin_api_key)
