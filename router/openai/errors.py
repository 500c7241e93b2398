"""The OpenAI API's errors: OpenAI's JSON shape, and the HTTP status of each gRPC status."""
from __future__ import annotations

import math

import grpc
from aiohttp import web

from baton.serving.grpc_server import ServiceError

# gRPC status -> (HTTP status, OpenAI error type)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


# a 429 whose cause gave no retry hint (a worker out of KV blocks, say) still says when to come back:
# OpenAI's clients, and the README, count on Retry-After with every 429
DEFAULT_RETRY_AFTER_S = 1.0


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        if status == 429 and retry_after is None:
            retry_after = DEFAULT_RETRY_AFTER_S
        self.status, self.kind, self.param, self.code, self.retry_after = status, kind, param, code, retry_after

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return web.json_response(self.body(), status=self.status, headers=headers)

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code or self.status}}


def from_service_error(exc: ServiceError) -> HTTPError:
    status, kind = HTTP_STATUS.get(exc.code, (500, "internal_error"))
    return HTTPError(status, str(exc), kind, retry_after=exc.retry_after)
