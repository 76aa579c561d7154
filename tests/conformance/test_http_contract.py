"""The /generate request contract judged by SGLang 0.5.23's own code: our client's bodies, and the stand-in's answers.

The real server runs, in this order, on every /generate body: the schema decoder (`generate_contract_error`, from
`sglang/api/v1/api_types.py`; 400 {"error": "<text>"}), the tokenizer manager's length checks, then
`SamplingParams(**sampling_params)` with `normalize()` and `verify()` (400 {"error": {"message": "<text>"}}).
The real functions run in the tier's subprocess; the stand-in runs as its own process over HTTP.
"""

from __future__ import annotations

import ast
import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from datagen.engine.client import (
    AuthError,
    GenerateResult,
    ProtocolError,
    RequestRejected,
    ServerError,
    SGLangClient,
    sampling_params_for,
)
from datagen.engine.endpoints import ServerEndpoint
from datagen.local.model_fixture import ensure_model_dir
from datagen.runspec import SamplingSpec
from datagen.standin.testing import run_standin
from tests.conformance.conftest import RealSglang

KEY = "contract-key"
PROMPT = [9707, 11, 1879, 0, 151645]  # any in-vocabulary ids; lengths stay far inside the context
CONTEXT = 4096

# The real pipeline, per body: contract decoder, then SamplingParams as TokenizerManager builds it.
_JUDGE = """
import json
from sglang.srt.entrypoints.api_contract import generate_contract_error
from sglang.srt.sampling.sampling_params import SamplingParams

class _Tokenizer:  # normalize() only asks it for stop-string lengths
    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

vocab = int(ARGS[0])
out = []
for body in json.loads(ARGS[1]):
    err = generate_contract_error(body)
    if err is not None:
        out.append({"status": 400, "body": {"error": err}})
        continue
    sp = body.get("sampling_params") or {}
    try:
        params = SamplingParams(**sp)
        params.normalize(_Tokenizer())
        params.verify(vocab)
    except ValueError as exc:
        out.append({"status": 400, "body": {"error": {"message": str(exc)}}})
    else:
        out.append({"status": 200, "body": None})
RESULT = out
"""


def _vocab_size(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def _judge(real: RealSglang, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    verdicts: list[dict[str, Any]] = real.run(_JUDGE, args=[str(_vocab_size(ensure_model_dir())), json.dumps(bodies)])
    return verdicts


def _client_bodies(specs: list[SamplingSpec]) -> list[dict[str, Any]]:
    """The exact JSON our client POSTs to /generate for each sampling spec (captured off the wire)."""
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        finish = {"type": "stop", "matched": 248046}
        meta = {"id": body["rid"], "finish_reason": finish, "prompt_tokens": 5, "completion_tokens": 1}
        return httpx.Response(200, json={"text": "", "output_ids": [248046], "meta_info": meta})

    async def go() -> None:
        ep = ServerEndpoint(name="wire", url="http://wire.test", api_key=SecretStr(KEY))
        async with SGLangClient(ep, transport=httpx.MockTransport(handler)) as client:
            for spec in specs:
                await client.generate(PROMPT, sampling_params_for(spec))

    asyncio.run(go())
    return seen


# Sampling specs a run spec can hold: the default, the docs' examples and the validators' edges.
CLIENT_SPECS = [
    SamplingSpec(),
    SamplingSpec(max_new_tokens=32768, temperature=0.6, top_p=0.95, top_k=20),
    SamplingSpec(max_new_tokens=1, temperature=0.0, top_p=1.0, top_k=-1),
    SamplingSpec(max_new_tokens=64, temperature=2.0, top_p=1e-6, top_k=1),
]


def test_client_bodies_pass_the_real_contract_and_sampling_checks(real_sglang: RealSglang) -> None:
    """Every body our client can send is admitted by the real decoder and by real SamplingParams.verify."""
    bodies = _client_bodies(CLIENT_SPECS)
    assert len(bodies) == len(CLIENT_SPECS)
    assert all(set(b) == {"input_ids", "sampling_params", "rid", "stream"} for b in bodies)
    verdicts = _judge(real_sglang, bodies)
    assert verdicts == [{"status": 200, "body": None}] * len(bodies), list(zip(bodies, verdicts, strict=True))
    # And the real decoder reads back exactly what we meant (token ids, not text; no stream).
    decoded = real_sglang.run(
        "import json\nfrom sglang.api.v1.api_types import GenerateRequest\n"
        "RESULT = [GenerateRequest.from_json_value(b).to_json_value() for b in json.loads(ARGS[0])]\n",
        args=[json.dumps(bodies)],
    )
    for body, back in zip(bodies, decoded, strict=True):
        assert back["input_ids"] == PROMPT and back["rid"] == body["rid"] and back.get("stream") is False
        for key, value in body["sampling_params"].items():
            assert back["sampling_params"][key] == value, key
    # FastAPI's typed parse of the body into GenerateReqInput (before the contract), then its normalization.
    normalized = real_sglang.run(
        "import json, pydantic\nfrom sglang.srt.managers.io_struct import GenerateReqInput\n"
        "out = []\n"
        "for b in json.loads(ARGS[0]):\n"
        "    obj = pydantic.TypeAdapter(GenerateReqInput).validate_python(b)\n"
        "    obj.normalize_batch_and_arguments()\n"
        "    out.append([obj.is_single, obj.rid, obj.input_ids, obj.sampling_params, obj.stream])\n"
        "RESULT = out\n",
        args=[json.dumps(bodies)],
    )
    for body, (single, rid, ids, sp, stream) in zip(bodies, normalized, strict=True):
        assert single and rid == body["rid"] and ids == PROMPT and sp == body["sampling_params"] and stream is False


def _sp(**params: Any) -> dict[str, Any]:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, **params}}


# Bodies that differ from a good one in one place: contract-level (types, unknown keys, nulls) and value-level.
CORPUS: list[dict[str, Any]] = [
    _sp(),
    _sp(max_tokens=10),
    _sp(max_new_tokens=100.0),
    _sp(max_new_tokens="5"),
    _sp(max_new_tokens=None),
    _sp(temperature="hot"),
    _sp(temperature=None, top_p=None, top_k=None, min_p=None),
    _sp(top_k=1.5),
    _sp(top_k=True),
    _sp(stop=5),
    _sp(stop=["a", 1]),
    _sp(stop="</answer>"),
    _sp(stop_token_ids=[1, "x"]),
    _sp(stop_token_ids=[]),
    _sp(structural_tag={"a": 1}),
    _sp(ignore_eos="yes"),
    _sp(logit_bias={"5": "x"}),
    _sp(logit_bias=[1]),
    _sp(watermark={"bogus": 1}),
    _sp(choice="a"),
    {"input_ids": PROMPT, "sampling_params": "greedy"},
    {"input_ids": PROMPT, "sampling_params": None},
    {"input_ids": PROMPT},
    _sp(temperature=-1.0),
    _sp(temperature=0),
    _sp(top_p=0.0),
    _sp(top_p=1.5),
    _sp(min_p=2.0),
    _sp(top_k=0),
    _sp(top_k=-2),
    _sp(top_k=-1),
    _sp(frequency_penalty=3.0),
    _sp(presence_penalty=-3.0),
    _sp(repetition_penalty=0.0),
    _sp(repetition_penalty=3.0),
    _sp(min_new_tokens=-1),
    _sp(max_new_tokens=-1),
    _sp(max_new_tokens=5, min_new_tokens=10),
    _sp(stop=[f"s{i}" for i in range(33)]),
    _sp(stop=[f"s{i}" for i in range(32)]),
    _sp(stop_regex="x" * 300),
    _sp(regex="a+", json_schema="{}"),
    _sp(regex="a+", json_schema=""),
    _sp(logit_bias={"999999999": 1.0}),
    _sp(logit_bias={"5": 1.0}),
    _sp(sampling_seed=2**63),
    _sp(sampling_seed=7),
    _sp(beam_width=0),
]


@pytest.fixture(scope="module")
def standin() -> Iterator[ServerEndpoint]:
    env = {"DATAGEN_STANDIN_LOAD_S": "0", "DATAGEN_STANDIN_LENGTH_MAX": "40"}
    args = ["--context-length", str(CONTEXT), "--skip-server-warmup", "--enable-metrics"]
    with run_standin(ensure_model_dir(), api_key=KEY, args=args, env=env) as ep:
        yield ep


def test_standin_answers_every_body_as_the_real_contract_and_sampling_checks(
    real_sglang: RealSglang, standin: ServerEndpoint
) -> None:
    """Same status and same body (byte-equal JSON) for every body of the corpus; 200 where real admits it."""
    verdicts = _judge(real_sglang, CORPUS)
    mismatches = []
    with httpx.Client(base_url=standin.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        for body, want in zip(CORPUS, verdicts, strict=True):
            got = http.post("/generate", json=body)
            got_body = got.json() if want["status"] != 200 else None
            if got.status_code != want["status"] or got_body != want["body"]:
                mismatches.append({"body": body, "real": want, "standin": [got.status_code, got.text[:300]]})
    assert not mismatches, json.dumps(mismatches, indent=1)
    # The corpus exercises both layers and the admitted path: a check that can pass vacuously would show here.
    statuses = [v["status"] for v in verdicts]
    assert statuses.count(200) >= 8 and statuses.count(400) >= 20
    assert any(isinstance(v["body"] and v["body"]["error"], str) for v in verdicts)
    assert any(isinstance(v["body"] and v["body"]["error"], dict) for v in verdicts)


# --- responses: the shapes the real code builds, parsed by our client --------------------------------------

_RESPONSES = """
from sglang.api.v1.api_types import (
    FinishAbort, FinishLength, FinishStop, GenerateMetaInfo, GenerateResponse, JsonContractError,
)
meta = dict(id="rid-1", prompt_tokens=5, e2e_latency=0.5, cached_tokens=0, reasoning_tokens=2, weight_version="default")
out = {}
for name, finish, ids in (
    ("stop_token", FinishStop(matched=248046), [1, 2, 248046]),
    ("stop_string", FinishStop(matched="</answer>"), [1, 2]),
    ("length", FinishLength(length=3), [1, 2, 3]),
):
    m = GenerateMetaInfo(finish_reason=finish, completion_tokens=len(ids), **meta)
    out[name] = GenerateResponse(text="ab", meta_info=m, output_ids=ids).to_json_value()
# A request aborted by the server (client disconnect, /abort_request): a 200 with an abort finish reason.
m = GenerateMetaInfo(finish_reason=FinishAbort(message="Aborted"), completion_tokens=1, **meta)
out["abort"] = GenerateResponse(text="a", meta_info=m, output_ids=[1]).to_json_value()
RESULT = out
"""


def _parse(status: int, body: Any) -> GenerateResult:
    async def go() -> GenerateResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, json=body))
        ep = ServerEndpoint(name="real-shapes", url="http://real.test", api_key=SecretStr(KEY))
        async with SGLangClient(ep, transport=transport) as client:
            return await client.generate(PROMPT, sampling_params_for(SamplingSpec(max_new_tokens=8)))

    return asyncio.run(go())


def test_client_parses_the_real_response_and_finish_reason_shapes(real_sglang: RealSglang) -> None:
    """Finish reasons as the real encoder writes them (stop by token or string, length, abort) parse to results."""
    shapes = real_sglang.run(_RESPONSES)
    stop = _parse(200, shapes["stop_token"])
    assert (stop.finish_reason, stop.finish_detail["matched"], stop.completion_tokens) == ("stop", 248046, 3)
    assert _parse(200, shapes["stop_string"]).finish_detail["matched"] == "</answer>"
    length = _parse(200, shapes["length"])
    assert (length.finish_reason, length.finish_detail["length"]) == ("length", 3)
    abort = _parse(200, shapes["abort"])
    assert abort.finish_reason == "abort" and abort.finish_detail["message"] == "Aborted"
    assert stop.prompt_tokens == 5 and stop.e2e_latency == pytest.approx(0.5)


# The error bodies, as the real handlers build them (http_server.py / auth.py / the HTTPException handler).
REAL_ERRORS = [
    # contract decoder: generate_request -> ORJSONResponse(status_code=400, content={"error": contract_error})
    (400, {"error": "unknown field `max_tokens`, expected one of `max_new_tokens`"}, RequestRejected),
    # ValueError in the tokenizer manager: _create_error_response -> {"error": {"message": str(e)}}
    (400, {"error": {"message": "top_p must be in (0, 1], got 1.5."}}, RequestRejected),
    # a 503 abort (queue full) -> fastapi.HTTPException -> ErrorResponse via the HTTPException handler
    (
        503,
        {"object": "error", "message": "The request queue is full.", "type": "503", "param": None, "code": 503},
        ServerError,
    ),
    # auth middleware
    (401, {"error": "Unauthorized"}, AuthError),
    (403, {"error": "Forbidden"}, AuthError),
]


@pytest.mark.parametrize(("status", "body", "exc_type"), REAL_ERRORS)
def test_client_maps_the_real_error_shapes(status: int, body: dict[str, Any], exc_type: type[Exception]) -> None:
    """Each real error body lands in the right branch of the client's error tree, with the server's own text."""
    with pytest.raises(exc_type) as info:
        _parse(status, body)
    text = body["error"] if isinstance(body.get("error"), str) else (body.get("error") or body)["message"]
    assert text in str(info.value)


def _error_response_model(site: Path) -> dict[str, Any]:
    """Field names and defaults of SGLang's ErrorResponse, read from its source (importing it needs openai's deps)."""
    tree = ast.parse((site / "sglang/srt/entrypoints/openai/protocol.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ErrorResponse")
    return {
        f.target.id: (ast.literal_eval(f.value) if f.value is not None else ...)
        for f in cls.body
        if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
    }


def test_real_error_shapes_are_what_the_real_code_builds(real_sglang: RealSglang) -> None:
    """The bodies above come from the real code: the contract text, the ErrorResponse model, the auth decision."""
    got = real_sglang.run(
        "from sglang.srt.entrypoints.api_contract import generate_contract_error\n"
        "from sglang.srt.utils.auth import AuthLevel, decide_request_auth\n"
        "d = decide_request_auth(method='POST', path='/generate', authorization_header=None, api_key='k',"
        " admin_api_key=None, auth_level=AuthLevel.NORMAL)\n"
        "RESULT = {'contract': generate_contract_error({'text': 'hi', 'sampling_params': {'max_tokens': 1}}),"
        " 'auth': [d.allowed, d.error_status_code]}\n"
    )
    assert got["contract"].startswith(REAL_ERRORS[0][1]["error"])
    assert got["auth"] == [False, 401]
    model = _error_response_model(real_sglang.site)
    assert model == {"object": "error", "message": ..., "type": ..., "param": None, "code": ...}
    queue_full = REAL_ERRORS[2][1]
    assert list(queue_full) == list(model) and queue_full["type"] == str(queue_full["code"])


def test_standin_responses_decode_with_the_real_response_types(
    real_sglang: RealSglang, standin: ServerEndpoint
) -> None:
    """What the stand-in answers to our client is a valid real GenerateResponse, finish reason included."""
    bodies = []
    with httpx.Client(base_url=standin.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        for body in [*_client_bodies([SamplingSpec(max_new_tokens=1024)]), _sp(max_new_tokens=2)]:
            resp = http.post("/generate", json=body)
            assert resp.status_code == 200, resp.text
            bodies.append(resp.json())
    decoded = real_sglang.run(
        "import json\nfrom sglang.api.v1.api_types import GenerateResponse, FinishStop, FinishLength\n"
        "out = []\n"
        "for b in json.loads(ARGS[0]):\n"
        "    r = GenerateResponse.from_json_value(b)\n"
        "    out.append([type(r.meta_info.finish_reason).__name__, r.meta_info.completion_tokens, len(r.output_ids)])\n"
        "RESULT = out\n",
        args=[json.dumps(bodies)],
    )
    # A dict (not a Finish* struct) would mean the real decoder did not recognise the finish reason's shape.
    assert [d[0] for d in decoded] == ["FinishStop", "FinishLength"]
    assert all(d[1] == d[2] for d in decoded)
    with pytest.raises(ProtocolError):  # and our client refuses what the API does not allow
        _parse(200, {**bodies[0], "output_ids": "nope"})
