"""Judge one server command line with the engine's own code and print one JSON document.

Run with the ENGINE's Python: ``<engine_python> flag_probe.py sglang|standin < request.json``, where the
request is ``{"argv": [...], "resolve": true}``. Standalone on purpose (standard library plus the engine),
so it runs in SGLang's own venv, which has never heard of datagen.

It parses the argv with the parser the server itself builds (SGLang 0.5.23: `prepare_server_args`, the
function `sglang.launch_server` calls), so unknown flags, bad choices and bad values fail here exactly as
they would at startup, and then, with ``resolve``, runs the server's settings resolution
(`ServerArgs.resolve_once`), which reads the model's config.json and rejects flag/model combinations
(`--language-model-only` for Qwen3.6, say). Resolution looks at the GPU the way a server does, so on a
GPU box it sees one of the GPUs.

Output keys: probe_version, engine, version, flags (every option string the parser knows),
parse (ok, error), resolve (ok: true/false, or null when not asked; error).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

__all__ = ["PROBE_VERSION", "ParseError", "main", "probe"]

PROBE_VERSION = 1


class ParseError(Exception):
    """What argparse would print before exiting with code 2."""


def _raise(self: argparse.ArgumentParser, message: str) -> NoReturn:
    raise ParseError(f"{self.prog}: error: {message}")


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")})


def _judge(
    build: Callable[[], argparse.ArgumentParser],
    parse: Callable[[list[str]], Any],
    resolve: Callable[[Any], None] | None,
    argv: list[str],
) -> dict[str, Any]:
    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _raise  # type: ignore[method-assign]
    out: dict[str, Any] = {"flags": _option_strings(build()), "resolve": {"ok": None, "error": None}}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            parsed = parse(argv)
    except ParseError as exc:
        out["parse"] = {"ok": False, "error": str(exc)}
        return out
    finally:
        argparse.ArgumentParser.error = original  # type: ignore[method-assign]
    out["parse"] = {"ok": True, "error": None}
    if resolve is not None:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                resolve(parsed)
        except Exception as exc:
            out["resolve"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        else:
            out["resolve"] = {"ok": True, "error": None}
    return out


def _sglang(argv: list[str], resolve: bool) -> dict[str, Any]:
    # Imported by name: the pipeline's venv (where mypy runs) has no sglang.
    sglang = importlib.import_module("sglang")
    server_args = importlib.import_module("sglang.srt.server_args")
    prepare_server_args = server_args.prepare_server_args

    def build() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog="sglang serve")  # as prepare_server_args builds it
        server_args.ServerArgs.add_cli_args(parser)
        return parser

    def resolve_settings(record: Any) -> None:
        record.resolve_once()

    out = _judge(build, prepare_server_args, resolve_settings if resolve else None, argv)
    return {"engine": "sglang", "version": getattr(sglang, "__version__", None), **out}


def _standin(argv: list[str], resolve: bool) -> dict[str, Any]:
    from datagen.standin import cli

    out = _judge(cli.build_parser, cli.parse_args, cli.resolve_settings if resolve else None, argv)
    return {"engine": "standin", "version": None, **out}


def probe(engine: str, argv: Sequence[str], resolve: bool) -> dict[str, Any]:
    """The probe's report for `argv` under `engine` ("sglang" or "standin")."""
    judge = {"sglang": _sglang, "standin": _standin}[engine]
    return {"probe_version": PROBE_VERSION, **judge(list(argv), resolve)}


def main(args: Sequence[str]) -> int:
    """Read the request from stdin, print the report as the last line of stdout."""
    if len(args) != 1 or args[0] not in ("sglang", "standin"):
        print("usage: flag_probe.py sglang|standin < request.json", file=sys.stderr)
        return 2
    request = json.loads(sys.stdin.read())
    report = probe(args[0], [str(a) for a in request["argv"]], bool(request.get("resolve")))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
