"""Structured output: a request's JSON schema, regex, choice list or grammar, enforced token by token.

The grammar engine is llguidance (Rust, no dependencies, no torch: the router validates specs with
it too). Picked over xgrammar by measurement (`python -m baton.benchmarks.grammar_engines`,
docs/benchmarks.md "Structured output"): on SmolLM2's tokenizer a JSON schema compiles in 0.4-0.7 ms
against xgrammar's 3-10 ms (a request's TTFT pays it); a mask costs ~30 µs (xgrammar ~4 µs: it
precomputes at compile time), a batch of 64 masks 0.6 ms (xgrammar 0.2 ms), both hidden behind a
decode step's forward; xgrammar also needs torch, triton and a TVM runtime.

Each constrained sequence holds a `GrammarState` (an llguidance matcher and how far it has read
the sequence). Before a step samples, `StructuredOutputs.masks_async` (the engine's steps;
`bitmask`, the same at once) brings every matcher up to the tokens before the step's own --
whatever came before: the first token from the prefill worker, the output a migrated request
replays as `prior_output_tokens` of its prompt, the token the step still in flight sampled -- and
fills one bitmask row per sampling row (all ones for unconstrained rows). The sampling kernel reads
it in its one pass (triton_kernels/sampling.py; elsewhere engine/runner/logits_processing.apply_token_bitmask
masks the logits first). eos is allowed exactly where the grammar may end.
"""
from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, TimeoutError
from dataclasses import dataclass

import numpy as np

from baton.engine.requests.tokenizer import CoreTokenizer

log = logging.getLogger("baton.engine")

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 200_000
MAX_CHOICES = 1024
FILL_TIMEOUT = 120.0    # seconds a step's masks may take (llguidance bounds each mask's work; this bounds the wait)
TEMPLATES = 64          # compiled grammars kept per engine, most recently used: a spec seen again skips compiling
# one line of JSON with the separators models were trained on; flexible whitespace lets a small
# model run on newlines until max_tokens (vLLM added `disable_any_whitespace` for that)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the output must match. `kind` is one of KINDS; `spec` the JSON schema (JSON text), the
    regex or the grammar (Lark or GBNF, llguidance's syntax); `choices` the strings of `choice`.
    `strict` (json_schema, as OpenAI's): schema keywords the engine cannot enforce are refused, not
    ignored (the keywords it knows are enforced either way)."""
    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    strict: bool = False

    @classmethod
    def json(cls, schema: dict | str, strict: bool = False) -> StructuredOutput:
        """From a JSON schema (a dict, or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema), strict=strict)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices) -> StructuredOutput:
        return cls("choice", choices=tuple(choices))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        return cls("grammar", text)

    def validate(self) -> None:
        """ValueError saying what is wrong with the spec (the schema, regex or grammar included)."""
        compiled(self)


def compiled(spec: StructuredOutput) -> str:
    """The spec as an llguidance grammar, checked; ValueError naming the kind and the fault."""
    import llguidance

    where = f"structured output ({spec.kind})"
    if spec.kind not in KINDS:
        raise ValueError(f"{where}: unknown kind; use one of {', '.join(KINDS)}")
    if len(spec.spec) > MAX_SPEC_CHARS or sum(map(len, spec.choices)) > MAX_SPEC_CHARS:
        raise ValueError(f"{where}: the spec is over {MAX_SPEC_CHARS} characters")
    try:
        grammar = _grammar(spec, llguidance.LLMatcher)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{where}: {error.strip()[:500]}")
    return grammar


def _grammar(spec: StructuredOutput, matcher) -> str:
    if spec.kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "json_schema":
        schema = json.loads(spec.spec)            # (a JSONDecodeError is a ValueError)
        if not isinstance(schema, (dict, bool)):
            raise ValueError("the JSON schema must be an object")
        return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS,
                                                overrides=None if spec.strict else {"lenient": True})
    if spec.kind == "regex":
        if not spec.spec:
            raise ValueError("the regex is empty")
        return matcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        if not spec.choices or len(spec.choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in spec.choices):
            raise ValueError(f"choice takes 1..{MAX_CHOICES} non-empty strings")
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choices))
    if not spec.spec.strip():
        raise ValueError("the grammar is empty")
    from llguidance import grammar_from
    return grammar_from("grammar", spec.spec)      # Lark, or GBNF converted to Lark


class GrammarState:
    """One sequence's matcher: it has read the sequence's tokens [start, start + consumed)."""
    __slots__ = ("matcher", "start", "consumed", "failed")

    def __init__(self, matcher, start: int):
        self.matcher = matcher
        self.start = start              # the first output token (a resumed request's earlier output included)
        self.consumed = 0
        self.failed = False

    def read(self, new: list[int], request_id: str) -> None:
        """Read the sequence's next tokens (those after the ones it has read; usually one)."""
        if not new or self.failed:
            return
        self.consumed += len(new)
        if not (self.matcher.consume_token(new[0]) if len(new) == 1 else self.matcher.consume_tokens(new)):
            self.fail(request_id)

    def fail(self, request_id: str) -> None:
        """Its output left the grammar: only a bug (or a resumed output that never obeyed) gets here;
        the mask then allows eos alone, so the request ends rather than run unconstrained."""
        self.failed = True
        log.warning("request %s: its output left the grammar: %s", request_id, self.matcher.get_error().split("\n")[0])


def ll_tokenizer(tokenizer, n_vocab: int, eos: list[int] | None):
    """llguidance's view of a vocabulary. An engine core's CoreTokenizer (engine/requests/tokenizer.py)
    is handed over as llguidance.hf.from_tokenizer hands an HF fast tokenizer, its Rust tokenizer
    serialized, without that module's import of transformers."""
    import llguidance

    if not isinstance(tokenizer, CoreTokenizer):
        import llguidance.hf
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab,
                                  eos_token=tokenizer.eos_token_id if eos is None else eos)


class StructuredOutputs:
    """The engine's grammar side: matchers for new requests, bitmasks for each step's sampling rows."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.words = (vocab_size + 31) // 32
        self._tokenizer = None          # llguidance's view of the vocabulary (~0.3 s to build: on first use)
        self._executor = None
        self._filler: ThreadPoolExecutor | None = None     # masks_async's one thread
        # spec -> its compiled grammar, checked once; each request gets a matcher of its own. (Copies
        # of one matcher share its lexer, so a batch's masks, filled in parallel, would take turns
        # on it: measured on an H100 host, 64 rows took 2.5 ms on 12 threads that way, 0.76 ms with
        # a matcher each; docs/benchmarks.md)
        self._templates: OrderedDict[StructuredOutput, str] = OrderedDict()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            # the model's eos ids that the tokenizer has (a preset borrowing another model's tokenizer
            # may name none: then the tokenizer's own eos ends a match)
            eos = [t for t in self.eos_token_ids if t < len(self.hf_tokenizer)]
            self._tokenizer = ll_tokenizer(self.hf_tokenizer, self.vocab_size, eos or None)
        return self._tokenizer

    def state(self, spec: StructuredOutput, first_output: int) -> GrammarState:
        """A fresh matcher for a request whose output starts at token `first_output`; ValueError for a bad spec."""
        import llguidance

        grammar = self._templates.pop(spec, None) or compiled(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output ({spec.kind}): {matcher.get_error().strip()[:500]}")
        self._templates[spec] = grammar
        while len(self._templates) > TEMPLATES:
            self._templates.popitem(last=False)
        return GrammarState(matcher, first_output)

    def bitmask(self, seqs: list) -> np.ndarray | None:
        """[N, ceil(vocab / 32)] int32, bit t of row i: token t allowed for sampling row i (sequence
        seqs[i]), each matcher first caught up to its sequence's known tokens; None when no row is
        constrained. Rows of finished sequences (a row in flight after its request ended) and
        unconstrained ones allow everything. (The engine's steps use masks_async.)"""
        live = [(i, s) for i, s in enumerate(seqs) if s.grammar is not None and not s.is_finished]
        if not live:
            return None
        mask = np.empty((len(seqs), self.words), np.int32)
        work, eos_only = [], []
        for i, s in live:
            g = s.grammar
            g.read(s.token_ids[g.start + g.consumed:s.num_known_tokens], s.request_id)
            if g.failed:
                eos_only.append(i)
            else:
                work.append((g.matcher, i))
        self._other_rows(mask, [i for i, _ in live], eos_only)
        if work:
            self.fill(mask, work)
        return mask

    def masks_async(self, launched, prev, buffer: Callable) -> Callable:
        """The masks of step `launched` (its forward queued, its sampling deferred: engine/runner/model_runner.py),
        from every token before its own. Called right after the launch: it waits for the tokens of
        `prev` (the step before, still in flight: its sampling is queued before this step's forward, so
        they come first), catches the matchers up, and fills the masks into `buffer(rows, words)` (a host
        tensor, pinned where the device has pinned memory) on a thread of its own: llguidance drops the
        GIL while it fills, so the engine thread meanwhile resolves `prev` and schedules and builds the
        next step. Returns what waits for the fill and gives that tensor (None: nothing constrained);
        nothing may touch these matchers until it has returned.

        Everything before the fill holds the GIL on the engine thread, whose time bounds a step at
        this batch size (docs/benchmarks.md "Structured output"): one pass over the rows, each matcher
        reading its one new token in place (the token `prev` sampled, once its values are back)."""
        scheduled, slots = launched.out.scheduled, launched.slots
        where = known = None
        masked, work, eos_only = [], [], []
        for i, item in enumerate(launched.rows):
            seq = scheduled[item].seq
            g = seq.grammar
            if g is None or seq.is_finished:
                continue
            begin, end = g.start + g.consumed, slots[item]
            if seq.num_pending_tokens > 1:         # the last one sampled by `prev`, its value on its way
                if where is None:
                    where = prev.row_of() if prev is not None else {}
                row = where.get(seq.seq_id)
                if row is None or seq.num_pending_tokens > 2 or end <= begin:
                    raise RuntimeError(f"request {seq.request_id}: a pending token no step in flight samples")
                if known is None:
                    known = prev.row_tokens()
                new = seq.token_ids[begin:end - 1]
                new.append(known[row])
            else:
                new = seq.token_ids[begin:end]
            g.read(new, seq.request_id)
            masked.append(i)
            if g.failed:
                eos_only.append(i)
            else:
                work.append((g.matcher, i))
        if not masked:
            return lambda: None
        host = buffer(len(launched.rows), self.words)
        mask = host.numpy()
        self._other_rows(mask, masked, eos_only)
        if not work:
            return lambda: host
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="baton-grammar")
        started = threading.Event()

        def fill():
            started.set()
            self.fill(mask, work)
        future = self._filler.submit(fill)
        started.wait(1.0)          # let it into llguidance (which drops the GIL) before going on

        def wait():
            try:
                future.result(timeout=FILL_TIMEOUT)
            except TimeoutError:
                raise RuntimeError(f"structured output: a step's masks took over {FILL_TIMEOUT} s") from None
            return host
        return wait

    def _other_rows(self, mask: np.ndarray, masked: list[int], eos_only: list[int]) -> None:
        """The rows no matcher fills: every token allowed where a row is unconstrained, eos alone where
        its output left the grammar."""
        if len(masked) < len(mask):
            free = np.ones(len(mask), np.bool_)
            free[masked] = False
            mask[free] = -1
        for i in eos_only:
            words = mask[i].view(np.uint32)
            words[:] = 0
            for t in self.eos_token_ids:
                words[t // 32] |= np.uint32(1 << (t % 32))

    @property
    def executor(self):
        """llguidance's thread pool (masks, and reads in parallel)."""
        if self._executor is None:
            self.use_threads(None)
        return self._executor

    def use_threads(self, threads: int | None) -> None:
        """Fill masks on `threads` of llguidance's threads (None: its own default, 80 % of the cores)."""
        import llguidance
        self._executor = llguidance.LLExecutor(threads) if threads else llguidance.LLExecutor()

    def fill(self, mask: np.ndarray, work: list) -> None:
        """The allowed tokens of each (matcher, row) into its row of `mask`, across llguidance's threads."""
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask_par(self.executor, work, mask)
