"""Loading a model's tokenizer and its end-of-sequence ids."""
from __future__ import annotations

import json
import os
from pathlib import Path

import jinja2

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_tokenizer(source, core: bool = False):
    """`source`: a baton.models.source.ModelSource (its tokenizer_path); `core`: an engine core's,
    which gets prompts as token ids (load_core_tokenizer)."""
    if core:
        return load_core_tokenizer(source.tokenizer_dir())
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(source.tokenizer_dir())


class RustDecoder:
    """A model's Rust tokenizer (its tokenizer.json) alone, for a process that only turns ids
    into text (a worker's front): what the detokenizer needs of an HF tokenizer, without
    transformers and torch (a quarter of a gigabyte of memory). The HF fast tokenizer decodes
    through the same object, so the text is the same."""

    def __init__(self, backend):
        self._tokenizer = backend

    def decode(self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("RustDecoder does not clean up tokenization spaces")
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def load_decoder(tokenizer_dir: str):
    """The lightest tokenizer that decodes like the model's own: its tokenizer.json through the
    `tokenizers` library where there is one, else the full HF tokenizer."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer
        return RustDecoder(Tokenizer.from_file(str(path)))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


# tokenizer classes that are their tokenizer.json and nothing more (what transformers 5 writes
# for a GGUF's tokenizer, as for the embedded model's); other classes rebuild or amend it
PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class CoreTokenizer(RustDecoder):
    """What an engine core needs of a model's tokenizer (its prompts come as token ids): ids to
    text for stop strings, the vocabulary for grammars, the end-of-sequence id; from its
    tokenizer.json alone, without transformers (~1.4 s of CPU a worker start). Anything else asked
    of it (text to ids, a chat template) loads the full HF tokenizer on first use and asks that."""

    def __init__(self, backend, eos_token_id: int | None, tokenizer_dir: str):
        super().__init__(backend)
        self.backend_tokenizer = backend
        self.eos_token_id = eos_token_id
        self.tokenizer_dir = tokenizer_dir
        self._full = None

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, *args, **kwargs):
        return self.full(*args, **kwargs)

    def __getattr__(self, name: str):       # only what the class lacks
        if name.startswith("__") or name in ("_full", "_tokenizer", "tokenizer_dir"):
            raise AttributeError(name)
        return getattr(self.full, name)

    @property
    def full(self):
        if self._full is None:
            from transformers import AutoTokenizer
            self._full = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        return self._full


def load_core_tokenizer(tokenizer_dir: str):
    """An engine core's tokenizer: a CoreTokenizer where the folder's tokenizer.json is the whole
    tokenizer (every special token the config names is one of its added tokens), else the full HF one."""
    light = _plain_tokenizer(Path(tokenizer_dir))
    if light is not None:
        return light
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _plain_tokenizer(folder: Path) -> CoreTokenizer | None:
    path, config_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if not path.is_file() or any((folder / f).exists() for f in ("special_tokens_map.json", "added_tokens.json")):
        return None
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("tokenizer_class") not in PLAIN_CLASSES:
        return None
    from tokenizers import Tokenizer
    backend = Tokenizer.from_file(str(path))
    added = {t.content: (i, t.special) for i, t in backend.get_added_tokens_decoder().items()}
    for i, token in (config.get("added_tokens_decoder") or {}).items():
        if not isinstance(token, dict) or added.get(token.get("content")) != (int(i), token.get("special", False)):
            return None
    named = [config.get(name) for name in SPECIAL_NAMES]
    for extra in (config.get("additional_special_tokens"), config.get("extra_special_tokens")):
        named += list(extra.values()) if isinstance(extra, dict) else list(extra or [])
    for token in named:
        content = token.get("content") if isinstance(token, dict) else token
        if content is not None and (not isinstance(content, str) or not added.get(content, (0, False))[1]):
            return None                 # transformers would add it, or mark it special: its vocabulary differs
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return CoreTokenizer(backend, None if eos is None else added[eos][0], str(folder))


def eos_token_ids(source, tokenizer) -> list[int]:
    """Every end-of-sequence id the model's config, its generation config (where chat models
    list their end-of-turn ids, such as Llama-3's <|eom_id|> and <|eot_id|>) and the tokenizer name."""
    ids: list[int] = []
    for value in (getattr(source.hf_config, "eos_token_id", None), source.generation_config().get("eos_token_id"),
                  getattr(tokenizer, "eos_token_id", None)):
        if value is None:
            continue
        ids += value if isinstance(value, list) else [value]
    return sorted(set(ids))


CHAT_ROLES = ("system", "user", "assistant", "tool")


def encode_text(tokenizer, text: str) -> list[int]:
    """A raw prompt's ids, with whatever special tokens the tokenizer's config adds (BOS...)."""
    if not text:
        raise ValueError("prompt text is empty: give at least one character")
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None, template: str | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """Chat messages through the model's chat template (or `template`), ready for the assistant's
    turn. `tools`: OpenAI-style function tools, for a template that renders them (a ValueError if
    it would drop them); `template_kwargs`: extra template variables ({"enable_thinking": False})."""
    if not messages:
        raise ValueError("chat has no messages: give at least one {role, content}")
    for i, m in enumerate(messages):
        if m.get("role") not in CHAT_ROLES:
            raise ValueError(f"chat message {i} has role {m.get('role')!r}; use one of {CHAT_ROLES}")
        _check_content(i, m.get("content"))
    source = template or getattr(tokenizer, "chat_template", None)
    if source is None:
        raise ValueError("this model's tokenizer has no chat template; send text or tokens instead")
    if tools and "tools" not in (source if isinstance(source, str) else source.get("tool_use", "")):
        raise ValueError("this model's chat template does not render tools, so the model would never see them: "
                         "serve it with --chat-template FILE naming a template that does (Hermes / Qwen3 style)")
    kwargs = dict(template_kwargs or {})
    clash = sorted(set(kwargs) & {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template"})
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {clash}: they are the request's own fields")
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=template,
                                            add_generation_prompt=True, tokenize=True, **kwargs)
    except (TypeError, jinja2.TemplateError) as e:
        if any(isinstance(m.get("content"), list) for m in messages):      # a text-only template meeting media
            raise ValueError(f"this model's chat template cannot render image or audio parts ({e}): they need a "
                             "multimodal model's own tokenizer files (a Qwen3-VL or Qwen2-Audio checkpoint "
                             "directory); the random-weight presets use SmolLM2's tokenizer, which has no image "
                             "or audio tokens") from e
        if isinstance(e, TypeError):
            raise
        raise ValueError(f"the chat template failed on this chat: {e}") from e
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def _check_content(i: int, content) -> None:
    """A string, or template parts ({"type": "text", "text"} / {"type": "image"} / {"type": "audio"}: what
    baton.models.multimodal.split_content_parts makes of OpenAI-style parts)."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(f"chat message {i}: content must be a string or a list of parts")
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image", "audio") or (kind == "text" and isinstance(part.get("text"), str)):
            continue
        raise ValueError(f"chat message {i}: content parts must be {{'type': 'text', 'text': ...}}, "
                         f"{{'type': 'image'}} or {{'type': 'audio'}} (split OpenAI parts with split_content_parts), "
                         f"got {part!r:.80}")
