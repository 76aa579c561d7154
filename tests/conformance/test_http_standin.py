"""The stand-in's HTTP behaviour against SGLang 0.5.23's own code: lengths, auth, loads, metrics, health, server_info.

Where the real function imports cleanly under the tier's stubs it is called; where its module cannot be imported
without the GPU stack (the tokenizer manager, the scheduler utilities) the real function's own source is compiled
and run with its collaborators replaced by plain values, so the bounds and texts under test are SGLang's.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from datagen.engine.endpoints import ServerEndpoint
from datagen.local.model_fixture import ensure_model_dir
from datagen.standin.testing import free_port, run_standin, standin_command, stop_process
from tests.conformance.conftest import RealSglang

KEY = "standin-key"
ADMIN = "admin-key"
CONTEXT = 2048

# Runs a real method's source with its collaborators faked: ARGS[0] = relative path, ARGS[1] = class or "",
# ARGS[2] = function; the function lands in the global REAL.
_LOAD_FUNCTION = """
import ast, logging, types, typing
from pathlib import Path
import sglang

def real_function(rel, cls_name, name, extra):
    src = Path(sglang.__file__).parent / rel
    tree = ast.parse(src.read_text())
    body = tree.body
    if cls_name:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls_name).body
    fn = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []
    ns = {"logger": logging.getLogger("real"), "Union": typing.Union, "List": list, "Optional": typing.Optional,
          "Req": object, **extra}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(src), "exec"), ns)
    return ns[name]
"""

_LENGTHS = (
    _LOAD_FUNCTION
    + """
import json
class _Other:  # neither GenerateReqInput nor EmbeddingReqInput: skips the checks that do not concern lengths
    pass
features = types.SimpleNamespace(features=types.SimpleNamespace(enable_encoder_swa_bounded_replay=False))
validate_one = real_function("srt/managers/tokenizer_manager.py", "TokenizerManager", "_validate_one_request",
                             {"get_exec": lambda: features, "EmbeddingReqInput": _Other, "GenerateReqInput": _Other})
validate_input_length = real_function("srt/managers/utils.py", "", "validate_input_length", {})
context, max_req_input_len = int(ARGS[0]), int(ARGS[1])
manager = types.SimpleNamespace(
    context_len=context, num_reserved_tokens=0, validate_total_tokens=True, allow_auto_truncate=False,
    _validate_joint_schema_request=lambda obj, ids: None,
)
out = []
for n, max_new in json.loads(ARGS[2]):
    ids = [1000] * n
    obj = types.SimpleNamespace(sampling_params={} if max_new is None else {"max_new_tokens": max_new})
    try:
        validate_one(manager, obj, ids)
    except ValueError as exc:
        out.append({"status": 400, "message": str(exc)})
        continue
    error = validate_input_length(types.SimpleNamespace(origin_input_ids=ids), max_req_input_len, False)
    out.append({"status": 400, "message": error} if error else {"status": 200, "message": None})
RESULT = out
"""
)


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerEndpoint]:
    env = {
        "DATAGEN_STANDIN_LOAD_S": "0",
        "DATAGEN_STANDIN_WARMUP_S": "0",
        "DATAGEN_STANDIN_LENGTH_MAX": "30",
        "DATAGEN_STANDIN_STEP_BASE_MS": "5",  # a 400-token request decodes for about 2 s
    }
    args = ["--context-length", str(CONTEXT), "--enable-metrics", "--admin-api-key", ADMIN]
    log = tmp_path_factory.mktemp("standin-http") / "server.log"
    with run_standin(ensure_model_dir(), api_key=KEY, args=args, env=env, log_path=log) as ep:
        yield ep


def _http(ep: ServerEndpoint, key: str | None = KEY) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=ep.url, headers=headers, timeout=60)


def test_length_checks_are_the_real_bounds_and_texts(real_sglang: RealSglang, standin: ServerEndpoint) -> None:
    """Around every bound (context, context - max_new_tokens, max_req_input_len) the same status and message."""
    with _http(standin) as http:
        limit = int(http.get("/server_info").json()["max_req_input_len"])
        cases: list[tuple[int, int | None]] = []
        for n in (CONTEXT + 1, CONTEXT, CONTEXT - 1, limit + 1, limit, limit - 1):
            cases += [(n, None), (n, 1)]
        for n in (100, 1000):
            cases += [(n, CONTEXT - n - 1), (n, CONTEXT - n), (n, CONTEXT - n + 1)]
        want = real_sglang.run(_LENGTHS, args=[str(CONTEXT), str(limit), json.dumps(cases)])
        got = []
        for n, max_new in cases:
            sp = {} if max_new is None else {"max_new_tokens": max_new}
            r = http.post("/generate", json={"input_ids": [1000] * n, "sampling_params": sp})
            got.append(
                {"status": r.status_code, "message": r.json()["error"]["message"] if r.status_code == 400 else None}
            )
    assert got == want, [(c, g, w) for c, g, w in zip(cases, got, want, strict=True) if g != w]
    assert {w["status"] for w in want} == {200, 400}  # both sides of the bounds were exercised


def _route_auth_levels(site: Path) -> dict[str, str]:
    """Path -> auth level of every route in the real http_server.py (decorators read from its source)."""
    tree = ast.parse((site / "sglang/srt/entrypoints/http_server.py").read_text())
    levels: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        paths, level = [], "normal"
        for dec in node.decorator_list:
            if not isinstance(dec, ast.Call):
                continue
            name = ast.unparse(dec.func)
            if name.startswith("app.") and dec.args and isinstance(dec.args[0], ast.Constant):
                paths.append(str(dec.args[0].value))
            if name == "auth_level":
                level = ast.unparse(dec.args[0]).split(".")[-1].lower()
        for path in paths:
            levels[path] = level
    return levels


_AUTH = """
import json
from sglang.srt.utils.auth import AuthLevel, decide_request_auth
out = []
for method, path, header, api_key, admin_key, level in json.loads(ARGS[0]):
    d = decide_request_auth(method=method, path=path, authorization_header=header, api_key=api_key,
                            admin_api_key=admin_key, auth_level=AuthLevel(level))
    out.append(200 if d.allowed else d.error_status_code)
RESULT = out
"""


def test_auth_is_the_real_decision_for_every_route_and_header(real_sglang: RealSglang, standin: ServerEndpoint) -> None:
    """Which routes need which key, which header forms count, and the status and body of a refusal."""
    levels = _route_auth_levels(real_sglang.site)
    assert levels["/flush_cache"] == "admin_optional" and levels["/generate"] == "normal"
    routes = [
        ("GET", "/health"),
        ("GET", "/health_generate"),
        ("GET", "/ready"),
        ("GET", "/metrics"),
        ("GET", "/server_info"),
        ("GET", "/model_info"),
        ("GET", "/v1/models"),
        ("GET", "/ping"),
        ("POST", "/generate"),
        ("GET", "/flush_cache"),
        ("POST", "/abort_request"),
    ]
    headers = [
        None,
        f"Bearer {KEY}",
        f"bearer {KEY}",
        f"BEARER {KEY}",
        f"Bearer  {KEY}",
        f"Bearer {KEY}x",
        f"Bearer {KEY[:-1]}",
        f"Token {KEY}",
        KEY,
        f"Bearer {ADMIN}",
        "Bearer",
    ]
    cases = []
    for method, path in routes:
        level = levels.get(path, "normal")  # /v1/loads etc. live in routers without an auth decorator
        cases += [[method, path, h, KEY, ADMIN, level] for h in headers]
    want = real_sglang.run(_AUTH, args=[json.dumps(cases)])
    got = []
    with _http(standin, None) as http:
        for method, path, header, *_ in cases:
            h = {"Authorization": header} if header is not None else {}
            body = {"rid": "nothing-to-abort"} if path == "/abort_request" else {"text": "hi"}
            r = http.request(method, path, headers=h, json=body if method == "POST" else None)
            status = 401 if r.status_code == 401 else (403 if r.status_code == 403 else 200)
            if r.status_code in (401, 403):
                assert r.json() == {"error": "Unauthorized" if r.status_code == 401 else "Forbidden"}
            got.append(status)
    diffs = [(c[:3], g, w) for c, g, w in zip(cases, got, want, strict=True) if g != w]
    assert not diffs, diffs
    assert 401 in want and 200 in want


_LOADS = """
import json, msgspec
from sglang.srt.managers.load_snapshot import LoadSnapshot
out = []
from sglang.srt.managers import load_snapshot as ls
sections = {"memory": ls.MemoryMetrics, "speculative": ls.SpeculativeMetrics, "lora": ls.LoRAMetrics,
            "disaggregation": ls.DisaggregationMetrics, "queues": ls.QueueMetrics}
for entry, include in json.loads(ARGS[0]):
    entry = dict(entry)
    for name, struct in sections.items():  # array_like structs: their fields, in order, exactly
        if entry.get(name) is not None:
            fields = struct.__struct_fields__
            assert set(entry[name]) == set(fields), (name, sorted(entry[name]), fields)
            entry[name] = [entry[name][f] for f in fields]
    snap = msgspec.convert(entry, LoadSnapshot, strict=True)
    try:
        out.append(snap.to_dict(None if include is None else set(include)))
    except ValueError as exc:
        out.append({"error": str(exc)})
RESULT = out
"""


def test_v1_loads_is_the_real_load_snapshot(real_sglang: RealSglang, standin: ServerEndpoint) -> None:
    """Each /v1/loads entry decodes strictly as the real LoadSnapshot and re-encodes to itself, per include."""
    includes: list[list[str] | None] = [None, ["all"], ["core"], ["memory"], ["queues", "disagg"]]
    with _http(standin) as http:
        entries = []
        for include in includes:
            params = {"include": ",".join(include)} if include else {}
            body = http.get("/v1/loads", params=params).json()
            assert set(body) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
            # Real: datetime.now(timezone.utc).isoformat(), __version__, the device name (None without one).
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+\+00:00", body["timestamp"])
            assert body["version"] == real_sglang.version and isinstance(body["num_accelerators"], int)
            entries += [(e, include) for e in body["loads"]]
        bad = http.get("/v1/loads", params={"include": "core,bogus"})
    # The real snapshot holds every section; what /v1/loads shows is to_dict(include) of it: each entry, completed
    # with the sections of the full one, must come back from the real to_dict(include) exactly as served.
    full = real_sglang.run(_LOADS, args=[json.dumps([[entries[0][0], None]])])[0]
    assert {"memory", "disaggregation", "queues"} <= set(full)
    want = real_sglang.run(_LOADS, args=[json.dumps([[{**full, **e}, inc] for e, inc in entries])])
    assert [e for e, _ in entries] == want
    invalid = real_sglang.run(_LOADS, args=[json.dumps([[full, ["core", "bogus"]]])])[0]["error"]
    # Real: the ValueError becomes HTTPException(400) -> the ErrorResponse handler.
    assert bad.status_code == 400
    assert bad.json() == {"object": "error", "message": invalid, "type": "400", "param": None, "code": 400}


def _counter(metrics: str, name: str) -> float:
    values = [float(m) for m in re.findall(rf"^sglang:{name}\{{[^}}]*\}} (\S+)$", metrics, re.MULTILINE)]
    return sum(values)


def _calls_inside_finished_branch(site: Path) -> bool:
    """True when TokenizerManager calls observe_one_finished_request only under `if state.finished:`."""
    tree = ast.parse((site / "sglang/srt/managers/tokenizer_manager.py").read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "state.finished":
            found += [
                n
                for n in ast.walk(node)
                if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("observe_one_finished_request")
            ]
    every = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("observe_one_finished_request")
    ]
    return bool(every) and len(found) == len(every)


def _only_increment_is_at_finish(site: Path) -> bool:
    """True when sglang:generation_tokens_total is incremented only in observe_one_finished_request."""
    tree = ast.parse((site / "sglang/srt/observability/metrics_collector.py").read_text())
    holders = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for n in ast.walk(fn):
                if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("self.generation_tokens_total.labels"):
                    holders.append(fn.name)
    return set(holders) == {"observe_one_finished_request"}


def test_metrics_count_tokens_when_a_request_finishes(real_sglang: RealSglang, standin: ServerEndpoint) -> None:
    """Real: generation/prompt tokens and requests are counted at finish; the stand-in likewise, not per step."""
    assert _only_increment_is_at_finish(real_sglang.site) and _calls_inside_finished_branch(real_sglang.site)
    with _http(standin) as http, _http(standin) as side:
        before = side.get("/metrics").text
        long = {"input_ids": [1000] * 10, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        # A 400-token request decodes for a while; while it runs, the counter must not move.
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(http.post, "/generate", json=long)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _counter(side.get("/metrics").text, "num_running_reqs") < 1:
                time.sleep(0.01)
            during = side.get("/metrics").text
            result = future.result()
        after = side.get("/metrics").text
    assert result.status_code == 200
    completion = result.json()["meta_info"]["completion_tokens"]
    assert _counter(during, "num_running_reqs") == 1
    assert _counter(during, "generation_tokens_total") == _counter(before, "generation_tokens_total")
    assert _counter(after, "generation_tokens_total") - _counter(before, "generation_tokens_total") == completion
    assert _counter(after, "prompt_tokens_total") - _counter(before, "prompt_tokens_total") == 10
    assert re.search(r'^sglang:generation_tokens_total\{[^}]*is_streaming="false"[^}]*\}', after, re.MULTILINE)


def test_server_info_fields_are_real_server_args_and_scheduler_info(
    real_sglang: RealSglang, standin: ServerEndpoint
) -> None:
    """Every /server_info key is a real ServerArgs field or one build_server_info / the handler adds."""
    real_fields = set(
        real_sglang.run(
            "from sglang.srt.server_args import ServerArgs, record_fields\n"
            "RESULT = sorted(f.name for f in record_fields(ServerArgs))\n"
        )
    )
    added = {"launch_command", "status", "max_total_num_tokens", "max_req_input_len", "startup_time"}
    added |= {"kv_events", "internal_states", "version", "frontend", "enable_dp_attention"}
    with _http(standin) as http:
        info = http.get("/server_info").json()
    unknown = sorted(set(info) - real_fields - added)
    assert not unknown, f"/server_info keys with no real counterpart: {unknown}"
    assert info["status"] == "ready" and info["frontend"] == "python" and info["version"] == real_sglang.version
    state = info["internal_states"][0]
    assert {"effective_max_running_requests_per_dp", "last_gen_throughput", "memory_usage"} <= set(state)
    assert set(state["memory_usage"]) == {
        "weight",
        "kvcache",
        "startup_available",
        "token_capacity",
        "token_capacity_swa",
        "graph",
    }


def test_launch_command_and_startup_log_carry_the_key_like_the_real_server(
    real_sglang: RealSglang, standin: ServerEndpoint
) -> None:
    """Real: launch_command = redact_watermark_command_line(argv) and the startup log prints resolved_dict()
    through redact_watermark_secrets, both of which leave api_key alone. The stand-in does the same, so a
    leak through either is visible to the pipeline's tests (which must then redact it)."""
    with _http(standin) as http:
        info = http.get("/server_info").json()
    argv = info["launch_command"].split(" ")
    real = real_sglang.run(
        "import json\nfrom sglang.srt.sampling.watermarking.core import "
        "redact_watermark_command_line, redact_watermark_secrets\n"
        "argv = json.loads(ARGS[0])\n"
        "RESULT = {'cmd': redact_watermark_command_line(argv, None),"
        " 'dict': redact_watermark_secrets({'api_key': 'k', 'admin_api_key': 'a', 'watermark_key': 'w'})}\n",
        args=[json.dumps(argv)],
    )
    assert info["launch_command"] == real["cmd"] and f"--api-key {KEY}" in real["cmd"]
    assert real["dict"] == {"api_key": "k", "admin_api_key": "a", "watermark_key": "<redacted>"}
    engine = (real_sglang.site / "sglang/srt/entrypoints/engine.py").read_text()
    assert 'logger.info(f"server_args={_server_args_for_logging(server_args)}")' in engine
    log = Path(standin.log_path or "").read_text()
    line = next(line for line in log.splitlines() if "server_args={" in line)
    assert f"'api_key': '{KEY}'" in line and f"'admin_api_key': '{ADMIN}'" in line


def test_health_timing_is_the_real_probe(tmp_path: Path) -> None:
    """As SGLang's health_generate: 503 while Starting (warmup running); then a one-token probe polled once a
    second (200 after >= 1 s); a stalled scheduler answers 503 only after SGLANG_HEALTH_CHECK_TIMEOUT, and
    /ready (a flag check) turns 503 only once a probe has failed."""
    env = {
        "DATAGEN_STANDIN_LOAD_S": "0",
        "DATAGEN_STANDIN_WARMUP_S": "3",
        "DATAGEN_STANDIN_STALL_AFTER": "0",  # the first HTTP generation request (and every later one) hangs
        "SGLANG_HEALTH_CHECK_TIMEOUT": "2",
    }
    port = free_port()
    with (tmp_path / "server.log").open("wb") as log:
        cmd = standin_command(ensure_model_dir(), port, None, [])
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
        try:
            _check_health_phases(proc, f"http://127.0.0.1:{port}")
        finally:
            stop_process(proc)


def _check_health_phases(proc: subprocess.Popen[bytes], url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        deadline = time.monotonic() + 60
        while True:
            try:
                first = http.get("/health")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        assert first.status_code == 503  # Starting: the warmup request has not finished
        assert http.get("/ready").status_code == 503
        while http.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        started = time.monotonic()
        assert http.get("/health").status_code == 200
        assert time.monotonic() - started >= 1.0  # the probe sleeps a second before it looks
        with pytest.raises(httpx.ReadTimeout):  # stalls the scheduler: this request never finishes
            http.post("/generate", json={"text": "hang"}, timeout=1.0)
        assert http.get("/ready").status_code == 200  # no probe has failed yet
        started = time.monotonic()
        assert http.get("/health").status_code == 503
        assert time.monotonic() - started >= 2.0  # only after SGLANG_HEALTH_CHECK_TIMEOUT
        assert http.get("/ready").status_code == 503
