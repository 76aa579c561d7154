"""Request checks with SGLang's error texts: the strict /generate contract, then sampling value checks.

The contract half mirrors `sglang/api/v1/api_types.py` (generated from SGLang's proto schema; the Python server's
`generate_contract_error` runs it on every /generate body): null means "absent" for every field, unknown
`sampling_params` keys are refused, unknown top-level keys ignored. tests/conformance/test_http_contract.py
runs the same bodies through the real decoder and this one and requires the same answer.
"""

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
    """The body breaks the JSON contract (answered 400 with a plain-string `error`, like SGLang's contract check)."""


def describe(value: Any) -> str:
    """A JSON value as the contract's `_unexpected` names it in `invalid type: ...` messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "sequence"
    if isinstance(value, dict):
        return "map"
    return type(value).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _invalid(value: Any, expected: str) -> ContractError:
    return ContractError(f"invalid type: {describe(value)}, expected {expected}")


def _expect(ok: Callable[[Any], bool], expected: str) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if not ok(v):
            raise _invalid(v, expected)

    return check


def _seq_of(item: Callable[[Any], None]) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if not isinstance(v, list):
            raise _invalid(v, "a sequence")
        for e in v:
            item(e)

    return check


def _one_or_list(item: Callable[[Any], None], name: str, expected_item: str) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if isinstance(v, list):
            _seq_of(item)(v)
        else:
            _expect(lambda x: _scalar_ok(x, expected_item), f"a value or an array of values for {name}")(v)

    return check


def _scalar_ok(v: Any, kind: str) -> bool:
    return {"str": isinstance(v, str), "bool": isinstance(v, bool), "int": _is_int(v)}[kind]


_I64 = _expect(_is_int, "i64")
_F64 = _expect(_is_num, "f64")
_BOOL = _expect(lambda v: isinstance(v, bool), "a boolean")
_STR = _expect(lambda v: isinstance(v, str), "a string")
_STRING_OR_LIST = _one_or_list(_STR, "StringOrList", "str")
_I64_LIST = _seq_of(_I64)


def _logit_bias(v: Any) -> None:
    if not isinstance(v, dict):
        raise _invalid(v, "a map")
    for e in v.values():
        _F64(e)


def _watermark(v: Any) -> None:
    if not isinstance(v, dict):
        raise _invalid(v, "struct WatermarkRequestConfig")
    fields = {"enabled": _BOOL, "key": _STR, "context_window": _I64}
    for key, x in v.items():
        if key not in fields:
            raise _unknown_field(key, tuple(fields))
        if x is not None:
            fields[key](x)


def _choice(v: Any) -> None:
    _seq_of(_STR)(v)


def _anything(v: Any) -> None:
    return None


# decode_SamplingParams, field by field in declaration order (the order of the "expected one of" list).
SAMPLING_FIELDS: dict[str, Callable[[Any], None]] = {
    "max_new_tokens": _I64,
    "stop": _STRING_OR_LIST,
    "stop_token_ids": _I64_LIST,
    "stop_regex": _STRING_OR_LIST,
    "temperature": _F64,
    "top_p": _F64,
    "top_k": _I64,
    "min_p": _F64,
    "frequency_penalty": _F64,
    "presence_penalty": _F64,
    "repetition_penalty": _F64,
    "min_new_tokens": _I64,
    "n": _I64,
    "json_schema": _STR,
    "regex": _STR,
    "ebnf": _STR,
    "structural_tag": _STR,
    "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL,
    "spaces_between_special_tokens": _BOOL,
    "no_stop_trim": _BOOL,
    "stream_interval": _I64,
    "logit_bias": _logit_bias,
    "sampling_seed": _I64,
    "custom_params": _anything,
    "beam_width": _I64,
    "watermark": _watermark,
    "choice": _choice,
}


def _unknown_field(key: str, fields: tuple[str, ...]) -> ContractError:
    if not fields:
        return ContractError(f"unknown field `{key}`, there are no fields")
    if len(fields) == 1:
        return ContractError(f"unknown field `{key}`, expected `{fields[0]}`")
    if len(fields) == 2:
        return ContractError(f"unknown field `{key}`, expected `{fields[0]}` or `{fields[1]}`")
    listed = ", ".join(f"`{f}`" for f in fields)
    return ContractError(f"unknown field `{key}`, expected one of {listed}")


def _token_ids_or_list(v: Any) -> None:
    if not isinstance(v, list):
        raise _invalid(v, "a value or an array of values for TokenIdsOrList")
    if not v or _is_num(v[0]):  # [] and [scalar, ...] are one flat list; anything else is a batch
        _I64_LIST(v)
    else:
        _seq_of(_I64_LIST)(v)


# The top-level fields the stand-in reads (decode_GenerateRequest checks these the same way).
_TOP_LEVEL: dict[str, Callable[[Any], None]] = {
    "rid": _STRING_OR_LIST,
    "text": _STRING_OR_LIST,
    "input_ids": _token_ids_or_list,
    "stream": _BOOL,
    "return_logprob": _one_or_list(_BOOL, "BoolOrList", "bool"),
    "require_reasoning": _BOOL,
}


def check_sampling_params(params: Any) -> dict[str, Any]:
    """Reject unknown keys and wrong JSON types exactly as the contract does; returns the dict."""
    if not isinstance(params, dict):
        raise _invalid(params, "struct SamplingParams")
    for key, value in params.items():
        if key not in SAMPLING_FIELDS:
            raise _unknown_field(key, tuple(SAMPLING_FIELDS))
        if value is not None:
            SAMPLING_FIELDS[key](value)
    return params


def check_generate_body(body: Any) -> dict[str, Any]:
    """Top-level /generate contract: a JSON object; fields checked in the body's own key order, as the decoder."""
    if not isinstance(body, dict):
        raise _invalid(body, "struct GenerateRequest")
    for key, value in body.items():
        if value is None:
            continue
        if key == "sampling_params":
            if isinstance(value, list):
                for item in value:
                    check_sampling_params(item)
            elif isinstance(value, dict):
                check_sampling_params(value)
            else:
                raise _invalid(value, "a value or an array of values for SamplingParamsOrList")
        elif key in _TOP_LEVEL:
            _TOP_LEVEL[key](value)
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
