"""The OpenAI-compatible HTTP app: FastAPI on one :class:`acb.AsyncEngine`.

A client of the library like any user's code: it only calls the engine's public API
(``submit_nowait``, handles, ``stats``, ``start``/``shutdown``).

- ``/health`` answers 200 once the engine has started, 503 before and while shutting down.
- Every error is an OpenAI-style body (:class:`APIError`): 400 bad parameters (the engine's
  own validation messages), 401 bad API key, 404 unknown model, 413 body over the limit,
  429 queue full (``Retry-After``), 503 not ready.
- A client that goes away cancels its request: a stream's task is cancelled by the server,
  and a non-streamed request watches for the disconnect while it waits.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

import acb
from acb.errors import EngineDeadError, EngineNotRunningError, QueueFullError, RequestFailedError
from acb.outputs import GenerationOutput
from acb.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, read_body
from acb.telemetry import ServerSpan, Telemetry, request_attributes
from acb.text import token_bytes

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 << 20


class ServerState:
    """What the app shares between requests."""

    def __init__(self, engine: acb.AsyncEngine, model_name: str, api_key: str | None, max_body_bytes: int,
                 on_ready: Callable[[], None] | None, telemetry: Telemetry | None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.on_ready = on_ready
        self.ready = False
        self.closing = False
        self.created = int(time.time())
        self.telemetry = telemetry
        self.token_cache: dict[int, tuple[str, list[int]]] = {}

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer


def build_app(engine: acb.AsyncEngine, model_name: str, *, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, on_ready: Callable[[], None] | None = None,
              telemetry: Telemetry | None = None) -> FastAPI:
    """The app serving ``engine`` as ``model_name``. The engine is started in the background
    when the app starts (``/health`` says when it is ready) and stopped when it stops.
    ``telemetry`` (from ``acb.telemetry.configure(prometheus=True)``) gives ``/metrics``; each
    request gets a SERVER span when a tracer provider is set."""
    state = ServerState(engine, model_name, api_key, max_body_bytes, on_ready, telemetry)
    engine.model_name = model_name  # the name in the engine's spans and metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_start_engine, state)
            try:
                yield
            finally:
                state.closing = True
                tg.cancel_scope.cancel()
        await engine.shutdown(cancel_pending=True)

    app = FastAPI(title="acb", lifespan=lifespan)
    app.state.acb = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.get("/health")
    async def health() -> Response:
        if state.ready and not state.closing:
            return PlainTextResponse("ok")
        return PlainTextResponse("starting" if not state.closing else "shutting down", status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        tel = state.telemetry
        if tel is None or tel.prometheus_registry is None:
            raise APIError(404, "metrics are not configured (acb.telemetry.configure(prometheus=True))",
                           code="not_found")
        return Response(tel.prometheus_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _authorize(state, request)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "acb"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _parse(state, request, ChatCompletionRequest)
        assert isinstance(body, ChatCompletionRequest)
        if state.tokenizer is None:
            raise APIError(400, "the served model has no tokenizer: chat needs one", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        sampling = body.sampling(body.max_new_tokens(), body.logprobs_k())
        span = _server_span(state, request, "chat", sampling, body.stream)
        try:
            with span.active():
                handles = [_submit(state, messages, sampling, chat_template_kwargs=body.chat_template_kwargs)]
        except APIError as exc:
            span.finish(error_type=str(exc.status), message=str(exc))
            raise
        return await _respond(state, request, body, handles, span, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(state, request, CompletionRequest)
        assert isinstance(body, CompletionRequest)
        prompts = body.prompts()
        if any(isinstance(p, str) for p in prompts) and state.tokenizer is None:
            raise APIError(400, "the served model has no tokenizer: send token ids", param="prompt")
        sampling = body.sampling(body.max_tokens, body.logprobs)
        span = _server_span(state, request, "text_completion", sampling, body.stream)
        handles: list[Any] = []
        try:
            with span.active():
                for p in prompts:
                    handles.append(_submit(state, p, sampling))
        except BaseException as exc:
            for h in handles:
                h.cancel()
            span.finish(error_type=str(exc.status) if isinstance(exc, APIError) else type(exc).__name__,
                        message=str(exc))
            raise
        return await _respond(state, request, body, handles, span, chat=False)

    return app


async def _start_engine(state: ServerState) -> None:
    await anyio.to_thread.run_sync(state.engine.start)
    state.ready = True
    if state.on_ready is not None:
        state.on_ready()


def _authorize(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", type="authentication_error",
                       code="invalid_api_key")


async def _parse(state: ServerState, request: Request, schema: type[ChatCompletionRequest] | type[CompletionRequest]
                 ) -> ChatCompletionRequest | CompletionRequest:
    _authorize(state, request)
    if not state.ready or state.closing:
        raise APIError(503, "the engine is not ready" if not state.closing else "the server is shutting down",
                       type="server_error", headers={"Retry-After": "1"})
    raw = await read_body(request, state.max_body_bytes)
    try:
        body = schema.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise APIError(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")),
                       param=where or None) from None
    if body.model != state.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")
    body.check_refused()
    return body


def _server_span(state: ServerState, request: Request, operation: str, sampling: acb.SamplingParams,
                 stream: bool) -> ServerSpan:
    """The request's SERVER span (continuing the caller's ``traceparent``)."""
    attrs = {**request_attributes(sampling), "gen_ai.request.stream": stream,
             "http.request.method": request.method, "url.path": request.url.path,
             "server.address": request.url.hostname, "server.port": request.url.port}
    return ServerSpan(request.headers, operation, state.model_name, attrs)


def _submit(state: ServerState, prompt: Any, sampling: acb.SamplingParams, **kw: Any) -> Any:
    try:
        handle = state.engine.submit_nowait(prompt, sampling, record_timestamps=True, **kw)
    except QueueFullError as exc:
        raise APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) \
            from None
    except (EngineDeadError, EngineNotRunningError) as exc:
        raise APIError(503, str(exc), type="server_error") from None
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), param="prompt" if "prompt" in str(exc) else None) from None
    return handle


# ------------------------------------------------------------------ responses
def _finish_reason(out: Any) -> str | None:
    reason = getattr(out, "finish_reason", None)
    return None if reason is None else str(reason.value)


def _token(state: ServerState, token: int) -> tuple[str, list[int]]:
    """A token's text and bytes for logprobs. A token that is only part of a UTF-8 character
    keeps its own bytes, and its text shows them escaped (``\\xe2``), so tokens stay distinct."""
    found = state.token_cache.get(token)
    if found is None:
        tok = state.tokenizer
        raw = b"" if tok is None else token_bytes(tok, token)
        found = state.token_cache[token] = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
    return found


def _token_text(state: ServerState, token: int) -> str:
    return _token(state, token)[0]


def _chat_logprobs(state: ServerState, tokens: list[int], logprobs: list[float] | None,
                   top: list[list[tuple[int, float]]] | None) -> dict[str, Any] | None:
    if logprobs is None or not logprobs and tokens:
        return None
    content = []
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        text = _token_text(state, t)
        alts = top[i] if top is not None and i < len(top) else []
        content.append({"token": text, "logprob": lp, "bytes": _token(state, t)[1],
                        "top_logprobs": [{"token": _token_text(state, a), "logprob": alp,
                                          "bytes": _token(state, a)[1]} for a, alp in alts]})
    return {"content": content}


def _text_logprobs(state: ServerState, tokens: list[int], logprobs: list[float] | None,
                   top: list[list[tuple[int, float]]] | None, offset: int) -> dict[str, Any] | None:
    if logprobs is None or not logprobs and tokens:
        return None
    texts = [_token_text(state, t) for t in tokens]
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": texts, "token_logprobs": list(logprobs[:len(tokens)]),
            "top_logprobs": [{_token_text(state, a): alp for a, alp in (top[i] if top else [])}
                             for i in range(len(tokens))],
            "text_offset": offsets}


def _samples(out: GenerationOutput) -> list[Any]:
    return list(out.samples) if out.samples else [out]


def _usage(outs: list[GenerationOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_ids) for o in outs)
    completion = sum(len(s.generated_tokens) for o in outs for s in _samples(o))
    cached = sum(o.num_cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _respond(state: ServerState, request: Request, body: Any, handles: list[Any], span: ServerSpan, *,
                   chat: bool) -> Response:
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(state, rid, body, handles, span, chat, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    outs = await _await_all(state, request, handles, span)
    n = body.n
    choices = []
    for p, out in enumerate(outs):
        for s in _samples(out):
            index = p * n + getattr(s, "index", 0)
            text = s.text or ""
            if chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": _chat_logprobs(state, s.generated_tokens, s.logprobs if body.logprobs
                                                           else None, s.top_logprobs),
                                "finish_reason": _finish_reason(s)})
            else:
                choices.append({"index": index, "text": text,
                                "logprobs": _text_logprobs(state, s.generated_tokens, s.logprobs
                                                           if body.logprobs is not None else None,
                                                           s.top_logprobs, 0),
                                "finish_reason": _finish_reason(s)})
    result = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
              "model": state.model_name, "choices": choices, "usage": _usage(outs)}
    return JSONResponse(result)


async def _await_all(state: ServerState, request: Request, handles: list[Any], span: ServerSpan
                     ) -> list[GenerationOutput]:
    """Every handle's final output; the client going away cancels them all."""
    outs: list[GenerationOutput | None] = [None] * len(handles)

    async def one(i: int) -> None:
        outs[i] = await handles[i].result()

    try:
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                while not await request.is_disconnected():
                    await anyio.sleep(0.05)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            async with anyio.create_task_group() as inner:
                for i in range(len(handles)):
                    inner.start_soon(one, i)
            tg.cancel_scope.cancel()  # all done: stop watching
    except RequestFailedError as exc:
        span.finish(error_type="request", message=str(exc))
        raise APIError(500, str(exc), type="server_error") from None
    except EngineDeadError as exc:
        span.finish(error_type="engine_dead", message=str(exc))
        raise APIError(503, str(exc), type="server_error") from None
    finally:
        for h in handles:
            h.cancel()  # a no-op for ended requests; the rest: the client left
        if any(o is None for o in outs):  # the client disconnected (or the server is stopping)
            span.finish(error_type="cancelled", message="client disconnected")
    if any(o is None for o in outs):
        raise APIError(499, "client disconnected")
    done = [o for o in outs if o is not None]
    span.finish(done)
    return done


async def _stream(state: ServerState, rid: str, body: Any, handles: list[Any], span: ServerSpan, chat: bool,
                  include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    n = body.n

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        data: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": state.model_name,
                                "choices": choices}
        if include_usage:
            data["usage"] = usage
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    finals: list[GenerationOutput] = []
    offsets: dict[int, int] = {}
    ended = False
    try:
        if chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(handles) * n)])
        # one prompt after the other (no task group across yields): all of them run in the
        # engine meanwhile, and a later prompt's deltas wait, coalesced, in its handle
        for p, handle in enumerate(handles):
            async for delta in handle:
                index = p * n + delta.sample_index
                choices = []
                if delta.token_ids or delta.text:
                    lp = delta.logprobs if (body.logprobs if chat else body.logprobs is not None) else None
                    if chat:
                        choices.append({"index": index, "delta": {"content": delta.text or ""},
                                        "logprobs": _chat_logprobs(state, delta.token_ids, lp,
                                                                   delta.top_logprobs),
                                        "finish_reason": None})
                    else:
                        off = offsets.get(index, 0)
                        choices.append({"index": index, "text": delta.text or "",
                                        "logprobs": _text_logprobs(state, delta.token_ids, lp,
                                                                   delta.top_logprobs, off),
                                        "finish_reason": None})
                        offsets[index] = off + len(delta.text or "")
                if delta.finished and delta.output is not None:
                    finals.append(delta.output)
                    for s in _samples(delta.output):
                        i = p * n + getattr(s, "index", 0)
                        same = next((c for c in choices if c["index"] == i), None)
                        if same is not None:  # the sample's last piece carries its finish reason
                            same["finish_reason"] = _finish_reason(s)
                            continue
                        end: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": _finish_reason(s)}
                        end.update(delta={}) if chat else end.update(text="")
                        choices.append(end)
                if choices:
                    yield chunk(choices)
        if include_usage:
            yield chunk([], _usage(finals))
        ended = True
        span.finish(finals)
        yield "data: [DONE]\n\n"
    except (RequestFailedError, EngineDeadError) as exc:
        span.finish(error_type="request" if isinstance(exc, RequestFailedError) else "engine_dead", message=str(exc))
        err = APIError(500, str(exc), type="server_error")
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        for h in handles:
            h.cancel()
        if not ended:
            span.finish(error_type="cancelled", message="client disconnected")
