"""What a request must satisfy for the model it goes to: a prompt of known tokens that leaves
room for one new token, and valid sampling. Torch-free, so a worker's front refuses a bad
request before its engine core sees it; the engine checks again (engine/llm_engine.py)."""
from __future__ import annotations

from dataclasses import dataclass

from baton.engine.requests.policies import DEFAULT_SCHEDULING_POLICY
from baton.engine.requests.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY         # engine/scheduling/scheduling_policy.py

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError saying what to fix."""
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                             "which must leave room for at least one new token: shorten the prompt")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        params.validate(self.vocab_size)
        if params.priority and self.scheduling_policy != "priority":
            raise ValueError(f"priority {params.priority} needs a deployment started with --scheduling-policy "
                             f"priority (this one schedules {self.scheduling_policy}); send priority 0 or leave it unset")
        if params.prior_output_tokens >= len(token_ids):
            raise ValueError(f"prior_output_tokens ({params.prior_output_tokens}) must be less than the prompt's "
                             f"{len(token_ids)} tokens")
