"""The run form's schema: optional fields as plain inputs, thresholds as JSON boxes, all still checked by Prefect."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import validate

from datagen.runspec import RunSpec
from flows.expand_dataset import expand_dataset
from flows.multi_box import generate_on_box
from flows.pilot import pilot_flow


def _schema(fn: Any) -> dict[str, Any]:
    schema: dict[str, Any] = parameter_schema(fn).model_dump_for_openapi()
    return schema


def _errors(parameters: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    # What the server runs on every new flow run of a deployment (its default preprocessing included).
    return [f"{e.json_path}: {e.message}" for e in validate(parameters, schema)]


def test_optional_fields_have_no_null_branch_for_the_form_to_draw() -> None:
    # Issue 25.5: `X | None` was anyOf [X, null], drawn as tabs, one reading 'Property is type "None"'.
    for fn in (expand_dataset.fn, pilot_flow.fn):
        definitions = _schema(fn)["definitions"]
        assert '"null"' not in json.dumps(definitions), fn
    definitions = _schema(expand_dataset.fn)["definitions"]
    assert definitions["RunSpec"]["properties"]["max_prompt_tokens"] == {
        "type": "integer",
        "minimum": 1,
        "title": "Advanced: Max Prompt Tokens",
        "description": "Reject prompts longer than this; default: context length minus max_new_tokens.",
    }
    assert definitions["PromptSource"]["properties"]["tools"]["type"] == "array"


@pytest.mark.parametrize("fn", [expand_dataset.fn, generate_on_box.fn])
def test_the_server_takes_a_value_or_null_and_refuses_a_wrong_type(fn: Any) -> None:
    schema = _schema(fn)
    # A spec dumped whole (the multi-box parent's children) spells out every None.
    whole = RunSpec().model_dump(mode="json")
    assert whole["pilot"] is None and whole["sources"][0]["max_rows"] is None
    assert _errors({"spec": whole}, schema) == []
    assert (
        _errors({"spec": {"pilot": "p1", "max_prompt_tokens": 100, "sources": [{"path": "x", "max_rows": 2}]}}, schema)
        == []
    )
    assert _errors({"spec": {"max_prompt_tokens": 0}}, schema) == [
        "$.spec.max_prompt_tokens: 0 is less than the minimum of 1"
    ]
    assert _errors({"spec": {"pilot": "../x"}}, schema), "the pattern still applies"


def test_thresholds_are_json_boxes_whose_keys_and_values_are_still_checked() -> None:
    schema = _schema(expand_dataset.fn)
    validation = schema["definitions"]["RunSpec"]["properties"]["validation"]
    assert validation["type"] == "object" and "properties" not in validation  # the form draws a JSON editor
    assert (
        _errors({"spec": {"quality_gate": {"max_reject_rate": 0.5}, "validation": {"min_loop_copies": 3}}}, schema)
        == []
    )
    (bad_value,) = _errors({"spec": {"quality_gate": {"max_reject_rate": 1.5}}}, schema)
    assert bad_value.startswith("$.spec.quality_gate.max_reject_rate: 1.5 is greater than the maximum"), bad_value
    (bad_key,) = _errors({"spec": {"validation": {"min_answer_token": 3}}}, schema)
    assert "'min_answer_token' does not match any of the regexes" in bad_key, bad_key
    # The model itself is unchanged: a run spec still reads and fills the nested objects.
    spec = RunSpec.model_validate({"validation": {"min_loop_copies": 3}})
    assert spec.validation.min_loop_copies == 3 and spec.validation.min_answer_tokens == 8
