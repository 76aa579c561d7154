"""The SGLang stand-in as a real process over HTTP: startup, auth, /generate, chat, loads, faults, CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from datagen.chat import IM_END_ID, THINK_END_ID, ChatTokenizer
from datagen.local.model_fixture import ensure_model_dir
from datagen.standin.cli import parse_args
from datagen.standin.server import check_gpu_arch
from datagen.standin.testing import free_port, run_standin, standin_command, stop_process

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 4096
THINKING_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
NO_THINK_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
# Small steps (16 ms per 16-token step) keep requests in flight long enough to observe queues.
ENV = {
    "DATAGEN_STANDIN_LOAD_S": "0.5",
    "DATAGEN_STANDIN_WARMUP_S": "2.0",
    "DATAGEN_STANDIN_STEP_BASE_MS": "1",
    "DATAGEN_STANDIN_LENGTH_MEAN": "120",
    "DATAGEN_STANDIN_LENGTH_MAX": "400",
}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_model_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_model_dir(model_dir)


class Started:
    """A stand-in started by hand, with what /health and /ready answered while it came up."""

    def __init__(self, url: str, observed: list[tuple[str, int | None, int | None]], log: Path) -> None:
        self.url = url
        self.observed = observed  # (phase, /health status, /model_info status); None = connection refused
        self.log = log


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    port = free_port()
    log = tmp_path_factory.mktemp("standin") / "server.log"
    args = [
        "--enable-metrics",
        "--reasoning-parser",
        "qwen3",
        "--context-length",
        f"{CONTEXT // 1024}Ki",
        "--served-model-name",
        "qwen3.6-27b",
        "--max-running-requests",
        "4",
        "--max-queued-requests",
        "2",
    ]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            standin_command(model_dir, port, KEY, args),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV},
        )
        try:
            url = f"http://127.0.0.1:{port}"
            observed: list[tuple[str, int | None, int | None]] = []
            deadline = time.monotonic() + 90
            with httpx.Client(base_url=url, headers=AUTH, timeout=5) as c:
                while time.monotonic() < deadline and proc.poll() is None:
                    try:
                        health = c.get("/health").status_code
                        ready = c.get("/ready").status_code
                        info = c.get("/model_info").status_code
                        observed.append(("health", health, info))
                        observed.append(("ready", ready, info))
                        if health == 200:
                            break
                    except httpx.TransportError:
                        observed.append(("closed", None, None))
                    time.sleep(0.05)
            assert proc.poll() is None, log.read_text()
            yield Started(url, observed, log)
        finally:
            stop_process(proc)


@pytest.fixture()
def client(server: Started) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        yield c


def _generate(client: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    return client.post("/generate", json=body)


def test_startup_port_closed_then_503_then_200(server: Started) -> None:
    phases = [(p, h) for p, h, _ in server.observed]
    assert phases[0] == ("closed", None), "port must be closed while loading"
    first_open = next(i for i, (p, h) in enumerate(phases) if h is not None)
    statuses = [h for _, h in phases[first_open:]]
    assert statuses[0] == 503
    assert statuses[-1] == 200
    # Never back to 503 (or closed) once 200, and /model_info answered 200 as soon as the port opened.
    assert statuses == sorted(statuses, key=lambda s: s == 200)
    assert all(info == 200 for _, h, info in server.observed if h is not None)
    assert "The server is fired up and ready to roll!" in server.log.read_text()


def test_api_key_required_except_health(server: Started) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as anon:
        for path in ("/server_info", "/v1/models", "/v1/loads", "/model_info"):
            r = anon.get(path)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, path
        assert anon.post("/generate", json={"text": "hi"}).status_code == 401
        wrong = anon.get("/server_info", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert anon.get("/health").status_code == 200
        assert anon.get("/health").content == b""
        assert anon.get("/ready").status_code == 200
        assert anon.get("/metrics").status_code == 200


def test_generate_single_thinking_structure(client: httpx.Client, tokenizer: ChatTokenizer) -> None:
    r = _generate(client, {"text": THINKING_PROMPT, "sampling_params": {"max_new_tokens": 1000}})
    assert r.status_code == 200
    body = r.json()
    ids, text, meta = body["output_ids"], body["text"], body["meta_info"]
    assert ids[-1] == IM_END_ID
    assert meta["finish_reason"] == {"type": "stop", "matched": IM_END_ID}
    assert tokenizer.decode(ids[:-1]) == text
    assert tokenizer.encode(text) == ids[:-1], "text must re-encode to the same ids"
    k = ids.index(THINK_END_ID)
    assert ids[k - 1 : k + 2] == [198, THINK_END_ID, 271]
    reasoning, answer = text.split("</think>")
    assert reasoning.endswith("\n") and not reasoning.startswith("<think>")
    assert answer.startswith("\n\n") and len(answer.strip()) > 0
    assert meta["prompt_tokens"] == len(tokenizer.encode(THINKING_PROMPT))
    assert meta["completion_tokens"] == len(ids)
    assert len(meta["id"]) == 32
    assert list(meta) == [
        "id",
        "finish_reason",
        "prompt_tokens",
        "weight_version",
        "num_retractions",
        "reasoning_tokens",
        "completion_tokens",
        "cached_tokens",
        "e2e_latency",
        "response_sent_to_client_ts",
    ]
    again = _generate(client, {"text": THINKING_PROMPT, "sampling_params": {"max_new_tokens": 1000}}).json()
    assert again["output_ids"] == ids, "same prompt, same output (retries reproduce)"
    # This server's radix cache holds the prompt now: all of it but the last token, which is always prefilled.
    assert again["meta_info"]["cached_tokens"] == meta["prompt_tokens"] - 1


def test_generate_thinking_off_and_length_cut(client: httpx.Client, tokenizer: ChatTokenizer) -> None:
    off = _generate(client, {"input_ids": tokenizer.encode(NO_THINK_PROMPT), "sampling_params": {}}).json()
    assert THINK_END_ID not in off["output_ids"]
    cut = _generate(client, {"text": THINKING_PROMPT, "sampling_params": {"max_new_tokens": 5}}).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert len(cut["output_ids"]) == 5 and THINK_END_ID not in cut["output_ids"]
    assert tokenizer.decode(cut["output_ids"]) == cut["text"]


def test_generate_batch_shapes(client: httpx.Client) -> None:
    r = _generate(client, {"text": [THINKING_PROMPT, NO_THINK_PROMPT], "rid": "batch", "sampling_params": {}})
    assert r.status_code == 200
    items = r.json()
    assert isinstance(items, list) and len(items) == 2
    assert [it["meta_info"]["id"] for it in items] == ["batch_0", "batch_1"]
    for it in items:
        assert len(it["output_ids"]) <= 128  # default max_new_tokens
    bad = _generate(client, {"text": ["short", "x " * (CONTEXT + 10)]})
    assert bad.status_code == 400 and "context length" in bad.json()["error"]["message"]


def test_generate_strict_sampling_params(client: httpx.Client) -> None:
    r = _generate(client, {"text": "hi", "sampling_params": {"max_tokens": 10}})
    assert r.status_code == 400
    error = r.json()["error"]
    assert isinstance(error, str) and error.startswith("unknown field `max_tokens`, expected one of `max_new_tokens`")
    r = _generate(client, {"text": "hi", "sampling_params": {"max_new_tokens": 100.0}})
    assert r.json() == {"error": "invalid type: floating point `100.0`, expected i64"}
    r = _generate(client, {"text": "hi", "sampling_params": {"top_p": 1.5}})
    assert r.status_code == 400 and r.json() == {"error": {"message": "top_p must be in (0, 1], got 1.5."}}
    r = _generate(client, {"sampling_params": {}})
    assert r.json() == {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}


def test_generate_length_errors_exact(client: httpx.Client, tokenizer: ChatTokenizer) -> None:
    long_ids = [1000] * CONTEXT
    r = _generate(client, {"input_ids": long_ids})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        f"The input ({CONTEXT} tokens) is longer than the model's context length ({CONTEXT} tokens)."
    )
    r = _generate(client, {"input_ids": [1000] * 100, "sampling_params": {"max_new_tokens": CONTEXT}})
    assert r.json()["error"]["message"] == (
        f"Requested token count exceeds the model's maximum context length of {CONTEXT} tokens. "
        f"You requested a total of {CONTEXT + 100} tokens: 100 tokens from the input messages and {CONTEXT} "
        "tokens for the completion. Please reduce the number of tokens in the input messages or the completion "
        "to fit within the limit."
    )
    # Off by one as SGLang: input + max_new_tokens == context length is allowed (the check is `>`) ...
    ok = _generate(client, {"input_ids": [1000] * 100, "sampling_params": {"max_new_tokens": CONTEXT - 100}})
    assert ok.status_code == 200, ok.text
    # ... and the scheduler refuses an input of max_req_input_len (context - 6) tokens (its check is `>=`).
    limit = CONTEXT - 6
    r = _generate(client, {"input_ids": [1000] * limit, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        f"Input length ({limit} tokens) exceeds the maximum allowed length ({limit} tokens). "
        "Use a shorter input or enable --allow-auto-truncate."
    )
    assert _generate(client, {"input_ids": [1000] * (limit - 1), "sampling_params": {"max_new_tokens": 1}}).is_success


def test_chat_reasoning_split_and_thinking_off(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    r = client.post("/v1/chat/completions", json={"model": "anything", "messages": messages, "max_tokens": 1000})
    assert r.status_code == 200
    body = r.json()
    assert len(body["id"]) == 32 and body["model"] == "anything" and body["object"] == "chat.completion"
    choice = body["choices"][0]
    msg = choice["message"]
    assert msg["reasoning_content"].endswith("\n") and msg["content"].startswith("\n\n")
    assert "</think>" not in msg["content"] + msg["reasoning_content"]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == IM_END_ID
    usage = body["usage"]
    assert 0 < usage["reasoning_tokens"] < usage["completion_tokens"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": usage["reasoning_tokens"]}
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    off = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()
    assert off["choices"][0]["message"]["reasoning_content"] is None
    assert off["usage"]["reasoning_tokens"] == 0 and off["choices"][0]["message"]["content"]

    cut = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 4}).json()
    assert cut["choices"][0]["message"]["content"] == ""
    assert cut["choices"][0]["finish_reason"] == "length" and cut["choices"][0]["matched_stop"] is None
    assert cut["usage"]["completion_tokens"] == 4


def test_chat_errors(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", content=b'{"messages": []}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and "Unsupported Media Type" in r.json()["message"]
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert r.json() == {
        "object": "error",
        "message": "Messages cannot be empty.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    r = client.post("/v1/chat/completions", json={"model": "m"})
    assert r.status_code == 400 and r.json()["type"] == "Bad Request"


def test_info_endpoints(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "qwen3.6-27b" and models["data"][0]["max_model_len"] == CONTEXT
    assert client.get("/v1/models/qwen3.6-27b").status_code == 200
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    info = client.get("/server_info").json()
    # "status" is the scheduler handshake's "ready", as SGLang's build_server_info reports it.
    assert info["version"] == "0.5.23" and info["status"] == "ready"
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 4
    assert info["context_length"] == CONTEXT and info["max_req_input_len"] == CONTEXT - 6
    # Like SGLang (only watermark keys are masked there): the key in clear, so leak tests can see it.
    assert info["api_key"] == KEY and f"--api-key {KEY}" in info["launch_command"]
    assert info["internal_states"][0]["api_key"] == KEY
    assert client.get("/get_server_info").json()["version"] == "0.5.23"
    model_info = client.get("/model_info").json()
    assert model_info["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    metrics = client.get("/metrics").text
    for name in ("num_running_reqs", "num_queue_reqs", "gen_throughput", "generation_tokens_total"):
        assert f"sglang:{name}{{" in metrics


def test_queue_full_duplicate_rid_loads_and_abort(client: httpx.Client, server: Started) -> None:
    # ignore_eos + a large max_new_tokens keeps these six in flight until they are aborted.
    long = {"text": THINKING_PROMPT, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}

    def send(i: int) -> httpx.Response:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
            return c.post("/generate", json={**long, "rid": f"long-{i}"})

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(send, i) for i in range(6)]
        deadline = time.monotonic() + 30
        load: dict[str, Any] = {}
        while time.monotonic() < deadline:
            load = client.get("/v1/loads").json()["loads"][0]
            if load["num_running_reqs"] + load["num_waiting_reqs"] == 6:
                break
            time.sleep(0.05)
        assert (load["num_running_reqs"], load["num_waiting_reqs"], load["max_running_requests"]) == (4, 2, 4)
        assert 0 < load["token_usage"] < 1 and load["queues"]["waiting"] == 2
        metrics = client.get("/metrics").text
        assert re.search(r"^sglang:num_queue_reqs\{[^}]*\} 2\.0$", metrics, re.MULTILINE)
        assert re.search(r"^sglang:num_running_reqs\{[^}]*\} 4\.0$", metrics, re.MULTILINE)

        full = _generate(client, {"text": "one more"})
        assert full.status_code == 503
        assert full.json() == {
            "object": "error",
            "message": "The request queue is full.",
            "type": "503",
            "param": None,
            "code": 503,
        }
        dup = _generate(client, {"text": "x", "rid": "long-0"})
        assert dup.status_code == 400
        assert dup.json() == {"error": {"message": "Duplicate request ID detected: long-0"}}

        assert client.post("/abort_request", json={"rid": "", "abort_all": True}).status_code == 200
        results = [f.result() for f in futures]
    for r in results:
        assert r.status_code == 200
        assert r.json()["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }


def test_crash_after_kills_process(model_dir: Path, tmp_path: Path) -> None:
    env = {"DATAGEN_STANDIN_CRASH_AFTER": "2", "DATAGEN_STANDIN_LOAD_S": "0"}
    log = tmp_path / "crash.log"
    with run_standin(model_dir, args=["--skip-server-warmup"], env=env, log_path=log) as ep:
        with httpx.Client(base_url=ep.url, headers=AUTH, timeout=30) as c:
            assert c.post("/generate", json={"text": "hello"}).status_code == 200
            assert c.post("/generate", json={"text": "hello again"}).status_code == 200
            deadline = time.monotonic() + 30
            refused = False
            while time.monotonic() < deadline and not refused:
                try:
                    c.get("/health")
                    time.sleep(0.05)
                except httpx.TransportError:
                    refused = True
        assert refused, "server still answering after the crash knob fired"
    assert "DATAGEN_STANDIN_CRASH_AFTER" in log.read_text()


def test_unknown_flag_exits_2(model_dir: Path) -> None:
    cmd = [*standin_command(model_dir, free_port(), None), "--mamba-scheduler-strategy", "extra_buffer"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--mamba-scheduler-strategy" in proc.stderr and "unrecognized arguments" in proc.stderr


def test_help_lists_flags() -> None:
    proc = subprocess.run([sys.executable, "-m", "datagen.standin", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for flag in ("--model-path", "--mamba-radix-cache-strategy", "--attention-backend", "--enable-metrics"):
        assert flag in proc.stdout


def test_bad_attention_backend_on_sm120_exits_1(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = standin_command(model_dir, port, None, ["--attention-backend", "fa3"])
    env = {**os.environ, "DATAGEN_STANDIN_GPU_ARCH": "12.0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1
    assert "AssertionError" in proc.stderr
    assert "backends are supported on Blackwell GPUs for hybrid GDN models" in proc.stderr
    assert "fa3" in proc.stderr
    # The same flags minus the bad backend pass the check (flashinfer is the SM120 default).
    args = parse_args(["--model-path", str(model_dir)])
    assert check_gpu_arch(args, ["Qwen3_5ForConditionalGeneration"], "12.0") == "flashinfer"
