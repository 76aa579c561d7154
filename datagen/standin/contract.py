"""Request checks with SGLang's error texts: the strict /generate contract, then sampling value checks."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = [
    "SAMPLING_FIELDS",
    "ContractError",
    "check_generate_body",
    "check_sampling_params",
    "check_sampling_values",
    "describe",
]


class ContractError(ValueError):
    """The body breaks the JSON contract (answered 400 with a plain-string `error`, like SGLang's serde check)."""


def describe(value: Any) -> str:
    """A JSON value as serde's `Unexpected` names it in `invalid type: ...` messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{int(value) if value.is_integer() else value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "sequence"
    return "map"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


Check = tuple[Callable[[Any], bool], str]
_INT: Check = (_is_int, "i64")
_OPT_INT: Check = (lambda v: v is None or _is_int(v), "i64")
_FLOAT: Check = (_is_num, "f64")
_OPT_FLOAT: Check = (lambda v: v is None or _is_num(v), "f64")
_BOOL: Check = (lambda v: isinstance(v, bool), "a boolean")
_OPT_STR: Check = (lambda v: v is None or isinstance(v, str), "a string")
_STR_OR_LIST: Check = (
    lambda v: v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
    "a string or a sequence of strings",
)
_INT_LIST: Check = (lambda v: v is None or (isinstance(v, list) and all(_is_int(i) for i in v)), "a sequence of i64")
_MAP: Check = (lambda v: v is None or isinstance(v, dict), "a map")
_ANY: Check = (lambda v: True, "any value")

# sglang/api/v1/api_types.py: SamplingParams, in declaration order (the order of the "expected one of" list).
SAMPLING_FIELDS: dict[str, Check] = {
    "max_new_tokens": _OPT_INT,
    "stop": _STR_OR_LIST,
    "stop_token_ids": _INT_LIST,
    "stop_regex": _STR_OR_LIST,
    "temperature": _FLOAT,
    "top_p": _FLOAT,
    "top_k": _INT,
    "min_p": _FLOAT,
    "frequency_penalty": _FLOAT,
    "presence_penalty": _FLOAT,
    "repetition_penalty": _FLOAT,
    "min_new_tokens": _INT,
    "n": _INT,
    "json_schema": _OPT_STR,
    "regex": _OPT_STR,
    "ebnf": _OPT_STR,
    "structural_tag": _ANY,
    "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL,
    "spaces_between_special_tokens": _BOOL,
    "no_stop_trim": _BOOL,
    "stream_interval": _OPT_INT,
    "logit_bias": _MAP,
    "sampling_seed": _OPT_INT,
    "custom_params": _MAP,
    "beam_width": _OPT_INT,
    "watermark": _ANY,
    "choice": _ANY,
}
_EXPECTED = ", ".join(f"`{name}`" for name in SAMPLING_FIELDS)

_TOP_LEVEL: dict[str, Check] = {
    "text": _STR_OR_LIST,
    "input_ids": (
        lambda v: (
            v is None
            or (
                isinstance(v, list)
                and (all(_is_int(i) for i in v) or all(_INT_LIST[0](x) and x is not None for x in v))
            )
        ),
        "a sequence of i64 or a sequence of sequences of i64",
    ),
    "rid": _STR_OR_LIST,
    "stream": _BOOL,
    "return_logprob": (lambda v: v is None or isinstance(v, bool | list), "a boolean"),
    "require_reasoning": _BOOL,
}


def _check(value: Any, check: Check) -> None:
    ok, expected = check
    if not ok(value):
        raise ContractError(f"invalid type: {describe(value)}, expected {expected}")


def check_sampling_params(params: Any) -> dict[str, Any]:
    """Reject unknown keys and wrong JSON types exactly as the contract does; returns the dict."""
    if not isinstance(params, dict):
        raise ContractError(f"invalid type: {describe(params)}, expected struct SamplingParams")
    for key, value in params.items():
        if key not in SAMPLING_FIELDS:
            raise ContractError(f"unknown field `{key}`, expected one of {_EXPECTED}")
        _check(value, SAMPLING_FIELDS[key])
    return params


def check_generate_body(body: Any) -> dict[str, Any]:
    """Top-level /generate contract: a JSON object with well-typed text/input_ids/rid/sampling_params."""
    if not isinstance(body, dict):
        raise ContractError(f"invalid type: {describe(body)}, expected struct GenerateRequest")
    for key, check in _TOP_LEVEL.items():
        if key in body:
            _check(body[key], check)
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        for item in sp:
            check_sampling_params(item)
    elif sp is not None:
        check_sampling_params(sp)
    return body


# sglang/srt/sampling/sampling_params.py constants.
_SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30
MAX_STOP_COUNT = 32
MAX_STOP_REGEX_COUNT = 32
MAX_STOP_REGEX_LEN = 256


def check_sampling_values(p: dict[str, Any], vocab_size: int) -> None:
    """SGLang's SamplingParams: `__post_init__` defaulting, then `normalize()`, then `verify()` (same texts)."""

    def value(key: str, default: Any) -> Any:
        v = p.get(key)
        return default if v is None else v  # null means "use the default", as __post_init__

    temperature = value("temperature", 1.0)
    top_p = value("top_p", 1.0)
    top_k = value("top_k", -1)
    min_p = value("min_p", 0.0)
    min_new = value("min_new_tokens", 0)
    max_new = p.get("max_new_tokens", 128)
    if 0 <= temperature < _SAMPLING_EPS:  # greedy: __post_init__ turns it into top_k = 1
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    # normalize()
    stop = p.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_COUNT:
            raise ValueError(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stops)}")
    stop_regex = p.get("stop_regex")
    if stop_regex is not None:
        patterns = [stop_regex] if isinstance(stop_regex, str) else stop_regex
        if len(patterns) > MAX_STOP_REGEX_COUNT:
            raise ValueError(f"at most {MAX_STOP_REGEX_COUNT} stop_regex patterns are allowed, got {len(patterns)}")
        for pattern in patterns:
            size = len(pattern.encode("utf-8"))
            if size > MAX_STOP_REGEX_LEN:
                raise ValueError(f"stop_regex is {size} bytes, over the {MAX_STOP_REGEX_LEN}-byte limit")
    # verify()
    beam_width = p.get("beam_width")
    if beam_width is not None and beam_width < 1:
        raise ValueError(f"beam_width must be at least 1, got {beam_width}.")
    if not math.isfinite(temperature) or temperature < 0.0:
        raise ValueError(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < 1 or top_k == -1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        penalty = value(name, 0.0)
        if not -2.0 <= penalty <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {penalty}.")
    repetition_penalty = value("repetition_penalty", 1.0)
    if not 0.0 < repetition_penalty <= 2.0:
        raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition_penalty}.")
    if min_new < 0:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    if max_new is not None:
        if max_new < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {max_new}.")
        if not min_new <= max_new:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    for token_id in p.get("logit_bias") or {}:
        if not 0 <= int(token_id) < vocab_size:
            raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
    seed = p.get("sampling_seed")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        raise ValueError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    # Empty grammar strings mean "unset" (__post_init__).
    if sum(bool(p.get(k)) for k in ("json_schema", "regex", "ebnf", "structural_tag")) > 1:
        raise ValueError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
