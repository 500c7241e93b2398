"""serving/grpc_server.py's wrappers: an error becomes its status; a call that ended under the
answer (the client cancelled, or its deadline passed as the error was sent) ends quietly."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from baton.serving.grpc_server import ServiceError, _wrap_unary


class Context:
    """A servicer context whose call is over: sending the status fails as grpc's core does."""

    def __init__(self, ended: bool):
        self.ended = ended
        self.aborted = None

    def set_trailing_metadata(self, md):
        pass

    async def abort(self, code, msg):
        if self.ended:
            raise RuntimeError('Failed "execute_batch"')      # grpc's ExecuteBatchError stands here
        self.aborted = (code, msg)
        raise grpc.aio.AbortError()


async def _failing(request, context):
    raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")


def test_an_error_becomes_its_status():
    ctx = Context(ended=False)
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(_wrap_unary(_failing)(object(), ctx))
    assert ctx.aborted == (grpc.StatusCode.RESOURCE_EXHAUSTED, "full")


def test_an_error_for_a_call_that_already_ended_is_not_logged_as_one(caplog):
    caplog.set_level(logging.INFO)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_wrap_unary(_failing)(object(), Context(ended=True)))
    assert not [r for r in caplog.records if r.levelno >= logging.INFO], caplog.text
