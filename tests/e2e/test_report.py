"""What a run tells people: run names, the run report, live progress lines, the dataset link, `datagen inspect`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datagen.engine.stats import DispatcherStats, ServerStats
from datagen.operations import report
from datagen.operations.inspection import inspect_namespace, list_namespaces
from datagen.publishing.storage import ObjectStore
from datagen.records import REJECT_SCHEMA
from datagen.runspec import RunSpec
from flows.cli import main as cli_main
from flows.cli import summary_text
from tasks.publishing import publish


def _stats(elapsed: float, completed: int, rejected: int = 0, in_flight: int = 0, tokens: int = 0) -> DispatcherStats:
    server = ServerStats("gpu0", "up", 8, 8, in_flight, 0, completed, tokens, tokens / elapsed if elapsed else 0, "")
    return DispatcherStats(
        elapsed_s=elapsed,
        submitted=completed + rejected + in_flight,
        completed=completed,
        rejected=rejected,
        failed=0,
        retries=0,
        requeued=0,
        output_tokens=tokens,
        queued=0,
        in_flight=in_flight,
        completions_per_s=completed / elapsed if elapsed else 0.0,
        output_tokens_per_s=tokens / elapsed if elapsed else 0.0,
        # What the dispatcher says halfway: only the shards started so far are "expected".
        eta_s=0.0,
        servers=[server],
    )


class _ScriptedDispatcher:
    """Hands out prepared snapshots, one per stats() call (the reporter reads nothing else)."""

    def __init__(self, snapshots: list[DispatcherStats]) -> None:
        self.snapshots = snapshots

    def stats(self) -> DispatcherStats:
        return self.snapshots.pop(0) if len(self.snapshots) > 1 else self.snapshots[0]


def test_run_names_say_what_a_run_does_to_which_namespace() -> None:
    spec = RunSpec(namespace="expansion_v7")
    assert report.describe_run("expand-dataset", {"spec": spec, "dry_run": False}) == "expand expansion_v7"
    assert report.describe_run("expand-dataset", {"spec": spec, "dry_run": True}) == "expand expansion_v7 (dry run)"
    assert report.describe_run("check-environment", {"spec": {"namespace": "x"}}) == "check environment for x"
    assert report.describe_run("pilot", {"spec": spec, "pilot_spec": {"name": "p1"}}) == "pilot p1 for expansion_v7"
    # Prefect's generated names are replaced; a typed name (more than two words, digits, ...) is not.
    from prefect.utilities.names import generate_slug

    # Every name Prefect's API and schedules make up is recognised (coolname's words)...
    assert all(report.is_generated_name(generate_slug(2)) for _ in range(200))
    assert report.is_generated_name("coral-anaconda")
    assert report.is_generated_name("Gorgeous-Akita")  # the V2 run form's prefill
    assert report.is_generated_name("Fantastic-Goose")  # the V1 run form's prefill
    # ... and names people type are theirs: the old rule took "Nightly-Test" for a generated one and replaced it.
    for typed in ("Nightly-Test", "started-from-the-ui", "nightly 3", "expand-auto", "Weekly-Refresh", "v2-rerun"):
        assert not report.is_generated_name(typed), typed


def test_progress_eta_comes_from_the_whole_run_and_lines_are_never_repeated(caplog: pytest.LogCaptureFixture) -> None:
    snapshots = [
        _stats(10, 0, in_flight=8),
        _stats(20, 50, in_flight=8, tokens=5000),
        _stats(30, 100, in_flight=8, tokens=10000),
        _stats(40, 150, rejected=2, in_flight=0, tokens=15000),
        _stats(50, 150, rejected=2, in_flight=0, tokens=15000),
        _stats(60, 150, rejected=2, in_flight=0, tokens=15000),
    ]
    logger = logging.getLogger("test.progress")
    reporter = report.ProgressReporter(
        _ScriptedDispatcher(snapshots),  # type: ignore[arg-type]
        total_prompts=300,
        already_settled=100,
        progress_artifact_id=None,
        logger=logger,
        interval_s=3600,
        log_every_s=0,
    )
    with caplog.at_level(logging.INFO, logger="test.progress"):
        for _ in range(6):
            reporter.tick()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(set(lines)) == 4, lines  # the last three looks had the same counts: one line
    assert "ETA unknown until the first result" in lines[0]
    # 150 of 300 settled after 20 s of this call's 50 results: 150 left at 2.5/s = 60 s, not "0.0 min".
    assert "150 of 300 prompts (50%)" in lines[1] and "ETA 1 min 0 s" in lines[1], lines[1]
    assert "252 of 300" in lines[3]
    assert reporter.throughput_series(buckets=3), reporter.samples


def test_a_run_shorter_than_one_progress_interval_still_gets_a_throughput_chart() -> None:
    # The demo's generation takes a few seconds: with one look every 5 s the report's chart used to be missing.
    reporter = report.ProgressReporter(
        _ScriptedDispatcher([_stats(3, 40, tokens=6000)] * 50),  # type: ignore[arg-type]
        total_prompts=40,
        already_settled=0,
        progress_artifact_id=None,
        logger=logging.getLogger("test.progress"),
        interval_s=5,
    )
    with reporter:
        pass  # generation ended at once: only the final look
    assert reporter.throughput_series() == [("3.0 s", 2000.0)]


def test_run_report_is_a_table_with_servers_stages_and_charts() -> None:
    stats = _stats(100, 300, rejected=4, tokens=60000)
    facts = report.RunFacts(
        namespace="expansion_v2",
        uri="s3://bucket/expansion_v2/",
        dry_run=False,
        prompts=304,
        shards=2,
        rows=290,
        rejects=14,
        rejects_by_reason={"validate/truncated": 10, "generate/server_rejected": 4},
        output_tokens=60000,
        dataset_bytes=3 * 1024 * 1024,
        servers=8,
        generation_s=100.0,
        stages={"environment checks": 2.0, "generation": 100.0, "publish": 3.0},
        wall_s=120.0,
        generated_tokens=60000,
        server_s=180.0,
        final_stats=stats,
        throughput=[("10 s", 500.0), ("20 s", 700.0)],
        lengths=[10, 20, 30, 200, 400],
    )
    text = report.run_report(facts)
    assert "| training rows | 290 |" in text
    assert "| output tokens/s (this run's generation stage) | 600 |" in text
    assert "| GPU-hours (servers × their start + generation time) | 0.400 |" in text  # 8 x 180 s
    assert "| validate/truncated | 10 |" in text
    assert "| gpu0 | up | 300 | 60,000 | 600 | 600 | — |" in text
    assert "| generation | 1 min 40 s | 83% |" in text
    assert "datagen inspect expansion_v2" in text and "3.0 MiB" in text
    assert "## Output tokens/s over the generation" in text and "█" in text
    assert "median 30" in text
    assert facts.summary()["gpu_hours"] == 0.4


def test_nothing_to_do_names_the_reason_and_the_cli_prints_it() -> None:
    markdown, message = report.nothing_to_do_report(
        "expansion_v3", ["data/prompts"], 294, ["demo-20261203-101010"], 0, skip_published=True
    )
    assert "Nothing new to generate for expansion_v3" in message
    assert "294 prompt ids are already published" in message and "demo-20261203-101010" in message
    assert "nothing to do" in markdown and "skip_published: false" in markdown
    summary = {"uri": None, "namespace": "expansion_v3", "prompts": 0, "message": message}
    assert summary_text(summary) == f"nothing published in namespace expansion_v3: {message}"
    published = {"uri": "s3://b/n/", "namespace": "n", "rows": 5, "rejects": 1, "prompts": 6, "dry_run": False}
    assert "Published 5 rows (1 rejects) from 6 prompts" in summary_text(published)
    assert "datagen inspect n" in summary_text(published)


def test_an_empty_source_is_called_empty_even_when_earlier_runs_exist() -> None:
    # Issue 23.6: with earlier namespaces in the catalog this said "every prompt is already published".
    markdown, message = report.nothing_to_do_report(
        "expansion_v4", ["data/empty.jsonl"], 294, ["expansion_v1"], 0, True, None, n_rows_in_sources=0
    )
    assert "the sources are empty: 0 rows read from data/empty.jsonl" in message
    assert "already published" not in message
    assert "| rows in the sources | 0 |" in markdown


def test_dataset_link_opens_in_a_console() -> None:
    class Store:
        bucket = "datasets"
        region = "eu-west-1"
        endpoint_url: str | None = None

    store = Store()
    uri = "s3://datasets/team/expansion_v2/"
    aws = report.dataset_link(store, uri)
    assert aws == "https://s3.console.aws.amazon.com/s3/buckets/datasets?prefix=team/expansion_v2/&region=eu-west-1"
    store.endpoint_url = "http://s3.internal:9000"
    assert report.dataset_link(store, uri) == uri  # no console known for a private endpoint
    template = "https://minio.example.com/browser/{bucket}/{key}"
    assert report.dataset_link(store, uri, template) == "https://minio.example.com/browser/datasets/team/expansion_v2/"


def test_dataset_link_on_a_laptop_opens_the_card_in_a_browser(s3_store: ObjectStore) -> None:
    # Issue 25.5: on a laptop (S3 on loopback) the link was the s3:// location, which a browser cannot open.
    card = b"---\nconfigs: []\n---\n# expansion_v2\n"
    s3_store.put_if_absent("expansion_v2/README.md", card)
    link = report.dataset_link(s3_store, s3_store.uri("expansion_v2/"), expiry_s=600)
    assert link.startswith(s3_store.endpoint_url + "/"), link
    assert "X-Amz-Expires=600" in link and "X-Amz-Signature=" in link, link
    secret = s3_store._client._request_signer._credentials.secret_key
    assert secret not in link
    # A browser sends no credentials: plain HTTP gets the card's bytes, and an unsigned URL is refused.
    response = httpx.get(link, timeout=30)
    assert response.status_code == 200 and response.content == card, (response.status_code, response.text[:300])
    assert httpx.get(link.split("?", 1)[0], timeout=30).status_code in (401, 403)


def test_targets_are_typed_rows_in_the_form_and_mappings_in_configs() -> None:
    spec = RunSpec.model_validate({"source_targets": {"code": 5}, "category_targets": [{"name": "math", "count": 2}]})
    assert spec.source_target_counts == {"code": 5}
    assert spec.category_target_counts == {"math": 2}
    with pytest.raises(ValueError, match="targets must be >= 0"):
        RunSpec.model_validate({"source_targets": {"code": -1}})
    with pytest.raises(ValueError, match="one target"):
        RunSpec.model_validate({"source_targets": [{"name": "a", "count": 1}, {"name": "a", "count": 2}]})
    schema = RunSpec.model_json_schema()
    assert schema["properties"]["source_targets"]["type"] == "array"
    assert "</think>" not in str(schema)
    # Rarely changed fields come last in the form, titled as such.
    names = list(schema["properties"])
    assert names[-1] == "context_length" and schema["properties"]["context_length"]["title"].startswith("Advanced:")
    assert names.index("namespace") < names.index("quality_gate")


def test_loading_the_tokenizer_prints_no_pytorch_advice() -> None:
    code = (
        "from datagen.local.model_fixture import ensure_model_dir\n"
        "from datagen.chat import ChatTokenizer\n"
        "ChatTokenizer.from_model_dir(ensure_model_dir())\n"
        "import warnings, transformers.utils.logging as tl\n"
        "tl.get_logger('transformers').warning('a real warning still shows')\n"
    )
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert "PyTorch was not found" not in quiet.stderr, quiet.stderr
    assert "a real warning still shows" in quiet.stderr
    # The check can fail: a plain import does print the advice.
    plain = subprocess.run([sys.executable, "-c", "import transformers"], capture_output=True, text=True, timeout=300)
    assert "PyTorch was not found" in plain.stderr


def _staging(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "rejects").mkdir()
    pq.write_table(pa.table({"prompt_id": ["a", "b", "c"]}), root / "data" / "train-00000-of-00001.parquet")
    rejects = [
        {
            "stage": "validate",
            "reason": "truncated",
            "detail": "hit max_new_tokens 64",
            "source": "s",
            "prompt_id": "d",
        },
        {
            "stage": "validate",
            "reason": "truncated",
            "detail": "hit max_new_tokens 64",
            "source": "s",
            "prompt_id": "e",
        },
        {"stage": "load", "reason": "malformed_row", "detail": "line 9: not JSON", "source": "s", "prompt_id": None},
    ]
    full = [{**r, "row": None, "completion_tokens": None, "request_key": None} for r in rejects]
    pq.write_table(
        pa.Table.from_pylist(full, schema=REJECT_SCHEMA), root / "rejects" / "rejects-00000-of-00001.parquet"
    )
    (root / "README.md").write_text("# Dataset card\n\nthree rows\n", encoding="utf-8")
    return root


def test_inspect_shows_manifest_files_rejects_with_examples_and_card(s3_store: ObjectStore, tmp_path: Path) -> None:
    lineage = {
        "model_path": "/dev/shm/Qwen3.6-27B",
        "engine": "standin",
        "row_counts": {"data/train-00000-of-00001.parquet": 3, "rejects/rejects-00000-of-00001.parquet": 3},
    }
    publish(_staging(tmp_path / "ds"), "inspect_v1", s3_store, lineage)
    text, ok = inspect_namespace(s3_store, "inspect_v1", examples=1)
    assert ok, text
    assert "3 rows, 3 rejects" in text
    assert "data/train-00000-of-00001.parquet" in text and "3 rows" in text
    assert "validate/truncated: 2" in text and "load/malformed_row: 1" in text
    assert text.count("hit max_new_tokens 64") == 1  # one example per reason
    assert "# Dataset card" in text

    missing, ok = inspect_namespace(s3_store, "no_such_ns")
    assert not ok and "nothing there" in missing

    s3_store.put_if_absent("inspect_v2/data/train-00000-of-00001.parquet", b"half a publish")
    listing = list_namespaces(s3_store)
    assert "inspect_v1  published" in listing and "3 rows" in listing
    assert "inspect_v2  NOT PUBLISHED (1 objects" in listing
    assert "_catalog" not in listing


def test_inspect_command_exits_1_for_an_unpublished_namespace(
    s3_store: ObjectStore, monkeypatch: pytest.MonkeyPatch, local_s3: object, capsys: pytest.CaptureFixture[str]
) -> None:
    for key, value in local_s3.settings(s3_prefix=s3_store.prefix).model_dump().items():  # type: ignore[attr-defined]
        if value is not None and key.startswith("s3_"):
            raw = value.get_secret_value() if hasattr(value, "get_secret_value") else value
            monkeypatch.setenv(f"DATAGEN_{key.upper()}", str(raw))
    assert cli_main(["inspect", "never_published"]) == 1
    assert "nothing there" in capsys.readouterr().out


def test_laptop_command_writes_worker_settings_and_demo_sized_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    import stat

    from datagen.local import localstack
    from datagen.settings import Settings

    state_dir, out = tmp_path / "stack", tmp_path / "laptop"
    try:
        assert cli_main(["laptop", "--out", str(out), "--state-dir", str(state_dir), "--servers", "3"]) == 0
        env_file = out / "worker.env"
        assert stat.S_IMODE(env_file.stat().st_mode) == 0o600  # it holds the local S3 secret
        env = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
        assert env["DATAGEN_ENGINE"] == "standin" and env["DATAGEN_NUM_SERVERS"] == "3"
        assert env["DATAGEN_SKIP_GPU_CHECKS"] == "true" and env["DATAGEN_BASE_PORT"] == "0"
        settings = Settings(_env_file=env_file)  # type: ignore[call-arg]
        ObjectStore.from_settings(settings).check_bucket()  # the local S3 server it started answers
        params = json.loads((out / "run-spec.json").read_text())
        spec = RunSpec.model_validate(params["spec"])
        assert spec.shard_size == 50 and spec.sampling.max_new_tokens == 4096 and spec.namespace == "auto"
        assert Path(spec.model_path, "tokenizer.json").exists()
        assert "infra/prefect-worker.sh" in capsys.readouterr().out

        # The same run spec the UI takes checks as it is: the laptop's settings come from worker.env beside it,
        # `auto` is resolved without writing, and the check leaves nothing in any namespace.
        env = {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}
        cli = "from flows.cli import main; raise SystemExit(main())"
        check = subprocess.run(
            [sys.executable, "-c", cli, "check", "--config", str(out / "run-spec.json")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert check.returncode == 0, check.stdout + check.stderr
        assert "namespace 'auto' -> expansion_v1" in check.stdout
        assert "worker.env" in check.stderr
        store = ObjectStore.from_settings(settings)
        left = [o.key for o in store.list()]
        assert left == [], left  # nothing in `auto/` or `expansion_v1/`, and the probe is gone
    finally:
        localstack.stop(state_dir)
