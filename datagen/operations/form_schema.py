"""How the Prefect run form shows a run spec: optional fields as plain inputs, rarely changed groups as a JSON box.

Prefect 3.9's V2 run form is drawn from the deployment's parameter schema (pydantic's JSON schema of the flow's
parameters), and the server checks every run's parameters against the same schema. Two shapes of that schema
draw badly, and each has a form that draws well and checks the same:

- `X | None = None` is `anyOf: [X, {type: null}]`: the form draws tabs, one of them the text
  `Property is type "None"`. `optional_fields_as_plain_inputs` leaves `X` alone, without a `default`: the form
  draws one input (empty: the key is left out, and the model's default None applies), and Prefect's server
  still accepts an explicit null for it (it adds the null branch back to every non-required property with a
  type and no default before checking: `prefect.utilities.schema_tools.validation._fix_null_typing`), so a
  spec dumped with its Nones (the multi-box parent's children, a lineage's run_spec) passes as before.
- A nested model is drawn field by field, each with its title and description. `json_box` gives a model the
  schema of an object without `properties`, which the form draws as one JSON editor holding the current
  values; its fields stay checked by the server (`patternProperties`, one exact name each, and no other key).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

__all__ = ["json_box", "optional_fields_as_plain_inputs"]


def optional_fields_as_plain_inputs(schema: dict[str, Any]) -> None:
    """Model `json_schema_extra`: each `X | None = None` property becomes X alone (no `default`, no null branch)."""
    for prop in schema.get("properties", {}).values():
        branches = prop.get("anyOf")
        if not branches or "default" not in prop or prop["default"] is not None:
            continue
        kept = [b for b in branches if b.get("type") != "null"]
        # Only a single typed branch: Prefect's server adds the null branch back only where a "type" is.
        if len(kept) != 1 or len(branches) != 2 or "type" not in kept[0]:
            continue
        del prop["anyOf"], prop["default"]
        prop.update(kept[0])


def json_box(model: type[BaseModel]) -> dict[str, Any]:
    """The schema of `model` as one JSON box in the form, every field still checked by Prefect's server."""
    own = model.model_json_schema()
    if "$defs" in own:  # a nested model inside would need its definitions carried along
        raise ValueError(f"{model.__name__}: json_box takes models of plain fields only")
    return {
        "type": "object",
        "patternProperties": {f"^{re.escape(name)}$": field for name, field in own["properties"].items()},
        "additionalProperties": False,
    }
