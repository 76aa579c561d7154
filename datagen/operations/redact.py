"""Masking of secrets in whatever the pipeline reads back from a server: log tails, `/server_info`, error texts.

Real SGLang 0.5.23 logs its full settings at startup (`server_args={... 'api_key': '...'}`) and answers
`/server_info` with the resolved settings and an unredacted `launch_command`; only watermark keys are masked.
Anything read from a server therefore passes through here before it reaches an exception, a Prefect log,
an artifact or a task result. Two layers: the exact secret values we know (the fleet's API key), and
patterns for secret-looking flags and fields, so a key we were not told about (an operator's
`--admin-api-key` in the run spec) is masked too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import SecretStr

__all__ = ["MASK", "is_secret_field", "redact", "redact_lines", "redact_text"]

MASK = "***"
_MIN_SECRET_LEN = 4  # shorter "secrets" would mask ordinary text; real keys are far longer

# Field names that hold secrets in SGLang's ServerArgs (api_key, admin_api_key, watermark_key[_b],
# watermark_config, ssl_keyfile_password, hf tokens) and in general.
_SECRET_FIELD = re.compile(
    r"(?:^|_)(?:api_key|secret(?:_key)?|password|passwd|token|auth_token|access_key|watermark_key(?:_b)?|"
    r"watermark_config|credentials?)$",
    re.IGNORECASE,
)
# `--api-key X`, `--api-key=X`, argparse abbreviations (`--api-k X`), `--admin-api-key`, `--hf-token`, ...
_SECRET_FLAG = re.compile(
    r"(?P<flag>--(?:admin-)?api-k[a-z-]*|--[a-z0-9-]*(?:secret|password|token|watermark-key|watermark-config)"
    r"(?![a-z0-9]))(?P<sep>=|\s+)(?P<value>(?!--)\S+)",
    re.IGNORECASE,
)
# `api_key='X'`, `"api_key": "X"`, `'admin_api_key': 'X'` (Python reprs and JSON), quoted values.
_SECRET_QUOTED = re.compile(
    r"""(?P<key>['"]?\b[\w.-]*(?:api_key|secret|password|token|watermark_key(?:_b)?|watermark_config)['"]?\s*[:=]\s*)"""
    r"""(?P<q>['"])(?P<value>(?:\\.|(?!(?P=q)).)*)(?P=q)""",
    re.IGNORECASE,
)
# `api_key=X` unquoted (key=value logs), up to a separator.
_SECRET_BARE = re.compile(
    r"(?P<key>\b[\w.-]*(?:api_key|secret|password|token)=)(?P<value>(?!None\b)[^\s,;)'\"\]}]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?P<key>\bBearer\s+)(?P<value>[^\s'\",]+)", re.IGNORECASE)


def is_secret_field(name: str) -> bool:
    """True for a settings/JSON field name that holds a secret (api_key, admin_api_key, watermark_key, ...)."""
    return bool(_SECRET_FIELD.search(name))


def _values(secrets: Iterable[str | SecretStr | None]) -> list[str]:
    out = []
    for s in secrets:
        value = s.get_secret_value() if isinstance(s, SecretStr) else s
        if value and len(value) >= _MIN_SECRET_LEN:
            out.append(value)
    return sorted(set(out), key=len, reverse=True)  # longest first: a key containing another is masked whole


def redact_text(text: str, secrets: Iterable[str | SecretStr | None] = ()) -> str:
    """`text` with every known secret value and every secret-looking flag or field value replaced by ***."""
    for value in _values(secrets):
        text = text.replace(value, MASK)
    text = _SECRET_FLAG.sub(lambda m: f"{m['flag']}{m['sep']}{MASK}", text)
    text = _SECRET_QUOTED.sub(lambda m: f"{m['key']}{m['q']}{MASK}{m['q']}", text)
    text = _SECRET_BARE.sub(lambda m: f"{m['key']}{MASK}", text)
    return _BEARER.sub(lambda m: f"{m['key']}{MASK}", text)


def redact_lines(lines: Sequence[str], secrets: Iterable[str | SecretStr | None] = ()) -> list[str]:
    """Every line through `redact_text` (a log tail)."""
    known = _values(secrets)
    return [redact_text(line, known) for line in lines]


def redact(value: Any, secrets: Iterable[str | SecretStr | None] = ()) -> Any:
    """A JSON-like value (e.g. `/server_info`) with secret fields masked and every string through `redact_text`."""
    known = _values(secrets)

    def walk(v: Any, key: str | None) -> Any:
        if key is not None and is_secret_field(key) and v is not None and not isinstance(v, dict | list | bool):
            return MASK
        if isinstance(v, dict):
            return {k: walk(item, str(k)) for k, item in v.items()}
        if isinstance(v, list | tuple):
            return [walk(item, None) for item in v]
        if isinstance(v, str):
            return redact_text(v, known)
        return v

    return walk(value, None)
