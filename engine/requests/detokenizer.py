"""Incremental detokenization that only ever emits whole UTF-8 characters.

A multi-byte character split across tokens decodes to U+FFFD until its last byte arrives;
we hold such tails back. A few prompt tokens are kept as context so tokenizers that drop
a word's leading space when decoding it alone still produce the right spacing.

Fast (Rust) tokenizers go through `tokenizers.decoders.DecodeStream`, which does this in
Rust: ~1.2 µs a token against ~8.4 µs for two Python-side decodes a token (smollm2's
tokenizer, this machine; docs/benchmarks.md). Others take the two-decode path.
"""
from __future__ import annotations

CONTEXT_TOKENS = 5


def make_detokenizer(tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
    """The detokenizer for `tokenizer`: streaming in Rust where it can be, else in Python."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and _decode_stream is not None:
        return StreamDetokenizer(tokenizer, backend, prompt_token_ids, skip_special_tokens)
    return PythonDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)


try:
    from tokenizers.decoders import DecodeStream as _decode_stream
except ImportError:          # tokenizers < 0.21
    _decode_stream = None


class StreamDetokenizer:
    """`text` grows by whole characters; `flush` adds an incomplete tail at the end."""

    def __init__(self, tokenizer, backend, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer, self.backend = tokenizer, backend
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.stream = _decode_stream(ids=context, skip_special_tokens=skip_special_tokens)
        self.recent = context            # the last ids that produced text (context for `flush`)
        self.pending: list[int] = []     # ids whose text is not complete yet
        self.text = ""

    def add(self, token_id: int) -> str:
        delta = self.stream.step(self.backend, token_id)
        if not delta:
            self.pending.append(token_id)
            return ""
        self.recent = (self.recent + self.pending + [token_id])[-CONTEXT_TOKENS:]
        self.pending = []
        self.text += delta
        return delta

    def flush(self) -> str:
        if not self.pending:
            return ""
        kw = dict(skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False)
        before = self.tokenizer.decode(self.recent, **kw)
        full = self.tokenizer.decode(self.recent + self.pending, **kw)
        self.pending = []
        delta = full[len(before):] if full.startswith(before) else ""
        self.text += delta
        return delta


class PythonDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Feed one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of a sequence: whatever is left, even an incomplete character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)
