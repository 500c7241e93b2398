"""OpenAI's and vLLM's structured-output fields -> baton.v1.StructuredOutput.

OpenAI: `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
"schema", "strict"}} (what `client.chat.completions.parse(response_format=Model)` sends). vLLM's
extras: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and `structured_outputs`
{json, regex, choice, grammar, json_object}. At most one field may ask for structure. The spec is
compiled here (llguidance, no torch, well under a millisecond), so a bad schema, regex or grammar
is a 400 naming the field, before anything reaches a worker.
"""
from __future__ import annotations

import json

from baton.engine.requests.structured_output import StructuredOutput
from baton.router.openai.errors import HTTPError
from baton.serving.wire import structured_to_proto
from baton.v1 import router_pb2

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# structured_outputs' keys that ask for structure; its other keys (vLLM's tuning flags) must be unset
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured(body: dict) -> router_pb2.StructuredOutput | None:
    """The request's structured output, checked; None when it asks for none."""
    found: list[tuple[str, StructuredOutput]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    for name, kind in GUIDED.items():
        if body.get(name) not in (None, "", [], {}):
            found.append((name, _spec(kind, body[name], name)))
    if body.get("structured_outputs") not in (None, {}):
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    if not found:
        return None
    if len(found) > 1:
        raise HTTPError(400, f"{found[0][0]} and {found[1][0]} both ask for structured output; send one",
                        param=found[1][0])
    name, spec = found[0]
    try:
        spec.validate()
    except ValueError as exc:
        raise HTTPError(400, f"{name}: {exc}", param=name) from None
    return structured_to_proto(spec)


def _response_format(rf) -> StructuredOutput | None:
    name = "response_format"
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind != "json_schema":
        if not isinstance(rf, dict):
            raise HTTPError(400, f"{name} must be an object {{type: text | json_object | json_schema}}, "
                                 f"got {rf!r:.60}", param=name)
        raise HTTPError(400, f"{name}.type must be text, json_object or json_schema, got {kind!r:.60}", param=name)
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        raise HTTPError(400, f"{name}.json_schema.schema must be a JSON schema object", param=name)
    strict = js.get("strict")
    if strict not in (None, True, False):
        raise HTTPError(400, f"{name}.json_schema.strict must be true or false", param=name)
    return StructuredOutput.json(js["schema"], strict=bool(strict))


def _spec(kind: str, value, name: str) -> StructuredOutput:
    """One vLLM-style spec: json (an object or its JSON text), regex / grammar (text), choice (strings)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise HTTPError(400, f"{name} is not valid JSON: {exc}", param=name) from None
        if not isinstance(value, dict):
            raise HTTPError(400, f"{name} must be a JSON schema object", param=name)
        return StructuredOutput.json(value)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise HTTPError(400, f"{name} must be a list of strings", param=name)
        return StructuredOutput.choice(value)
    if not isinstance(value, str):
        raise HTTPError(400, f"{name} must be a string", param=name)
    return StructuredOutput.regex(value) if kind == "regex" else StructuredOutput.grammar(value)


def _structured_outputs(value) -> StructuredOutput:
    name = "structured_outputs"
    if not isinstance(value, dict):
        raise HTTPError(400, f"{name} must be an object with one of {', '.join(STRUCTURED_KEYS)}", param=name)
    extra = [k for k, v in value.items() if k not in STRUCTURED_KEYS and v not in (None, False, "", [], {})]
    if extra:
        raise HTTPError(400, f"{name}.{extra[0]} is not supported by Baton; leave it unset", param=name)
    asked = [k for k in STRUCTURED_KEYS if value.get(k) not in (None, False, "", [], {})]
    if len(asked) != 1:
        raise HTTPError(400, f"{name} must set exactly one of {', '.join(STRUCTURED_KEYS)}", param=name)
    if asked[0] == "json_object":
        if value["json_object"] is not True:
            raise HTTPError(400, f"{name}.json_object must be true", param=name)
        return StructuredOutput.json_object()
    return _spec(asked[0], value[asked[0]], f"{name}.{asked[0]}")
