"""The `datagen` command line: run the flow, run the environment checks, run the demo, manage the local stack."""

# It starts flows and stage bodies, so it lives on top of them (flows/), not in the datagen library below them.

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any, TypeAlias

import yaml
from pydantic import ValidationError

__all__ = ["apply_overrides", "load_spec", "main", "summary_text"]

REPO_ROOT = Path(__file__).resolve().parents[1]
FLOW_PARAMETERS = frozenset({"spec", "dry_run"})  # expand-dataset's parameters, as a deployment run takes them
DEFAULT_STACK_DIR = Path(".datagen") / "stack"


def _quiet_prefect_defaults() -> None:
    # Offline machines: no analytics; keep Prefect's state inside the project unless told otherwise.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_HOME", str(Path(".datagen") / "prefect"))
    # The embedded server migrates a fresh database on its first start: 16 s measured on 2 cores, over
    # Prefect's 20 s limit when the machine is busy (a fresh clone's demo failed that way).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    # Prefect's client retries 503 (a busy SQLite) and connection errors with 2**n s backoff: 7 tries ride out
    # about 4 minutes of a loaded server instead of the default 5 (about 1 minute).
    os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", "7")
    if not os.environ.get("PREFECT_API_URL"):
        # Embedded Prefect: a temporary server on a loopback port for this process's life. A per-process auth
        # string keeps the machine's other users out of it (docs/security.md); its subprocess inherits both.
        auth = os.environ.get("PREFECT_API_AUTH_STRING") or f"datagen:{secrets.token_urlsafe(30)}"
        os.environ.setdefault("PREFECT_SERVER_API_AUTH_STRING", auth)
        os.environ.setdefault("PREFECT_API_AUTH_STRING", auth)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (values parsed as YAML) to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. sampling.max_new_tokens=4096")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"--set {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def _read_config(config: Path) -> dict[str, Any]:
    """A config file's run-spec fields: a plain mapping of fields, or the flow's parameters ({"spec": {...}})."""
    if not config.exists():
        raise SystemExit(f"datagen: config file {config} does not exist")
    loaded = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    if not isinstance(loaded, dict):
        raise SystemExit(f"datagen: {config}: expected a mapping of run-spec fields at the top level")
    # The parameters a deployment run takes (the UI form, `prefect deployment run --params`, the laptop's
    # run-spec.json) wrap the fields in "spec"; the same file works here.
    if "spec" in loaded and set(loaded) <= FLOW_PARAMETERS:
        spec = loaded["spec"]
        if not isinstance(spec, dict):
            raise SystemExit(f"datagen: {config}: 'spec' must be a mapping of run-spec fields")
        return spec
    return loaded


def load_spec(config: Path | None, overrides: list[str]) -> Any:
    """Read a run spec from a YAML/JSON file plus overrides; exits with a clear message when invalid."""
    from datagen.runspec import RunSpec

    data = _read_config(config) if config is not None else {}
    try:
        data = apply_overrides(data, overrides)
        return RunSpec.model_validate(data)
    except (ValueError, ValidationError) as exc:
        raise SystemExit(f"datagen: invalid run spec ({config or 'defaults'}):\n{exc}") from None


def load_env_file(path: Path) -> list[str]:
    """Set the KEY=VALUE lines of an env file (e.g. the laptop's worker.env) that the environment does not set.

    The environment wins, as it does over `.env` in Settings; returns the names taken from the file.
    """
    if not path.is_file():
        raise SystemExit(f"datagen: env file {path} does not exist")
    taken = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        if not sep or not key.strip().isidentifier():
            raise SystemExit(f"datagen: {path}:{number}: expected KEY=VALUE")
        if key.strip() not in os.environ:
            os.environ[key.strip()] = value.strip().strip("'\"")
            taken.append(key.strip())
    return taken


def _apply_env_file(args: argparse.Namespace) -> None:
    # `datagen laptop` writes worker.env beside run-spec.json: a check of that run spec uses those settings.
    env_file: Path | None = args.env_file
    if env_file is None and args.config is not None and (args.config.parent / "worker.env").is_file():
        env_file = args.config.parent / "worker.env"
    if env_file is not None:
        taken = load_env_file(env_file)
        print(f"settings: the environment, then {env_file} ({len(taken)} taken from it)", file=sys.stderr)


def _cmd_run(args: argparse.Namespace) -> int:
    _quiet_prefect_defaults()
    _apply_env_file(args)
    spec = load_spec(args.config, args.set)
    from flows.expand_dataset import expand_dataset

    try:
        report = expand_dataset(spec, dry_run=args.dry_run)
    except Exception as exc:
        if args.verbose:
            raise
        from datagen.checks.quality import QualityGateError
        from datagen.operations.failure import reason
        from datagen.settings import Settings

        if isinstance(exc, QualityGateError) and exc.report:
            # On the box the whole gate report (reject files' paths included) helps; the run page gets the short one.
            print(f"datagen: run failed: {exc.report.text}", file=sys.stderr)
            return 1
        # The flow's log (and the Prefect UI) already holds the full trace: one line here says what to fix.
        print(f"datagen: run failed: {reason(exc, Settings().work_dir)}", file=sys.stderr)
        print("datagen: the full trace is in the flow's log above; `datagen run --verbose` raises it", file=sys.stderr)
        return 1
    print(summary_text(report))
    return 0


def summary_text(report: dict[str, Any]) -> str:
    """The CLI's closing lines for a flow's summary: the dataset's location, or why nothing was published."""
    if report.get("already_published"):
        return (
            f"{report.get('message')} ({report.get('rows')} rows, {report.get('rejects')} rejects); look at it with: "
            f"datagen inspect {report.get('namespace')}\n{report['uri']}"
        )
    if not report.get("uri"):
        why = report.get("message") or report.get("reason") or "no prompts"
        return f"nothing published in namespace {report.get('namespace')}: {why}"
    rows, rejects = report.get("rows", 0), report.get("rejects", 0)
    what = "Would publish" if report.get("dry_run") else "Published"
    source = f"{report.get('prompts')} prompts"
    turns = report.get("conversations")
    if isinstance(turns, dict):  # every-turn mode: conversations and their steps
        source = (
            f"{turns.get('conversations_finished')} of {turns.get('conversations_planned')} conversations "
            f"({turns.get('steps')} steps)"
        )
    return (
        f"{what} {rows} rows ({rejects} rejects) from {source} "
        f"in namespace {report.get('namespace')}; look at it with: datagen inspect {report.get('namespace')}\n"
        f"{report['uri']}"
    )


def _cmd_check(args: argparse.Namespace) -> int:
    _apply_env_file(args)
    spec = load_spec(args.config, args.set)
    from datagen.paths import secure_run
    from datagen.publishing.catalog import next_expansion_namespace
    from datagen.publishing.storage import ObjectStore, StorageError, s3_preflight
    from datagen.runspec import AUTO_NAMESPACE
    from datagen.settings import Settings
    from tasks.environment import format_report, run_checks

    settings = Settings()
    secure_run(settings, spec)
    store = ObjectStore.from_settings(settings)
    if spec.namespace == AUTO_NAMESPACE:
        try:  # read-only: the run itself picks (and repairs) for real
            resolved = next_expansion_namespace(store)
        except StorageError as exc:
            print(f"namespace 'auto': not resolved ({exc}); the S3 checks below say why")
        else:
            print(f"namespace 'auto' -> {resolved} (the next free expansion_vN now)")
            spec = spec.model_copy(update={"namespace": resolved})
    results = run_checks(settings, spec, s3_check=lambda: s3_preflight(store, spec.namespace, resume=args.resume))
    print(format_report(results))
    return 1 if any(r.failed for r in results) else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _cmd_demo(args: argparse.Namespace) -> int:
    """Run the whole pipeline on the bundled prompts: local S3, stand-in servers, embedded Prefect."""
    _quiet_prefect_defaults()
    from datagen.local import localstack
    from datagen.local.model_fixture import ensure_model_dir
    from datagen.runspec import PromptSource, RunSpec

    model_dir = ensure_model_dir()
    state_dir = args.state_dir
    was_running = localstack.is_running(state_dir)
    info = localstack.start(state_dir)
    try:
        os.environ.update(info.env())
        os.environ.update(
            {
                "DATAGEN_ENGINE": "standin",
                "DATAGEN_NUM_SERVERS": str(args.servers),
                "DATAGEN_BASE_PORT": str(_free_port()),
                "DATAGEN_SKIP_GPU_CHECKS": "true",
                "DATAGEN_REQUIRE_TMPFS_MODEL": "false",
                "DATAGEN_SERVER_START_TIMEOUT_S": "120",
                **_roots_env(model_dir),
            }
        )
        namespace = args.namespace or time.strftime("demo-%Y%m%d-%H%M%S")
        spec = RunSpec(
            sources=[PromptSource(path=str(REPO_ROOT / "data" / "prompts"))],
            model_path=str(model_dir),
            namespace=namespace,
            shard_size=50,
            context_length=32768,
        )
        spec = spec.model_copy(update={"sampling": spec.sampling.model_copy(update={"max_new_tokens": 4096})})
        from flows.expand_dataset import expand_dataset

        report = expand_dataset(spec)
        print("\n" + summary_text(report))
        if report.get("uri"):
            # The catalog now lists these prompts: a later run with skip_published (the default) skips them.
            print(
                "Its prompts now count as published: later runs skip them unless they set skip_published: false. "
                f"Inspect it while the local S3 runs: datagen stack up && datagen inspect {namespace}"
            )
        return 0
    finally:
        if not was_running and not args.keep_stack:
            localstack.stop(state_dir)


def _cmd_abandon(args: argparse.Namespace) -> int:
    """Mark a namespace whose publish can never be finished as abandoned (adds one marker object)."""
    from datagen.publishing.storage import ObjectStore, StorageError
    from datagen.settings import Settings
    from tasks.publishing import PublishError, abandon

    store = ObjectStore.from_settings(Settings())
    try:
        marker = abandon(store, args.namespace, args.reason)
    except (PublishError, StorageError) as exc:
        print(f"datagen: abandon failed: {exc}", file=sys.stderr)
        return 1
    print(
        f"namespace {args.namespace} is abandoned ({marker}); its objects stay as they are and nothing is published "
        "there any more. Publish the run under a new namespace."
    )
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from datagen.operations.inspection import inspect_namespace, list_namespaces
    from datagen.publishing.storage import ObjectStore
    from datagen.settings import Settings

    if args.state_dir is not None:
        from datagen.local import localstack

        if "DATAGEN_S3_ENDPOINT_URL" not in os.environ and localstack.is_running(args.state_dir):
            os.environ.update(localstack.start(args.state_dir).env())
    if args.namespace is None and args.conversation is not None:
        print("--conversation needs a namespace: datagen inspect NAMESPACE --conversation [ID]", file=sys.stderr)
        return 2
    store = ObjectStore.from_settings(Settings())
    if args.namespace is None:
        print(list_namespaces(store))
        return 0
    if args.conversation is not None:
        from datagen.conversation.view import find_conversation, render_conversation

        wanted = args.conversation or None  # a bare --conversation: the first one
        found = find_conversation(store, args.namespace, wanted)
        if found is None:
            what = f"no conversation with id {wanted!r}" if wanted else "no published conversations"
            print(f"{store.uri(args.namespace.strip('/') + '/conversations/')}: {what}", file=sys.stderr)
            return 1
        print(render_conversation(found))
        return 0
    text, ok = inspect_namespace(store, args.namespace, examples=args.examples)
    print(text)
    return 0 if ok else 1


def laptop_spec(model_dir: Path, namespace: str = "auto") -> dict[str, Any]:
    """Demo-sized run parameters for a laptop worker: the bundled prompts, the fixture model, short outputs."""
    return {
        "sources": [{"path": str(REPO_ROOT / "data" / "prompts"), "category_field": "category"}],
        "model_path": str(model_dir),
        "namespace": namespace,
        "shard_size": 50,
        "sampling": {"max_new_tokens": 4096},
        "context_length": 32768,
    }


def _roots_env(model_dir: Path) -> dict[str, str]:
    """The bundled prompts and the fixture model as the only roots run paths may resolve under."""
    return {
        "DATAGEN_DATA_ROOTS": str(REPO_ROOT / "data"),
        "DATAGEN_MODEL_ROOTS": str(model_dir),
    }


def laptop_env(s3_env: dict[str, str], work_dir: Path, servers: int, model_dir: Path | None = None) -> dict[str, str]:
    """DATAGEN_* settings of a laptop worker: local S3, stand-in servers on free ports, no GPU checks."""
    return {
        **(_roots_env(model_dir) if model_dir is not None else {}),
        **s3_env,
        "DATAGEN_ENGINE": "standin",
        "DATAGEN_NUM_SERVERS": str(servers),
        "DATAGEN_BASE_PORT": "0",
        "DATAGEN_SKIP_GPU_CHECKS": "true",
        "DATAGEN_REQUIRE_TMPFS_MODEL": "false",
        "DATAGEN_SERVER_START_TIMEOUT_S": "120",
        "DATAGEN_WORK_DIR": str(work_dir.resolve()),
        "DATAGEN_HOME": str(REPO_ROOT),
    }


def _cmd_laptop(args: argparse.Namespace) -> int:
    """Set up a worker environment on a laptop: local S3, fixture model, stand-in settings, a run spec."""
    import json

    from datagen.local import localstack
    from datagen.local.model_fixture import ensure_model_dir
    from datagen.runspec import RunSpec

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    print("building the fixture model directory (real Qwen vocabulary, no weights) ...", flush=True)
    model_dir = ensure_model_dir()
    print(f"starting the local S3 server (state in {args.state_dir}) ...", flush=True)
    info = localstack.start(args.state_dir)
    env = laptop_env(info.env(), out / "work", args.servers, model_dir)
    env_file = out / "worker.env"
    fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the S3 secret
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{k}={v}\n" for k, v in sorted(env.items()))
    spec = laptop_spec(model_dir)
    RunSpec.model_validate(spec)  # what the deployment's schema will accept
    spec_file = out / "run-spec.json"
    spec_file.write_text(json.dumps({"spec": spec}, indent=1) + "\n", encoding="utf-8")
    print(f"worker settings: {env_file}\nrun parameters:  {spec_file}")
    print(
        "start a worker with them:  set -a; . "
        f"{env_file}; set +a; bash infra/prefect-worker.sh\n"
        # The server is authenticated (docs/security.md): infra/prefect-server.sh writes its auth string here.
        'start a run:               PREFECT_API_AUTH_STRING="$(cat .datagen/prefect-auth)" '
        "prefect deployment run expand-dataset/manual "
        f'--params "$(cat {spec_file})" --watch'
    )
    return 0


def _cmd_pin(args: argparse.Namespace) -> int:
    """Pin the pool's job template and its deployments on this box (or check them against the pin)."""
    from datagen.operations.deploy_pin import default_pin_path, pin_command

    return pin_command(args.pool, args.file or default_pin_path(), args.check)


def _cmd_stack(args: argparse.Namespace) -> int:
    from datagen.local import localstack

    if args.action == "up":
        info = localstack.start(args.state_dir)
        print(f"local S3 at {info.endpoint_url}, bucket {info.bucket}; settings in {info.env_file}")
    elif args.action == "down":
        localstack.stop(args.state_dir)
        print("local S3 stopped")
    else:
        print("running" if localstack.is_running(args.state_dir) else "stopped")
    return 0


def _cmd_fixture(args: argparse.Namespace) -> int:
    from datagen.local.model_fixture import ensure_model_dir

    print(ensure_model_dir(args.out))
    return 0


Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for `datagen`."""
    parser = argparse.ArgumentParser(prog="datagen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _run_commands(sub)
    _look_commands(sub)
    _local_commands(sub)
    return parser


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="YAML or JSON file with run-spec fields")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. shard_size=500")
    p.add_argument(
        "--env-file",
        type=Path,
        help="DATAGEN_* settings to use where the environment sets none (default: worker.env beside --config)",
    )


def _run_commands(sub: Subparsers) -> None:
    """Run, check, abandon and pin: the commands that act on a run or a box."""
    run = sub.add_parser("run", help="run the expand-dataset flow")
    _spec_args(run)
    run.add_argument("--dry-run", action="store_true", help="do everything but write to S3; list what would be written")
    run.add_argument("--verbose", action="store_true", help="on failure, raise the full traceback (default: one line)")
    run.set_defaults(func=_cmd_run)

    abandon = sub.add_parser(
        "abandon",
        help="mark an unfinished publish that can never be finished (its work dir is gone) as abandoned; "
        "adds NAMESPACE/abandoned.json, deletes and replaces nothing",
    )
    abandon.add_argument("namespace")
    abandon.add_argument("--reason", default="abandoned by an operator", help="recorded in the marker")
    abandon.set_defaults(func=_cmd_abandon)

    check = sub.add_parser("check", help="run only the environment checks; exit 1 if one fails")
    _spec_args(check)
    check.add_argument("--resume", action="store_true", help="allow a namespace that already holds this run's data")
    check.set_defaults(func=_cmd_check)

    pin = sub.add_parser(
        "pin",
        help="operator, on the box: record what this box's worker may run (each deployment's entrypoint, pull "
        "steps and parameter schema, the pool's job template); runs that differ later fail (docs/security.md)",
    )
    pin.add_argument("--check", action="store_true", help="only compare the API with the pin; exit 1 on a change")
    pin.add_argument("--pool", default=os.environ.get("DATAGEN_WORK_POOL", "gpu-box-1"), help="the work pool")
    pin.add_argument("--file", type=Path, help="the pin file (default DATAGEN_PIN_FILE, else .datagen/pin/pin.json)")
    pin.set_defaults(func=_cmd_pin)


def _look_commands(sub: Subparsers) -> None:
    """Inspect: what the datasets hold."""

    inspect = sub.add_parser(
        "inspect",
        help="list the namespaces, or show what one holds: manifest, rows, conversations, rejects, card",
    )
    inspect.add_argument("namespace", nargs="?", help="the namespace to show (none: list every namespace)")
    inspect.add_argument("--examples", type=int, default=2, help="example rejects shown per reason")
    inspect.add_argument(
        "--conversation",
        nargs="?",
        const="",
        metavar="ID",
        help="show one published conversation, readable (roles, reasoning shortened, tool calls, outcome): "
        "the one with this id, or the first",
    )
    inspect.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STACK_DIR,
        help="use the local S3 server of this stack when it runs (the demo's); else DATAGEN_S3_* settings",
    )
    inspect.set_defaults(func=_cmd_inspect)


def _local_commands(sub: Subparsers) -> None:
    """Demo, laptop, stack and fixture: the local stack of a developer's machine."""
    demo = sub.add_parser("demo", help="end-to-end demo on the bundled prompts (local S3 + stand-in servers)")
    demo.add_argument("--namespace", help="output namespace (default demo-<timestamp>)")
    demo.add_argument("--servers", type=int, default=2, help="stand-in servers to start")
    demo.add_argument("--state-dir", type=Path, default=DEFAULT_STACK_DIR, help="local stack state directory")
    demo.add_argument("--keep-stack", action="store_true", help="leave the local S3 server running afterwards")
    demo.set_defaults(func=_cmd_demo)

    laptop = sub.add_parser(
        "laptop", help="set up a Prefect worker environment on a laptop: local S3, stand-ins, fixture model"
    )
    laptop.add_argument("--out", type=Path, default=Path(".datagen") / "laptop", help="where settings are written")
    laptop.add_argument("--servers", type=int, default=2, help="stand-in servers per run")
    laptop.add_argument("--state-dir", type=Path, default=DEFAULT_STACK_DIR, help="local stack state directory")
    laptop.set_defaults(func=_cmd_laptop)

    stack = sub.add_parser("stack", help="start, stop or query the local S3 server")
    stack.add_argument("action", choices=["up", "down", "status"])
    stack.add_argument("--state-dir", type=Path, default=DEFAULT_STACK_DIR)
    stack.set_defaults(func=_cmd_stack)

    fixture = sub.add_parser("fixture", help="build the local Qwen3.6-style model directory (no weights)")
    fixture.add_argument("--out", type=Path, default=None)
    fixture.set_defaults(func=_cmd_fixture)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `datagen` console script."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
