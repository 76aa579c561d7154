"""HTTP client for one SGLang server (or the project's stand-in): health, capacity, load and `/generate`.

Errors raised by `SGLangClient`, in one tree::

    EngineError                      base of everything below
    ├── TransientError               worth retrying (new rid, maybe another server)
    │   ├── ServerUnreachable        connection refused/reset/dropped: the server may be down
    │   ├── RequestTimeout           no answer within the request's deadline
    │   └── ServerError              5xx (503 "queue is full" included) or 429
    ├── RequestRejected              400 for this prompt (too long, bad value): a reject row, never retried
    ├── AuthError                    401/403: wrong or missing API key; fatal
    └── ProtocolError                2xx/4xx body that is not what the API promises; retried a bounded
                                     number of times, then a reject row with the detail

Requests carry token ids (`input_ids`, never text) so that what the model sees is exactly what we tokenized,
and `sampling_params` with exactly the keys in `SAMPLING_KEYS` (the server rejects unknown keys).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import httpx

from datagen.engine.endpoints import ServerEndpoint
from datagen.engine.transport import H11PoolTransport
from datagen.operations.redact import redact
from datagen.runspec import SamplingSpec

__all__ = [
    "SAMPLING_KEYS",
    "AuthError",
    "EngineError",
    "GenerateResult",
    "LoadInfo",
    "ProtocolError",
    "RequestRejected",
    "RequestTimeout",
    "SGLangClient",
    "ServerError",
    "ServerUnreachable",
    "TransientError",
    "sampling_params_for",
]

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k")
FINISH_TYPES = frozenset({"stop", "length", "abort"})


class EngineError(Exception):
    """Base of every error the engine client raises."""

    def __init__(self, message: str, *, server: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.server = server

    def __str__(self) -> str:
        return f"{self.server}: {self.message}" if self.server else self.message


class TransientError(EngineError):
    """Worth retrying with a new rid."""


class ServerUnreachable(TransientError):
    """The connection could not be made or was dropped before an answer."""


class RequestTimeout(TransientError):
    """No answer within the request's deadline."""


class ServerError(TransientError):
    """The server answered 5xx or 429."""

    def __init__(self, message: str, *, status: int, server: str = "") -> None:
        super().__init__(message, server=server)
        self.status = status


class RequestRejected(EngineError):
    """The server refused this request (400); `message` is the server's own text."""


class AuthError(EngineError):
    """The server refused our credentials (401/403)."""


class ProtocolError(EngineError):
    """The server answered something the API does not allow."""


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """One finished `/generate` call, as the server reported it."""

    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    finish_detail: dict[str, Any]  # the server's finish_reason object (matched token, length, abort message)
    prompt_tokens: int
    completion_tokens: int
    e2e_latency: float  # server-side seconds
    rid: str
    server: str = ""
    latency_s: float = 0.0  # client-side wall seconds of the successful attempt
    cached_tokens: int = 0  # prompt tokens the server found in its radix cache (`meta_info.cached_tokens`)
    num_retractions: int = 0  # times the server retracted it to free KV cache (`meta_info.num_retractions`)


@dataclass(frozen=True, slots=True)
class LoadInfo:
    """A server's load, summed over its data-parallel ranks (`/v1/loads`)."""

    num_running_reqs: int
    num_waiting_reqs: int
    max_running_requests: int
    gen_throughput: float  # decode tokens/s, recent
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


def sampling_params_for(spec: SamplingSpec) -> dict[str, Any]:
    """The `sampling_params` object for a run's sampling spec (exactly `SAMPLING_KEYS`)."""
    return {
        "max_new_tokens": spec.max_new_tokens,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "top_k": spec.top_k,
    }


def _error_message(body: Any) -> str | None:
    """The message of SGLang's error bodies: {"error": "text"}, {"error": {"message": ...}} or {"message": ...}."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, str):
        return err
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return str(err["message"])
    if isinstance(body.get("message"), str):
        return str(body["message"])
    return None


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


class SGLangClient:
    """Async client for one server; explicit timeouts and connection limits, key sent as a Bearer token."""

    def __init__(
        self,
        endpoint: ServerEndpoint,
        *,
        max_connections: int = 256,
        connect_timeout_s: float = 5.0,
        control_timeout_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.name = endpoint.name
        headers = {}
        if endpoint.api_key is not None and endpoint.api_key.get_secret_value():
            headers["Authorization"] = f"Bearer {endpoint.api_key.get_secret_value()}"
        self._connect_timeout_s = connect_timeout_s
        self._control_timeout = httpx.Timeout(control_timeout_s, connect=connect_timeout_s)
        self._http = httpx.AsyncClient(
            base_url=endpoint.url,
            headers=headers,
            timeout=self._control_timeout,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            # httpx's API over a lean keep-alive pool (transport.py: httpcore's pool cost ~half the client's CPU).
            transport=transport or H11PoolTransport(max_connections),
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- control endpoints ------------------------------------------------------------------

    async def health(self, timeout_s: float = 25.0) -> bool:
        """True when GET /health answers 200 (SGLang's probe takes >= 1 s and may poll up to 20 s)."""
        try:
            resp = await self._http.get("/health", timeout=httpx.Timeout(timeout_s, connect=self._connect_timeout_s))
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def server_info(self) -> dict[str, Any]:
        """GET /server_info: resolved server args and per-DP internal states, secrets masked.

        SGLang answers with `api_key` (top level and in every internal state) and `launch_command` in clear;
        what this returns may be logged or stored, so it is redacted here, once.
        """
        body = await self._get_json("/server_info")
        if not isinstance(body, dict):
            raise ProtocolError(f"/server_info returned {type(body).__name__}, not an object", server=self.name)
        redacted: dict[str, Any] = redact(body, [self.endpoint.api_key])
        return redacted

    async def effective_max_running(self) -> int:
        """Running-request capacity: effective_max_running_requests_per_dp summed over DP ranks."""
        return (await self.serving_shape())[0]

    async def serving_shape(self) -> tuple[int, bool]:
        """(running-request capacity, whether the server keeps its radix cache) from one /server_info.

        The radix (prefix) cache is per server process: SGLang reports its resolved `disable_radix_cache` there;
        a server that does not say is taken at SGLang's default (kept).
        """
        info = await self.server_info()
        return self._capacity(info), info.get("disable_radix_cache") is not True

    def _capacity(self, info: dict[str, Any]) -> int:
        states = info.get("internal_states")
        if isinstance(states, list) and states:
            values: list[int] = []
            for state in states:
                value = state.get("effective_max_running_requests_per_dp") if isinstance(state, dict) else None
                if _is_int(value) and value > 0:
                    values.append(value)
            if len(values) == len(states):
                return sum(values)
        fallback = info.get("max_running_requests")
        if _is_int(fallback) and fallback > 0:
            return int(fallback)
        raise ProtocolError(
            "/server_info has neither internal_states[].effective_max_running_requests_per_dp nor max_running_requests",
            server=self.name,
        )

    async def loads(self) -> LoadInfo:
        """GET /v1/loads, summed over DP ranks."""
        body = await self._get_json("/v1/loads")
        ranks = body.get("loads") if isinstance(body, dict) else None
        if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
            raise ProtocolError("/v1/loads has no 'loads' list", server=self.name)
        try:
            return LoadInfo(
                num_running_reqs=sum(int(r["num_running_reqs"]) for r in ranks),
                num_waiting_reqs=sum(int(r["num_waiting_reqs"]) for r in ranks),
                max_running_requests=sum(int(r["max_running_requests"]) for r in ranks),
                gen_throughput=sum(float(r.get("gen_throughput") or 0.0) for r in ranks),
                raw=body,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"/v1/loads entry lacks {exc}", server=self.name) from exc

    async def _get_json(self, path: str) -> Any:
        try:
            resp = await self._http.get(path)
        except httpx.TimeoutException as exc:
            raise RequestTimeout(f"GET {path} timed out ({type(exc).__name__})", server=self.name) from exc
        except httpx.TransportError as exc:
            raise ServerUnreachable(f"GET {path}: {type(exc).__name__}: {exc}", server=self.name) from exc
        self._raise_for_status(resp, f"GET {path}")
        try:
            return resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"GET {path}: body is not JSON: {resp.text[:200]!r}", server=self.name) from exc

    # --- generation -------------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], sampling: dict[str, Any], *, rid: str | None = None, timeout_s: float = 600.0
    ) -> GenerateResult:
        """POST /generate for one prompt given as token ids; `timeout_s` bounds the whole call."""
        if set(sampling) != set(SAMPLING_KEYS):
            raise ValueError(f"sampling must have exactly the keys {SAMPLING_KEYS}, got {sorted(sampling)}")
        if not input_ids:
            raise ValueError("input_ids must not be empty")
        rid = rid or uuid.uuid4().hex
        payload = {"input_ids": input_ids, "sampling_params": dict(sampling), "rid": rid, "stream": False}
        started = time.monotonic()
        try:
            # httpx's read timeout is per read; asyncio.timeout caps the whole exchange.
            async with asyncio.timeout(timeout_s):
                resp = await self._http.post(
                    "/generate", json=payload, timeout=httpx.Timeout(timeout_s, connect=self._connect_timeout_s)
                )
        except (TimeoutError, httpx.TimeoutException) as exc:
            if isinstance(exc, httpx.ConnectTimeout):
                raise ServerUnreachable(f"connect timed out (rid {rid})", server=self.name) from exc
            raise RequestTimeout(
                f"/generate got no answer within {timeout_s:.0f} s (rid {rid})", server=self.name
            ) from exc
        except httpx.TransportError as exc:
            raise ServerUnreachable(f"/generate: {type(exc).__name__}: {exc} (rid {rid})", server=self.name) from exc
        latency = time.monotonic() - started
        self._raise_for_status(resp, "POST /generate")
        return self._parse_generate(resp, rid, latency)

    def _raise_for_status(self, resp: httpx.Response, what: str) -> None:
        status = resp.status_code
        if status < 400:
            return
        try:
            message = _error_message(resp.json()) or resp.text[:500]
        except (json.JSONDecodeError, UnicodeDecodeError):
            message = resp.text[:500]
        if status in (401, 403):
            raise AuthError(
                f"{what}: HTTP {status} {message!r}: the server refused the API key "
                "(check DATAGEN_SGLANG_API_KEY against the server's --api-key)",
                server=self.name,
            )
        if status >= 500 or status == 429:
            raise ServerError(f"{what}: HTTP {status}: {message}", status=status, server=self.name)
        if status in (400, 413, 422):
            raise RequestRejected(message, server=self.name)
        raise ProtocolError(f"{what}: unexpected HTTP {status}: {message}", server=self.name)

    def _parse_generate(self, resp: httpx.Response, rid: str, latency: float) -> GenerateResult:
        def bad(why: str) -> ProtocolError:
            return ProtocolError(f"/generate response {why} (rid {rid}): {resp.text[:200]!r}", server=self.name)

        try:
            body = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad("is not JSON") from exc
        if not isinstance(body, dict):
            raise bad("is not an object")
        output_ids, text, meta = body.get("output_ids"), body.get("text"), body.get("meta_info")
        if not isinstance(output_ids, list) or not all(_is_int(t) for t in output_ids):
            raise bad("has no integer output_ids list")
        if not isinstance(text, str):
            raise bad("has no text")
        if not isinstance(meta, dict):
            raise bad("has no meta_info")
        finish = meta.get("finish_reason")
        if not isinstance(finish, dict) or finish.get("type") not in FINISH_TYPES:
            raise bad("has no finished finish_reason")
        prompt_tokens, completion_tokens = meta.get("prompt_tokens"), meta.get("completion_tokens")
        if not _is_int(prompt_tokens) or not _is_int(completion_tokens):
            raise bad("lacks prompt_tokens/completion_tokens")
        # The API counts the stop token in both: a mismatch means a broken or truncated answer.
        if completion_tokens != len(output_ids):
            raise bad(f"says completion_tokens={completion_tokens} but has {len(output_ids)} output_ids")
        e2e = meta.get("e2e_latency", latency)
        cached = meta.get("cached_tokens")  # the prompt's prefix the server's radix cache held (0 without one)
        retractions = meta.get("num_retractions")
        return GenerateResult(
            output_ids=output_ids,
            text=text,
            finish_reason=str(finish["type"]),
            finish_detail=finish,
            prompt_tokens=int(prompt_tokens),
            completion_tokens=int(completion_tokens),
            e2e_latency=float(e2e) if isinstance(e2e, int | float) else latency,
            rid=rid,
            server=self.name,
            latency_s=latency,
            cached_tokens=int(cached) if _is_int(cached) and cached > 0 else 0,
            num_retractions=int(retractions) if _is_int(retractions) and retractions > 0 else 0,
        )
