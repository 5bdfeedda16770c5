"""Request fields -> output constraint (server/structured.py)."""

from __future__ import annotations

import json

from server.protocol import ChatCompletionRequest, CompletionRequest
from server.structured import closed_objects, output_constraint


def test_strict_json_schema_closes_every_object():
    schema = {
        "type": "object",
        "properties": {"type": {"type": "string"}, "inner": {"properties": {"a": {"type": "integer"}}}},
        "$defs": {"D": {"type": "object"}},
        "anyOf": [{"type": "object", "additionalProperties": True}],
    }
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["inner"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["type"], "a property named 'type' is no schema"
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is True, "an explicit choice stays"
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": schema, "strict": True},
            },
        }
    )
    spec, param = output_constraint(body)
    assert param == "response_format" and json.loads(spec.text)["additionalProperties"] is False


def test_vllm_fields_map_to_specs():
    cases = {
        "guided_regex": ({"guided_regex": "a+"}, "regex"),
        "guided_choice": ({"guided_choice": ["a", "b"]}, "choice"),
        "guided_json": ({"guided_json": '{"type": "object"}'}, "json_schema"),
        "guided_grammar": ({"guided_grammar": 'root ::= "x"'}, "grammar"),
        "structured_outputs.json_object": ({"structured_outputs": {"json_object": True}}, "json_object"),
        "structured_outputs.regex": ({"structured_outputs": {"regex": "[0-9]+"}}, "regex"),
    }
    for param, (fields, kind) in cases.items():
        spec, got = output_constraint(CompletionRequest.model_validate({"prompt": "x", **fields}))
        assert (got, spec.kind) == (param, kind)
    so = {"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}}
    spec, _ = output_constraint(CompletionRequest.model_validate({"prompt": "x", **so}))
    assert spec.any_whitespace is False
    assert (
        output_constraint(
            CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "text"}})
        )
        is None
    )
