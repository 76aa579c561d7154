"""A run spec as every deployment's parameter defaults, so each one runs from the UI's Quick run as it is.

`infra/laptop.sh` applies `.datagen/laptop/run-spec.json` after `infra/deploy.sh` registered the deployments:
the form then opens on the laptop's values (bundled prompts, fixture model, demo sizes) instead of the
production defaults of `RunSpec()`. A deployment's own values (prefect.yaml's `parameters`, e.g.
scheduled-expansion's `namespace: auto`) win over the file's.

    python -m datagen.operations.deploy_defaults .datagen/laptop/run-spec.json   # PREFECT_API_URL (+ auth) in the env
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from datagen.runspec import RunSpec

__all__ = ["apply_defaults", "merge_defaults", "read_spec_fields"]


def read_spec_fields(path: Path) -> dict[str, Any]:
    """The run-spec fields of a JSON file: the flow's parameters ({"spec": {...}}) or the fields themselves."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise SystemExit(f"deploy_defaults: {path}: expected a JSON object of run-spec fields")
    fields = data.get("spec", data)
    if not isinstance(fields, dict):
        raise SystemExit(f"deploy_defaults: {path}: 'spec' must be a JSON object of run-spec fields")
    RunSpec.model_validate(fields)  # a file the deployments' schema would refuse is refused here, naming the field
    return fields


def merge_defaults(base: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """`base` with `own` laid over it, recursively for mappings: the deployment's own values win."""
    merged = dict(base)
    for key, value in own.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_defaults(merged[key], value)
        else:
            merged[key] = value
    return merged


def apply_defaults(spec_fields: dict[str, Any]) -> list[str]:
    """Set `spec_fields` as the `spec` default of every deployment whose flow takes a `spec`; return their names."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    updated: list[str] = []
    with get_client(sync_client=True) as client:
        for deployment in client.read_deployments():
            properties = (deployment.parameter_openapi_schema or {}).get("properties", {})
            if "spec" not in properties:
                continue
            parameters = dict(deployment.parameters or {})
            own = parameters.get("spec")
            spec = merge_defaults(spec_fields, own if isinstance(own, dict) else {})
            RunSpec.model_validate(spec)  # never store defaults the form would then refuse
            parameters["spec"] = spec
            client.update_deployment(deployment.id, DeploymentUpdate(parameters=parameters))
            flow = client.read_flow(deployment.flow_id)
            updated.append(f"{flow.name}/{deployment.name}")
    return sorted(updated)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m datagen.operations.deploy_defaults", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_spec", type=Path, help="JSON file of run-spec fields (or {'spec': {...}})")
    args = parser.parse_args(argv)
    names = apply_defaults(read_spec_fields(args.run_spec))
    print(f"deploy_defaults: {args.run_spec} is now the run spec default of: {', '.join(names) or 'no deployment'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
