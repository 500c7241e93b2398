"""The offline API, as in nano-vllm / vLLM: `LLM(model).generate(prompts, params)`."""
from __future__ import annotations

import gc
import sys
import time
from collections.abc import Sequence as Seq
from dataclasses import replace

from baton.engine.config import DEFAULT_MODEL, EngineConfig
from baton.engine.llm_engine import LLMEngine, freeze_startup_objects
from baton.engine.output_processor import CompletionOutput
from baton.engine.requests.sampling_params import SamplingParams, sample_seed
from baton.engine.requests.tokenizer import render_chat
from baton.engine.scheduling.multimodal import check_kinds
from baton.models.multimodal import MediaInput, split_content_parts
from baton.progress import Progress

Prompt = str | list[int]


def collect_frozen_objects() -> None:
    """The other half of freeze_startup_objects, for a process that drops an engine and goes on:
    frozen objects are never collected, and an engine's reference cycles would keep its weights
    and KV cache alive for good. What was frozen comes back, the dead cycles are collected, and
    what still lives is frozen again."""
    gc.unfreeze()
    freeze_startup_objects()


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **config):
        unknown = set(config) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown engine options {sorted(unknown)}; "
                             f"known: {sorted(EngineConfig.__dataclass_fields__)}")
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        freeze_startup_objects()
        self.engine.stream_text = False        # outputs are decoded once, when they finish
        self.tokenizer = self.engine.tokenizer

    def __del__(self, _finalizing=sys.is_finalizing):       # (bound now: at exit this module's globals may be gone)
        """This LLM gone, its engine's memory (weights, KV cache) goes back: freeze_startup_objects
        put the engine's reference cycles out of the collector's reach, so they are dropped here
        and collected, else every LLM made in a process would stay for good."""
        if _finalizing():                       # the process ends: it all goes back anyway
            return
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            platform = engine.runner.platform
            self.__dict__.pop("tokenizer", None)
            del engine
            collect_frozen_objects()
            platform.release_cached_memory()    # else the next LLM's KV sizing finds the device full

    def default_sampling_params(self) -> SamplingParams:
        """What `generate(prompts)` samples with: the model's generation-config defaults
        (EngineConfig.generation_config), else SamplingParams()'s."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 progress: bool = False) -> list[CompletionOutput]:
        prompts = _as_list(prompts)
        token_lists = [self.engine.tokenize(p) for p in prompts]
        return self._generate(token_lists, [()] * len(token_lists), sampling_params, progress)

    def _generate(self, token_lists: list[list[int]], images: list[Seq[MediaInput]], sampling_params,
                  progress: bool) -> list[CompletionOutput]:
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = self._params_per_prompt(sampling_params, len(token_lists))
        # validate everything first so a bad prompt leaves the engine untouched
        for ids, p, imgs in zip(token_lists, params, images, strict=True):
            self.engine.validate(ids, p)
            self.engine.check_images(ids, list(imgs))
        results: dict[str, CompletionOutput] = {}
        firsts: list[CompletionOutput] = []
        try:
            streamed = set()
            for ids, p, imgs in zip(token_lists, params, images, strict=True):
                for j in range(p.n):        # one request a sample (SamplingParams.n), a seed of its own each
                    pj = p if j == 0 else replace(p, seed=None if p.seed is None else sample_seed(p.seed, j))
                    rid = self.engine.add_request(ids, pj, images=imgs)
                    results[rid] = out = CompletionOutput(rid, ids, index=j)
                    if j == 0:
                        firsts.append(out)
                    else:
                        firsts[-1].samples.append(out)
                    if p.stop:              # stop strings need the text as it grows
                        streamed.add(rid)
            self._run(results, streamed, progress)
        finally:
            for rid in results:             # on an exception mid-run: free everything we queued
                self.engine.abort(rid)
        return firsts

    def chat(self, conversations, sampling_params=None, progress: bool = False, tools: list[dict] | None = None,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> list[CompletionOutput]:
        """One conversation ([{"role", "content"}, ...]) or a list of them. `content`: a string,
        or OpenAI-style parts: {"type": "text", "text"}, {"type": "image_url", "image_url":
        {"url": "data:image/png;base64,..."}} or {"type": "image", "image": <encoded bytes>}
        (images: vision-language models only), {"type": "input_audio", "input_audio": {"data": <base64>,
        "format": "wav"}} or {"type": "audio", "audio": <encoded bytes>} (audio-language models only). `tools`: OpenAI-style function tools the template
        renders (messages may hold an assistant's `tool_calls` and `tool` results);
        `chat_template`: a template of your own; `chat_template_kwargs`: its extra variables,
        e.g. {"enable_thinking": False}. The output is the model's text, as vLLM's LLM.chat."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if not conversations:               # as generate([]): no silent empty answer to a call that asked nothing
            raise ValueError("no conversations given: pass one ([{'role': 'user', 'content': ...}]) or a list of them")
        token_lists, images = [], []
        for c in conversations:
            messages, imgs = split_content_parts(c)
            check_kinds(imgs, self.engine.placeholders, self.engine.source.name)   # before its template
            ids = render_chat(self.tokenizer, messages, tools, chat_template, chat_template_kwargs)
            if imgs or (self.engine.placeholders is not None
                        and self.engine.placeholders.token_id in ids):
                ids = self._placeholders().expand(ids, imgs)        # one pad per image (clip) -> its count
            token_lists.append(ids)
            images.append(imgs)
        return self._generate(token_lists, images, sampling_params, progress)

    def _placeholders(self):
        if self.engine.placeholders is None:
            raise ValueError(f"model {self.engine.source.name} takes no images or audio; send text only")
        return self.engine.placeholders

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """The chat's token ids (text content; image parts need `chat`, which expands them)."""
        return render_chat(self.tokenizer, messages)

    def _run(self, results: dict[str, CompletionOutput], streamed: set[str], progress: bool) -> None:
        done, total, t0, last = 0, len(results), time.monotonic(), 0.0
        shown = Progress("requests done", total) if progress else None
        while self.engine.has_unfinished:
            for out in self.engine.step():
                r = results[out.request_id]
                r.token_ids += out.new_token_ids
                r.text += out.new_text
                if out.logprobs is not None:
                    r.logprobs = (r.logprobs or []) + out.logprobs
                if out.prompt_logprobs is not None:
                    r.prompt_logprobs = out.prompt_logprobs
                r.cached_tokens = out.cached_tokens
                if out.finished:
                    r.finish_reason = out.finish_reason
                    if out.request_id not in streamed:   # not streamed: decode it once, now
                        r.text = self.tokenizer.decode(r.token_ids, skip_special_tokens=True,
                                                       clean_up_tokenization_spaces=False)
                    done += 1
            if shown is not None and time.monotonic() - last > 1.0:
                last = time.monotonic()
                shown.update(done)
        if shown is not None:
            shown.done(f"{done}/{total} requests done in {time.monotonic() - t0:.1f}s")

    @staticmethod
    def _params_per_prompt(sp, n: int) -> list[SamplingParams]:
        if isinstance(sp, SamplingParams):
            return [sp] * n
        one = isinstance(sp, (str, bytes, dict)) or not hasattr(sp, "__iter__")
        sp = [sp] if one else list(sp)
        wrong = next((p for p in sp if not isinstance(p, SamplingParams)), None)
        if wrong is not None:       # else an AttributeError from deep inside (a dict has no .validate)
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(wrong).__name__} (e.g. SamplingParams(max_tokens=32))")
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts: give one, or one per prompt")
        return sp


def _as_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, dict)) or not hasattr(prompts, "__iter__"):
        raise TypeError("prompts must be a string, a list of strings or a list of token-id lists, "
                        f"got {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]                      # a single pre-tokenized prompt
    for i, p in enumerate(prompts):           # else a wrong one fails deep in the tokenizer, unnamed
        if isinstance(p, str):
            continue
        if isinstance(p, (bytes, dict)) or not hasattr(p, "__iter__"):
            hint = ": chat messages go to llm.chat;" if isinstance(p, dict) else ":"
            raise TypeError(f"prompt {i} is a {type(p).__name__}{hint} give generate a string or a list of token ids")
        prompts[i] = p = list(p)              # (an iterator read once here stays readable)
        wrong = next((t for t in p if not hasattr(t, "__index__")), None)     # ints, numpy's too
        if wrong is not None:
            raise TypeError(f"prompt {i} holds a {type(wrong).__name__}: a token-id list holds ints")
    return prompts
