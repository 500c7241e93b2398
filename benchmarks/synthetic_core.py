"""A synthetic engine core for `baton bench relay`: no model, no device, no KV. Every request
gets one token per step, one step every BATON_SYNTHETIC_STEP_MS milliseconds, so a real worker
front and the router relay tokens from a source that costs next to nothing.

Run by the stock colocated worker: `baton decode --colocated --engine-core
baton.benchmarks.synthetic_core:SyntheticCore` (benchmarks/relay.py); this module imports no
torch of its own (the core's host module, serving/worker/engine_core.py, still does).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from baton.benchmarks import environment as bench_env
from baton.serving.grpc_server import ServiceError
from baton.serving.worker.core_protocol import Beat, CoreStats, TokenUpdate
from baton.serving.worker.engine_core import BEAT_INTERVAL_S, EngineCore

KV_BLOCKS = 1 << 20                         # made-up KV figures, for the router's load-aware policies
MAX_MODEL_LEN = 1 << 17
VOCAB_SIZE = 32000                          # with no tokenizer: ids only, any ids below this
FALLBACK_IDS = list(range(1000, 1016))
WORDS = (" the quick brown fox jumps over the lazy dog while a small bird sings"
         " on the old wooden fence near the river")


@dataclass(slots=True)
class SyntheticRequest:
    max_tokens: int
    blocks: int                             # what it "holds" of the made-up KV cache
    emitted: int = 0


def step_seconds() -> float:
    ms = bench_env.synthetic_step_ms()
    if ms <= 0:
        raise ValueError(f"{bench_env.SYNTHETIC_STEP_MS} must be > 0 (milliseconds per step), got {ms:g}")
    return ms / 1e3


def word_tokens(tokenizer_dir: str | None) -> tuple[list[int], int]:
    """(the ids to cycle through, vocab size): ordinary words when a tokenizer.json is given, so
    the streamed text reads as words; else fixed ids."""
    path = Path(tokenizer_dir).expanduser() / "tokenizer.json" if tokenizer_dir else None
    if path is None or not path.is_file():
        return FALLBACK_IDS, VOCAB_SIZE
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(path))
    return tok.encode(WORDS, add_special_tokens=False).ids, tok.get_vocab_size()


class SyntheticCore(EngineCore):
    def __init__(self, cfg, emit):
        super().__init__(cfg, emit)
        self.step_s = bench_env.SYNTHETIC_STEP_MS_DEFAULT / 1e3
        self.requests: dict[str, SyntheticRequest] = {}
        self.blocks_used = 0
        self.steps = 0
        self.token_ids, self.vocab_size = FALLBACK_IDS, VOCAB_SIZE
        self._ticker: asyncio.Task | None = None

    async def start(self) -> dict:
        self.step_s = step_seconds()            # here: a bad value is reported as the core's start failure
        self.token_ids, self.vocab_size = word_tokens(self.cfg.engine.tokenizer)
        self._ticker = asyncio.ensure_future(self._tick())
        return self.hello()

    def hello(self) -> dict:
        e = self.cfg.engine
        tokenizer = str(Path(e.tokenizer).expanduser()) if e.tokenizer else None
        return {"model": e.model, "architecture": "synthetic", "vocab_size": self.vocab_size,
                "max_model_len": e.max_model_len or MAX_MODEL_LEN, "block_size": e.block_size,
                "eos_token_ids": [], "tokenizer_dir": tokenizer, "kv_backends": [self.cfg.kv_backend],
                "device": e.device, "stats": self.stats(), "kv_address": "synthetic:0"}

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()

    def stats(self) -> CoreStats:
        return CoreStats(len(self.requests), 0, KV_BLOCKS, KV_BLOCKS - self.blocks_used)

    # -- commands ------------------------------------------------------------------------------
    async def cmd_add(self, rid: str, prompt: list[int], params, images) -> None:
        if rid in self.requests:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already running here")
        blocks = -(-(len(prompt) + params.max_tokens) // self.cfg.engine.block_size)
        self.requests[rid] = SyntheticRequest(params.max_tokens, blocks)
        self.blocks_used += blocks

    async def cmd_abort(self, rid: str) -> bool:
        return self._drop(rid)

    async def cmd_admit(self, *args) -> dict:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                           "the synthetic core runs whole requests (colocated) only; it takes no KV")

    def _drop(self, rid: str) -> bool:
        r = self.requests.pop(rid, None)
        if r is not None:
            self.blocks_used -= r.blocks
        return r is not None

    # -- the step loop -------------------------------------------------------------------------
    async def _tick(self) -> None:
        """One step every step_s on a fixed schedule; a core that falls behind skips the missed
        steps rather than bursting (a real engine's step rate drops the same way)."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due += self.step_s
            late = loop.time() - due
            if late < 0:
                await asyncio.sleep(-late)
            elif late > self.step_s:
                due = loop.time()
            self._step()

    def _step(self) -> None:
        if not self.requests:
            self._beat()
            return
        self.steps += 1
        ids, updates, done = self.token_ids, [], []
        for rid, r in self.requests.items():
            token = ids[r.emitted % len(ids)]        # each stream's text reads as the words
            r.emitted += 1
            finished = r.emitted >= r.max_tokens
            updates.append(TokenUpdate(rid, [token], "length" if finished else None))
            if finished:
                done.append(rid)
        for rid in done:
            self._drop(rid)
        self.send_updates(updates)

    def _beat(self) -> None:
        """Idle: still say we are alive, as the real core's idle loop does."""
        now = time.monotonic()
        if now - self._last_emit >= BEAT_INTERVAL_S:
            self._last_emit = now
            self.emit(Beat(self.stats(), self.metrics.take()))
