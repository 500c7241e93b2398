"""Turning a public GenerateRequest into prompt token ids and engine SamplingParams.

Every field is checked here; a bad one is a ValueError (INVALID_ARGUMENT) that says what
to fix. Nothing reaches a worker unless it passes.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence

from baton.engine.requests.sampling_params import SamplingParams
from baton.engine.requests.tokenizer import encode_text, render_chat
from baton.models.multimodal import split_content_parts
from baton.router import generic_tools, tool_calls
from baton.router.images import ChatImage, ImagePolicy
from baton.serving.wire import sampling_from_proto
from baton.v1 import router_pb2

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
MAX_TEXT_CHARS = 1_000_000


def check_request_id(rid: str) -> None:
    if rid and not REQUEST_ID.match(rid):
        raise ValueError("request_id must be 1-128 characters of letters, digits and . _ : -")


def prompt_ids(req: router_pb2.GenerateRequest, tokenizer, vocab_size: int, images: Sequence[ChatImage] = (),
               policy: ImagePolicy | None = None, own_templates: bool = False) -> list[int]:
    """The prompt's token ids; with `policy` (the router's images rules), each image placeholder of
    the rendered chat expanded to the token count of its image in `images` (ImagePolicy.collect).
    `own_templates`: a chat may bring its own template (--trust-request-chat-template)."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise ValueError("no input: set one of text, tokens or chat")
    if kind == "text":
        if len(req.text) > MAX_TEXT_CHARS:
            raise ValueError(f"prompt text is {len(req.text)} characters; the limit is {MAX_TEXT_CHARS}")
        ids = encode_text(tokenizer, req.text)
    elif kind == "tokens":
        ids = list(req.tokens.ids)
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    else:
        ids = chat_ids(req.chat, tokenizer, own_templates)
    if not ids:
        raise ValueError("prompt is empty: give at least one token")
    return policy.expand(ids, list(images)) if policy is not None else ids


def chat_ids(chat: router_pb2.Chat, tokenizer, own_templates: bool = False) -> list[int]:
    """A chat through its template, with its tools and template variables; when a tool call is
    forced, the assistant's turn opens with the call (tool_calls.forced_call)."""
    tool_calls.check(chat)
    if chat.template and not own_templates:
        raise ValueError("chat_template: this router does not take a request's own chat template (start it with "
                         "--trust-request-chat-template to allow it); leave it unset for the model's, or the "
                         "router's --chat-template")
    # a template without tools gets them in the generic form (generic_tools.py)
    messages, tools = generic_tools.prompt_inputs(chat, chat_messages(chat), chat.template or getattr(tokenizer, "chat_template", None))
    ids = render_chat(tokenizer, messages, tools, chat.template or None, template_kwargs(chat))
    forced = tool_calls.forced_call(chat)
    if forced is not None:
        ids += tokenizer.encode(forced.prefix, add_special_tokens=False)
    return ids


def template_kwargs(chat: router_pb2.Chat) -> dict:
    if not chat.template_kwargs:
        return {}
    try:
        kwargs = json.loads(chat.template_kwargs)
    except json.JSONDecodeError as exc:
        raise ValueError(f"chat_template_kwargs is not JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be a JSON object of template variables")
    return kwargs


def chat_messages(chat: router_pb2.Chat) -> list[dict]:
    """The chat as its template renders it. Content parts go the way the offline `LLM.chat` takes
    OpenAI-style parts (split_content_parts): images as {"type": "image"}, text-only parts joined;
    an assistant's earlier tool calls and a tool message's call id as transformers' templates take them."""
    messages: list[dict] = []
    for i, m in enumerate(chat.messages):
        if not m.parts:
            message = {"role": m.role, "content": m.content}
        elif m.content:
            raise ValueError(f"chat.messages[{i}] sets both content and parts: put its text in a text part")
        else:
            message = {"role": m.role, "content": [_part(p, f"chat.messages[{i}].parts[{j}]")
                                                   for j, p in enumerate(m.parts)]}
        if m.tool_calls:
            if m.role != "assistant":
                raise ValueError(f"chat.messages[{i}]: only an assistant's message has tool_calls")
            message["tool_calls"] = tool_calls.history_calls(m)
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return split_content_parts(messages)[0]


def _part(part: router_pb2.ChatContentPart, where: str) -> dict:
    kind = part.WhichOneof("part")
    if kind == "text":
        return {"type": "text", "text": part.text}
    if kind == "image":
        return {"type": "image", "image": part.image.data}
    if kind == "audio":
        return {"type": "audio", "audio": part.audio.data, "format": part.audio.format.lower()}
    raise ValueError(f"{where} is empty: set its text, its image or its audio")


def check_limits(req: router_pb2.GenerateRequest, prompt_len: int, max_prompt_tokens: int,
                 max_new_tokens: int) -> None:
    """The operator's configured limits (0 = none); exceeding one is the client's to fix."""
    if max_prompt_tokens and prompt_len > max_prompt_tokens:
        raise ValueError(f"prompt has {prompt_len} tokens; this server accepts at most {max_prompt_tokens}")
    if max_new_tokens and req.sampling.HasField("max_tokens") and req.sampling.max_tokens > max_new_tokens:
        raise ValueError(f"max_tokens {req.sampling.max_tokens} is over this server's limit of {max_new_tokens}")


def sampling(req: router_pb2.GenerateRequest, prompt_len: int, max_model_len: int,
             vocab_size: int, max_new_tokens: int = 0, defaults: dict | None = None) -> SamplingParams:
    if req.sampling.HasField("max_tokens") and req.sampling.max_tokens == 0:
        raise ValueError("max_tokens must be >= 1 (leave it unset for the default of 256)")
    params = sampling_from_proto(req.sampling, defaults)
    params.validate(vocab_size)
    if params.prior_output_tokens >= prompt_len:
        raise ValueError(f"prior_output_tokens ({params.prior_output_tokens}) must be less than the prompt's "
                         f"{prompt_len} tokens (it counts the prompt's last tokens as earlier output)")
    if max_new_tokens:
        params.max_tokens = min(params.max_tokens, max_new_tokens)
    if prompt_len >= max_model_len:
        raise ValueError(f"prompt has {prompt_len} tokens; the model's context is {max_model_len} "
                         "and must leave room for one new token: shorten the prompt")
    params.max_tokens = min(params.max_tokens, max_model_len - prompt_len)   # capped by the context
    params.min_tokens = min(params.min_tokens, params.max_tokens)            # ...and so is min_tokens
    return params
