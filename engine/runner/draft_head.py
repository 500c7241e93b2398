"""An EAGLE-3 draft head on the device (models/eagle3.py): its pass over every step, its drafting
steps, and the rejection sampler that keeps sampling exact with drafts drawn from a distribution.

Where the head's state lives, and why: its KV is one more layer of the target's paged cache, under
the same block tables (the runner allocates layers + 1, engine/runner/kv_cache.py). So it needs no allocator or
ownership of its own (a sequence's blocks hold both, freed once, together), the prefix cache
shares it with the target's KV, and a prefill worker that runs the head over the prompt hands its
KV to the decode worker inside the same blocks, through every KV backend, with no change to any;
the handshake's layer count tells a worker with a head from one without. The one thing more a
decode worker needs to draft at its first step is the head's last hidden state (one row of the
head's width), which rides in the last piece's metadata (`HEAD_STATE_META`).

Per step (`pass_over_step`, over the `HeadPass` the target's forward leaves, engine/runner/step.py): the
target hands out three of its layers' hidden states for every input row; once the step's tokens are drawn the head runs over the same rows, each row's input
the token after it (the next input token, or the token drawn at that row), and so writes its KV
at the same slots. A verified row's token after it is what was drawn there: up to the first
rejected guess that is exactly the sequence's next token; the rows after it are rewritten by
later steps before anything reads them. Each sequence keeps the head's output at its last kept
row (`keep_states`). A decode step that the decode graphs ran replays the head's pass captured
for the same bucket (engine/runner/graph_runner.py), over the same buffers; and after a decode step of
more sequences than speculate (--speculative-max-batch) nothing drafts, so the pass writes only
the head's KV (no attention, MLP or outputs; `wants_states`) and the sequences' states are dropped
until a full pass runs again.

Drafting (`draft`): from that output, the head's LM head gives the first guess; each further guess
runs the head one position on, over its own output and the guess before. Greedy requests take the
argmax; sampled ones draw from q = softmax(head logits / temperature), kept for verification.

Verification (`reject`): a greedy row keeps a guess when it is the target's argmax (exact). A
sampled row accepts guess d with probability min(1, p(d) / q(d)) and on rejection draws from
max(0, p - q) normalized (Leviathan et al. 2023; Chen et al. 2023): each kept token is a draw from
the target's p given the tokens before. Seeded requests draw every uniform from a hash of (seed,
position), salted per use, so the same seed gives the same tokens.
"""
from __future__ import annotations

import base64

import numpy as np
import torch

from baton.engine.config import EngineConfig
from baton.engine.runner.forward import Forward
from baton.engine.runner.sampler import hashed_uniform, probabilities
from baton.engine.runner.staging import HostUpload
from baton.engine.runner.step import DraftInputs, HeadPass
from baton.models.attention_metadata import AttnMetadata
from baton.models.forward_context import ForwardContext

# salts of the seeded uniforms: the draft's draw, the acceptance test and the residual's draw are
# independent of each other and of the target sampler's noise
_DRAFT_SALT, _ACCEPT_SALT, _RESIDUAL_SALT = 0x5D1A3E, 0xACCE97, 0x2E51D0


class DraftChecks:
    """The sampled rows of a verifying step that test a guess drawn from q: the row (among the
    step's sampled tokens), the guess, and q over the draft vocabulary."""
    __slots__ = ("rows", "tokens", "q")

    def __init__(self, rows: np.ndarray, tokens: np.ndarray, q: torch.Tensor):
        self.rows, self.tokens, self.q = rows, tokens, q


def load_head(config, model, ops, dtype, device):
    """--speculative-method eagle3: (the head in --speculative-model, each draft id's target id [draft
    vocab] on the device), and the target set to hand it the hidden states it reads (models/eagle3.py);
    (None, None) otherwise. Both on the device before the KV cache is sized from what is left."""
    if config.speculative_method != "eagle3":
        return None, None
    from baton.models.decoder import DecoderModel
    from baton.models.eagle3 import build_head
    if not isinstance(getattr(model, "model", None), DecoderModel):
        raise ValueError(f"--speculative-method eagle3 needs a decoder-only target (Llama, Qwen2, Qwen3, "
                         f"Qwen3-MoE), not {type(model).__name__}")
    head = build_head(config.speculative_model, model, ops, dtype, device)
    model.model.aux_layers = head.aux_layers
    return head, head.target_ids(torch.arange(head.draft_vocab_size, device=device))


class DraftHead:
    """The head's passes and drafts over the target's cache (`forward`: its last layer is the head's),
    its small host arrays through the step's own staging (`upload`)."""

    def __init__(self, head, targets: torch.Tensor, forward: Forward, upload: HostUpload, config: EngineConfig,
                 dtype: torch.dtype):
        self.head = head
        self.targets = targets          # [draft vocab]: each draft id's target id
        self.forward = forward
        self.upload = upload
        self.device, self.dtype = upload.device, dtype
        self.block_size = config.block_size
        self.max_batch = config.speculative_max_batch
        self._arange = np.arange(0, dtype=np.int64)

    # -- the pass over each step -----------------------------------------------------------
    def wants_states(self, out) -> bool:
        """Does the step's pass need the head's outputs (what its sequences draft from next), or only
        its KV: after a decode step of more sequences than speculate (--speculative-max-batch) nothing
        drafts, so the head writes its KV and skips its attention, MLP and outputs. (Prompt chunks keep
        the state: a prefill worker hands it to the decode side, where the batch is another.)"""
        return not out.is_decode or len(out.scheduled) <= self.max_batch

    def inputs(self, out, sample_items: np.ndarray, next_ids: np.ndarray,
               sample_logit_rows: np.ndarray) -> DraftInputs:
        """The head's share of a step's host inputs (engine/runner/input_builder.py)."""
        return DraftInputs(next_ids, sample_logit_rows, self.checks(out, sample_items), self.wants_states(out))

    def pass_over_step(self, step: HeadPass, sampled: torch.Tensor | None) -> torch.Tensor | None:
        """The head over the step's rows (its KV written at their slots); its outputs [T, width], or
        None where the step wanted only the KV (`wants_states`). A step the decode graphs ran replays
        the head's captured pass over the same buffers (engine/runner/graph_runner.py); others run it eagerly."""
        nxt = self.next_tokens(step.draft, sampled)
        if step.graphs is not None:
            return step.graphs.run_head(nxt, step.draft.full)
        f = self.forward
        ctx = ForwardContext(step.meta, f.kv_caches, f.attention, f.scale)
        return self.run_pass(nxt, step.positions, step.aux, ctx, step.draft.full)

    def next_tokens(self, draft: DraftInputs, sampled: torch.Tensor | None) -> torch.Tensor:
        """[T] on the device: the token after each input row (the ones drawn this step from `sampled`)."""
        rows = draft.sample_logit_rows
        if sampled is not None and len(rows) == len(draft.next_ids) and (rows == self._rows(len(rows))).all():
            return sampled                               # a decode step: every row's next token was drawn
        nxt = torch.from_numpy(draft.next_ids).to(self.device, non_blocking=True)
        if sampled is not None and len(rows):
            nxt.index_copy_(0, torch.from_numpy(rows).to(self.device, non_blocking=True), sampled)
        return nxt

    def _rows(self, n: int) -> np.ndarray:
        if len(self._arange) < n:
            self._arange = np.arange(max(n, 2 * len(self._arange)), dtype=np.int64)
        return self._arange[:n]

    def run_pass(self, next_ids: torch.Tensor, positions: torch.Tensor, aux: torch.Tensor, ctx: ForwardContext,
                 full: bool) -> torch.Tensor | None:
        """The pass itself (what the graphs capture): the head's outputs, or only its KV (None)."""
        hidden = self.head.fc(aux)
        if full:
            return self.head(next_ids, positions, hidden, ctx)
        self.head.write_kv(next_ids, positions, hidden, ctx)
        return None

    def keep_states(self, launched, picks: list[tuple[object, int]]) -> None:
        """Each (sequence, sampled row) keeps the head's output at that row: what it drafts from."""
        if launched.head_hidden is None or not picks:
            return
        rows = torch.tensor([int(launched.head_rows[m]) for _, m in picks], device=self.device)
        kept = launched.head_hidden.index_select(0, rows)
        for i, (seq, _) in enumerate(picks):
            seq.spec_hidden = (kept, i)

    def keep_last_states(self, launched, kept: list[list[int] | None] | None) -> None:
        """After a step, each sampling sequence keeps the head's output at its last kept token: its
        first sampled row, plus the guesses it kept (`kept`: each item's tokens of a verifying step;
        None: a plain step)."""
        if launched.head_hidden is None:         # its pass wrote only the head's KV (a batch too large to draft)
            self.drop_states(launched.out.scheduled)
            return
        first: dict[int, int] = {}
        for m, item in enumerate(launched.rows):
            first.setdefault(item, m)
        picks = [(launched.out.scheduled[item].seq, m + (len(kept[item]) - 1 if kept is not None else 0))
                 for item, m in first.items()]
        self.keep_states(launched, picks)

    @staticmethod
    def drop_states(items) -> None:
        """After a pass that wrote only the head's KV its sequences' states are stale: each guesses
        again once a full pass has run (the step after the batch shrinks to --speculative-max-batch)."""
        for item in items:
            item.seq.spec_hidden = None

    # -- drafting --------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, seqs: list, counts: list[int]) -> list[list[int]]:
        """counts[i] guesses for each sequence (each has `spec_hidden`, and blocks for its guesses);
        sets each sampled sequence's `draft_probs` ([count, draft vocab] q of its guesses)."""
        n, k = len(seqs), max(counts)
        g = torch.cat([t[i:i + 1] for t, i in (seq.spec_hidden for seq in seqs)])
        temps = np.array([seq.params.temperature for seq in seqs], np.float32)
        sampling = bool((temps > 0).any())
        up = self.upload(temps, np.array([_signed(seq.sampling_seed or 0) for seq in seqs], np.int64),
                      np.array([seq.sampling_seed is not None for seq in seqs], np.bool_))
        base = np.array([seq.num_tokens - 1 for seq in seqs], np.int64)     # where the second guess's pass runs
        counts_np = np.array(counts, np.int64)
        width = max(len(seq.block_table) for seq in seqs)
        tables = np.full((n, width), -1, np.int32)
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.block_table)] = seq.block_table
        tokens, probs = [], []
        for j in range(k):
            drawn, q = self._draw(self.head.logits(g), up, base + j + 1, sampling)
            tokens.append(self.targets[drawn])
            probs.append(q)
            if j + 1 < k:
                g = self._step(tokens[-1], g, base, j, counts_np, tables)
        host = torch.stack(tokens, dim=1).tolist()
        q_all = torch.stack(probs, dim=1) if sampling else None
        for i, seq in enumerate(seqs):
            seq.draft_probs = q_all[i, :counts[i]] if sampling and temps[i] > 0 else None
        return [host[i][:counts[i]] for i in range(n)]

    def _step(self, tokens: torch.Tensor, g: torch.Tensor, base: np.ndarray, j: int, counts: np.ndarray,
              tables: np.ndarray) -> torch.Tensor:
        """The head one position on for every row (rows done drafting write nothing and are dropped later)."""
        bs, n = self.block_size, len(base)
        live = counts > j + 1
        positions = base + np.where(live, j, 0)
        slots = tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        slots = np.where(live, slots, -1)
        lens = (positions + 1).astype(np.int32)
        starts = np.arange(n + 1, dtype=np.int32)
        pos, slot_dev, starts_dev, lens_dev, tables_dev = self.upload(positions, slots, starts, lens, tables)
        meta = AttnMetadata(is_decode=True, slot_mapping=slot_dev, query_start_loc=starts_dev, seq_lens=lens_dev,
                            block_tables=tables_dev, max_query_len=1, max_seq_len=int(lens.max()), has_context=True,
                            query_start_loc_cpu=starts.tolist(), seq_lens_cpu=lens.tolist(), num_decode_rows=n)
        f = self.forward
        return self.head(tokens, pos, g, ForwardContext(meta, f.kv_caches, f.attention, f.scale))

    def _draw(self, logits: torch.Tensor, up, positions: np.ndarray, sampling: bool):
        """(draft ids, q over the draft vocabulary or None): greedy rows the argmax, the others a draw from q."""
        greedy = logits.argmax(dim=-1)
        if not sampling:
            return greedy, None
        temps, seeds, has_seed = up
        q = torch.softmax(logits / torch.where(temps > 0, temps, torch.ones_like(temps))[:, None], dim=-1)
        pos = torch.from_numpy(positions).to(q.device)
        noise = _exponential(q, seeds ^ _DRAFT_SALT, has_seed, pos)
        return torch.where(temps > 0, (q / noise).argmax(dim=-1), greedy), q

    # -- verification ----------------------------------------------------------------------
    def checks(self, out, sample_items: np.ndarray) -> DraftChecks | None:
        """The step's sampled rows that test a guess drawn from q (None: none do)."""
        if not any(item.draft for item in out.scheduled):
            return None
        rows, tokens, qs = [], [], []
        m = 0
        while m < len(sample_items):
            item = out.scheduled[int(sample_items[m])]
            q = item.seq.draft_probs
            if item.draft and q is not None:
                rows += range(m, m + len(item.draft))
                tokens += item.draft
                qs.append(q[:len(item.draft)])
            m += 1 + len(item.draft)
        if not rows:
            return None
        return DraftChecks(np.array(rows, np.int64), np.array(tokens, np.int64), torch.cat(qs))

    def reject(self, logits: torch.Tensor, sampling, sampled: torch.Tensor, checks: DraftChecks) -> torch.Tensor:
        """`sampled` with each checked row's token: its guess if accepted (probability min(1, p/q)),
        else a draw from max(0, p - q) normalized (which never is the guess)."""
        dev = logits.device
        rows = torch.from_numpy(checks.rows).to(dev)
        guess = torch.from_numpy(checks.tokens).to(dev)
        p = probabilities(logits.index_select(0, rows), sampling.temperatures[rows], sampling.top_ks[rows],
                          sampling.top_ps[rows])
        q = torch.zeros_like(p)
        q[:, self.targets] = checks.q.float()
        seeds, has_seed, positions = sampling.seeds[rows], sampling.has_seed[rows], sampling.positions[rows]
        u = _uniform(p[:, :1], seeds ^ _ACCEPT_SALT, has_seed, positions)[:, 0]
        accept = u * q.gather(1, guess[:, None])[:, 0] <= p.gather(1, guess[:, None])[:, 0]
        residual = (p - q).clamp_min_(0)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
        redrawn = (residual / _exponential(residual, seeds ^ _RESIDUAL_SALT, has_seed, positions)).argmax(dim=-1)
        out = sampled.clone()
        out[rows] = torch.where(accept, guess, redrawn)
        return out

    # -- the hand-off ----------------------------------------------------------------------
    @staticmethod
    def encode_state(state) -> str:
        tensor, i = state
        return base64.b64encode(tensor[i].float().cpu().numpy().tobytes()).decode()

    def decode_state(self, text: str):
        values = np.frombuffer(base64.b64decode(text), np.float32)
        width = self.head.config.hidden_size
        if values.size != width:
            raise ValueError(f"the prefill worker's draft head state has {values.size} values, this head {width}")
        return torch.from_numpy(values.copy()).to(self.device, self.dtype)[None], 0


def _uniform(like: torch.Tensor, seeds: torch.Tensor, has_seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) shaped like `like`: hashed from (seed, position) on seeded rows."""
    u = torch.rand_like(like, dtype=torch.float32).clamp_min_(1e-12)
    if bool(has_seed.any()):
        u = torch.where(has_seed[:, None], hashed_uniform(seeds, positions, like.shape[-1]), u)
    return u


def _exponential(like: torch.Tensor, seeds: torch.Tensor, has_seed: torch.Tensor, positions: torch.Tensor):
    """Exp(1) noise shaped like `like` (argmax of probs / noise is a draw from probs)."""
    return _uniform(like, seeds, has_seed, positions).log_().neg_()


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x
