"""How structured output's grammar engine was picked: llguidance against xgrammar on the embedded
model's tokenizer (SmolLM2, vocabulary 49152), CPU only.

    pip install xgrammar          # not a Baton dependency; llguidance is
    python -m baton.benchmarks.grammar_engines

For four JSON schemas (flat; enum + array; nested with a pattern and numbers; an invoice of records):
the time to compile each into a matcher, and the time to fill one token mask at each step of a
valid output; then one step's masks for a batch of 64 matchers (llguidance fills them on its thread
pool, xgrammar one after another). Compact JSON on both sides, so the same tokens are valid.
"""
from __future__ import annotations

import json
import statistics
import time

from baton.engine.requests.tokenizer import load_tokenizer
from baton.models.source import resolve_model

VOCAB = 49152
SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}, {"name": "Alice Smith", "age": 42}),
    "enum_array": ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                     "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
                    "required": ["color", "tags"], "additionalProperties": False},
                   {"color": "green", "tags": ["a", "bc", "def"]}),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1},
                                                  "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
                 "required": ["id", "email"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "number"}}, "active": {"type": "boolean"}},
        "required": ["user", "scores", "active"], "additionalProperties": False},
        {"user": {"id": 7, "email": "bob@example.com"}, "scores": [1.5, 2.25, -3], "active": True}),
    "invoice": ({"type": "object", "properties": {
        "invoice": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 100},
            "price": {"type": "number"}}, "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "note": {"type": ["string", "null"]}}, "required": ["invoice", "items"], "additionalProperties": False},
        {"invoice": "INV-123456", "items": [{"sku": "A-1", "qty": 3, "price": 9.99}, {"sku": "B-22", "qty": 1, "price": 100}],
         "note": None}),
}


class Llguidance:
    def __init__(self, tok):
        import llguidance
        import llguidance.hf
        import llguidance.numpy
        self.L, self.np = llguidance, llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
        self.mask = llguidance.numpy.allocate_token_bitmask(64, VOCAB)
        self.executor = llguidance.LLExecutor()

    def matcher(self, schema):
        g = self.L.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        return self.L.LLMatcher(self.tok, g, log_level=0)

    def copies(self, schemas):
        """As Baton's engine does: one compiled matcher per schema, each request a copy of it."""
        templates = {}
        return [(templates.get(id(s)) or templates.setdefault(id(s), self.matcher(s))).deep_copy() for s in schemas]

    def fill(self, m, i=0):
        self.np.fill_next_token_bitmask(m, self.mask, i)

    def fill_batch(self, ms):
        self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], self.mask)

    def accept(self, m, t):
        assert m.consume_token(t), m.get_error()


class Xgrammar:
    def __init__(self, tok):
        import xgrammar
        self.x = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
        self.mask = xgrammar.allocate_token_bitmask(64, VOCAB)

    def matcher(self, schema):
        compiler = self.x.GrammarCompiler(self.info, cache_enabled=False)
        return self.x.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                  separators=(",", ":")))

    def fill(self, m, i=0):
        m.fill_next_token_bitmask(self.mask, i)

    def fill_batch(self, ms):
        for i, m in enumerate(ms):
            m.fill_next_token_bitmask(self.mask, i)

    def accept(self, m, t):
        assert m.accept_token(t)


def measure(engine, tok) -> dict:
    out, per_token = {}, []
    for name, (schema, instance) in SCHEMAS.items():
        t0 = time.perf_counter()
        m = engine.matcher(schema)
        compile_ms = 1e3 * (time.perf_counter() - t0)
        ids = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            engine.fill(m)
            times.append(time.perf_counter() - t0)
            engine.accept(m, t)
        per_token += times
        out[name] = {"compile_ms": round(compile_ms, 2), "tokens": len(ids),
                     "mask_us_mean": round(1e6 * statistics.mean(times), 1)}
    out["mask_us_mean_all"] = round(1e6 * statistics.mean(per_token), 1)
    out["mask_us_median_all"] = round(1e6 * statistics.median(per_token), 1)
    items = list(SCHEMAS.values())
    outputs = [tok.encode(json.dumps(items[i % 4][1], separators=(",", ":")), add_special_tokens=False) for i in range(64)]
    out["batch64_ms_per_step"] = batch(engine, [engine.matcher(items[i % 4][0]) for i in range(64)], outputs)
    if hasattr(engine, "copies"):
        out["batch64_copies_ms_per_step"] = batch(engine, engine.copies([items[i % 4][0] for i in range(64)]), outputs)
    return out


def batch(engine, ms, outputs) -> float:
    """Mean ms to fill a step's masks for the 64 matchers, over the steps of the shortest output."""
    steps = []
    for s in range(min(map(len, outputs))):
        t0 = time.perf_counter()
        engine.fill_batch(ms)
        steps.append(time.perf_counter() - t0)
        for m, ids in zip(ms, outputs, strict=True):
            engine.accept(m, ids[s])
    return round(1e3 * statistics.mean(steps), 3)


def main() -> None:
    tok = load_tokenizer(resolve_model(None))
    for name, cls in (("llguidance", Llguidance), ("xgrammar", Xgrammar)):
        try:
            t0 = time.perf_counter()
            engine = cls(tok)
        except ImportError as exc:
            print(json.dumps({"engine": name, "skipped": str(exc)}))
            continue
        setup_ms = round(1e3 * (time.perf_counter() - t0), 1)
        print(json.dumps({"engine": name, "tokenizer_setup_ms": setup_ms, **measure(engine, tok)}), flush=True)


if __name__ == "__main__":
    main()
