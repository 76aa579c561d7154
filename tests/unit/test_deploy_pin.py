"""The pin comparison (datagen/operations/deploy_pin.py) and the flow-run environment of datagen's worker."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from datagen.operations.deploy_pin import (
    DeploymentPin,
    PinFile,
    PinMismatch,
    PoolPin,
    deployment_changes,
    differences,
    digest,
    pool_changes,
    read_pin,
    write_pin,
)
from datagen.worker import flow_run_env

STEPS = [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $DATAGEN_HOME }}"}}]
SCHEMA = {"type": "object", "properties": {"spec": {"type": "object"}}}
TEMPLATE = {"job_configuration": {"stream_output": True}, "variables": {"type": "object", "properties": {}}}
DEP = "11111111-2222-3333-4444-555555555555"


def _pin() -> PinFile:
    dep = DeploymentPin.of(DEP, "expand-dataset/manual", "flows/expand_dataset.py:expand_dataset", STEPS, SCHEMA)
    pool = PoolPin(name="gpu-box-1", base_job_template=TEMPLATE, sha256=digest(TEMPLATE))
    return PinFile(api_url="http://x/api", pinned_at="2026-01-01T00:00:00+00:00", pool=pool, deployments={DEP: dep})


def test_the_pinned_definition_has_no_changes_whatever_the_key_order() -> None:
    reordered_schema = {"properties": {"spec": {"type": "object"}}, "type": "object"}
    entry = "flows/expand_dataset.py:expand_dataset"
    assert deployment_changes(_pin(), DEP, entry, list(STEPS), reordered_schema) == []
    assert pool_changes(_pin(), "gpu-box-1", {"variables": TEMPLATE["variables"], **TEMPLATE}) == []


def test_each_changed_field_is_named_with_its_deployment() -> None:
    shell = {"prefect.deployments.steps.run_shell_script": {"script": "id"}}
    changes = deployment_changes(_pin(), DEP, "evil.py:f", [*STEPS, shell], {})
    assert [c.split(": ", 1)[1].split(" (")[0] for c in changes] == [
        "entrypoint changed",
        "pull_steps changed",
        "parameter_openapi_schema changed",
    ]
    assert all(c.startswith("deployment expand-dataset/manual: ") for c in changes)


def test_an_unpinned_deployment_and_another_pool_are_refused() -> None:
    assert "is not pinned on this box" in deployment_changes(_pin(), "other", "a.py:f", [], {})[0]
    assert "is not the pinned pool" in pool_changes(_pin(), "gpu-box-2", TEMPLATE)[0]
    command = {**TEMPLATE, "job_configuration": {"command": "{{ command }}"}}
    assert pool_changes(_pin(), "gpu-box-1", command)[0].startswith("work pool gpu-box-1: base_job_template changed")


def test_differences_lists_added_and_removed_deployments() -> None:
    now = _pin()
    gone = _pin()
    now.deployments = {"new": DeploymentPin.of("new", "f/new", "a.py:f", [], {})}
    changes = differences(gone, now)
    assert any("not pinned on this box" in c for c in changes)
    assert any("expand-dataset/manual is pinned but gone" in c for c in changes)


def test_the_pin_file_is_private_and_one_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pin" / "pin.json"
    write_pin(path, _pin())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_pin(path) == _pin()
    os.chmod(path, 0o644)
    with pytest.raises(PinMismatch, match="open to other users"):
        read_pin(path)
    with pytest.raises(PinMismatch, match="datagen pin"):
        read_pin(tmp_path / "missing.json")
    os.chmod(path, 0o600)
    path.write_text("{}")
    with pytest.raises(PinMismatch, match="not a datagen pin"):
        read_pin(path)


def test_a_flow_run_gets_only_the_secrets_its_tasks_need() -> None:
    worker = {
        "PATH": "/usr/bin",
        "DATAGEN_HOME": "/srv/datagen",
        "PREFECT_API_AUTH_STRING": "box:secret",
        "PREFECT_SERVER_API_AUTH_STRING": "server:secret",
        "DATAGEN_OPERATOR_AUTH_STRING": "olga:secret",
        "DATAGEN_SGLANG_API_KEY": "sk",
        "DATAGEN_S3_SECRET_ACCESS_KEY": "s3",
        "PREFECT__FLOW_ENTRYPOINT": "evil.py:f",
    }
    expand = flow_run_env(worker, "flows/expand_dataset.py:expand_dataset", "run-1")
    assert expand["DATAGEN_SGLANG_API_KEY"] == "sk" and expand["DATAGEN_S3_SECRET_ACCESS_KEY"] == "s3"
    assert expand["PREFECT__FLOW_RUN_ID"] == "run-1" and "PREFECT__FLOW_ENTRYPOINT" not in expand
    for key in ("PREFECT_SERVER_API_AUTH_STRING", "DATAGEN_OPERATOR_AUTH_STRING"):
        assert key not in expand
    check = flow_run_env(worker, "flows/check_environment.py:check_environment", "run-2")
    assert "DATAGEN_SGLANG_API_KEY" not in check and check["DATAGEN_S3_SECRET_ACCESS_KEY"] == "s3"
    parent = flow_run_env(worker, "flows/multi_box.py:expand_dataset_multibox", "run-3")
    assert "DATAGEN_SGLANG_API_KEY" not in parent
    unknown = flow_run_env(worker, "flows/other.py:f", "run-4")
    assert "DATAGEN_SGLANG_API_KEY" not in unknown and "DATAGEN_S3_SECRET_ACCESS_KEY" not in unknown
