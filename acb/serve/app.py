"""The OpenAI-compatible HTTP app: FastAPI on one :class:`acb.AsyncEngine`.

A client of the library like any user's code: it only calls the engine's public API
(``submit_nowait``, handles, ``config``, ``stats``, ``start``/``shutdown``).

- ``/health`` answers 200 once the engine has started, 503 before and while shutting down.
- Every error is an OpenAI-style body (:class:`APIError`): 400 bad parameters (the engine's
  own validation messages, a chat template that refuses the chat, too many prompts, an output
  constraint the engine refuses, named by the field it came from), 401 bad
  API key, 404 unknown model or path, 413 body over the limit, 429 queue full
  (``Retry-After``), 500 a request that failed in the engine (or any other failure), 503 not
  ready or shutting down. A stream that fails after it started ends with an error event and
  ``[DONE]``.
- Work that grows with what a client sends stays off the event loop: chats are rendered and
  prompts tokenized by a :class:`RenderPool` (daemon threads, each job within a time bound), and
  a request may ask for at most ``max_prompts_per_request`` completions (prompts × ``n``).
- A client that goes away cancels its request: a stream's task is cancelled by the server,
  and a non-streamed request watches for the disconnect while it waits.
- SIGINT/SIGTERM: a :class:`~acb.serve.protocol.Drain` keeps the port open (``/health`` and new
  requests 503) while requests in flight get the grace period; those still running then end
  with a 503 error body (a stream: an error event, then ``[DONE]``), and the server stops.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

import acb
from acb.errors import EngineDeadError, EngineNotRunningError, QueueFullError, RequestFailedError
from acb.outputs import GenerationOutput, RequestStatus
from acb.serve import shaping
from acb.serve.protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, Drain, DrainMiddleware, ShutdownExpired, check_choices,
    ENGINE_PARAMS, install_error_handlers, internal_error, read_body, request_param, shutdown_error,
)
from acb.serve.render_pool import DEFAULT_RENDER_THREADS, DEFAULT_RENDER_TIMEOUT, RenderPool
from acb.structured_outputs import StructuredOutputs
from acb.telemetry import ServerSpan, Telemetry, request_attributes
from acb.text import RenderedChat, TokenizedText, render_chat, text_tokenizer, token_bytes

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024  # completions (prompts × n) one request may ask for


@dataclass(frozen=True)
class AppOptions:
    """:func:`build_app`'s settings beyond the engine and the name (see its docstring)."""

    trust_request_chat_template: bool = False
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    grace_period: float | None = None
    render_timeout: float = DEFAULT_RENDER_TIMEOUT
    render_threads: int = DEFAULT_RENDER_THREADS
    tool_call_parser: str | None = None  # acb.serve.tool_parsers.TOOL_PARSERS: tool_choice "auto"
    reasoning_parser: str | None = None  # acb.serve.reasoning.REASONING_PARSERS: reasoning_content


class ServerState:
    """What the app shares between requests."""

    def __init__(self, engine: acb.AsyncEngine, model_name: str, api_key: str | None, max_body_bytes: int,
                 on_ready: Callable[[], None] | None, telemetry: Telemetry | None, options: AppOptions) -> None:
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.on_ready = on_ready
        self.options = options
        self.ready = False
        self.stopped = False
        self.created = int(time.time())
        self.telemetry = telemetry
        self.token_cache: dict[int, tuple[str, list[int]]] = {}
        self.drain = Drain(options.grace_period)
        self.renderer = RenderPool(options.render_threads, options.render_timeout)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def closing(self) -> bool:
        return self.drain.closing or self.stopped


def build_app(engine: acb.AsyncEngine, model_name: str, *, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, on_ready: Callable[[], None] | None = None,
              telemetry: Telemetry | None = None, trust_request_chat_template: bool | None = None,
              max_prompts_per_request: int | None = None, grace_period: float | None = None,
              render_timeout: float | None = None, render_threads: int | None = None,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> FastAPI:
    """The app serving ``engine`` as ``model_name``. The engine is started in the background
    when the app starts (``/health`` says when it is ready) and stopped when it stops.
    ``telemetry`` (from ``acb.telemetry.configure(prometheus=True)``) gives ``/metrics``; each
    request gets a SERVER span when a tracer provider is set.

    ``trust_request_chat_template``: accept a chat template in the request (``chat_template``,
    or in ``chat_template_kwargs``); by default a 400, since the server would run the client's
    code. ``max_prompts_per_request``: the most completions (prompts × ``n``) one request may ask
    for; more is a 400. ``grace_period``: seconds requests in flight get after SIGINT/SIGTERM
    (default: the server's own, uvicorn's ``timeout_graceful_shutdown``). ``render_timeout``:
    seconds a request's chat rendering and tokenizing may take (a 400 past it);
    ``render_threads``: how many run at once. ``tool_call_parser`` (``hermes``, ``llama3_json``):
    how ``tool_choice="auto"`` finds tool calls in the model's text (without one, ``auto`` is
    refused). ``reasoning_parser`` (``deepseek_r1``, ``qwen3``): the model's ``<think>`` text is
    returned as ``reasoning_content``. Arguments not given take :class:`AppOptions`' defaults."""
    given: dict[str, Any] = {"trust_request_chat_template": trust_request_chat_template,
                             "max_prompts_per_request": max_prompts_per_request, "grace_period": grace_period,
                             "render_timeout": render_timeout, "render_threads": render_threads,
                             "tool_call_parser": tool_call_parser, "reasoning_parser": reasoning_parser}
    options = replace(AppOptions(), **{k: v for k, v in given.items() if v is not None})
    shaping.check_parsers(options.tool_call_parser, options.reasoning_parser)
    if options.max_prompts_per_request < 1:
        raise ValueError(f"max_prompts_per_request must be >= 1, got {options.max_prompts_per_request}")
    state = ServerState(engine, model_name, api_key, max_body_bytes, on_ready, telemetry, options)
    engine.model_name = model_name  # the name in the engine's spans and metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_start_engine, state)
            tg.start_soon(state.drain.watch_signals)
            try:
                yield
            finally:
                state.stopped = True
                tg.cancel_scope.cancel()
        await engine.shutdown(cancel_pending=True)
        state.renderer.close()

    app = FastAPI(title="acb", lifespan=lifespan)
    app.state.acb = state
    app.add_middleware(DrainMiddleware, drain=state.drain)

    install_error_handlers(app)  # OpenAI error bodies on every failure path

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
        kwargs = body.template_kwargs(state.options.trust_request_chat_template)
        check_choices(1, body.n, state.options.max_prompts_per_request)
        plan = shaping.plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                                  state.options.tool_call_parser)
        if plan.template_tools is not None:  # the model's chat template renders the tools
            kwargs = {**(kwargs or {}), "tools": plan.template_tools}
        constraint = shaping.one_constraint(
            shaping.Constraint.of("response_format", shaping.structured_from_response_format(body.response_format)),
            shaping.Constraint.of("structured_outputs", shaping.structured_from_extra(body.model_extra or {})),
            plan.constraint)
        structured = None if constraint is None else constraint.spec
        messages = [shaping.history_message(m.model_dump(), m.text(), f"messages[{i}]")
                    for i, m in enumerate(body.messages)]
        sampling = body.sampling(body.max_new_tokens(), body.logprobs_k(), structured)
        span = _server_span(state, request, "chat", sampling, body.stream)
        try:
            with span.active():
                if constraint is not None:
                    spec, param = constraint.spec, constraint.param
                    await state.drain.until_expired(lambda: compile_grammar(state, spec, param))
                prompt = await state.drain.until_expired(
                    lambda: state.renderer.run(_render, state.tokenizer, messages, kwargs, _max_len(state)))
                handles = [_submit(state, prompt, sampling, fields={
                    "prompt": "messages", "prompt_ids": "messages", "logprobs": "top_logprobs",
                    "structured_outputs": None if constraint is None else constraint.param})]
        except BaseException as exc:
            _span_failed(span, exc)
            raise
        tail = state.tokenizer.decode(prompt.token_ids[-64:]) if state.options.reasoning_parser else ""
        return await _respond(state, request, body, handles, span, chat=True,
                              shaper=lambda: shaping.OutputShaper(plan, state.options.reasoning_parser, tail,
                                                                  constrained=constraint is not None))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(state, request, CompletionRequest)
        assert isinstance(body, CompletionRequest)
        prompts = body.prompts()
        check_choices(len(prompts), body.n, state.options.max_prompts_per_request)
        if any(isinstance(p, str) for p in prompts) and state.tokenizer is None:
            raise APIError(400, "the served model has no tokenizer: send token ids", param="prompt")
        structured = shaping.structured_from_extra(body.model_extra or {})
        sampling = body.sampling(body.max_tokens, body.logprobs, structured)
        span = _server_span(state, request, "text_completion", sampling, body.stream)
        handles: list[Any] = []
        try:
            with span.active():
                if structured is not None:
                    await state.drain.until_expired(lambda: compile_grammar(state, structured, "structured_outputs"))
                encoded = await state.drain.until_expired(
                    lambda: state.renderer.run(_tokenize, state.tokenizer, prompts, _max_len(state)))
                for i, p in enumerate(encoded):
                    handles.append(_submit(state, p, sampling))
                    if i % 32 == 31:
                        await anyio.sleep(0)  # each submit checks its prompt: let others in meanwhile
        except BaseException as exc:
            for h in handles:
                h.cancel()
            _span_failed(span, exc)
            raise
        return await _respond(state, request, body, handles, span, chat=False)

    from acb.serve import responses  # (it builds on this module's helpers)

    responses.add_routes(app, state)  # POST /v1/responses (the Responses API)
    return app


def _span_failed(span: ServerSpan, exc: BaseException) -> None:
    kind = str(exc.status) if isinstance(exc, APIError) else "503" if isinstance(exc, ShutdownExpired) \
        else type(exc).__name__
    span.finish(error_type=kind, message=str(exc))


# ------------------------------------------------------------------ prompts (in the render pool)
def _max_len(state: ServerState) -> int:
    return int(state.engine.config.max_model_len)


def _check_fits(ids: Sequence[int], limit: int, where: str) -> None:
    # the engine says the same at submit, after checking every token id on the event loop
    if len(ids) >= limit:
        raise ValueError(f"{where} of {len(ids)} tokens can never fit: a request may hold at most {limit} tokens "
                         "(prompt + at least one generated token)")


def _render(tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any] | None, limit: int
            ) -> RenderedChat:
    """The chat's token ids by the chat template. Any failure of the template is the request's
    (400): the template refused the chat (``raise_exception``) or broke on it."""
    try:
        ids = render_chat(tokenizer, messages, kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    except Exception as exc:  # noqa: BLE001 - whatever the template raised on this chat
        raise APIError(400, f"the chat template failed on this chat: {type(exc).__name__}: {exc}",
                       param="messages") from None
    try:
        _check_fits(ids, limit, "the rendered chat")
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    return RenderedChat(messages, ids)


def _tokenize(tokenizer: Any, prompts: list[str | list[int]], limit: int) -> list[TokenizedText | list[int]]:
    """Each text prompt with its token ids (one batched tokenizer call); token-id prompts as they are."""
    texts = [p for p in prompts if isinstance(p, str)]
    try:
        if any(not t for t in texts):
            raise ValueError("the prompt is an empty string: a request needs at least one prompt token")
        ids = iter(list(text_tokenizer(tokenizer)(texts)["input_ids"]) if texts else [])
        out: list[TokenizedText | list[int]] = []
        for i, p in enumerate(prompts):
            item: TokenizedText | list[int] = TokenizedText(p, next(ids)) if isinstance(p, str) else p
            _check_fits(item.token_ids if isinstance(item, TokenizedText) else item, limit,
                        "prompt" if len(prompts) == 1 else f"prompt[{i}]")
            out.append(item)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), param="prompt") from None
    return out


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


async def compile_grammar(state: ServerState, spec: StructuredOutputs, param: str) -> None:
    """Compile a request's grammar off the event loop before its submit
    (:meth:`acb.AsyncEngine.compile_structured_outputs`).

    Args:
        state: the server's state.
        spec: the request's constraint.
        param: the request field the constraint came from, which a refusal names.

    Raises:
        APIError: 400 for a spec the engine refuses (one that does not compile, that can never be
            met, or that is over the compile budget); 503 when the engine is not running.
    """
    try:
        await state.engine.compile_structured_outputs(spec)
    except (EngineDeadError, EngineNotRunningError) as exc:
        raise APIError(503, str(exc), type="server_error") from None
    except ValueError as exc:
        raise APIError(400, f"{param}: {str(exc).removeprefix('structured_outputs: ')}", param=param) from None


def _submit(state: ServerState, prompt: Any, sampling: acb.SamplingParams, *,
            fields: dict[str, str | None] | None = None, **kw: Any) -> Any:
    """Submit one request. The engine's refusals are 400s naming the request's field: ``fields``
    maps the engine field a refusal carries (``InvalidRequestError.field``; the others as
    :data:`~acb.serve.protocol.ENGINE_PARAMS` does) to the request's, such as
    ``structured_outputs`` to where the constraint came from (a refusal at submit: a constraint
    ``min_tokens`` can never meet)."""
    try:
        handle = state.engine.submit_nowait(prompt, sampling, record_timestamps=True, **kw)
    except QueueFullError as exc:
        raise APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) \
            from None
    except (EngineDeadError, EngineNotRunningError) as exc:
        raise APIError(503, str(exc), type="server_error") from None
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), param=request_param(exc, {**ENGINE_PARAMS, **(fields or {})})) from None
    return handle


# ------------------------------------------------------------------ responses
# acb's finish reasons that OpenAI's API lacks, as the nearest of OpenAI's: an output its grammar
# could not continue (acb's "grammar": no token was left to sample) ends before its constraint was
# met, a prefix of a match, as one cut short does
_OPENAI_FINISH = {"grammar": "length"}


def _finish_reason(out: Any) -> str | None:
    reason = getattr(out, "finish_reason", None)
    if reason is None:
        return None
    value = str(reason.value)
    return _OPENAI_FINISH.get(value, value)


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
                   chat: bool, shaper: Callable[[], shaping.OutputShaper] | None = None) -> Response:
    """The response to a chat or text completion request. ``shaper`` (chat) makes each choice's
    text into a message: reasoning content, tool calls."""
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(state, rid, body, handles, span, chat, include_usage, shaper),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    outs = await _await_all(state, request, handles, span)
    n = body.n
    choices = []
    for p, out in enumerate(outs):
        for s in _samples(out):
            index = p * n + getattr(s, "index", 0)
            text = s.text or ""
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                reason = _finish_reason(s)
                if shaper is not None:
                    shaped = shaper()
                    shaped.shape_whole(text)
                    message, reason = shaped.message(), shaped.finish_reason(reason)
                choices.append({"index": index, "message": message,
                                "logprobs": _chat_logprobs(state, s.generated_tokens, s.logprobs if body.logprobs
                                                           else None, s.top_logprobs),
                                "finish_reason": reason})
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
    """Every handle's final output; the client going away, or the end of the server's grace
    period, cancels them all."""
    outs: list[GenerationOutput | None] = [None] * len(handles)
    failures: list[Exception] = []

    def cancel_all() -> None:
        for h in handles:
            h.cancel()  # a no-op for ended requests

    try:
        with state.drain.on_expire(cancel_all):
            async with anyio.create_task_group() as tg:
                async def one(i: int) -> None:
                    try:
                        outs[i] = await handles[i].result()
                    except (RequestFailedError, EngineDeadError) as exc:  # raised below as itself, not in
                        failures.append(exc)  # the ExceptionGroup a task group would wrap it in
                        tg.cancel_scope.cancel()

                async def watch() -> None:
                    while not state.drain.expired and not await request.is_disconnected():
                        await anyio.sleep(0.05)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                async with anyio.create_task_group() as inner:
                    for i in range(len(handles)):
                        inner.start_soon(one, i)
                tg.cancel_scope.cancel()  # all done: stop watching
    finally:
        cancel_all()  # the rest: the client left, or the server is stopping
    if failures:
        exc = failures[0]
        dead = isinstance(exc, EngineDeadError)
        span.finish(error_type="engine_dead" if dead else "request", message=str(exc))
        raise APIError(503 if dead else 500, str(exc), type="server_error")
    if state.drain.expired and any(o is None or o.status == RequestStatus.CANCELLED for o in outs):
        span.finish(error_type="503", message="the server shut down")
        raise ShutdownExpired
    if any(o is None for o in outs):
        span.finish(error_type="cancelled", message="client disconnected")
        raise APIError(499, "client disconnected")
    done = [o for o in outs if o is not None]
    span.finish(done)
    return done


async def _stream(state: ServerState, rid: str, body: Any, handles: list[Any], span: ServerSpan, chat: bool,
                  include_usage: bool, shaper: Callable[[], shaping.OutputShaper] | None = None
                  ) -> AsyncIterator[str]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        data: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": state.model_name,
                                "choices": choices}
        if include_usage:
            data["usage"] = usage
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def cancel_all() -> None:
        for h in handles:
            h.cancel()  # a no-op for ended requests

    finals: list[GenerationOutput] = []
    offsets: dict[int, int] = {}
    shapers: dict[int, shaping.OutputShaper] | None = {} if shaper is not None else None
    ended = False
    try:
        if chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(handles) * body.n)])
        # one prompt after the other (no task group across yields): all of them run in the
        # engine meanwhile, and a later prompt's deltas wait, coalesced, in its handle
        with state.drain.on_expire(cancel_all):  # the end of the grace period cancels them
            for p, handle in enumerate(handles):
                async for delta in handle:
                    if state.drain.expired:
                        raise ShutdownExpired
                    choices = _delta_choices(state, body, delta, p, chat, offsets, finals, shapers, shaper)
                    if choices:
                        yield chunk(choices)
        if include_usage:
            yield chunk([], _usage(finals))
        ended = True
        span.finish(finals)
        yield "data: [DONE]\n\n"
    except ShutdownExpired:
        span.finish(error_type="503", message="the server shut down")
        yield shutdown_error().sse()
    except (RequestFailedError, EngineDeadError) as exc:
        span.finish(error_type="request" if isinstance(exc, RequestFailedError) else "engine_dead", message=str(exc))
        yield APIError(500, str(exc), type="server_error").sse()
    except Exception as exc:  # noqa: BLE001 - the stream has begun: its end is an error event
        logger.error("acb serve: a stream failed", exc_info=exc)
        span.finish(error_type=type(exc).__name__, message=str(exc))
        yield internal_error(exc).sse()
    finally:
        cancel_all()
        if not ended:
            span.finish(error_type="cancelled", message="client disconnected")


def _chat_delta(shaped: shaping.Shaped) -> dict[str, Any]:
    """A chat chunk's ``delta`` from shaped text: content, ``reasoning_content``, ``tool_calls``."""
    out: dict[str, Any] = {}
    if shaped.reasoning:
        out["reasoning_content"] = shaped.reasoning
    if shaped.content or not shaped:
        out["content"] = shaped.content
    if shaped.tool_calls:
        out["tool_calls"] = [c.to_openai() for c in shaped.tool_calls]
    return out


def _delta_choices(state: ServerState, body: Any, delta: Any, p: int, chat: bool, offsets: dict[int, int],
                   finals: list[GenerationOutput], shapers: dict[int, shaping.OutputShaper] | None = None,
                   shaper: Callable[[], shaping.OutputShaper] | None = None) -> list[dict[str, Any]]:
    """One stream delta of prompt ``p`` as chunk choices (a sample's last piece carries its
    finish reason); a final delta's output goes to ``finals``. ``shapers``: each chat choice's
    :class:`~acb.serve.shaping.OutputShaper` (made by ``shaper`` on its first delta)."""
    n = body.n
    index = p * n + delta.sample_index
    choices: list[dict[str, Any]] = []

    def shaper_of(i: int) -> shaping.OutputShaper | None:
        if shapers is None or shaper is None:
            return None
        if i not in shapers:
            shapers[i] = shaper()
        return shapers[i]

    if delta.token_ids or delta.text:
        lp = delta.logprobs if (body.logprobs if chat else body.logprobs is not None) else None
        if chat:
            sh = shaper_of(index)
            shaped = sh.feed(delta.text or "") if sh is not None else None
            if shaped is None or shaped or lp is not None:  # (text a parser holds back: nothing to send yet)
                content = {"content": delta.text or ""} if shaped is None else _chat_delta(shaped)
                choices.append({"index": index, "delta": content,
                                "logprobs": _chat_logprobs(state, delta.token_ids, lp, delta.top_logprobs),
                                "finish_reason": None})
        else:
            off = offsets.get(index, 0)
            choices.append({"index": index, "text": delta.text or "",
                            "logprobs": _text_logprobs(state, delta.token_ids, lp, delta.top_logprobs, off),
                            "finish_reason": None})
            offsets[index] = off + len(delta.text or "")
    if delta.finished and delta.output is not None:
        finals.append(delta.output)
        for s in _samples(delta.output):
            i = p * n + getattr(s, "index", 0)
            reason = _finish_reason(s)
            sh = shaper_of(i) if chat else None
            tail = sh.finish() if sh is not None else None
            if sh is not None:
                reason = sh.finish_reason(reason)
            same = next((c for c in choices if c["index"] == i), None)
            if same is not None:
                same["finish_reason"] = reason
                if tail:  # what the parsers held until the end joins this chunk's delta
                    merged = _chat_delta(tail)
                    d = same["delta"]
                    for key in ("content", "reasoning_content"):
                        if merged.get(key):
                            d[key] = (d.get(key) or "") + merged[key]
                    if merged.get("tool_calls"):
                        d["tool_calls"] = d.get("tool_calls", []) + merged["tool_calls"]
                continue
            end: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": reason}
            end.update(delta=_chat_delta(tail) if tail else {}) if chat else end.update(text="")
            choices.append(end)
    return choices
