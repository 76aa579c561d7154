"""Stand-in flag parity: every flag `python -m datagen.standin` accepts, SGLang 0.5.23's own parser accepts
the same way (same flag and aliases, same destination, same choices, same value parsing).

Both parsers are built in one subprocess (the real one exactly as `prepare_server_args` builds it) and fed
the same probe values; a stand-in flag that the real parser lacks, or parses differently, is a difference.
"""

from __future__ import annotations

from typing import Any

from tests.conformance.conftest import RealSglang

# Values every store-flag is fed (besides its own choices): numbers and SI/IEC suffixes of every case,
# JSON of every shape, and words that are choices of some flag somewhere.
PROBES = (
    "0",
    "1",
    "-1",
    "8",
    "32768",
    "32k",
    "32K",
    "32Ki",
    "32ki",
    "1.5k",
    "1.5Ki",
    "2M",
    "2m",
    "0.5",
    "1e3",
    " 7 ",
    "abc",
    "",
    "true",
    "null",
    "{}",
    '{"enable_thinking": true}',
    "[1]",
    '"x"',
    "auto",
    "full",
    "tc_piecewise",
    "flashinfer",
    "FLASHINFER",
    "qwen3",
    "EAGLE",
    "eagle",
    "debug",
    "INFO",
)

_PARITY = r"""
import argparse, json
from sglang.srt.server_args import ServerArgs
from datagen.standin import cli

class Refused(Exception):
    pass

def _error(self, message):
    raise Refused(message)

argparse.ArgumentParser.error = _error

def real_parser():
    p = argparse.ArgumentParser(prog="sglang serve")  # as prepare_server_args builds it
    ServerArgs.add_cli_args(p)
    return p

real, standin = real_parser(), cli.build_parser()
BASE = ["--model-path", "m"]
PROBES = ARGS

def outcome(parser, argv, dest):
    try:
        ns = parser.parse_args(BASE + argv)
    except Refused:
        return "refused"
    except SystemExit as exc:  # a custom action that exits by itself
        return f"exit {exc.code}"
    return "ok " + json.dumps(getattr(ns, dest), default=repr, sort_keys=True)

def by_option(parser):
    return {s: a for a in parser._actions for s in a.option_strings}

real_opts = by_option(real)
diffs = []
checked = 0
for action in standin._actions:
    if isinstance(action, argparse._HelpAction):
        continue
    first = action.option_strings[0]
    missing = [s for s in action.option_strings if s not in real_opts]
    if missing:
        diffs.append(f"{first}: the real parser has no {missing}")
        continue
    twin = real_opts[first]
    if any(real_opts[s] is not twin for s in action.option_strings):
        diffs.append(f"{first}: its aliases {action.option_strings} are different flags in the real parser")
    if twin.dest != action.dest:
        diffs.append(f"{first}: dest {action.dest!r}, real {twin.dest!r}")
    mine_choices = None if action.choices is None else sorted(map(str, action.choices))
    real_choices = None if twin.choices is None else sorted(map(str, twin.choices))
    if mine_choices != real_choices:
        extra = sorted(set(mine_choices or ()) - set(real_choices or ()))
        lacking = sorted(set(real_choices or ()) - set(mine_choices or ()))
        diffs.append(f"{first}: choices differ (stand-in only: {extra}; real only: {lacking}; "
                     f"restricted: stand-in {mine_choices is not None}, real {real_choices is not None})")
    if action.nargs == 0:
        cases = [[first]]
    else:
        values = list(PROBES) + [str(c) for c in (action.choices or ())] + [str(c) for c in (twin.choices or ())]
        cases = [[first, v] for v in dict.fromkeys(values)] + [[f"{first}={v}"] for v in ("1", "x")]
    cases.append([])  # the flag left out: its default as parsed
    for argv in cases:
        mine, theirs = outcome(standin, argv, action.dest), outcome(real, argv, twin.dest)
        checked += 1
        if mine != theirs and not (argv == [] and mine.startswith("ok") and theirs.startswith("ok")):
            diffs.append(f"{first}: {argv!r} -> stand-in {mine}, real {theirs}")
RESULT = {"diffs": diffs, "checked": checked, "flags": len(standin._actions) - 1}
"""


def _parity(real_sglang: RealSglang) -> dict[str, Any]:
    result: dict[str, Any] = real_sglang.run(_PARITY, PROBES)
    return result


def test_every_standin_flag_is_a_real_flag_parsed_the_same_way(real_sglang: RealSglang) -> None:
    """No stand-in flag without a real counterpart, and no value one parser takes and the other refuses."""
    result = _parity(real_sglang)
    assert result["flags"] > 50  # the whole stand-in parser was compared, not an empty one
    assert result["checked"] > 1000
    assert result["diffs"] == []
