"""The `check-environment` flow: only the environment checks, as a report artifact (nothing is started)."""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from datagen import paths
from datagen.operations import alerts, failure, report
from datagen.publishing.storage import ObjectStore, s3_preflight
from datagen.runspec import RunSpec
from datagen.settings import Settings
from tasks import environment

__all__ = ["check_environment"]


def _check_environment(spec: RunSpec, resume: bool) -> list[dict[str, str]]:
    settings = Settings()
    paths.secure_run(settings, spec)  # run paths under the box's roots, a private work dir: before anything
    store = ObjectStore.from_settings(settings)
    results = environment.run_checks(settings, spec, s3_check=lambda: s3_preflight(store, spec.namespace, resume))
    rows: list[dict[str, str]] = environment.report_rows(results)
    create_table_artifact(
        table=rows, key="environment-report", description=f"Environment checks on this box for {spec.namespace}"
    )
    get_run_logger().info("\n%s", environment.format_report(results))
    environment.raise_if_failed(results)
    return rows


# The same name as expand-dataset's task: a failed check reads "check environment failed: ..." in both.
check_environment_task = task(name="check environment", cache_policy=NO_CACHE)(_check_environment)


@flow(
    name="check-environment",
    flow_run_name=report.run_name("check-environment"),
    on_failure=[alerts.announce_failure],
)
def check_environment(spec: RunSpec = RunSpec(), resume: bool = False) -> list[dict[str, str]]:  # noqa: B008
    """Run every environment check for `spec` on this box; fail the run if one fails."""
    return failure.reported(check_environment_task, spec, resume)
