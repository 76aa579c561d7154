"""The `check-environment` flow: only the environment checks, as a report artifact (nothing is started)."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from datagen import alerts, paths, report
from datagen.runspec import RunSpec
from datagen.settings import Settings
from datagen.storage import ObjectStore, s3_preflight
from tasks import environment

__all__ = ["check_environment"]


@flow(
    name="check-environment",
    flow_run_name=report.run_name("check-environment"),
    on_failure=[alerts.announce_failure],
)
def check_environment(spec: RunSpec = RunSpec(), resume: bool = False) -> list[dict[str, str]]:  # noqa: B008
    """Run every environment check for `spec` on this box; fail the run if one fails."""
    settings = Settings()
    paths.secure_run(settings, spec)  # run paths under the box's roots, a private work dir: before anything
    store = ObjectStore.from_settings(settings)
    results = environment.run_checks(settings, spec, s3_check=lambda: s3_preflight(store, spec.namespace, resume))
    rows: list[dict[str, str]] = environment.report_rows(results)
    create_table_artifact(
        table=rows, key="environment-report", description=f"Environment checks on this box for {spec.namespace}"
    )
    get_run_logger().info("\n%s", environment.format_report(results))
    failed = [r for r in results if r.failed]
    if failed:
        raise RuntimeError("environment checks failed:\n" + "\n".join(f"- {r.name}: {r.detail}" for r in failed))
    return rows
