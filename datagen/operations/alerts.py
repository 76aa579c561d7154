"""Tell the team when a run fails: a flow hook that names the failing task, and the Prefect automation that notifies.

How it fits together:

- Every deployed flow has `on_failure=[announce_failure]`. When a run ends Failed, the hook emits one event,
  `datagen.flow-run.failed`, whose payload holds the failing task's name and the short reason, as
  `datagen.operations.failure` finds them from the exception that ended the run (the run's state message says the same).
- A crashed run (worker killed, box gone) runs no hook; Prefect's server emits `prefect.flow-run.Crashed`.
- One automation (`AUTOMATION_NAME`) reacts to either event of any deployment's run and sends a
  notification through a Prefect notification block (Slack, Teams, e-mail, a custom webhook, ...).

    python -m datagen.operations.alerts install --webhook-url https://hooks.example.com/...   # custom webhook block
    python -m datagen.operations.alerts install --block slack-webhook/team-alerts              # an existing block

`infra/deploy.sh` runs `install` when DATAGEN_ALERT_WEBHOOK_URL or DATAGEN_ALERT_BLOCK is set. Installing
again replaces the automation (same name), so it is safe after every deploy.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any
from uuid import UUID

from pydantic import SecretStr

from datagen.operations import failure

__all__ = [
    "AUTOMATION_NAME",
    "FAILED_EVENT",
    "NOTIFICATION_BODY",
    "RECORDED_FAILURE",
    "announce_failure",
    "automation_definition",
    "install",
    "main",
]

AUTOMATION_NAME = "datagen: a run failed or crashed"
FAILED_EVENT = "datagen.flow-run.failed"
WEBHOOK_BLOCK_NAME = "datagen-alerts"

NOTIFICATION_SUBJECT = "datagen: {{ flow_run.name }} {{ flow_run.state.name }}"

# Every notification is rendered by Prefect's server from the triggering event and the run as the database holds it.
# Events are not proof: any holder of the box credential can send one over the events websocket, where nothing
# checks what it says (docs/security.md). So the alert says only what the run's record says:
# - it is sent only when the run's recorded state is the failure the event names (Failed for the hook's event,
#   Crashed for the server's): otherwise rendering stops on an undefined call, Prefect fails the action ("Template
#   rendering failed: ... 'no_alert_...' is undefined", in the automation's events) and nothing is sent;
# - the failing task and reason are the hook's only when the recorded state message says the same
#   (`<task> failed: <reason>`, datagen.operations.failure), the link only when it is an artifact page of this UI;
# - a state an operator set by hand carries "set by hand by NAME (operator)" in its message (infra/nginx/
#   prefect-proxy.js), and the message is in every alert; runners cannot set one.
RECORDED_FAILURE = """\
{%- set recorded = flow_run.state.type -%}
{%- if not ((event.event == "datagen.flow-run.failed" and recorded == "FAILED")
        or (event.event == "prefect.flow-run.Crashed" and recorded == "CRASHED")) -%}
{{ no_alert_the_run_s_recorded_state_is_not_this_failure() }}
{%- endif -%}
{%- set message = flow_run.state.message or "" -%}
{%- set hook_task = event.payload.failed_task if event.payload.failed_task is string else "" -%}
{%- set hook_reason = event.payload.task_message if event.payload.task_message is string else "" -%}
{%- set task = hook_task if hook_task and message.startswith(hook_task ~ " failed: " ~ hook_reason) else "" -%}
{%- set artifact_pages = ((flow_run|ui_url) or "").split("/runs/flow-run/")[0] ~ "/artifacts/artifact/" -%}
{%- set link = event.payload.report_url if event.payload.report_url is string else "" -%}
{%- set report = link if (flow_run|ui_url) and link.startswith(artifact_pages)
        and link|length == artifact_pages|length + 36 else "" -%}
"""
# Jinja rendered by Prefect's server with the triggering event and the objects it names.
NOTIFICATION_BODY = (
    RECORDED_FAILURE
    + """\
Run "{{ flow_run.name }}" of deployment "{{ deployment.name }}" ({{ flow.name }}) ended {{ flow_run.state.name }}.
{% if task %}Failing task: {{ task }}
{% elif recorded == "CRASHED" %}Failing task: none (the run crashed: its process or box went away, or see the message)
{% else %}Failing task: none (the run failed outside a task)
{% endif %}Run message: {{ message }}
{% if report %}Why, with links (the reason is the page's first line): {{ report }}
{% endif %}{% if flow_run|ui_url %}Open it: {{ flow_run|ui_url }} (the message is in the run page's Details tab)
{% else %}Flow run id: {{ flow_run.id }} (set PREFECT_UI_URL on the server for a link)
{% endif %}"""
)


def announce_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """`on_failure` hook: emit `datagen.flow-run.failed` naming the failing task and its message."""
    from prefect.events import emit_event

    # The state holds the exception that ended the run (datagen.operations.failure.reported): the task it came from.
    failed = failure.of_state(state, getattr(flow, "name", "the flow")) if state is not None else None
    try:
        report = failure.report_url(flow_run.id) or ""
    except Exception as exc:  # the notification still goes out, without the link
        report = ""
        print(f"datagen.operations.alerts: could not read the run-failure artifact: {exc}", file=sys.stderr)
    related: list[dict[str, str]] = []
    if getattr(flow_run, "deployment_id", None):
        related.append(
            {
                "prefect.resource.id": f"prefect.deployment.{flow_run.deployment_id}",
                "prefect.resource.role": "deployment",
            }
        )
    related.append({"prefect.resource.id": f"prefect.flow.{flow_run.flow_id}", "prefect.resource.role": "flow"})
    emit_event(
        event=FAILED_EVENT,
        resource={"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.name": flow_run.name},
        related=related,
        payload={
            "failed_task": (failed.task or "") if failed else "",
            "task_message": failed.reason if failed else "",
            "report_url": report,
            "message": (state.message or "") if state is not None else "",
        },
    )


def automation_definition(block_document_id: UUID | str, body: str = NOTIFICATION_BODY) -> dict[str, Any]:
    """The automation, as `prefect automation create --from-json` and the REST API take it (`body`: its text)."""
    return {
        "name": AUTOMATION_NAME,
        "description": (
            "Notifies when a run of any datagen deployment fails (with the failing task and its message) or "
            "crashes. Installed by `python -m datagen.operations.alerts install` (infra/deploy.sh)."
        ),
        "enabled": True,
        "trigger": {
            "type": "event",
            "posture": "Reactive",
            "match": {"prefect.resource.id": "prefect.flow-run.*"},
            "match_related": {"prefect.resource.role": "deployment"},
            "expect": [FAILED_EVENT, "prefect.flow-run.Crashed"],
            "for_each": ["prefect.resource.id"],
            "threshold": 1,
            "within": 0,
        },
        "actions": [
            {
                "type": "send-notification",
                "block_document_id": str(block_document_id),
                "subject": NOTIFICATION_SUBJECT,
                "body": body,
            }
        ],
    }


def _webhook_block(url: str, bearer_token: SecretStr | None = None) -> UUID:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    # The token lives in the block's secrets (masked when the block is read back), filled into the header on send.
    auth = (
        {
            "headers": {"Authorization": "Bearer {{bearer_token}}"},
            "secrets": {"bearer_token": bearer_token.get_secret_value()},
        }
        if bearer_token
        else {}
    )
    block = CustomWebhookNotificationBlock(
        name="datagen alerts",
        url=url,
        method="POST",
        json_data={"subject": "{{subject}}", "text": "{{body}}"},
        **auth,
    )
    block_id = block.save(WEBHOOK_BLOCK_NAME, overwrite=True)
    return UUID(str(block_id))


def _existing_block(slug: str) -> UUID:
    from prefect.blocks.core import Block

    if "/" not in slug:
        raise SystemExit(
            f"datagen.operations.alerts: --block {slug!r}: expected BLOCK-TYPE/NAME, e.g. slack-webhook/team-alerts"
        )
    block: Any = Block.load(slug)
    if block._block_document_id is None:
        raise SystemExit(f"datagen.operations.alerts: block {slug!r} has no document id")
    return UUID(str(block._block_document_id))


def install(
    webhook_url: str | None = None,
    block: str | None = None,
    body: str = NOTIFICATION_BODY,
    bearer_token: SecretStr | None = None,
) -> UUID:
    """Create (or replace) the notification automation on the server PREFECT_API_URL names; its id.

    `bearer_token`: sent as `Authorization: Bearer ...` with each post to `webhook_url` (the laptop's listener).
    """
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    if bool(webhook_url) == bool(block):
        raise SystemExit("datagen.operations.alerts: give exactly one of --webhook-url and --block")
    block_id = _webhook_block(webhook_url, bearer_token) if webhook_url else _existing_block(str(block))
    automation = AutomationCore.model_validate(automation_definition(block_id, body))
    with get_client(sync_client=True) as client:
        for existing in client.read_automations_by_name(AUTOMATION_NAME):
            client.delete_automation(existing.id)
        automation_id: UUID = client.create_automation(automation)
    return automation_id


def main(argv: list[str] | None = None) -> int:
    """`python -m datagen.operations.alerts install|show`."""
    parser = argparse.ArgumentParser(prog="python -m datagen.operations.alerts", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    inst = sub.add_parser("install", help="create or replace the automation on the Prefect server")
    inst.add_argument("--webhook-url", help="URL that receives a JSON POST {subject, text}")
    inst.add_argument("--block", help="an existing notification block, BLOCK-TYPE/NAME")
    sub.add_parser("show", help="print the automation definition (with a placeholder block id)")
    args = parser.parse_args(argv)
    if args.command == "show":
        import json

        print(json.dumps(automation_definition("<notification-block-id>"), indent=2))
        return 0
    automation_id = install(args.webhook_url, args.block)
    print(f"automation {AUTOMATION_NAME!r} installed ({automation_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
