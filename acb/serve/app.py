"""The OpenAI-compatible HTTP app: FastAPI on one :class:`acb.AsyncEngine`, its routes and settings.

A client of the library like any user's code: it only calls the engine's public API
(``submit_nowait``, handles, ``config``, ``stats``, ``start``/``shutdown``).

- ``/health`` answers 200 once the engine has started, 503 before and while shutting down.
- ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` (:mod:`acb.serve.responses`)
  each run :func:`acb.serve.pipeline.serve` (auth, parse, span, compile, render, submit, await or
  stream) with their own part: the checks and settings of their body, their prompts' rendering,
  and their outputs' formatting (:mod:`acb.serve.formatting` for these two).
- Every error is an OpenAI-style body (:class:`~acb.serve.protocol.APIError`): 400 bad parameters
  (the engine's own validation messages, a prompt that can never fit among them; a chat template
  that refuses the chat; too many prompts; an output constraint the engine refuses; named by the
  field it came from), 401 bad API key, 404 unknown model or path, 413 body over the limit, 429
  queue full (``Retry-After``), 500 a request that failed in the engine (or any other failure),
  503 not ready or shutting down. A stream that fails after it started ends with an error event
  and ``[DONE]``.
- Work that grows with what a client sends stays off the event loop: chats are rendered and
  prompts tokenized by a :class:`~acb.serve.render_pool.RenderPool` (daemon threads, each job
  within a time bound), and a request may ask for at most ``max_prompts_per_request`` completions
  (prompts × ``n``).
- A client that goes away cancels its request: a stream's task is cancelled by the server,
  and a non-streamed request watches for the disconnect while it waits.
- SIGINT/SIGTERM: a :class:`~acb.serve.protocol.Drain` keeps the port open (``/health`` and new
  requests 503) while requests in flight get the grace period; those still running then end
  with a 503 error body (a stream: an error event, then ``[DONE]``), and the server stops.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

import acb
from acb.serve import responses, shaping
from acb.serve.formatting import CompletionOutput
from acb.serve.media import (
    DEFAULT_FETCH_TIMEOUT,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    MediaPolicy,
    content_parts,
)
from acb.serve.pipeline import (
    Job,
    Prompts,
    ServerState,
    authorize,
    render_messages,
    serve,
    tokenize_prompts,
)
from acb.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DrainMiddleware,
    check_choices,
    install_error_handlers,
)
from acb.serve.render_pool import DEFAULT_RENDER_THREADS, DEFAULT_RENDER_TIMEOUT
from acb.telemetry import Telemetry
from acb.weight_transfer import LOOPBACK_HOSTS

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
    # images in requests (acb.serve.media): domains whose http(s) image URLs are fetched (none:
    # data URLs only), the largest image in bytes and in pixels, seconds a fetch may take
    allowed_media_domains: tuple[str, ...] = ()
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    media_fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    # the routes of a trainer elsewhere (acb.serve.weights): pause, sleep, weight updates
    enable_weight_updates: bool = False
    # where /init_weight_transfer may make the server connect (acb.serve.weights.resolve_trainer)
    weight_transfer_hosts: tuple[str, ...] = LOOPBACK_HOSTS


def build_app(
    engine: acb.AsyncEngine,
    model_name: str,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    on_ready: Callable[[], None] | None = None,
    telemetry: Telemetry | None = None,
    trust_request_chat_template: bool | None = None,
    max_prompts_per_request: int | None = None,
    grace_period: float | None = None,
    render_timeout: float | None = None,
    render_threads: int | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    allowed_media_domains: Sequence[str] | None = None,
    max_image_bytes: int | None = None,
    max_image_pixels: int | None = None,
    media_fetch_timeout: float | None = None,
    enable_weight_updates: bool | None = None,
    weight_transfer_hosts: Sequence[str] | None = None,
) -> FastAPI:
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
    returned as ``reasoning_content``. ``allowed_media_domains``: the domains whose ``http(s)``
    image URLs the server fetches (by default none: images come as ``data:`` URLs), within
    ``media_fetch_timeout`` seconds; an image has at most ``max_image_bytes`` bytes and
    ``max_image_pixels`` pixels (:mod:`acb.serve.media`). Arguments not given take
    :class:`AppOptions`' defaults. ``enable_weight_updates``: the routes a trainer elsewhere
    drives (pause, sleep, weight updates from disk or over ``torch.distributed``:
    :mod:`acb.serve.weights`), behind ``api_key`` when one is set; ``weight_transfer_hosts``: the
    trainer addresses (IPs, networks, host names, ``*``) it may join a group at (loopback by
    default)."""
    given: dict[str, Any] = {
        "trust_request_chat_template": trust_request_chat_template,
        "max_prompts_per_request": max_prompts_per_request,
        "grace_period": grace_period,
        "render_timeout": render_timeout,
        "render_threads": render_threads,
        "tool_call_parser": tool_call_parser,
        "reasoning_parser": reasoning_parser,
        "allowed_media_domains": None if allowed_media_domains is None else tuple(allowed_media_domains),
        "max_image_bytes": max_image_bytes,
        "max_image_pixels": max_image_pixels,
        "media_fetch_timeout": media_fetch_timeout,
        "enable_weight_updates": enable_weight_updates,
        "weight_transfer_hosts": None if weight_transfer_hosts is None else tuple(weight_transfer_hosts),
    }
    options = replace(AppOptions(), **{k: v for k, v in given.items() if v is not None})
    shaping.check_parsers(options.tool_call_parser, options.reasoning_parser)
    if options.max_prompts_per_request < 1:
        raise ValueError(f"max_prompts_per_request must be >= 1, got {options.max_prompts_per_request}")
    state = ServerState(
        engine,
        model_name,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        on_ready=on_ready,
        telemetry=telemetry,
        trust_request_chat_template=options.trust_request_chat_template,
        max_prompts_per_request=options.max_prompts_per_request,
        grace_period=options.grace_period,
        render_threads=options.render_threads,
        render_timeout=options.render_timeout,
        tool_call_parser=options.tool_call_parser,
        reasoning_parser=options.reasoning_parser,
        media=MediaPolicy(
            options.allowed_media_domains,
            options.max_image_bytes,
            options.max_image_pixels,
            options.media_fetch_timeout,
        ),
    )
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
        for stop in state.on_stop:
            stop()
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
            raise APIError(
                404, "metrics are not configured (acb.telemetry.configure(prometheus=True))", code="not_found"
            )
        return Response(tel.prometheus_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(state, request)
        return {
            "object": "list",
            "data": [{"id": state.model_name, "object": "model", "created": state.created, "owned_by": "acb"}],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve(state, request, ChatCompletionRequest, "chat", lambda body: _chat_job(state, body))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(
            state, request, CompletionRequest, "text_completion", lambda body: _completion_job(state, body)
        )

    responses.add_routes(app, state)  # POST /v1/responses (the Responses API)
    if options.enable_weight_updates:  # a trainer's routes: pause, sleep, weights (acb.serve.weights)
        from acb.serve import weights

        weights.add_routes(app, state, options.weight_transfer_hosts)
    return app


def _chat_job(state: ServerState, body: ChatCompletionRequest) -> Job:
    """A chat completion's part of the pipeline: its checks, its chat rendered by the model's
    template (with the tools, when the template renders them), its constraint (``response_format``,
    vLLM's ``structured_outputs``, a forced tool call), its choices shaped into messages."""
    if state.tokenizer is None:
        raise APIError(400, "the served model has no tokenizer: chat needs one", param="messages")
    kwargs = body.template_kwargs(state.trust_request_chat_template)
    check_choices(1, body.n, state.max_prompts_per_request)
    plan = shaping.plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_call_parser)
    if plan.template_tools is not None:  # the model's chat template renders the tools
        kwargs = {**(kwargs or {}), "tools": plan.template_tools}
    constraint = shaping.one_constraint(
        shaping.Constraint.of("response_format", shaping.structured_from_response_format(body.response_format)),
        shaping.Constraint.of("structured_outputs", shaping.structured_from_extra(body.model_extra or {})),
        plan.constraint,
    )
    messages = [
        shaping.history_message(
            m.model_dump(),
            content_parts(m.content, f"messages[{i}]", "messages", ("text",), ("image_url",)),
            f"messages[{i}]",
        )
        for i, m in enumerate(body.messages)
    ]
    sampling = body.sampling(body.max_new_tokens(), body.logprobs_k(), None if constraint is None else constraint.spec)
    tokenizer, parser = state.tokenizer, state.reasoning_parser

    def output(prompts: Prompts) -> CompletionOutput:
        return CompletionOutput(
            chat=True,
            model=state.model_name,
            texts=state.texts,
            num_prompts=1,
            n=body.n,
            logprobs=body.logprobs,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            shaper=lambda: shaping.OutputShaper(plan, parser, prompts.tail, constrained=constraint is not None),
            token_ids=body.return_token_ids,
        )

    return Job(
        sampling,
        body.stream,
        render=lambda: render_messages(tokenizer, messages, kwargs, parser is not None, state, "messages"),
        output=output,
        constraint=constraint,
        params={
            "prompt": "messages",
            "prompt_ids": "messages",
            "logprobs": "top_logprobs",
            "structured_outputs": None if constraint is None else constraint.param,
        },
    )


def _completion_job(state: ServerState, body: CompletionRequest) -> Job:
    """A text completion's part of the pipeline: its prompts (texts tokenized in one batch, token
    ids as they are), its constraint (vLLM's ``structured_outputs``), its choices as text."""
    prompts = body.prompts()
    check_choices(len(prompts), body.n, state.max_prompts_per_request)
    if any(isinstance(p, str) for p in prompts) and state.tokenizer is None:
        raise APIError(400, "the served model has no tokenizer: send token ids", param="prompt")
    structured = shaping.structured_from_extra(body.model_extra or {})
    sampling = body.sampling(body.max_tokens, body.logprobs, structured)
    tokenizer = state.tokenizer
    output = CompletionOutput(
        chat=False,
        model=state.model_name,
        texts=state.texts,
        num_prompts=len(prompts),
        n=body.n,
        logprobs=body.logprobs is not None,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        token_ids=body.return_token_ids,
    )
    return Job(
        sampling,
        body.stream,
        render=lambda: tokenize_prompts(tokenizer, prompts),
        output=lambda _: output,
        constraint=shaping.Constraint.of("structured_outputs", structured),
    )


async def _start_engine(state: ServerState) -> None:
    await anyio.to_thread.run_sync(state.engine.start)
    state.ready = True
    if state.on_ready is not None:
        state.on_ready()
