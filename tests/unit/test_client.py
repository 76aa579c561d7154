"""SGLangClient: request shape and the mapping of every server answer onto the error tree (MockTransport)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from datagen.engine.client import (
    SAMPLING_KEYS,
    AuthError,
    EngineError,
    GenerateResult,
    ProtocolError,
    RequestRejected,
    RequestTimeout,
    ServerError,
    ServerUnreachable,
    SGLangClient,
    TransientError,
    sampling_params_for,
)
from datagen.engine.endpoints import ServerEndpoint
from datagen.runspec import SamplingSpec

SAMPLING = sampling_params_for(SamplingSpec(max_new_tokens=64))
EP = ServerEndpoint(name="gpu0", url="http://gpu0.test", api_key=SecretStr("sekrit"))

Handler = Callable[[httpx.Request], Any]


def ok_body(output_ids: list[int], finish: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "text": "x" * len(output_ids),
        "output_ids": output_ids,
        "meta_info": {
            "id": "r",
            "finish_reason": finish or {"type": "stop", "matched": 248046},
            "prompt_tokens": 3,
            "completion_tokens": len(output_ids),
            "e2e_latency": 0.25,
        },
    }


def run_generate(handler: Handler, **kwargs: Any) -> GenerateResult:
    async def go() -> GenerateResult:
        async with SGLangClient(EP, transport=httpx.MockTransport(handler)) as client:
            return await client.generate([1, 2, 3], SAMPLING, **kwargs)

    return asyncio.run(go())


def test_generate_sends_token_ids_exact_sampling_keys_fresh_rid_and_bearer_key() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/generate"
        assert request.headers["authorization"] == "Bearer sekrit"
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=ok_body([5, 6, 248046]))

    first = run_generate(handler)
    second = run_generate(handler)
    body = seen[0]
    assert body["input_ids"] == [1, 2, 3]
    assert "text" not in body
    assert set(body["sampling_params"]) == set(SAMPLING_KEYS)
    assert body["sampling_params"]["max_new_tokens"] == 64
    assert len(body["rid"]) == 32 and body["rid"] != seen[1]["rid"]
    assert first.output_ids == [5, 6, 248046]
    assert first.finish_reason == "stop" and first.finish_detail["matched"] == 248046
    assert (first.prompt_tokens, first.completion_tokens, first.e2e_latency) == (3, 3, 0.25)
    assert first.server == "gpu0" and first.rid == body["rid"] and second.rid == seen[1]["rid"]


def test_generate_refuses_wrong_sampling_keys_before_sending() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("must not send")

    async def go() -> None:
        async with SGLangClient(EP, transport=httpx.MockTransport(handler)) as client:
            await client.generate([1], {**SAMPLING, "max_tokens": 5})

    with pytest.raises(ValueError, match="exactly the keys"):
        asyncio.run(go())


@pytest.mark.parametrize(
    ("status", "body", "exc_type", "text"),
    [
        (400, {"error": "unknown field `max_tokens`"}, RequestRejected, "unknown field `max_tokens`"),
        (
            400,
            {
                "error": {
                    "message": "The input (300000 tokens) is longer than the model's context length (262144 tokens)."
                }
            },
            RequestRejected,
            "longer than the model's context length",
        ),
        (401, {"error": "Unauthorized"}, AuthError, "API key"),
        (403, {"error": "Forbidden"}, AuthError, "Forbidden"),
        (503, {"object": "error", "message": "The request queue is full.", "code": 503}, ServerError, "queue is full"),
        (500, {"error": {"message": "boom"}}, ServerError, "boom"),
        (429, {"error": "slow down"}, ServerError, "slow down"),
        (404, {"detail": "Not Found"}, ProtocolError, "404"),
    ],
)
def test_http_errors_map_onto_the_tree(status: int, body: Any, exc_type: type[EngineError], text: str) -> None:
    with pytest.raises(exc_type, match=text) as info:
        run_generate(lambda request: httpx.Response(status, json=body))
    assert info.value.server == "gpu0"
    assert "sekrit" not in str(info.value)
    assert isinstance(info.value, TransientError) == (exc_type is ServerError)


def test_rejected_carries_the_servers_message_verbatim() -> None:
    message = "Requested token count exceeds the model's maximum context length of 262144 tokens."
    with pytest.raises(RequestRejected) as info:
        run_generate(lambda request: httpx.Response(400, json={"error": {"message": message}}))
    assert info.value.message == message


@pytest.mark.parametrize(
    "content",
    [
        b"<html>bad gateway</html>",
        b"[]",
        json.dumps({"text": "x", "meta_info": {}}).encode(),
        json.dumps(ok_body([1, 2]) | {"output_ids": [1, "2"]}).encode(),
        json.dumps(ok_body([1, 2], finish={"type": "weird"})).encode(),
        json.dumps({**ok_body([1, 2]), "meta_info": {**ok_body([1, 2])["meta_info"], "completion_tokens": 5}}).encode(),
    ],
)
def test_garbage_answers_are_protocol_errors(content: bytes) -> None:
    with pytest.raises(ProtocolError):
        run_generate(lambda request: httpx.Response(200, content=content))


def test_length_and_abort_finishes_are_results() -> None:
    length = run_generate(lambda r: httpx.Response(200, json=ok_body([7] * 4, {"type": "length", "length": 4})))
    assert length.finish_reason == "length" and length.finish_detail["length"] == 4
    abort = run_generate(lambda r: httpx.Response(200, json=ok_body([], {"type": "abort", "message": "Aborted"})))
    assert abort.finish_reason == "abort" and abort.output_ids == []


def test_connection_errors_are_server_unreachable() -> None:
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    def dropped(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    with pytest.raises(ServerUnreachable, match="ConnectError"):
        run_generate(refused)
    with pytest.raises(ServerUnreachable, match="RemoteProtocolError"):
        run_generate(dropped)


def test_deadline_bounds_the_whole_call() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200, json=ok_body([1]))

    with pytest.raises(RequestTimeout, match="no answer within"):
        run_generate(slow, timeout_s=0.05)


def test_control_endpoints_parse_capacity_and_loads() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/server_info":
            states = [{"effective_max_running_requests_per_dp": 37}, {"effective_max_running_requests_per_dp": 35}]
            return httpx.Response(200, json={"internal_states": states, "max_running_requests": 999})
        if request.url.path == "/v1/loads":
            load = {"num_running_reqs": 30, "num_waiting_reqs": 2, "max_running_requests": 37, "gen_throughput": 900.5}
            return httpx.Response(200, json={"loads": [load, {**load, "gen_throughput": 100.0}]})
        return httpx.Response(404)

    async def go() -> None:
        async with SGLangClient(EP, transport=httpx.MockTransport(handler)) as client:
            assert await client.health() is True
            assert await client.effective_max_running() == 72
            load = await client.loads()
            assert (load.num_running_reqs, load.num_waiting_reqs, load.max_running_requests) == (60, 4, 74)
            assert load.gen_throughput == pytest.approx(1000.5)

    asyncio.run(go())


def test_health_is_false_on_503_and_on_refused_connections() -> None:
    def starting(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503)

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async def go(handler: Handler) -> bool:
        async with SGLangClient(EP, transport=httpx.MockTransport(handler)) as client:
            return await client.health()

    assert asyncio.run(go(starting)) is False
    assert asyncio.run(go(refused)) is False


def test_capacity_falls_back_to_max_running_requests_and_fails_without_either() -> None:
    async def go(body: dict[str, Any]) -> int:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, json=body))
        async with SGLangClient(EP, transport=transport) as client:
            return await client.effective_max_running()

    assert asyncio.run(go({"max_running_requests": 48})) == 48
    with pytest.raises(ProtocolError, match="effective_max_running_requests_per_dp"):
        asyncio.run(go({"internal_states": [{}]}))


def test_repr_of_endpoint_and_errors_never_show_the_key() -> None:
    assert "sekrit" not in repr(EP)
    with pytest.raises(AuthError) as info:
        run_generate(lambda request: httpx.Response(401, json={"error": "Unauthorized"}))
    assert "sekrit" not in repr(info.value) and "sekrit" not in str(info.value)
