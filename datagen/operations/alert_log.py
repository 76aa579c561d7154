"""Failure alerts on a laptop: a webhook listener on loopback that writes each alert as one line of a log file.

A team's server sends alerts to Slack, e-mail or a webhook (`datagen.operations.alerts`, DEPLOY.md section 7); a laptop
has none of those. `start` runs a small HTTP listener on 127.0.0.1 in the background and installs datagen's failure
automation with a custom-webhook block that posts to it. The Prefect server (on the same laptop) sends each alert
there, and the listener appends one line to `alerts.log` in the state directory:

    2026-12-04T14:37:52Z expand ui-failed-run · esoteric-echidna (manual) ended Failed | failing task: check
    environment: 1 of 24 environment checks failed: engine.attention_backend: ... | why, with links:
    http://127.0.0.1:4200/v2/artifacts/artifact/<id> | http://127.0.0.1:4200/v2/runs/flow-run/<id>   (one line)

    # PREFECT_API_URL (+ auth) in the environment:
    python -m datagen.operations.alert_log start --state-dir .datagen/laptop
    python -m datagen.operations.alert_log stop --state-dir .datagen/laptop
    tail -f .datagen/laptop/alerts.log

The listener is on loopback and takes only posts that carry its bearer token (`Authorization: Bearer ...`): each
start makes a new one, kept in `alert-log.token` (mode 0600) and in the webhook block's secrets, so another user
or process on the laptop cannot write lines into the log. It only ever appends lines.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pydantic import SecretStr

from datagen.local.localstack import stop_pid
from datagen.operations import alerts

__all__ = ["LINE_TEMPLATE", "LOG_NAME", "alert_line", "listener_env", "main", "serve", "start", "stop"]

LOG_NAME = "alerts.log"
_PID_NAME = "alert-log.pid"
_PORT_NAME = "alert-log.port"
_TOKEN_NAME = "alert-log.token"
_MAX_BODY = 1 << 20
# What the listener's process gets of the environment of whoever started it (infra/deploy.sh holds an operator's
# credential): enough to run Python, nothing else. It needs only its own bearer token, which it makes itself.
_LISTENER_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")
READY_TIMEOUT_S = 30.0

# The notification text (Jinja, rendered by Prefect's server): what datagen.operations.alerts.NOTIFICATION_BODY
# says, on one line, after the same check that the run's record holds the failure (alerts.RECORDED_FAILURE).
LINE_TEMPLATE = alerts.RECORDED_FAILURE + (
    "{{ flow_run.name }} ({{ deployment.name }}) ended {{ flow_run.state.name }} | "
    "{% if task %}failing task: {{ task }}: {{ hook_reason }}"
    "{% elif recorded == 'CRASHED' %}no failing task: the run crashed: "
    "{{ message or 'its process or box went away' }}"
    "{% else %}failed outside a task: {{ message }}{% endif %} | "
    "{% if report %}why, with links: {{ report }} | {% endif %}"
    "{% if flow_run|ui_url %}{{ flow_run|ui_url }}{% else %}flow run {{ flow_run.id }}{% endif %}"
)


def alert_line(text: str, now: datetime | None = None) -> str:
    """One log line: the UTC time, then the alert's text with every run of whitespace (newlines too) as one space."""
    stamp = (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"{stamp} {' '.join(text.split())}\n"


def serve(log: Path, port_file: Path, token_file: Path) -> None:
    """Listen on a free port of 127.0.0.1 (written to `port_file`) and append each POSTed alert to `log`.

    A new bearer token is written to `token_file` (0600) first; a post without it is refused (401), unread.
    """
    os.chmod(log.parent, 0o700)  # alerts name runs, tasks and reasons: the laptop's user's alone
    lock = threading.Lock()
    token = secrets.token_urlsafe(32)
    expected = f"Bearer {token}".encode()
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file keeps its mode on O_TRUNC
        f.write(token)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if not hmac.compare_digest((self.headers.get("Authorization") or "").encode(), expected):
                self.send_error(401, "missing or wrong bearer token")
                return
            length = int(self.headers.get("Content-Length") or 0)
            try:
                if length > _MAX_BODY:
                    raise ValueError(f"body of {length} bytes (at most {_MAX_BODY})")
                body = json.loads(self.rfile.read(length))
                text = body["text"] if isinstance(body, dict) else None
                if not isinstance(text, str):
                    raise ValueError('expected a JSON object with a string "text"')
            except (ValueError, KeyError) as exc:
                self.send_error(400, str(exc))
                return
            with lock, os.fdopen(os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a") as out:
                os.fchmod(out.fileno(), 0o600)  # an alerts.log of an older version keeps its mode otherwise
                out.write(alert_line(text))
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass  # the alert log is the record; no access log on stderr

    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        port_file.write_text(str(server.server_address[1]), encoding="utf-8")
        server.serve_forever()


def listener_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The listener's environment: the few variables Python needs, none of its starter's credentials."""
    return {k: v for k, v in environ.items() if k in _LISTENER_ENV}


def _running_pid(state_dir: Path) -> int | None:
    try:
        pid = int((state_dir / _PID_NAME).read_text(encoding="utf-8"))
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None
    except PermissionError:
        return None  # a pid reused by another user's process: not ours
    return pid


def start(state_dir: Path) -> str:
    """Start the listener in the background unless it runs, install the automation posting to it; its URL."""
    state_dir.mkdir(parents=True, exist_ok=True)
    port_file = state_dir / _PORT_NAME
    if _running_pid(state_dir) is None or not port_file.is_file():
        stop(state_dir)  # a listener whose port is not known is of no use
        command = [sys.executable, "-m", "datagen.operations.alert_log", "serve", "--state-dir", str(state_dir)]
        with (state_dir / "alert-log.err").open("ab") as err:
            proc = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, env=listener_env(os.environ)
            )
        (state_dir / _PID_NAME).write_text(str(proc.pid), encoding="utf-8")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not port_file.is_file() or not port_file.read_text(encoding="utf-8"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"alert_log: the listener did not start; see {state_dir / 'alert-log.err'}")
            time.sleep(0.05)
    url = f"http://127.0.0.1:{port_file.read_text(encoding='utf-8')}/"
    token = SecretStr((state_dir / _TOKEN_NAME).read_text(encoding="utf-8"))
    alerts.install(webhook_url=url, body=LINE_TEMPLATE, bearer_token=token)
    return url


def stop(state_dir: Path) -> None:
    """Stop the listener `start` left running in `state_dir` (the automation stays; its posts then fail)."""
    pid = _running_pid(state_dir)
    if pid is not None:
        stop_pid(pid)
    (state_dir / _PID_NAME).unlink(missing_ok=True)
    (state_dir / _PORT_NAME).unlink(missing_ok=True)
    (state_dir / _TOKEN_NAME).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m datagen.operations.alert_log start|stop|serve --state-dir DIR`."""
    parser = argparse.ArgumentParser(
        prog="python -m datagen.operations.alert_log", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("command", choices=["start", "stop", "serve"])
    parser.add_argument("--state-dir", type=Path, default=Path(".datagen") / "laptop", help="where alerts.log goes")
    args = parser.parse_args(argv)
    state_dir: Path = args.state_dir
    if args.command == "serve":
        serve(state_dir / LOG_NAME, state_dir / _PORT_NAME, state_dir / _TOKEN_NAME)
    elif args.command == "start":
        url = start(state_dir)
        print(f"alert_log: failed runs are written to {state_dir / LOG_NAME} (listener {url})")
    else:
        stop(state_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
