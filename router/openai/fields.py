"""Every request field the OpenAI API takes, and what Baton does with it: none is silently ignored.

Each field of OpenAI's completions and chat-completions schemas, and each of vLLM's common extra
fields, is either honoured (HONOURED: router/openai/sampling.py turns it into baton.v1 sampling), taken
as information that changes no output (INFORMATIONAL, as OpenAI's own `user`), or refused with a
400 naming it unless it holds a value that asks for nothing (REFUSED: field -> its no-op values).
A field in none of them is refused as unknown, so a typo never passes for a default.
"""
from __future__ import annotations

from collections.abc import Mapping

COMMON_HONOURED = {
    "model", "stream", "stream_options", "temperature", "top_p", "max_tokens", "stop", "seed", "n",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    # vLLM's extras
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "priority",
    # structured output (router/openai/structured.py)
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    # Baton's own: false opts a request out of speculative decoding (--speculative-method)
    "speculative",
}
HONOURED = {
    "completions": COMMON_HONOURED | {"prompt", "echo"},
    "chat": COMMON_HONOURED | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "chat_template", "chat_template_kwargs"},
    # vLLM's /tokenize and /detokenize
    "tokenize": {"model", "prompt", "messages", "tools", "tool_choice", "chat_template", "chat_template_kwargs",
                 "return_token_strs"},
    "detokenize": {"model", "tokens"},
}

# no effect on any output, on OpenAI's servers either (end-user ids, cache routing hints, and
# metadata kept with a stored completion: Baton stores none, `store: true` is refused)
INFORMATIONAL = {
    "completions": {"user"},
    "chat": {"user", "metadata", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
             "safety_identifier"},
    "tokenize": set(), "detokenize": set(),
}

_NONE = (None,)
_OFF = (None, False)
_EMPTY = (None, [], {}, "")
COMMON_REFUSED: dict[str, tuple] = {
    # vLLM's extras
    "use_beam_search": _OFF, "length_penalty": (None, 1, 1.0), "include_stop_str_in_output": _OFF,
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": _NONE, "allowed_token_ids": _NONE, "bad_words": _EMPTY, "prompt_logprobs": _NONE,
    "guided_decoding_backend": _EMPTY, "guided_whitespace_pattern": _EMPTY, "structural_tag": _EMPTY,
    "request_id": _EMPTY, "logits_processors": _EMPTY,
    "return_tokens_as_token_ids": _OFF, "return_token_ids": _OFF, "cache_salt": _EMPTY,
    "kv_transfer_params": _EMPTY, "vllm_xargs": _EMPTY, "add_special_tokens": (None, True),
    "mm_processor_kwargs": _EMPTY, "min_tokens_per_choice": _NONE, "thinking_token_budget": _NONE,
}
REFUSED: dict[str, dict[str, tuple]] = {
    "completions": COMMON_REFUSED | {
        "best_of": (None, 1), "suffix": (None, ""),
    },
    "chat": COMMON_REFUSED | {
        "parallel_tool_calls": (None, True, False),
        "functions": (None, []), "function_call": (None, "none"),
        "audio": _NONE, "modalities": (None, ["text"]), "prediction": _NONE,
        "reasoning_effort": _NONE, "verbosity": _NONE, "web_search_options": _NONE, "moderation": _NONE,
        "store": _OFF, "service_tier": (None, "auto", "default"),
        # vLLM's chat extras
        "echo": _OFF, "add_generation_prompt": (None, True), "continue_final_message": _OFF,
        "documents": _EMPTY, "tool_parser": _EMPTY, "reasoning_parser": _EMPTY,
    },
    "tokenize": {"add_special_tokens": _NONE, "add_generation_prompt": (None, True), "continue_final_message": _OFF,
                 "mm_processor_kwargs": _EMPTY},
    "detokenize": {},
}

WHY = {
    "tool_parser": "tool_parser is the server's: Baton reads Hermes / Qwen3 <tool_call> blocks whenever tools are given",
    "reasoning_parser": "reasoning_parser is the server's: start it with --reasoning-parser",
    "guided_decoding_backend": "Baton has one grammar engine (llguidance); leave guided_decoding_backend unset",
}


PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "tokenize": "/tokenize",
         "detokenize": "/detokenize"}


def refusal(endpoint: str, body: Mapping) -> tuple[str, str] | None:
    """(field, message) for the first field of `body` that Baton would not honour; None if all are."""
    refused = REFUSED[endpoint]
    for name, value in body.items():
        if name in HONOURED[endpoint] or name in INFORMATIONAL[endpoint]:
            continue
        if name in refused:
            if _is_noop(value, refused[name]):
                continue
            return name, WHY.get(name, f"{name} is not supported by Baton; leave it unset (got {value!r:.60})")
        return name, (f"unknown field {name!r} for {PATHS[endpoint]}; Baton refuses fields it would otherwise ignore")
    return None


def _is_noop(value, noops: tuple) -> bool:
    # bool is an int: True must not pass for 1, nor False for 0; 1.0 may pass for 1
    return any(value == x and (type(value) is type(x) or (type(value) is float and type(x) is int)) for x in noops)
