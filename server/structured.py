"""Structured outputs: a request's constraint (OpenAI's `response_format`, vLLM's `guided_*` fields and
`structured_outputs` object) as a GrammarSpec, and its compilation for the request (400 on a bad one).

At most one constraint per request: two would be two grammars for one output.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from engine.grammar import CompiledGrammar, GrammarCompiler, GrammarError, GrammarSpec
from server.errors import invalid
from server.protocol import SamplingFields

# vLLM's structured_outputs keys (vllm.sampling_params.StructuredOutputsParams) that pick a grammar.
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def output_constraint(body: SamplingFields) -> tuple[GrammarSpec, str] | None:
    """The request's constraint and the field it came from, or None. Raises APIError (400)."""
    found: list[tuple[GrammarSpec, str]] = []
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    guided = {
        "guided_json": body.guided_json,
        "guided_regex": body.guided_regex,
        "guided_choice": body.guided_choice,
        "guided_grammar": body.guided_grammar,
    }
    for param, value in guided.items():
        if value is not None:
            found.append((_spec(param.removeprefix("guided_"), value, param, True), param))
    if body.structured_outputs is not None:
        so = body.structured_outputs
        whitespace = not bool(so.get("disable_any_whitespace"))
        kinds = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
        if len(kinds) > 1:
            raise invalid(
                f"structured_outputs takes one of {', '.join(_SO_KINDS)}; got {', '.join(kinds)}.",
                param="structured_outputs",
            )
        if kinds:
            param = f"structured_outputs.{kinds[0]}"
            closed = bool(so.get("disable_additional_properties"))
            found.append((_spec(kinds[0], so[kinds[0]], param, whitespace, closed), param))
    if len(found) > 1:
        raise invalid(
            "Only one output constraint may be given; got " + ", ".join(p for _, p in found) + ".",
            param=found[1][1],
        )
    return found[0] if found else None


def _response_format(fmt: Any) -> GrammarSpec | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object")
    js = fmt.json_schema
    if not isinstance(js, dict):
        raise invalid(
            "response_format of type json_schema needs a json_schema object.", param="response_format"
        )
    schema = js.get("schema", {"type": "object"})  # OpenAI: the schema is optional
    if not isinstance(schema, (dict, bool)):
        raise invalid("response_format.json_schema.schema must be a JSON schema object.", "response_format")
    if js.get("strict") and isinstance(schema, dict):
        schema = closed_objects(schema)
    return GrammarSpec.json_schema(schema)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say otherwise.
    OpenAI's strict mode means exactly this (it rejects open objects; pydantic's schemas leave the key
    out, and without it a model may add properties until max_tokens); vLLM calls it
    disable_additional_properties."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if ("properties" in out or out.get("type") == "object") and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(v) for v in out[key]]
    return out


def _spec(kind: str, value: Any, param: str, any_whitespace: bool, closed: bool = False) -> GrammarSpec:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise invalid(f"{param} is not valid JSON: {exc}", param=param) from None
        if not isinstance(value, (dict, bool)):
            raise invalid(f"{param} must be a JSON schema object.", param=param)
        if closed:
            value = closed_objects(value)
        return GrammarSpec.json_schema(value, any_whitespace)
    if kind == "json_object":
        return GrammarSpec("json_object", any_whitespace=any_whitespace)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise invalid(f"{param} must be a list of non-empty strings.", param=param)
        return GrammarSpec.choice(value)
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise invalid(f"{param} must be a non-empty string.", param=param)
        return GrammarSpec(kind, value)  # type: ignore[arg-type]
    raise invalid(f"{param} is not supported by this server.", param=param)


async def compile_constraint(compiler: GrammarCompiler, spec: GrammarSpec, param: str) -> CompiledGrammar:
    """The compiled grammar (cached: instant; otherwise compiled in a worker thread). 400 if it fails."""
    try:
        hit = compiler.cached(spec)
        return hit if hit is not None else await asyncio.to_thread(compiler.compile, spec)
    except GrammarError as exc:
        raise invalid(f"Invalid {param}: {exc}", param=param, code="invalid_grammar") from None
