"""The HTTP API of `rocketkv serve` (Starlette, served by uvicorn): docs/serve.md.

    GET  /health                    liveness and what is warm (no key needed)
    GET  /v1/models                 the warm caches as OpenAI models (`kv:<path>`)
    GET  /v1/models/{model}         one `kv:<path>` model (`models.retrieve`), 404 if no cache is there
    POST /v1/chat/completions       OpenAI chat completions over a cache (SSE with "stream": true)
    POST /v1/rocketkv/ask           rocketkv's own protocol (NDJSON events; what `rocketkv ask` uses)
    POST /v1/rocketkv/summarize     a cache's summary (NDJSON events; what `rocketkv summarize` uses)
    POST /v1/ingest                 ingest a document into a .kv file (progress as SSE)
    POST /v1/rocketkv/shutdown      stop the server

Every request passes `Guard` first: the Bearer key when the server has one, the body size limit,
and the bounded queue (503 with Retry-After beyond it). Every refusal is a JSON error object
(`{"error": {"message", "type", "hint", ...}}`) and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse as StarletteJSON
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .. import __version__
from ..api.preflight import check_cache_file
from ..errors import CacheFormatError
from .jobs import (
    AskRequest,
    BadRequest,
    BatchTaskRequest,
    IngestRequest,
    Job,
    SummarizeRequest,
    allowed_path,
    answer_job,
    batch_job,
    ingest_job,
    summarize_job,
)
from .warm import Warm

# a ModelLoadError is the request's: the model it named, or a device it asked for, cannot load
ERROR_STATUS = {"UsageError": 400, "InputError": 400, "BudgetError": 400, "CacheFormatError": 422,
                "ModelLoadError": 400, "OutputError": 409}  # fmt: skip
FINISH = {"length": "length"}  # every other stop reason (eos, stop string, repetition) is "stop"


@dataclass
class ServeState:
    """The server's settings and counters. `roots`: the allowed folders (None: any path); `active`:
    requests being answered or waiting for the decode lock; `last_activity`: monotonic seconds.
    `in_flight()` also counts jobs still running whose client has left (a long question's chunk)."""

    warm: Warm
    roots: tuple[Path, ...] | None
    api_key: str | None
    url: str
    idle_timeout_s: float
    max_queue: int
    max_body_bytes: int
    max_tokens_limit: int
    trust_remote_code: bool = False
    host: str | None = None  # TCP: the host given (Host headers must name it or loopback); None: a Unix socket
    started: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)
    active: int = 0
    served: int = 0
    stop: asyncio.Event | None = None

    def in_flight(self) -> int:
        return max(self.active, Job.live)

    def health(self) -> dict:
        return {"service": "rocketkv", "status": "ok", "version": __version__, "pid": os.getpid(), "url": self.url,
                "threads": self.warm.current_threads, "threads_fixed": self.warm.threads is not None,
                "uptime_s": round(time.monotonic() - self.started, 1),
                "active": self.in_flight(), "served": self.served, "max_queue": self.max_queue,
                "max_body_bytes": self.max_body_bytes,
                "idle_timeout_s": self.idle_timeout_s, "cancelled": Job.cancelled_total,
                **self.warm.describe()}  # fmt: skip


def encoded(obj: Any) -> bytes:
    """`obj` as JSON in UTF-8; where a string holds a lone surrogate (a file name that is not UTF-8,
    a `\\ud800` sent in a request), the whole text in ASCII escapes instead, which every JSON reader
    reads back, rather than a UnicodeEncodeError that cut the response (and broke /health for good
    once such a path was warm)."""
    try:
        return json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(obj).encode()


class JSONResponse(StarletteJSON):
    """Starlette's JSON response; where a string holds a lone surrogate, in ASCII escapes (as `encoded`)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()


def error_response(exc: BadRequest) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 503 and exc.retry else None  # busy, not stopping
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class Guard:
    """ASGI middleware: authentication, body size, the queue bound, and the activity counters."""

    def __init__(self, app, state: ServeState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        refusal = self.refuse(scope)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        counted = scope["method"] == "POST" and scope["path"] != "/v1/rocketkv/shutdown"
        if counted:
            state.active += 1
            state.last_activity = time.monotonic()
        try:
            await self.app(scope, _limited(receive, state.max_body_bytes), send)
        finally:
            if counted:
                state.active -= 1
                state.served += 1
                state.last_activity = time.monotonic()

    def refuse(self, scope) -> BadRequest | None:
        state = self.state
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if state.api_key is not None and scope["path"] != "/health":
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                return BadRequest(401, "missing or wrong API key", "InputError",
                                  "send Authorization: Bearer KEY (ROCKETKV_API_KEY for rocketkv ask)")  # fmt: skip
        if state.host is not None:  # a web page's request through DNS rebinding names its own host
            host = headers.get("host", "")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name.strip("[]") not in {state.host.strip("[]"), "localhost", "127.0.0.1", "::1"}:
                return BadRequest(403, f"Host {host!r} is not this server's", "InputError")
        if (
            scope["method"] == "POST"
            and scope["path"].startswith("/v1/")  # a POST elsewhere: 404 or 405 as routed
            and headers.get("content-type", "").split(";")[0].strip().lower() != "application/json"
        ):  # a media type is case-insensitive, its parameters (charset) aside; `application/jsonx` is not JSON
            return BadRequest(415, "send the body as Content-Type: application/json", "InputError")
        codings = [
            c.strip()
            for k, v in scope.get("headers", [])
            if k.lower() == b"content-encoding"
            for c in v.decode("latin-1").split(",")
        ]  # every header's every coding: the dict keeps the last
        coding = next((c for c in codings if c.lower() not in ("", "identity")), None)
        if scope["method"] == "POST" and coding is not None:  # a compressed body read as JSON was "not JSON"
            return BadRequest(415, f"Content-Encoding {coding[:40]!r} is not supported", "InputError",
                              "send the body uncompressed")  # fmt: skip
        length = headers.get("content-length")
        if length is not None and "transfer-encoding" in headers:  # which one frames the body? (RFC 9112 §6.1)
            return BadRequest(400, "Content-Length and Transfer-Encoding both given", "InputError",
                              "send one of them")  # fmt: skip
        if length is not None and (not length.isdigit() or int(length) > state.max_body_bytes):
            return BadRequest(413, f"request body over {state.max_body_bytes} bytes", "InputError", TOO_LARGE_HINT)
        busy = state.in_flight()  # a left client's job may still wait for the lock: it counts
        if scope["method"] == "POST" and scope["path"] != "/v1/rocketkv/shutdown" and busy >= state.max_queue:
            return BadRequest(503, f"the server is busy ({busy} requests in flight)", "RocketKVError",
                              "try again in a moment")  # fmt: skip
        return None


TOO_LARGE_HINT = "send a smaller request (rocketkv's commands: --no-server answers without the server)"
BODY_TIMEOUT_S = 20.0  # seconds between a request's start and the end of its body


def _limited(receive, limit: int, timeout_s: float = BODY_TIMEOUT_S):
    """`receive` that stops a chunked body (no Content-Length) at `limit` bytes, and a body not
    complete `timeout_s` seconds after the request began (408: a Content-Length larger than what
    is sent would otherwise hold a place in the queue for as long as the client keeps its socket
    open). After the body, `receive` waits as long as it must (a streamed answer's disconnect)."""
    seen, done, deadline = [0], [False], time.monotonic() + timeout_s

    async def wrapped():
        if done[0]:
            return await receive()
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
            raise BadRequest(408, f"the request body did not arrive within {timeout_s:.0f} s") from None
        if message["type"] == "http.request":
            seen[0] += len(message.get("body", b""))
            if seen[0] > limit:
                raise BadRequest(413, f"request body over {limit} bytes", "InputError", TOO_LARGE_HINT)
            done[0] = not message.get("more_body", False)
        else:
            done[0] = True
        return message

    return wrapped


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except ClientDisconnect:  # the client left before its body arrived: nothing to answer, nothing to log
        raise ClientGone() from None
    except (ValueError, UnicodeDecodeError):
        raise BadRequest(400, "the request body is not JSON") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise BadRequest(400, "the request body is JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "the request body must be a JSON object")
    return body


class ClientGone(Exception):
    """The client disconnected before its response started: the job is cancelled, nothing is sent."""


async def _next_event(job: Job, request: Request) -> dict | None:
    """The job's next event; cancels the job and raises ClientGone if the client goes meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(job.queue.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()
                raise ClientGone() from None


def _status_of(event: dict) -> BadRequest:
    kind = str(event.get("type", "RocketKVError"))
    code = event.get("code")
    status = code if isinstance(code, int) else ERROR_STATUS.get(kind, 500)
    return BadRequest(status, str(event.get("message")), kind, event.get("hint"), retry=False)


async def _events(job: Job, first: dict | None) -> AsyncIterator[dict]:
    """The job's events from `first` on; the job is cancelled when the consumer stops early."""
    finished = False
    try:
        event = first
        while event is not None:
            yield event
            event = await job.queue.get()
        finished = True
    finally:
        if not finished:
            job.cancelled.set()


def _ndjson(job: Job, first: dict | None) -> StreamingResponse:
    """The job's events as NDJSON lines, `{"event": "done"}` last (rocketkv's own protocol)."""

    async def lines() -> AsyncIterator[bytes]:
        async for event in _events(job, first):
            yield encoded(event) + b"\n"
        yield b'{"event": "done"}\n'

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def _start(request: Request, work, *args, skip: tuple[str, ...] = ()) -> tuple[Job, dict | None]:
    """Run `work` as a job; (the job, its first event). An error as the first event is the
    response's HTTP status; events of the kinds in `skip` (a model's load: `status`, `log`, which
    an OpenAI client has no use for) are dropped first, so that an error after them is one too."""
    job = Job(asyncio.get_running_loop())
    job.announce = request.headers.get("x-rocketkv-events", "").strip().lower() == "status" and not skip
    job.run(work, *args)
    first = await _next_event(job, request)
    while first is not None and first.get("event") in skip:
        first = await _next_event(job, request)
    if first is not None and first.get("event") == "error":
        raise _status_of(first)
    return job, first


def build_app(state: ServeState) -> Guard:
    """The ASGI application for `state` (Starlette routes inside `Guard`)."""

    async def health(request: Request) -> Response:
        return JSONResponse(state.health())

    async def models(request: Request) -> Response:
        warm = state.warm.describe()["caches"]
        data = [{"id": f"kv:{p}", "object": "model", "created": 0, "owned_by": "rocketkv"} for p in warm]
        return JSONResponse({"object": "list", "data": data})

    async def model(request: Request) -> Response:
        """One model as `models.retrieve` asks for it: a `kv:` cache the server may read, or 404."""
        name = request.path_params["name"]
        if name.startswith("kv:"):
            try:
                check_cache_file(allowed_path(name[3:], state.roots, "the model's cache"))  # a cache: its header
            except CacheFormatError:
                pass
            else:
                return JSONResponse({"id": name, "object": "model", "created": 0, "owned_by": "rocketkv"})
        raise BadRequest(404, f"model {name[:200]!r} not found", hint="name a cache as kv:/path/to/doc.kv")

    async def ask(request: Request) -> Response:
        req = AskRequest.parse(
            await _json_body(request), state.roots, None, state.trust_remote_code
        )  # as the CLI: the context bounds it
        job, first = await _start(request, answer_job, state.warm, req)
        return _ndjson(job, first)

    async def summarize(request: Request) -> Response:
        req = SummarizeRequest.parse(await _json_body(request), state.roots, state.trust_remote_code)
        job, first = await _start(request, summarize_job, state.warm, req)
        return _ndjson(job, first)

    async def batch_task(request: Request) -> Response:
        req = BatchTaskRequest.parse(await _json_body(request), state.roots, state.trust_remote_code)
        job, first = await _start(request, batch_job, state.warm, req)
        return _ndjson(job, first)

    async def chat_completions(request: Request) -> Response:
        body = await _json_body(request)
        req = AskRequest.parse(openai_to_ask(body, state.max_tokens_limit), state.roots, state.max_tokens_limit,
                               state.trust_remote_code)  # fmt: skip
        job, first = await _start(request, answer_job, state.warm, req, skip=("status", "log"))
        ident, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body["model"]
        if not body.get("stream"):
            text, record, event = [], None, first
            while event is not None:  # drained here, watching for a client that leaves (it cancels)
                if event["event"] == "piece":
                    text.append(event["text"])
                elif event["event"] == "answer":
                    record = event["record"]
                elif event["event"] == "error":
                    raise _status_of(event)
                event = await _next_event(job, request)
            if record is None:
                raise BadRequest(500, "the answer was not completed", "RocketKVError")
            return JSONResponse(completion(ident, created, model, record))

        async def sse() -> AsyncIterator[bytes]:
            def chunk(delta: dict, finish: str | None) -> bytes:
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                data = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [choice]}  # fmt: skip
                return b"data: " + encoded(data) + b"\n\n"

            yield chunk({"role": "assistant", "content": ""}, None)
            async for event in _events(job, first):
                if event["event"] == "piece":
                    yield chunk({"content": event["text"]}, None)
                elif event["event"] == "answer":
                    yield chunk({}, FINISH.get(event["record"]["stop_reason"], "stop"))
                elif event["event"] == "error":
                    err = {"error": {k: event.get(k) for k in ("message", "type", "hint")}}
                    yield b"data: " + encoded(err) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    async def ingest(request: Request) -> Response:
        req = IngestRequest.parse(await _json_body(request), state.roots)
        job, first = await _start(request, ingest_job, state.warm, req)

        async def sse() -> AsyncIterator[bytes]:
            async for event in _events(job, first):
                yield f"event: {event['event']}\ndata: ".encode() + encoded(event) + b"\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    async def shutdown(request: Request) -> Response:
        if state.stop is not None:
            state.stop.set()
        return JSONResponse({"stopping": True, "pid": os.getpid()})

    async def gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it: the client closed the connection

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BadRequest)  # registered for BadRequest only
        return error_response(exc)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        if status == 405:  # the endpoint exists, for another method
            allow = ", ".join(sorted(filter(None, (getattr(exc, "headers", None) or {}).get("Allow", "").split(", "))))
            response = error_response(BadRequest(405, f"{request.method} is not allowed on {request.url.path}",
                                                 hint=f"use {allow}" if allow else None))  # fmt: skip
            if allow:
                response.headers["Allow"] = allow  # set in hash order by Starlette: sorted here
            return response
        return error_response(BadRequest(status, f"no such endpoint: {request.method} {request.url.path}"))

    async def failed(request: Request, exc: Exception) -> Response:
        """A failure no check foresaw: a JSON 500 (the client's one line), the trace in the server's
        log (Starlette logs it after this response)."""
        return error_response(BadRequest(500, "the server failed unexpectedly (its log has the details)",
                                         "RocketKVError"))  # no internals to a TCP client  # fmt: skip

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{name:path}", model, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/rocketkv/ask", ask, methods=["POST"]),
            Route("/v1/rocketkv/summarize", summarize, methods=["POST"]),
            Route("/v1/rocketkv/batch", batch_task, methods=["POST"]),
            Route("/v1/ingest", ingest, methods=["POST"]),
            Route("/v1/rocketkv/shutdown", shutdown, methods=["POST"]),
        ],
        exception_handlers={BadRequest: refused, ClientGone: gone, 404: not_found, 405: not_found, Exception: failed},
    )
    return Guard(app, state)


def openai_to_ask(body: dict, max_tokens_limit: int) -> dict:
    """An OpenAI chat-completions body as an `AskRequest` body. The document is the cache named by
    `model` = `kv:<absolute path>`, or by the extra field `cache` (then `model` may name the model).
    The question is the last user message (earlier turns are not replayed: each request is answered
    from the document alone, as `rocketkv ask` answers). `temperature` defaults to 0 (greedy, rocketkv's
    default), not OpenAI's 1. Raises BadRequest."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(400, "field 'model' must be a string",
                         hint="use model 'kv:/path/to/doc.kv'")  # fmt: skip
    if not model:
        raise BadRequest(400, "missing field 'model'", hint="use model 'kv:/path/to/doc.kv'")
    cache = body.get("cache")
    if cache is None:
        if not model.startswith("kv:"):
            raise BadRequest(400, f"model {model!r} names no cache", hint="use model 'kv:/path/to/doc.kv'")
        cache, named_model = model.removeprefix("kv:"), None
        if not cache.startswith("/"):  # say it in the user's terms: they named a model, not a 'cache' field
            raise BadRequest(
                400, f"model {model!r} must name the cache by its absolute path", hint="use model 'kv:/path/to/doc.kv'"
            )
    else:
        named_model = None if model.startswith("kv:") or model == "rocketkv" else model
        if (
            isinstance(cache, str)
            and model.startswith("kv:")
            and os.path.normpath(model[3:]) != os.path.normpath(cache)
        ):
            raise BadRequest(400, f"model {model!r} and cache {cache!r} name different caches",
                             hint="name the cache once: in model as 'kv:/path', or in 'cache'")  # fmt: skip
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "'messages' must be a non-empty list")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise BadRequest(400, "no user message to answer")
    content = users[-1].get("content")
    if isinstance(content, list):  # content parts: text only, joined
        other = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content]
        other = [kind for kind in other if kind != "text"]
        if other:  # an image or audio part left out would answer another question than the one asked
            raise BadRequest(400, f"a content part of type {str(other[0])[:40]!r} is not supported: text only",
                             "UsageError")  # fmt: skip
        parts = [p.get("text") for p in content]
        if not all(isinstance(p, str) for p in parts):
            raise BadRequest(400, "a text part's 'text' must be a string")
        content = "".join(str(p) for p in parts)
    if not isinstance(content, str):
        raise BadRequest(400, "the user message's content must be text")
    tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(tokens_field)
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        given = repr(max_tokens)[:40]
        raise BadRequest(400, f"field {tokens_field!r} must be a positive integer, got {given}", "UsageError")
    if max_tokens is not None and max_tokens > max_tokens_limit:
        raise BadRequest(400, f"{tokens_field} {max_tokens} is over this server's limit {max_tokens_limit}",
                         "UsageError")  # fmt: skip
    if body.get("stream") is not None and not isinstance(body["stream"], bool):  # "yes" or 1 pass a truth test
        raise BadRequest(400, f"field 'stream' must be true or false, got {body['stream']!r}")
    n = 1 if body.get("n") is None else body["n"]  # OpenAI's clients may send null for "not set"
    if not (type(n) is int and n == 1):  # not 1.0 or true, which equal 1 in Python
        raise BadRequest(400, "only n = 1 is supported", "UsageError")
    for name in unsupported_fields(body):  # never accepted and then ignored: the client would rely on them
        raise BadRequest(400, f"field {name!r} is not supported by rocketkv", "UsageError",
                         "leave it out (docs/serve.md lists the fields honoured)")  # fmt: skip
    return {
        "cache": cache,
        "questions": [content],
        "model": named_model,
        "max_new_tokens": max_tokens,
        "temperature": body.get("temperature", 0.0),
        "top_p": body.get("top_p", 1.0),
        "seed": body.get("seed"),
    }


def unsupported_fields(body: dict) -> list[str]:
    """The OpenAI chat-completion fields of `body` that ask for something rocketkv does not do
    (stop strings, log-probabilities, a response format, tools, logit bias, penalties): those
    given with a value other than their default."""
    defaults: dict[str, tuple] = {"stop": (None, [], ""), "logprobs": (None, False), "top_logprobs": (None, 0),
                                  "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
                                  "function_call": (None, "none"), "logit_bias": (None, {}),
                                  "presence_penalty": (None, 0), "frequency_penalty": (None, 0)}  # fmt: skip
    found = [name for name, ok in defaults.items() if name in body and body[name] not in ok]
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        found.append("response_format")
    return found


def completion(ident: str, created: int, model: str, record: dict) -> dict:
    """An OpenAI `chat.completion` object for one answer's `--json` record."""
    prompt, answer = record["n_question_tokens"], record["n_answer_tokens"]
    return {"id": ident, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": record["answer"]},
                         "finish_reason": FINISH.get(record["stop_reason"], "stop")}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": answer,
                      "total_tokens": prompt + answer}}  # fmt: skip
