"""What the box runs, pinned by its operator: each deployment's code path and the work pool's job template.

Anyone holding a credential that may change deployments or work pools can make a worker run code (a
`run_shell_script` pull step, a job template with a `command`). The box therefore trusts a file on the box, not the
API: `datagen pin` (an operator action on the box) writes each deployment's entrypoint, pull steps and parameter
schema and the pool's base job template to a 0600 file in a 0700 directory, and `datagen.worker` refuses a flow run
whose deployment or pool differs from it, naming what changed (docs/security.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

__all__ = [
    "DeploymentPin",
    "PinFile",
    "PinMismatch",
    "PoolPin",
    "default_pin_path",
    "deployment_changes",
    "digest",
    "pool_changes",
    "read_pin",
    "write_pin",
]

PIN_VERSION = 1


def digest(value: Any) -> str:
    """sha256 of `value` as canonical JSON (sorted keys, no spaces): equal content, equal hash."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class DeploymentPin(BaseModel):
    """One deployment as the box will run it."""

    id: str = Field(..., description="Deployment id (flow runs name it).")
    name: str = Field(..., description="`<flow>/<deployment>`, for messages.")
    entrypoint: str = Field(..., description="`path.py:function` relative to the pull steps' directory.")
    pull_steps: list[dict[str, Any]] = Field(default_factory=list, description="Steps run before the flow loads.")
    parameter_openapi_schema: dict[str, Any] = Field(default_factory=dict, description="The run form's schema.")
    hashes: dict[str, str] = Field(default_factory=dict, description="sha256 of each pinned field.")

    @classmethod
    def of(cls, deployment_id: str, name: str, entrypoint: str, pull_steps: Any, schema: Any) -> DeploymentPin:
        """A pin of these fields, with their hashes."""
        fields = {"entrypoint": entrypoint, "pull_steps": pull_steps or [], "parameter_openapi_schema": schema or {}}
        return cls(id=deployment_id, name=name, **fields, hashes={k: digest(v) for k, v in fields.items()})


class PoolPin(BaseModel):
    """The work pool's base job template as the box accepts it."""

    name: str
    base_job_template: dict[str, Any]
    sha256: str


class PinFile(BaseModel):
    """The whole pin: one pool, its deployments by id."""

    version: int = PIN_VERSION
    api_url: str = Field(..., description="The API the pin was read from (for the operator; not checked).")
    pinned_at: str
    pool: PoolPin
    deployments: dict[str, DeploymentPin]


class PinMismatch(Exception):
    """A flow run's deployment or pool is not what the operator pinned on this box."""


def default_pin_path() -> Path:
    """DATAGEN_PIN_FILE, else <DATAGEN_HOME or cwd>/.datagen/pin/pin.json."""
    explicit = os.environ.get("DATAGEN_PIN_FILE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("DATAGEN_HOME") or ".") / ".datagen" / "pin" / "pin.json"


def _field_change(name: str, pinned: Any, current: Any) -> str | None:
    if digest(pinned) == digest(current):
        return None
    return f"{name} changed (pinned sha256 {digest(pinned)[:12]}, now {digest(current)[:12]})"


def deployment_changes(pin: PinFile, deployment_id: str, entrypoint: Any, pull_steps: Any, schema: Any) -> list[str]:
    """What differs between the API's deployment and the pin; empty when it is the pinned one."""
    pinned = pin.deployments.get(deployment_id)
    if pinned is None:
        return [f"deployment {deployment_id} is not pinned on this box (created after `datagen pin`)"]
    changes = [
        _field_change("entrypoint", pinned.entrypoint, entrypoint),
        _field_change("pull_steps", pinned.pull_steps, pull_steps or []),
        _field_change("parameter_openapi_schema", pinned.parameter_openapi_schema, schema or {}),
    ]
    return [f"deployment {pinned.name}: {c}" for c in changes if c]


def pool_changes(pin: PinFile, pool_name: str, base_job_template: Any) -> list[str]:
    """What differs between the API's work pool and the pin; empty when it is the pinned one."""
    if pool_name != pin.pool.name:
        return [f"work pool {pool_name!r} is not the pinned pool {pin.pool.name!r}"]
    change = _field_change("base_job_template", pin.pool.base_job_template, base_job_template or {})
    return [f"work pool {pool_name}: {change}"] if change else []


def read_pin(path: Path) -> PinFile:
    """The pin at `path`; refuses a missing, unreadable or others-readable file with what to do."""
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        raise PinMismatch(
            f"no pin file at {path}: the operator runs `datagen pin` on this box after deploying"
        ) from None
    if mode & 0o077:
        raise PinMismatch(f"pin file {path} is open to other users (mode {mode:o}): chmod 600 it, or run `datagen pin`")
    try:
        return PinFile.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise PinMismatch(
            f"pin file {path} is not a datagen pin ({exc.error_count()} errors): run `datagen pin`"
        ) from None


def write_pin(path: Path, pin: PinFile) -> None:
    """Write the pin atomically: 0600 file in a 0700 directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(pin.model_dump_json(indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


async def snapshot(pool_name: str) -> PinFile:
    """The pool and its deployments as the API (PREFECT_API_URL, with its credential) holds them now."""
    from datetime import UTC, datetime

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName
    from prefect.settings import PREFECT_API_URL

    async with get_client() as client:
        pool = await client.read_work_pool(pool_name)
        deployments = await client.read_deployments(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool_name]))
        )
        pins: dict[str, DeploymentPin] = {}
        for d in deployments:
            flow = await client.read_flow(d.flow_id)
            pins[str(d.id)] = DeploymentPin.of(
                str(d.id), f"{flow.name}/{d.name}", d.entrypoint or "", d.pull_steps, d.parameter_openapi_schema
            )
    template = pool.base_job_template or {}
    return PinFile(
        api_url=str(PREFECT_API_URL.value()),
        pinned_at=datetime.now(UTC).isoformat(timespec="seconds"),
        pool=PoolPin(name=pool_name, base_job_template=template, sha256=digest(template)),
        deployments=pins,
    )


def differences(pinned: PinFile, now: PinFile) -> list[str]:
    """Every change from `pinned` to `now`: pool template, deployments changed, added or removed."""
    changes = pool_changes(pinned, now.pool.name, now.pool.base_job_template)
    for dep_id, d in now.deployments.items():
        changes += deployment_changes(pinned, dep_id, d.entrypoint, d.pull_steps, d.parameter_openapi_schema)
    changes += [
        f"deployment {d.name} is pinned but gone" for i, d in pinned.deployments.items() if i not in now.deployments
    ]
    return changes


def pin_command(pool_name: str, path: Path, check: bool) -> int:
    """`datagen pin`: write the pin (or with `check`, say what changed since it); 0 when in step."""
    import asyncio

    now = asyncio.run(snapshot(pool_name))
    if check:
        try:
            changes = differences(read_pin(path), now)
        except PinMismatch as exc:
            print(f"datagen pin --check: {exc}", file=sys.stderr)
            return 1
        for change in changes:
            print(f"changed since the pin: {change}")
        if not changes:
            print(f"{path}: pool {pool_name} and its {len(now.deployments)} deployments are as pinned")
        return 1 if changes else 0
    write_pin(path, now)
    print(
        f"pinned work pool {pool_name} (template sha256 {now.pool.sha256[:12]}) and "
        f"{len(now.deployments)} deployments to {path}:"
    )
    for d in sorted(now.deployments.values(), key=lambda d: d.name):
        print(f"  {d.name}: {d.entrypoint}, {len(d.pull_steps)} pull step(s)")
    return 0
