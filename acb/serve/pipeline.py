"""One request's way through ``acb serve``: :func:`serve` is the pipeline every generating route
(chat completions, completions, the Responses API) runs, once, in this order::

    auth, ready ─► parse ─► the route's plan ─► span ─► compile ─► render ─► submit ─► await | stream
    (parse)        (body)   (a Job)                     (grammar)  (pool)    (engine)   (the Job's Output)

A route supplies its body's schema and its ``plan``: what only it knows (its checks, its
sampling settings, its prompts' rendering, its constraint, the formatting of its outputs), as a
:class:`Job`. The shared steps are here: the API key and readiness, the body read within its size
limit and validated, the SERVER span, the grammar compiled off the event loop, the prompts made
in the :class:`~acb.serve.render_pool.RenderPool`, each submitted (the engine's validation is the
only one: a prompt that can never fit is its refusal, a 400 naming the route's field), then the
outputs awaited (the client going away, or the end of the grace period, cancels them) or streamed
(the route's :class:`Output` makes the events). :class:`ServerState` is what the requests share.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from acb.api.async_engine import AsyncEngine
from acb.api.handles import RequestHandle
from acb.errors import EngineDeadError, EngineNotRunningError, QueueFullError, RequestFailedError
from acb.outputs import GenerationOutput, RequestStatus, StreamDelta
from acb.sampling_params import SamplingParams
from acb.serve.formatting import TokenTexts
from acb.serve.media import has_image_parts, load_images
from acb.serve.protocol import (
    ENGINE_PARAMS,
    APIError,
    Drain,
    RequestBody,
    ShutdownExpired,
    internal_error,
    read_body,
    request_param,
    shutdown_error,
)
from acb.serve.render_pool import RenderPool
from acb.serve.settings import ServerSettings
from acb.serve.shaping import Constraint
from acb.structured_outputs import StructuredOutputs
from acb.telemetry import ServerSpan, Telemetry, request_attributes
from acb.text import RenderedChat, TokenizedText, render_chat, text_tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "Job",
    "Output",
    "Prompts",
    "ServerState",
    "authorize",
    "await_all",
    "compile_grammar",
    "parse",
    "render_messages",
    "serve",
    "server_span",
    "stream",
    "submit",
    "tokenize_prompts",
    "validated",
]

B = TypeVar("B", bound=RequestBody)
V = TypeVar("V", bound=BaseModel)


class ServerState:
    """What the app's requests share: the engine, the settings, readiness, the drain, the render
    pool and the token texts.

    Args:
        engine: the served engine.
        settings: the server's settings (:class:`~acb.serve.settings.ServerSettings`; the app
            reads its own part: the name, the API key, the limits, the parsers, the media).
        on_ready: called once the engine started.
        telemetry: ``/metrics``' source, if configured.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        settings: ServerSettings,
        *,
        on_ready: Callable[[], None] | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.model_name = settings.served_name
        self.on_ready = on_ready
        self.telemetry = telemetry
        self.media = settings.media  # what a request's images may be (acb.serve.media)
        self.on_stop: list[Callable[[], None]] = []  # called once the app stops (before the engine)
        self.ready = False
        self.stopped = False
        self.created = int(time.time())
        self.drain = Drain(settings.grace_period)
        self.render_pool = RenderPool(settings.render_threads, settings.render_timeout)
        self.texts = TokenTexts(engine.tokenizer)

    @property
    def prompt_renderer(self) -> Any:
        """What renders chats and tokenizes text: the engine's :attr:`~acb.api.base.EngineBase.renderer`
        (the model's processor, else its tokenizer; ``None`` for a model served by token ids only)."""
        return self.engine.renderer

    @property
    def closing(self) -> bool:
        """The server is draining or stopped: new requests get a 503."""
        return self.drain.closing or self.stopped


@dataclass(frozen=True)
class Prompts:
    """What a route's rendering made, in the render pool: the prompts to submit (anything
    :meth:`acb.AsyncEngine.submit_nowait` takes: a rendered chat, a tokenized text, token ids),
    and the last prompt's end as text (the reasoning parser reads whether it opened ``<think>``)."""

    items: Sequence[Any]
    tail: str = ""


class Output(Protocol):
    """A route's formatting of its outputs: the body of a request that is not streamed, or a
    stream's server-sent events (:class:`acb.serve.formatting.CompletionOutput` for chat and text
    completions; the Responses API's own)."""

    def body(self, outs: Sequence[GenerationOutput]) -> dict[str, Any]:
        """The response body, from each prompt's final output."""

    def start(self) -> list[str]:
        """A stream's first events."""

    def delta(self, p: int, delta: StreamDelta) -> list[str]:
        """The events of prompt ``p``'s stream delta."""

    def end(self, finals: Sequence[GenerationOutput]) -> list[str]:
        """A stream's last events (the last one is sent after the span ended)."""

    def error(self, err: APIError) -> str:
        """A stream's last event when it fails after it began."""


@dataclass(frozen=True)
class Job:
    """What a route made of its parsed request: everything :func:`serve`'s shared steps need.

    ``render`` runs in the render pool and makes the prompts; ``output`` makes the route's
    formatting once they are submitted. ``constraint`` is compiled before the prompts are made.
    ``params``: the engine fields a submit refusal may carry, as this route's request names them
    (over :data:`~acb.serve.protocol.ENGINE_PARAMS`).
    """

    sampling: SamplingParams
    stream: bool
    render: Callable[[], Prompts]
    output: Callable[[Prompts], Output]
    constraint: Constraint | None = None
    params: Mapping[str, str | None] = field(default_factory=dict)


def render_messages(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    kwargs: dict[str, Any] | None,
    with_tail: bool,
    state: ServerState | None = None,
    param: str = "messages",
) -> Prompts:
    """A chat's prompt, rendered by the chat template (a render pool job). Any failure of the
    template is the request's (400): the template refused the chat (``raise_exception``) or broke
    on it.

    Args:
        tokenizer: the served tokenizer.
        messages: the chat, as templates take it.
        kwargs: the template's variables (``tools`` among them).
        with_tail: also decode the prompt's end (its last 64 tokens), for the reasoning parser.

    Returns:
        The rendered chat as the one prompt.

    Raises:
        APIError: 400 for a chat the template refused or failed on, or an image refused.
    """
    if has_image_parts(messages):  # (state: the server's, which a chat with images needs)
        assert state is not None
        return render_images(state, messages, kwargs, with_tail, param)
    try:
        ids = render_chat(tokenizer, messages, kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    except Exception as exc:  # noqa: BLE001 - whatever the template raised on this chat
        raise APIError(
            400, f"the chat template failed on this chat: {type(exc).__name__}: {exc}", param="messages"
        ) from None
    tail = str(text_tokenizer(tokenizer).decode(ids[-64:])) if with_tail else ""
    return Prompts([RenderedChat(messages, ids)], tail)


def render_images(
    state: ServerState, messages: list[dict[str, Any]], kwargs: dict[str, Any] | None, with_tail: bool, param: str
) -> Prompts:
    """A chat with images (a render pool job): each image fetched or decoded within the server's
    limits (:mod:`acb.serve.media`), then the chat rendered and the images processed by the
    engine's processor, as one :class:`acb.media.MediaPrompt`.

    Raises:
        APIError: 400 for a model without images, an image refused or undecodable (naming its
            part), or a chat the processor refused.
    """
    engine = state.engine
    why = engine.processor.media_refused() if engine.runner is not None else "the engine is not started"
    if why:
        raise APIError(400, f"the served model cannot take images: {why}", param=param)
    chat = load_images(messages, state.media, param, engine.model_processor)
    try:
        prompt = engine.processor.process_media(chat, kwargs)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), param=param) from None
    tok = engine.tokenizer
    tail = str(tok.decode(prompt[-64:])) if with_tail and tok is not None else ""
    return Prompts([prompt], tail)


def tokenize_prompts(tokenizer: Any, prompts: Sequence[str | list[int]]) -> Prompts:
    """A text completion's prompts (a render pool job): each text with its token ids (one
    batched tokenizer call), token-id prompts as they are.

    Args:
        tokenizer: the served tokenizer (``None`` when every prompt is token ids).
        prompts: the request's prompts.

    Returns:
        The prompts to submit.

    Raises:
        APIError: 400 for an empty text, or a text the tokenizer refuses.
    """
    texts = [p for p in prompts if isinstance(p, str)]
    try:
        if any(not t for t in texts):
            raise ValueError("the prompt is an empty string: a request needs at least one prompt token")
        ids = iter(list(text_tokenizer(tokenizer)(texts)["input_ids"]) if texts else [])
        items = [TokenizedText(p, next(ids)) if isinstance(p, str) else p for p in prompts]
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), param="prompt") from None
    return Prompts(items)


async def serve(
    state: ServerState, request: Request, schema: type[B], operation: str, plan: Callable[[B], Job]
) -> Response:
    """The serve pipeline: one generating request, from its arrival to its response.

    Args:
        state: the server's state.
        request: the HTTP request.
        schema: the route's body schema.
        operation: the span's operation name (``chat``, ``text_completion``).
        plan: the route's part: the parsed body's checks, settings, rendering and formatting.

    Returns:
        The JSON response, or the stream of events.

    Raises:
        APIError: the request's refusal or failure (its status and OpenAI error body).
        ShutdownExpired: the grace period ended while the request was prepared or ran (a 503).
    """
    body = await parse(state, request, schema)
    job = plan(body)
    span = server_span(state, request, operation, job.sampling, job.stream)
    handles: list[RequestHandle] = []
    try:
        with span.active():
            constraint = job.constraint
            if constraint is not None:
                await state.drain.until_expired(lambda: compile_grammar(state, constraint.spec, constraint.param))
            prompts = await state.drain.until_expired(lambda: state.render_pool.run(job.render))
            several = len(prompts.items) > 1
            lora = None if body.model == state.model_name else body.model  # (parse checked it is loaded)
            for i, prompt in enumerate(prompts.items):
                where = f"prompt[{i}]" if several else None
                handles.append(submit(state, prompt, job.sampling, job.params, where=where, lora=lora))
                if i % 32 == 31:
                    await anyio.sleep(0)  # each submit checks its prompt: let others in meanwhile
        output = job.output(prompts)
    except BaseException as exc:
        for h in handles:
            h.cancel()
        _span_failed(span, exc)
        raise
    if job.stream:
        return StreamingResponse(
            stream(state, handles, span, output), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    outs = await await_all(state, request, handles, span)
    return JSONResponse(output.body(outs))


def authorize(state: ServerState, request: Request) -> None:
    """Check the request's API key (``Authorization: Bearer ...``), if the server has one.

    Args:
        state: the server's state.
        request: the HTTP request.

    Raises:
        APIError: 401 for a wrong or missing key.
    """
    if state.settings.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.settings.api_key.encode()):
        raise APIError(
            401,
            "invalid or missing API key (Authorization: Bearer ...)",
            type="authentication_error",
            code="invalid_api_key",
        )


def validated(raw: bytes, schema: type[V]) -> V:
    """A request body parsed as ``schema``; an invalid one is a 400 naming its first bad field
    (OpenAI's ``param``)."""
    try:
        return schema.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise APIError(
            400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param=where or None
        ) from None


def check_ready(state: ServerState) -> None:
    """A 503 (with ``Retry-After``) while the engine starts or the server shuts down."""
    if not state.ready or state.closing:
        raise APIError(
            503,
            "the engine is not ready" if not state.closing else "the server is shutting down",
            type="server_error",
            headers={"Retry-After": "1"},
        )


async def parse(state: ServerState, request: Request, schema: type[B]) -> B:
    """The request's body, authorized, read and checked: the server ready, the body within its
    size limit, valid for ``schema``, for the served model, asking nothing refused.

    Args:
        state: the server's state.
        request: the HTTP request.
        schema: the route's body schema.

    Returns:
        The parsed body.

    Raises:
        APIError: 401 (auth), 503 (not ready, shutting down), 413 (too large), 400 (invalid,
            refused), 404 (a model that is neither the served one nor a loaded LoRA adapter).
    """
    authorize(state, request)
    check_ready(state)
    body = validated(await read_body(request, state.settings.max_body_bytes), schema)
    if body.model != state.model_name and all(info.name != body.model for info in state.engine.list_loras()):
        adapters = "".join(f", {info.name!r}" for info in state.engine.list_loras())
        raise APIError(
            404,
            f"the model {body.model!r} does not exist; this server serves {state.model_name!r}{adapters}",
            param="model",
            code="model_not_found",
        )
    body.check_refused()
    return body


def server_span(
    state: ServerState, request: Request, operation: str, sampling: SamplingParams, stream: bool
) -> ServerSpan:
    """The request's SERVER span (continuing the caller's ``traceparent``).

    Args:
        state: the server's state.
        request: the HTTP request.
        operation: the operation name.
        sampling: the request's sampling settings (the span's request attributes).
        stream: whether the response is streamed.

    Returns:
        The span (a no-op without a tracer provider).
    """
    attrs = {
        **request_attributes(sampling),
        "gen_ai.request.stream": stream,
        "http.request.method": request.method,
        "url.path": request.url.path,
        "server.address": request.url.hostname,
        "server.port": request.url.port,
    }
    return ServerSpan(request.headers, operation, state.model_name, attrs)


def _span_failed(span: ServerSpan, exc: BaseException) -> None:
    kind = (
        str(exc.status)
        if isinstance(exc, APIError)
        else "503"
        if isinstance(exc, ShutdownExpired)
        else type(exc).__name__
    )
    span.finish(error_type=kind, message=str(exc))


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


def submit(
    state: ServerState,
    prompt: Any,
    sampling: SamplingParams,
    params: Mapping[str, str | None] | None = None,
    *,
    where: str | None = None,
    lora: str | None = None,
) -> RequestHandle:
    """Submit one prompt. The engine's validation is the only one (a prompt that can never fit
    the model or the cache included): its refusals are 400s naming the request's field.

    Args:
        state: the server's state.
        prompt: what the render pool made.
        sampling: the request's sampling settings.
        params: the engine field a refusal carries (``InvalidRequestError.field``) -> the route's
            request field, over :data:`~acb.serve.protocol.ENGINE_PARAMS` (such as
            ``structured_outputs`` to where the constraint came from: a refusal at submit is a
            constraint ``min_tokens`` can never meet).
        where: which of the request's prompts this is (``prompt[3]``), for a refusal of the prompt.
        lora: the LoRA adapter the request's ``model`` named (None: the served model itself).

    Returns:
        The request's handle.

    Raises:
        APIError: 400 for a refusal, 429 when the queue is full, 503 when the engine is not running.
    """
    try:
        return state.engine.submit_nowait(prompt, sampling, record_timestamps=True, lora=lora)
    except QueueFullError as exc:
        raise APIError(
            429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}
        ) from None
    except (EngineDeadError, EngineNotRunningError) as exc:
        raise APIError(503, str(exc), type="server_error") from None
    except (ValueError, TypeError) as exc:
        param = request_param(exc, {**ENGINE_PARAMS, **(params or {})})
        message = f"{where}: {exc}" if where is not None and param == "prompt" else str(exc)
        raise APIError(400, message, param=param) from None


async def await_all(
    state: ServerState, request: Request, handles: Sequence[RequestHandle], span: ServerSpan
) -> list[GenerationOutput]:
    """Every handle's final output; the client going away, or the end of the server's grace
    period, cancels them all. Ends the span.

    Args:
        state: the server's state.
        request: the HTTP request (watched for a disconnect).
        handles: the request's submitted prompts.
        span: the request's span.

    Returns:
        Each handle's final output, in order.

    Raises:
        APIError: 500 for a request that failed in the engine, 503 when the engine died, 499 when
            the client went away.
        ShutdownExpired: the grace period ended first.
    """
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


async def stream(
    state: ServerState, handles: Sequence[RequestHandle], span: ServerSpan, output: Output
) -> AsyncIterator[str]:
    """The request's outputs as server-sent events, made by the route's ``output``: its start,
    each delta's, its end; a failure after the stream began ends it with ``output``'s error event.
    The end of the grace period cancels the requests; a client that goes away (the server cancels
    this generator) cancels them too. Ends the span.

    Args:
        state: the server's state.
        handles: the request's submitted prompts.
        span: the request's span.
        output: the route's formatting.

    Yields:
        The events.
    """

    def cancel_all() -> None:
        for h in handles:
            h.cancel()  # a no-op for ended requests

    finals: list[GenerationOutput] = []
    ended = False
    try:
        for event in output.start():
            yield event
        # one prompt after the other (no task group across yields): all of them run in the
        # engine meanwhile, and a later prompt's deltas wait, coalesced, in its handle
        with state.drain.on_expire(cancel_all):  # the end of the grace period cancels them
            for p, handle in enumerate(handles):
                async for delta in handle:
                    if state.drain.expired:
                        raise ShutdownExpired
                    for event in output.delta(p, delta):
                        yield event
                    if delta.finished and delta.output is not None:
                        finals.append(delta.output)
        *events, last = output.end(finals)
        for event in events:
            yield event
        ended = True
        span.finish(finals)
        yield last
    except ShutdownExpired:
        span.finish(error_type="503", message="the server shut down")
        yield output.error(shutdown_error())
    except (RequestFailedError, EngineDeadError) as exc:
        span.finish(error_type="request" if isinstance(exc, RequestFailedError) else "engine_dead", message=str(exc))
        yield output.error(APIError(500, str(exc), type="server_error"))
    except Exception as exc:  # noqa: BLE001 - the stream has begun: its end is an error event
        logger.error("acb serve: a stream failed", exc_info=exc)
        span.finish(error_type=type(exc).__name__, message=str(exc))
        yield output.error(internal_error(exc))
    finally:
        cancel_all()
        if not ended:
            span.finish(error_type="cancelled", message="client disconnected")
