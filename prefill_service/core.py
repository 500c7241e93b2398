"""The prefill worker's engine core (serving/worker/engine_core.py): runs prompts in continuous
batches (prefix cache, chunked prefill), samples each request's first token, and pushes its
KV to the decode worker the router chose, from this process, where the KV is. All of it is the
KV plane's sending half (serving/worker/kv_push.py), which decode workers share.
"""
from __future__ import annotations

from baton.serving.worker.kv_push import PrefillHandoff, PushingCore


class PrefillCore(PushingCore):
    pass


__all__ = ["PrefillCore", "PrefillHandoff"]
