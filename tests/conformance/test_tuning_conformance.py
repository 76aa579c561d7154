"""The run-parameter policy (datagen/checks/tuning.py) and the key file, judged against SGLang 0.5.23's own parser.

The allow-list and the managed list name real flags; every alias of a managed flag is managed (argparse stores
aliases in one dest, so a missed alias would reopen the flag); the real parser takes abbreviations, which is
why tuning flags must be spelled in full; and the real config merger reads the key from our 0600 file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from datagen.checks.tuning import MANAGED_FLAGS, TUNING_FLAGS
from datagen.engine.launcher import write_key_config
from datagen.local.model_fixture import ensure_model_dir
from tests.conformance.conftest import RealSglang

_PARSER = r"""
import argparse
from sglang.srt.server_args import ServerArgs, prepare_server_args
p = argparse.ArgumentParser(prog="sglang serve")  # as prepare_server_args builds it
ServerArgs.add_cli_args(p)
import json
model, probes, key_files = ARGS[0], json.loads(ARGS[1]), ARGS[2:]
acts = [{"opts": a.option_strings, "dest": a.dest} for a in p._actions]
wins = {}
for name, extra in probes.items():
    ns = p.parse_args(["--model-path", model, "--host", "127.0.0.1", "--port", "30000", *extra])
    wins[name] = {"host": ns.host, "port": ns.port, "api_key": ns.api_key,
                  "trust_remote_code": ns.trust_remote_code, "tokenizer_path": ns.tokenizer_path}
keys = [prepare_server_args(["--model-path", model, "--config", f]).api_key for f in key_files]
RESULT = {"allow_abbrev": p.allow_abbrev, "acts": acts, "wins": wins, "keys": keys}
"""

# The issue's probes, appended after the launcher's own flags: each one wins in the real parser.
PROBES = {
    "host": ["--host", "0.0.0.0"],
    "empty key": ["--api-key="],
    "abbreviated key": ["--api-k", "x"],
    "remote code": ["--trust-remote-code"],
    "tokenizer": ["--tokenizer-path", "/tmp/x"],
    "port": ["--port", "1234"],
}
# A key starting with "-" would read as a flag after the merge (`--api-key -x`): Settings refuses those.
KEYS = ["plain-key_123", 'quote " and # hash: colon', "true", "0123", " padded ", "ключ"]


def _real(real_sglang: RealSglang, tmp_path: Path) -> dict[str, Any]:
    files = [str(write_key_config(tmp_path / f"k{i}.yaml", SecretStr(k))) for i, k in enumerate(KEYS)]
    result: dict[str, Any] = real_sglang.run(_PARSER, [str(ensure_model_dir()), json.dumps(PROBES), *files])
    return result


def test_policy_names_real_flags_and_every_alias_of_a_managed_flag(real_sglang: RealSglang, tmp_path: Path) -> None:
    real = _real(real_sglang, tmp_path)
    dest_of = {o: a["dest"] for a in real["acts"] for o in a["opts"]}
    assert sorted(f for f in (*TUNING_FLAGS, *MANAGED_FLAGS) if f not in dest_of) == []
    assert not set(TUNING_FLAGS) & set(MANAGED_FLAGS)
    managed_dests = {dest_of[f] for f in MANAGED_FLAGS}
    aliases = {o for a in real["acts"] if a["dest"] in managed_dests for o in a["opts"] if o.startswith("--")}
    assert sorted(aliases - set(MANAGED_FLAGS)) == []
    # No tuning flag shares a dest with a managed one (that would be a managed flag under another name).
    assert not {dest_of[f] for f in TUNING_FLAGS} & managed_dests


def test_real_parser_lets_the_issue_probes_win_which_is_why_they_are_refused(
    real_sglang: RealSglang, tmp_path: Path
) -> None:
    real = _real(real_sglang, tmp_path)
    assert real["allow_abbrev"] is True  # "--api-k" is --api-key to the real parser
    wins = real["wins"]
    assert wins["host"]["host"] == "0.0.0.0"
    assert wins["empty key"]["api_key"] == ""
    assert wins["abbreviated key"]["api_key"] == "x"
    assert wins["remote code"]["trust_remote_code"] is True
    assert wins["tokenizer"]["tokenizer_path"] == "/tmp/x"
    assert wins["port"]["port"] == 1234


def test_real_config_merger_reads_every_key_from_our_file(real_sglang: RealSglang, tmp_path: Path) -> None:
    """write_key_config's YAML gives the real `--config` merger the key exactly, whatever its characters."""
    assert _real(real_sglang, tmp_path)["keys"] == KEYS


_MERGE = r"""
import argparse, json
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
p = argparse.ArgumentParser(prog="sglang serve")
ServerArgs.add_cli_args(p)
out = []
for argv in json.loads(ARGS[0]):
    try:
        out.append(ConfigArgumentMerger(p).merge_config_with_args(argv))
    except ValueError as exc:
        out.append(f"ValueError: {exc}")
RESULT = out
"""


def test_standin_merges_a_config_file_as_the_real_merger_does(real_sglang: RealSglang, tmp_path: Path) -> None:
    """The stand-in's `--config` (how servers get the key) gives the argv the real ConfigArgumentMerger gives."""
    from datagen.standin import cli

    config = tmp_path / "c.yaml"
    config.write_text(
        'api-key: "k"\nenable-metrics: true\ndisable-radix-cache: false\nmax-running-requests: 48\n'
        'default-chat-template-kwargs: {"enable_thinking": true}\nlog-requests-level: 2\n'
    )
    empty, not_yaml = tmp_path / "e.yml", tmp_path / "c.json"
    empty.write_text("")
    not_yaml.write_text("{}")
    argvs = [
        ["--model-path", "m", "--config", str(config), "--port", "1"],
        ["--config", str(empty), "--model-path", "m"],
        ["--model-path", "m", "--config", str(not_yaml)],
        ["--model-path", "m", "--config", str(tmp_path / "absent.yaml")],
        ["--model-path", "m", "--config"],
        ["--config", str(config), "--config", str(config)],
        ["--model-path", "m"],
    ]
    real = real_sglang.run(_MERGE, [json.dumps(argvs)])

    def standin(argv: list[str]) -> list[str] | str:
        try:
            return cli.merge_config(cli.build_parser(), argv)
        except ValueError as exc:
            return f"ValueError: {exc}"

    assert [standin(a) for a in argvs] == real
