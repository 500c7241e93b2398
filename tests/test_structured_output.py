"""Structured output (engine/requests/structured_output.py): JSON schema, json_object, regex, choice and grammar
outputs match their spec, token by token, on the embedded model; unconstrained requests keep their
greedy tokens; a bad spec is a ValueError / 400 / INVALID_ARGUMENT naming it. Served through router +
prefill + decode (the session's pd_cluster): the first token, sampled on the prefill worker, obeys the
grammar and the decode worker's matcher resumes after it; the real `openai` client's `parse()` gets a
valid Pydantic instance. A migrated request replays its earlier output into the survivor's matcher
(here through the router's ledger; test_chaos.py kills a decode worker under such streams)."""
from __future__ import annotations

import json
import re

import grpc
import httpx
import jsonschema
import numpy as np
import openai
import pydantic
import pytest

from baton.engine import SamplingParams, StructuredOutput
from baton.engine.requests.structured_output import StructuredOutputs
from baton.v1 import router_pb2, router_pb2_grpc

MODEL = "smollm2-135m-instruct"
# (question, schema): objects, enums, arrays, nesting, numbers with bounds, booleans, patterns,
# optional fields, nullable types, a top-level array
SCHEMAS = [
    ("Describe a person.", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("Pick a color for the sky.", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                                   "required": ["color"], "additionalProperties": False}),
    ("List three fruits.", {"type": "object", "properties": {
        "fruits": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3}},
        "required": ["fruits"], "additionalProperties": False}),
    ("Give a user record.", {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}},
            "required": ["id", "email"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False}),
    ("What is the temperature in Paris?", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "celsius": {"type": "number", "minimum": -50, "maximum": 60},
        "note": {"type": "string", "maxLength": 30}}, "required": ["city", "celsius"], "additionalProperties": False}),
    ("Give an invoice.", {"type": "object", "properties": {
        "invoice": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
        "lines": {"type": "array", "maxItems": 1, "items": {"type": "object", "properties": {
            "qty": {"type": "integer", "minimum": 1, "maximum": 9}, "price": {"type": "number"}},
            "required": ["qty", "price"], "additionalProperties": False}}},
        "required": ["invoice", "lines"], "additionalProperties": False}),
    ("Is water wet?", {"type": "object", "properties": {
        "answer": {"type": "boolean"}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["answer", "confidence"], "additionalProperties": False}),
    ("Give three numbers.", {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3}),
    ("Name a planet.", {"type": "object", "properties": {
        "planet": {"type": ["string", "null"], "maxLength": 20}, "moons": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
        "required": ["planet"], "additionalProperties": False}),
]


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question + " Answer in JSON."}]


def greedy(spec: StructuredOutput | None = None, max_tokens: int = 64) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured=spec)


def test_json_schema_outputs_validate_for_every_schema_and_plain_greedy_tokens_are_unchanged(embedded_llm):
    """The constrained requests run in one batch with an unconstrained one, whose greedy tokens are
    those it gets alone (its row is never masked); every constrained output validates."""
    plain = ask("Describe a person.")
    alone = embedded_llm.chat([plain], greedy(max_tokens=16))[0]
    outs = embedded_llm.chat([plain] + [ask(q) for q, _ in SCHEMAS],
                             [greedy(max_tokens=16)] + [greedy(StructuredOutput.json(s, strict=True), 64)
                                                         for _, s in SCHEMAS])
    assert outs[0].token_ids == alone.token_ids and not alone.text.startswith("{")
    for (question, schema), out in zip(SCHEMAS, outs[1:], strict=True):
        assert out.finish_reason == "stop", (question, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_with_asynchronous_scheduling_the_masks_see_every_token_before_the_step(embedded_llm):
    """Look-ahead (the accelerators' default): step N+1's forward is launched before step N's tokens
    are back; its sampling waits for the masks built from them. Same outputs as stepping in lockstep."""
    questions = [q for q, _ in SCHEMAS[:2]]
    params = [greedy(StructuredOutput.json(s), 24) for _, s in SCHEMAS[:2]] + [greedy(max_tokens=8)]
    convs = [ask(q) for q in questions] + [ask("Hi.")]
    sync = [o.token_ids for o in embedded_llm.chat(convs, params)]
    embedded_llm.engine.look_ahead = True
    try:
        assert [o.token_ids for o in embedded_llm.chat(convs, params)] == sync
    finally:
        embedded_llm.engine.look_ahead = False


def test_json_object_regex_choice_and_grammar_outputs_match(embedded_llm):
    specs = [StructuredOutput.json_object(), StructuredOutput.regex(r"[0-9]{3}-[0-9]{4}"),
             StructuredOutput.choice(["yes", "no", "maybe"]),
             StructuredOutput.grammar('start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]?/')]
    questions = ["What is the capital of France?", "What is your phone number?", "Is the sky blue?",
                 "How many legs has a spider?"]
    outs = embedded_llm.chat([[{"role": "user", "content": q}] for q in questions],
                             [SamplingParams(temperature=0.8, seed=7, max_tokens=48, structured=s) for s in specs])
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert isinstance(json.loads(outs[0].text), dict)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outs[1].text)
    assert outs[2].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"The answer is [1-9][0-9]?\.", outs[3].text)


def test_masks_allow_exactly_the_grammars_next_tokens_and_eos_only_at_its_end(embedded_llm):
    engine = embedded_llm.engine
    tok = embedded_llm.tokenizer
    grammar = StructuredOutputs(tok, engine.vocab_size, engine.eos_token_ids)

    class Seq:                          # what bitmask() reads of a Sequence
        request_id, is_finished = "r", False

        def __init__(self, tokens):
            self.token_ids, self.num_known_tokens = tokens, len(tokens)
            self.grammar = grammar.state(StructuredOutput.choice(["yes", "no"]), 2)

    def allowed(seq) -> set[int]:
        bits = np.unpackbits(grammar.bitmask([seq]).view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits).tolist())

    seq = Seq([5, 6])                   # a two-token prompt
    first = allowed(seq)
    assert first and not first & set(engine.eos_token_ids)
    assert all("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t])) for t in first)
    seq.token_ids += tok.encode("yes", add_special_tokens=False)
    seq.num_known_tokens = len(seq.token_ids)
    assert allowed(seq) == set(engine.eos_token_ids)       # complete: eos alone
    seq.is_finished = True                                  # a row in flight after its request ended
    assert grammar.bitmask([seq]) is None                   # ...is not masked


@pytest.mark.parametrize("spec, fault", [
    (StructuredOutput.json({"type": "objectx"}), "Invalid type"),
    (StructuredOutput.json('{"type": "object"'), "json_schema"),
    (StructuredOutput.json({"type": "string", "format": "hostname-x"}, strict=True), "Unknown format"),
    (StructuredOutput.regex("(("), "unclosed group"),
    (StructuredOutput.choice([]), "choice"),
    (StructuredOutput.grammar("start: missing_rule"), "missing_rule"),
])
def test_a_bad_spec_is_a_value_error_naming_it_and_nothing_is_queued(embedded_llm, spec, fault):
    with pytest.raises(ValueError, match=re.escape(fault)) as err:
        embedded_llm.generate(["Hi"], SamplingParams(max_tokens=4, structured=spec))
    assert f"structured output ({spec.kind})" in str(err.value)
    assert not embedded_llm.engine.has_unfinished


def test_strict_false_ignores_keywords_the_engine_cannot_enforce():
    StructuredOutput.json({"type": "string", "format": "hostname-x"}).validate()


def test_a_migrated_request_replays_its_output_so_far_into_the_grammar(embedded_llm):
    """The router resumes a request elsewhere with prompt + output so far (router/migration.py); the
    survivor's matcher reads that output first, so the JSON goes on where it was cut."""
    from baton.router.migration import Ledger
    question, schema = SCHEMAS[0]
    prompt = embedded_llm.apply_chat_template(ask(question))
    params = greedy(StructuredOutput.json(schema), 32)
    whole = embedded_llm.generate([prompt], params)[0].token_ids
    ledger = Ledger(prompt, params, None, limit=1)
    ledger.tokens = whole[:5]
    resumed_prompt, resumed = ledger.request()
    assert resumed.prior_output_tokens == 5 and resumed.structured == params.structured
    rest = embedded_llm.generate([resumed_prompt], resumed)[0]
    assert rest.token_ids == whole[5:]
    jsonschema.validate(json.loads(embedded_llm.tokenizer.decode(whole[:5] + rest.token_ids,
                                                                 skip_special_tokens=True)), schema)


# -- served: router + prefill + decode ------------------------------------------------------------------
class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def client(pd_cluster):
    return openai.OpenAI(base_url=pd_cluster.http_url, api_key="unused", max_retries=0, timeout=120)


def test_openai_parse_returns_a_valid_pydantic_instance(client):
    r = client.chat.completions.parse(model=MODEL, messages=ask("Describe a person."), response_format=Person,
                                      temperature=0, max_tokens=64)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.name and 0 <= person.age <= 120


def test_the_first_token_from_prefill_obeys_and_decode_resumes_the_grammar(pd_cluster, client, embedded_llm):
    """pd_cluster's prefill worker samples token 1 (with a 16-token budget, after several chunks),
    the decode worker the rest: the served tokens are the offline engine's, constrained from token 1,
    where the unconstrained model starts otherwise."""
    question, schema = SCHEMAS[0]
    offline = embedded_llm.chat([ask(question)], greedy(StructuredOutput.json(schema), 32))[0]
    plain = embedded_llm.chat([ask(question)], greedy(max_tokens=4))[0]
    assert plain.token_ids[0] != offline.token_ids[0]
    r = client.chat.completions.create(model=MODEL, messages=ask(question), temperature=0, max_tokens=32,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].message.content == offline.text and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.parametrize("fields, check", [
    ({"guided_regex": "[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"n": {"type": "integer"}},
                                      "required": ["n"], "additionalProperties": False}}},
     lambda t: isinstance(json.loads(t)["n"], int)),
    ({"guided_grammar": 'start: "a" | "b"'}, lambda t: t in ("a", "b")),
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
])
def test_vllms_fields_are_honoured_on_completions(pd_cluster, fields, check):
    r = httpx.post(pd_cluster.http_url + "/completions", timeout=120, json={
        "model": MODEL, "prompt": "Answer: ", "max_tokens": 40, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    assert check(r.json()["choices"][0]["text"]), r.json()


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_json": '{"type": '}, "guided_json"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_a_bad_spec_is_a_400_naming_the_field(pd_cluster, fields, param):
    r = httpx.post(pd_cluster.http_url + "/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ask("Hi."), "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
    assert "got None" not in r.json()["error"]["message"]        # (what was sent, not what was looked for)


def test_grpc_structured_field_and_invalid_argument(pd_cluster):
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(pd_cluster.router.address))

    def text(structured: router_pb2.StructuredOutput) -> str:
        req = router_pb2.GenerateRequest(text="Colour: ", sampling=router_pb2.SamplingParams(
            temperature=0, max_tokens=8, structured=structured))
        return "".join(r.text for r in stub.Generate(req, timeout=60))
    assert text(router_pb2.StructuredOutput(choice=router_pb2.Choices(choices=["cyan", "magenta"]))) in ("cyan", "magenta")
    for bad in (router_pb2.StructuredOutput(regex="(("), router_pb2.StructuredOutput()):
        with pytest.raises(grpc.RpcError) as err:
            text(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured" in err.value.details()
