"""The prefill worker: its front serves `baton.v1.Prefill` (serving/worker/prefill_front.py: check
a request, hand it to the engine core), its engine core runs the prompt and pushes the KV to the
decode worker the router chose (prefill_service/core.py).
"""
from __future__ import annotations

from baton.serving.worker.prefill_front import PrefillFront, PrefillServicer
from baton.serving.worker.worker import EngineWorker
from baton.v1 import prefill_pb2_grpc


class PrefillWorker(PrefillFront, EngineWorker):
    service_names = ("baton.v1.Prefill",)
    core_target = "baton.prefill_service.core:PrefillCore"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.active: set[str] = set()

    def add_services(self, server) -> None:
        prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(self), server)

    def num_active(self) -> int:
        return len(self.active)

    def abort_request(self, rid: str) -> bool:
        return self.abort_prefill(rid)


__all__ = ["PrefillWorker"]
