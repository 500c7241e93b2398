"""The OpenAI-compatible HTTP API, beside the gRPC one, in the router's own event loop.

`/v1/models`, `/v1/completions`, `/v1/chat/completions` (whole or streamed as server-sent
events ending `data: [DONE]`) and `/health`. Each request becomes a `baton.v1` GenerateRequest
and goes through `RouterService.generate`, the very path a gRPC call takes: the same
validation, admission, routing, migration and metrics, so HTTP and gRPC answers are the same.
A client that disconnects cancels its handler (aiohttp's handler cancellation), which aborts
the request on its workers and frees its blocks.

aiohttp: its C HTTP parser and native streaming responses keep the cost per streamed chunk a
JSON encode and one write, and it shares the loop with grpc.aio (docs/benchmarks.md has the
HTTP layer's measured cost against plain gRPC).
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import uuid
from dataclasses import dataclass, field

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from baton import __version__
from baton.engine.requests.sampling_params import MAX_N
from baton.engine.requests.tokenizer import encode_text
from baton.models.audio import decode_base64_audio
from baton.models.multimodal import decode_data_url
from baton.router import health, tokens, worker_metrics
from baton.router.config import RouterConfig
from baton.router.openai.chat import Calls, chat_delta, chat_fields, chat_message, message_fields
from baton.router.openai.errors import HTTPError, from_service_error
from baton.router.openai.fields import HONOURED, refusal
from baton.router.openai.limits import check_max_tokens
from baton.router.openai.logprobs import (
    Entry,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    entries,
    prompt_entries,
)
from baton.router.openai.sampling import Shape, choice_request, number
from baton.router.openai.sampling import sampling as request_sampling
from baton.serving import tracing
from baton.serving.grpc_server import PortInUse, ServiceError
from baton.v1 import router_pb2

log = logging.getLogger("baton.router.http")

FINISH = {router_pb2.FINISH_REASON_STOP: "stop", router_pb2.FINISH_REASON_LENGTH: "length",
          router_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
          router_pb2.FINISH_REASON_ABORT: "abort"}


# OpenAI's "developer" messages are what its newer models take in place of "system" ones: the
# model's template knows the system role
ROLES = {"developer": "system"}

OPEN_PATHS = ("/health", "/metrics")     # answered without a bearer token
STREAMING = "baton.streaming"           # a request's key: its event stream has begun (headers sent)


@dataclass(slots=True)
class Result:
    """One choice's whole answer."""
    text: str = ""
    reason: str | None = None
    usage: router_pb2.Usage = field(default_factory=router_pb2.Usage)
    logprobs: list[Entry] = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)     # TokenLogprob messages
    reasoning: str = ""                                      # a chat's, with --reasoning-parser
    calls: Calls = field(default_factory=Calls)              # a chat's tool calls


@dataclass(slots=True)
class Choice:
    """One choice of a request (n of them per prompt), each its own GenerateRequest."""
    index: int
    req: router_pb2.GenerateRequest
    gate: asyncio.Event             # set once the prompt's first choice has its first token
    first: bool                     # the prompt's first choice


class HttpContext:
    """What RouterService.generate asks of a gRPC context, for an HTTP request."""

    def __init__(self, request: web.Request):
        self._auth = request.headers.get("Authorization", "")
        self._peer = request.remote or "unknown"
        self._trace = tuple((k, request.headers[k]) for k in tracing.CARRIED if k in request.headers)

    def time_remaining(self):
        return None                         # HTTP clients set no deadline: --request-timeout applies

    def invocation_metadata(self):
        """The bearer token and the W3C trace context, as gRPC metadata would carry them."""
        return ((("authorization", self._auth),) if self._auth else ()) + self._trace

    def peer(self) -> str:
        return f"ipv4:{self._peer}:0"


class OpenAIServer:
    def __init__(self, svc, cfg: RouterConfig, model_name: str, metrics_registry=None):
        self.svc = svc                      # None until attach(): /health says 503 meanwhile
        self.cfg = cfg
        self.metrics_registry = metrics_registry    # served on /metrics (None: no such path)
        self.names = list(cfg.served_model_name or [model_name])
        self.created = int(time.time())
        self.runner: web.AppRunner | None = None
        self.address = ""
        self._texts: TokenTexts | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def app(self) -> web.Application:
        # a body carries its images base64-encoded: 4/3 of their bytes
        images = self.cfg.max_images * self.cfg.max_image_bytes * 4 // 3
        app = web.Application(client_max_size=(8 << 20) + images, middlewares=[self._errors])
        app.router.add_get("/health", self.health)
        if self.metrics_registry is not None:
            app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        return app

    async def start(self) -> None:
        """Bind the port now (a clash is reported before the model loads)."""
        self.runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        tls = None
        if self.cfg.tls.cert:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(self.cfg.tls.cert, self.cfg.tls.key)
        site = web.TCPSite(self.runner, self.cfg.host, self.cfg.http_port, ssl_context=tls, backlog=1024,
                           reuse_port=self.cfg.reuse_port or None)
        try:
            await site.start()
        except OSError as exc:
            await self.runner.cleanup()
            raise PortInUse(f"cannot serve the OpenAI API on {self.cfg.host}:{self.cfg.http_port}: "
                            f"{exc.strerror or exc}; stop the other process, pick another port with "
                            "--http-port, or turn the HTTP API off with --http-port 0") from None
        scheme = "https" if tls else "http"
        self.address = f"{scheme}://{self.cfg.host}:{self.cfg.http_port}/v1"

    def attach(self, svc, model_name: str) -> None:
        """The router service, once the model is known (the port was bound before it loaded)."""
        self.svc = svc
        self.names = list(self.cfg.served_model_name or [model_name])

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # -- middleware: auth and errors in OpenAI's shape ----------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            if request.path in OPEN_PATHS and request.path != "/health":
                return await handler(request)          # for Prometheus, as vLLM's: no token, even while starting
            if self.svc is None:
                raise HTTPError(503, "the router is still starting", "service_unavailable", retry_after=1)
            if request.path not in OPEN_PATHS and self.svc.auth is not None:
                self._authenticate(request)
            return await handler(request)
        except HTTPError as exc:
            return exc.response()
        except ServiceError as exc:
            return from_service_error(exc).response()
        except ValueError as exc:           # the router's validation, as for gRPC (its words may name a proto field)
            message, param = str(exc), _field_named(str(exc))
            return HTTPError(400, message if param is None or param in message else f"{param}: {message}",
                             param=param).response()
        except web.HTTPException as exc:    # aiohttp's own (404 path, 405 method, 413 size)
            return HTTPError(exc.status, _unrouted(request, exc), "invalid_request_error").response()
        except Exception as exc:            # a bug: still OpenAI's shape, which clients parse (not aiohttp's text)
            if request.get(STREAMING):      # its headers are sent: nothing more can be said in HTTP
                raise
            log.exception("%s %s failed", request.method, request.path)
            return HTTPError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error").response()

    def _authenticate(self, request: web.Request) -> None:
        header = request.headers.get("Authorization")
        if not header:
            raise HTTPError(401, "missing bearer token: send 'Authorization: Bearer <token>' (the router's "
                                 "--api-key / --auth-token)", "authentication_error", code="invalid_api_key")
        if self.svc.auth.client_of((("authorization", header),)) is None:
            raise HTTPError(401, "unknown bearer token", "authentication_error", code="invalid_api_key")

    # -- endpoints ------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """200 when a request could be served now ("ok", or "degraded" with why: router/health.py),
        else 503 and why. It names the workers and their last error (what GetServerInfo tells gRPC
        clients) to a caller the API would let in: an open router's, or one with a known token;
        anyone else gets the counts."""
        reg = self.svc.registry
        draining = self.svc.server is not None and self.svc.server.draining
        verdict = health.judge(reg, draining)
        body = {"status": verdict.status}
        if verdict.reason:
            body["reason"] = verdict.reason
        body["roles"] = {role: {"healthy": len(reg.healthy(role)), "total": n}
                         for role, n in health.role_counts(reg).items()}
        if self.svc.auth is None or self.svc.auth.client_of(HttpContext(request).invocation_metadata()):
            body["workers"] = [{"address": w.address, "role": w.role, "healthy": w.healthy,
                                **({"error": w.last_error} if not w.healthy and w.last_error else {})}
                               for w in reg.workers]
        return web.json_response(body, status=503 if verdict.status == "unavailable" else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        """The router's Prometheus metrics (those of --metrics-port), vLLM's names among them; with
        --worker-metrics, every healthy worker's beside them (router/worker_metrics.py)."""
        body = generate_latest(self.metrics_registry)
        if self.svc is not None and self.svc.cfg.worker_metrics:          # (None: still loading the model)
            body = worker_metrics.merge(body, await worker_metrics.scrape(worker_metrics.targets(self.svc.registry)))
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card(name) for name in self.names]})

    async def model(self, request: web.Request) -> web.Response:
        """One model (the openai client's models.retrieve), or a 404 naming those served."""
        name = self._model({"model": request.match_info["model"]})
        return web.json_response(self._card(name))

    def _card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "baton", "root": name,
                "max_model_len": self.svc.max_model_len}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request, "completions")
        prompts = body.get("prompt")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise HTTPError(400, "prompt must be a string, a list of token ids, or a list of those", param="prompt")
        reqs = []
        for p in prompts:
            req = router_pb2.GenerateRequest()
            if isinstance(p, str):
                req.text = p
            elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
                self._check_ids(p, "prompt")
                req.tokens.ids.extend(p)
            else:
                raise HTTPError(400, "each prompt must be a string or a list of non-negative token ids",
                                param="prompt")
            reqs.append(req)
        return await self._serve(request, body, reqs, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request, "chat")
        req = _chat_request(body)
        return await self._serve(request, body, [req], chat=True)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: {prompt} or {messages, tools, chat_template_kwargs...} -> {count, tokens...}."""
        body = await _json(request, "tokenize")
        self._model(body)
        req = router_pb2.TokenizeRequest()
        if "messages" in body:
            req.chat.CopyFrom(_chat_request(body).chat)
        elif isinstance(body.get("prompt"), str):
            req.text = body["prompt"]
        else:
            raise HTTPError(400, "give prompt (a string) or messages", param="prompt")
        svc = self.svc
        out = tokens.tokenize(req, svc.tokenizer, svc.max_model_len, svc.cfg.trust_request_chat_template)
        strs = body.get("return_token_strs", False)
        return web.json_response({"count": len(out.ids), "max_model_len": out.max_model_len, "tokens": list(out.ids),
                                  "token_strs": list(out.tokens) if strs else None})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _json(request, "detokenize")
        self._model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise HTTPError(400, "tokens must be a list of token ids", param="tokens")
        self._check_ids(ids, "tokens")
        out = tokens.detokenize(router_pb2.DetokenizeRequest(ids=ids), self.svc.tokenizer,
                                self.svc.model_info.vocab_size)
        return web.json_response({"prompt": out.text})

    def _check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.svc.model_info.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise HTTPError(400, f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    # -- the shared path ----------------------------------------------------------------------
    async def _serve(self, request, body: dict, prompts: list, chat: bool) -> web.StreamResponse:
        model = self._model(body)
        sampling, shape = request_sampling(body, chat)
        n = number(body, "n", int, lo=1) or 1
        if n > MAX_N:
            raise HTTPError(400, f"n must be at most {MAX_N}, got {n}", param="n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise HTTPError(400, "stream must be true or false", param="stream")
        include_usage = _stream_options(body.get("stream_options"), stream)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        await check_max_tokens(self.svc, body, chat, prompts)     # a 400 now, not a capped answer later
        reqs = [choice_request(p, sampling, j) for p in prompts for j in range(n)]       # OpenAI's order of choices
        many = len(reqs) > 1
        for i, req in enumerate(reqs):
            req.request_id = f"{rid}-{i}" if many else rid
        # a prompt's first choice runs alone until its first token: the others find its KV in the prefix cache
        gates = [asyncio.Event() for _ in prompts]
        choices = [Choice(i, req, gates[i // n], first=i % n == 0) for i, req in enumerate(reqs)]
        if stream:                                     # several prompts too: each chunk names its choice
            return await self._stream(request, choices, rid, model, chat, shape, include_usage)
        results = await _all(self._whole(request, c) for c in choices)
        created = int(time.time())
        out, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        cached = 0
        for c, result in zip(choices, results, strict=True):
            if chat:
                out.append({"index": c.index, "message": chat_message(result.text, result.reasoning, result.calls),
                            "finish_reason": result.reason,
                            "logprobs": chat_logprobs(result.logprobs, self.texts) if shape.logprobs else None})
            else:
                out.append(self._completion_choice(c.index, c.req, result, shape))
            u = result.usage
            if c.first:                                # a prompt counts once, however many choices
                usage["prompt_tokens"] += u.prompt_tokens
                cached += u.cached_prompt_tokens
            usage["completion_tokens"] += 0 if shape.echo_only else u.completion_tokens
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": model, "choices": out, "usage": usage})

    @property
    def texts(self) -> TokenTexts:
        if self._texts is None:
            self._texts = TokenTexts(self.svc.tokenizer)
        return self._texts

    def _completion_choice(self, i: int, req, result: Result, shape: Shape) -> dict:
        text, items = result.text, result.logprobs
        if shape.echo_only:                          # max_tokens 0: the prompt alone
            text, items, result.reason = "", [], "length"
        prompt = self._echo(req, result) if shape.echo else None
        if prompt is not None:
            text = prompt[0] + text
            items = prompt[1] + items
        logprobs = completion_logprobs(items, self.texts) if shape.logprobs else None
        return {"index": i, "text": text, "finish_reason": result.reason, "logprobs": logprobs}

    def _echo(self, req, result: Result) -> tuple[str, list[Entry]]:
        """The prompt's text, and (with logprobs) its tokens' entries."""
        ids = list(req.tokens.ids) if req.WhichOneof("input") == "tokens" else None
        text = req.text if ids is None else self.svc.tokenizer.decode(ids, skip_special_tokens=False)
        if not result.prompt_logprobs:
            return text, []
        first = ids[0] if ids is not None else encode_text(self.svc.tokenizer, req.text)[0]
        return text, prompt_entries(first, result.prompt_logprobs)

    async def _responses(self, request, c: Choice):
        """The choice's responses; a prompt's later choices start once its first has a token."""
        if not c.first:
            await c.gate.wait()
        try:
            async for resp in self.svc.generate(c.req, HttpContext(request)):
                c.gate.set()
                yield resp
        finally:
            c.gate.set()                               # (failed or ended: the others go anyway)

    async def _whole(self, request, c: Choice) -> Result:
        result = Result()
        text, reasoning = [], []
        async for resp in self._responses(request, c):
            text.append(resp.text)
            reasoning.append(resp.reasoning_text)
            result.calls.add(resp.tool_calls)
            result.logprobs += entries(resp.logprobs)
            result.prompt_logprobs += resp.prompt_logprobs
            if resp.finish_reason:
                result.reason = FINISH.get(resp.finish_reason, "stop")
                result.usage = resp.usage
        result.text = "".join(text)
        result.reasoning = "".join(reasoning)
        return result

    async def _stream(self, request, choices: list[Choice], rid: str, model: str, chat: bool, shape: Shape,
                      include_usage: bool):
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async for item in self._responses(request, c):
                    queue.put_nowait((c, item))
            except Exception as exc:                   # (its status goes to the client below)
                queue.put_nowait((c, exc))
            finally:
                queue.put_nowait((c, None))
        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            return await self._stream_events(request, queue, choices, rid, model, kind, created, chat, shape,
                                             include_usage)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stream_events(self, request, queue: asyncio.Queue, choices: list[Choice], rid, model, kind, created,
                             chat: bool, shape: Shape, include_usage: bool):
        first = await queue.get()
        if isinstance(first[1], Exception):            # errors before the first token are plain HTTP errors
            raise first[1]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        request[STREAMING] = True
        sent_chars = {c.index: 0 for c in choices}   # of a completion's text (its logprobs' text_offset)

        async def send(obj) -> None:
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

        def chunk(i: int, text: str | None, reason: str | None, items: list[Entry] | None = None,
                  role: bool = False, parsed: dict | None = None) -> dict:
            logprobs = None
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
                if parsed:                             # reasoning and tool calls (chat.py: chat_delta)
                    if not text:
                        delta.pop("content", None)
                    delta.update(parsed)
                if shape.logprobs and not role:
                    logprobs = chat_logprobs(items or [], self.texts)
                choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
            else:
                if shape.logprobs:
                    logprobs = completion_logprobs(items or [], self.texts, sent_chars[i])
                sent_chars[i] += len(text or "")
                choice = {"index": i, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
            return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}

        if chat:
            for c in choices:
                await send(chunk(c.index, None, None, role=True))
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_prompt_tokens": 0}
        started, open_ = set(), len(choices)
        c, item = first
        while True:
            if item is None:
                open_ -= 1
                if not open_:
                    break
            elif isinstance(item, Exception):          # after the headers: the error goes in the stream
                error = item if isinstance(item, ServiceError) else ServiceError(
                    grpc.StatusCode.INVALID_ARGUMENT if isinstance(item, ValueError) else grpc.StatusCode.INTERNAL,
                    str(item))
                await send(from_service_error(error).body())
            else:
                if not chat and shape.echo and c.index not in started:
                    text, items = self._echo(c.req, Result(prompt_logprobs=list(item.prompt_logprobs)))
                    await send(chunk(c.index, text, None, items))
                started.add(c.index)
                await self._send_item(send, chunk, c, item, shape, usage)
            c, item = await queue.get()
        if include_usage and usage["prompt_tokens"]:
            await send({"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                        "usage": _usage(router_pb2.Usage(**usage))})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    async def _send_item(send, chunk, c: Choice, item, shape: Shape, usage: dict) -> None:
        reason = FINISH.get(item.finish_reason) if item.finish_reason else None
        if shape.echo_only:                            # max_tokens 0: no generated token is shown
            item = _without_tokens(item)
            reason = reason and "length"
        # new tokens whose text is held back (half a character, a possible stop string) or empty
        # (special tokens) still make an event, with empty text: the client sees progress, as
        # a gRPC client does, and a token's time is when it came, not when its text did
        if item.text or item.token_ids or reason:
            await send(chunk(c.index, item.text if item.text or item.token_ids else None, reason,
                             entries(item.logprobs), parsed=chat_delta(item)))
        if reason:
            u = item.usage
            if c.first:
                usage["prompt_tokens"] += u.prompt_tokens
                usage["cached_prompt_tokens"] += u.cached_prompt_tokens
            usage["completion_tokens"] += 0 if shape.echo_only else u.completion_tokens

    def _model(self, body: dict) -> str:
        model = body.get("model")
        if model is None:
            return self.names[0]
        if model not in self.names:
            raise HTTPError(404, f"model {model!r} does not exist here; GET /v1/models lists {self.names}",
                            "invalid_request_error", param="model", code="model_not_found")
        return model


def _unrouted(request: web.Request, exc: web.HTTPException) -> str:
    """What a client that asked for a path or method this API does not serve should do instead."""
    served = sorted({(r.method, r.resource.canonical) for r in request.app.router.routes() if r.method != "HEAD"},
                    key=lambda mp: mp[1])
    if exc.status == 404:
        paths = ", ".join(f"{m} {p}" for m, p in served)
        return f"{request.method} {request.path} is not served here (Baton serves {paths})"
    if exc.status == 405:
        methods = sorted({m for m, p in served if p == request.path})
        return f"{request.method} {request.path}: use {' or '.join(methods)}"
    return exc.reason or "error"


def _stream_options(options, stream: bool) -> bool:
    """stream_options' include_usage; as OpenAI's and vLLM's, only with stream true, and (as every field
    here) none of its keys ignored: include_obfuscation only pads OpenAI's events, so any value is kept."""
    if options is None:
        return False
    if not isinstance(options, dict):
        raise HTTPError(400, "stream_options must be an object", param="stream_options")
    if not stream:
        raise HTTPError(400, "stream_options is only allowed with stream: true", param="stream_options")
    for key, value in options.items():
        if key in ("include_usage", "include_obfuscation"):
            if value not in (None, True, False):
                raise HTTPError(400, f"stream_options.{key} must be true or false, got {value!r:.60}",
                                param="stream_options")
        elif not (key == "continuous_usage_stats" and value in (None, False)):
            raise HTTPError(400, f"stream_options.{key} is not supported by Baton; leave it unset (got {value!r:.60})",
                            param="stream_options")
    return bool(options.get("include_usage"))


def _field_named(message: str) -> str | None:
    """The request field a validation message starts with ("min_p must be in [0, 1]..."), if any."""
    if message.startswith("stop token id"):                            # the engine's words for stop_token_ids
        return "stop_token_ids"
    word = message.split(" ", 1)[0].split("[", 1)[0].rstrip(":")        # "tools[0] (f): ..." names tools
    if word in ("chat", "chat.messages"):                               # "chat message 0 has role ...": gRPC's words
        return "messages"
    return word if word in HONOURED["completions"] | HONOURED["chat"] else None


async def _all(coroutines) -> list:
    """Their results, in order; the first failure cancels the others (each frees its blocks)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _without_tokens(item):
    """A response with its generated tokens taken out (echo with max_tokens 0)."""
    out = router_pb2.GenerateResponse()
    out.CopyFrom(item)
    del out.token_ids[:]
    del out.logprobs[:]
    out.text = ""
    return out


def _usage(u) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


async def _json(request: web.Request, endpoint: str) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HTTPError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the body must be a JSON object")
    refused = refusal(endpoint, body)
    if refused is not None:
        raise HTTPError(400, refused[1], param=refused[0])
    return body


def _chat_request(body: dict) -> router_pb2.GenerateRequest:
    """A chat body's messages (text, images, audio, tool calls) and tools as a gRPC chat request."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list of {role, content}", param="messages")
    req = router_pb2.GenerateRequest()
    images = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HTTPError(400, f"messages[{i}] must be an object with a string role", param="messages")
        role = ROLES.get(m["role"], m["role"])
        content = m.get("content")
        if _has_images(content):
            parts = _parts(content, i, images)
            images += sum(p.HasField("image") or p.HasField("audio") for p in parts)
            message = req.chat.messages.add(role=role, parts=parts)
        else:
            message = req.chat.messages.add(role=role, content=_content(content, i))
        message_fields(m, i, message)
    chat_fields(body, req.chat)
    return req


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise HTTPError(400, f"messages[{i}].content: each part must be a text, image_url or input_audio object",
                                param="messages")
            parts.append(part["text"])
        return "\n".join(parts)         # as the offline LLM.chat and gRPC parts join text-only parts
    raise HTTPError(400, f"messages[{i}].content must be a string or a list of text / image_url / input_audio parts",
                    param="messages")


def _has_images(content) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") != "text" for p in content)


def _parts(content: list, i: int, images_before: int) -> list[router_pb2.ChatContentPart]:
    """Text, image_url and input_audio parts -> the gRPC chat's parts (`images_before`: the chat's
    images and clips in earlier messages). Images come inline as data: URLs (base64), audio as
    input_audio's base64 data; an http(s) URL is refused, since the server fetches nothing from the network."""
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(router_pb2.ChatContentPart(text=part["text"]))
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            try:
                image = decode_data_url(url, images_before + sum(p.HasField("image") for p in parts))
            except ValueError as exc:
                raise HTTPError(400, f"messages[{i}].content[{j}]: {exc}", param="messages") from None
            parts.append(router_pb2.ChatContentPart(image=router_pb2.Image(data=image.data,
                                                                            mime_type=image.mime_type)))
        elif kind == "input_audio":
            clip = part.get("input_audio")
            try:
                if not isinstance(clip, dict):
                    raise ValueError("input_audio must be an object {data: base64, format: wav | mp3}")
                audio = decode_base64_audio(clip.get("data"), clip.get("format"),
                                            images_before + sum(p.HasField("audio") for p in parts))
            except ValueError as exc:
                raise HTTPError(400, f"messages[{i}].content[{j}]: {exc}", param="messages") from None
            parts.append(router_pb2.ChatContentPart(audio=router_pb2.Audio(data=audio.data, format=audio.format)))
        else:
            raise HTTPError(400, f"messages[{i}].content[{j}] must be a text part, an image_url part "
                                 "(a data: URL) or an input_audio part", param="messages")
    return parts
