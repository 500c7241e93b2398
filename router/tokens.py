"""Tokenize and Detokenize: a prompt's ids as Generate makes them, and ids back to text (the
Router RPCs, and vLLM's /tokenize and /detokenize on the HTTP port)."""
from __future__ import annotations

from baton.engine.requests.tokenizer import encode_text
from baton.router import validation
from baton.v1 import router_pb2


def tokenize(req: router_pb2.TokenizeRequest, tokenizer, max_model_len: int,
             own_templates: bool = False) -> router_pb2.TokenizeResponse:
    """Text with the special tokens the tokenizer adds; a chat through its template (tools,
    template variables, a forced call's opening: what Generate would send)."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise ValueError("no input: set text or chat")
    if kind == "text":
        ids = encode_text(tokenizer, req.text)
    else:
        ids = validation.chat_ids(req.chat, tokenizer, own_templates)
    return router_pb2.TokenizeResponse(ids=ids, max_model_len=max_model_len,
                                       tokens=tokenizer.convert_ids_to_tokens(ids))


def detokenize(req: router_pb2.DetokenizeRequest, tokenizer, vocab_size: int) -> router_pb2.DetokenizeResponse:
    bad = next((t for t in req.ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return router_pb2.DetokenizeResponse(text=tokenizer.decode(list(req.ids), skip_special_tokens=False))
