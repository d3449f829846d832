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

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from acb.api.async_engine import AsyncEngine
from acb.serve import loras, responses, routes, shaping
from acb.serve.formatting import CompletionOutput
from acb.serve.media import content_parts
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
from acb.serve.settings import ServerSettings
from acb.telemetry import Telemetry


def build_app(
    engine: AsyncEngine,
    settings: ServerSettings,
    *,
    on_ready: Callable[[], None] | None = None,
    telemetry: Telemetry | None = None,
) -> FastAPI:
    """The app serving ``engine`` as ``settings.served_name``, with the app's part of
    ``settings`` (:class:`~acb.serve.settings.ServerSettings`: the API key, the body and prompt
    limits, the parsers, the media limits, a trainer's routes...; its model and engine fields are
    not read: the engine is given). The engine is started in the background when the app starts
    (``/health`` says when it is ready) and stopped when it stops. ``on_ready`` is called once it
    runs. ``telemetry`` (from ``acb.telemetry.configure(prometheus=True)``) gives ``/metrics``;
    each request gets a SERVER span when a tracer provider is set. Its routes are those of
    :data:`acb.serve.routes.ROUTES` (a trainer's only with ``settings.enable_weight_updates``).

    Raises:
        ValueError: an unknown parser, or ``max_prompts_per_request`` below 1.
    """
    shaping.check_parsers(settings.tool_call_parser, settings.reasoning_parser)
    if settings.max_prompts_per_request < 1:
        raise ValueError(f"max_prompts_per_request must be >= 1, got {settings.max_prompts_per_request}")
    state = ServerState(engine, settings, on_ready=on_ready, telemetry=telemetry)
    model_name = state.model_name
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
        state.render_pool.close()

    app = FastAPI(title="acb", lifespan=lifespan)
    app.state.acb = state
    app.add_middleware(DrainMiddleware, drain=state.drain)

    install_error_handlers(app)  # OpenAI error bodies on every failure path

    @routes.add(app, routes.HEALTH)
    async def health() -> Response:
        if state.ready and not state.closing:
            return PlainTextResponse("ok")
        return PlainTextResponse("starting" if not state.closing else "shutting down", status_code=503)

    @routes.add(app, routes.METRICS)
    async def metrics() -> Response:
        tel = state.telemetry
        if tel is None or tel.prometheus_registry is None:
            raise APIError(
                404, "metrics are not configured (acb.telemetry.configure(prometheus=True))", code="not_found"
            )
        return Response(tel.prometheus_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @routes.add(app, routes.MODELS)
    async def models(request: Request) -> dict[str, Any]:
        authorize(state, request)
        base = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "acb"}
        adapters = [
            {**base, "id": info.name, "root": info.source, "parent": state.model_name} for info in engine.list_loras()
        ]
        return {"object": "list", "data": [base, *adapters]}

    loras.add_routes(app, state)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (acb.serve.loras)

    @routes.add(app, routes.CHAT_COMPLETIONS)
    async def chat(request: Request) -> Response:
        return await serve(state, request, ChatCompletionRequest, "chat", lambda body: _chat_job(state, body))

    @routes.add(app, routes.COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await serve(
            state, request, CompletionRequest, "text_completion", lambda body: _completion_job(state, body)
        )

    responses.add_routes(app, state)  # POST /v1/responses (the Responses API)
    if settings.enable_weight_updates:  # a trainer's routes: pause, sleep, weights (acb.serve.weights)
        from acb.serve import weights

        weights.add_routes(app, state, settings.weight_transfer_hosts)
    return app


def _chat_job(state: ServerState, body: ChatCompletionRequest) -> Job:
    """A chat completion's part of the pipeline: its checks, its chat rendered by the model's
    template (with the tools, when the template renders them), its constraint (``response_format``,
    vLLM's ``structured_outputs``, a forced tool call), its choices shaped into messages."""
    if state.prompt_renderer is None:
        raise APIError(400, "the served model has no tokenizer: chat needs one", param="messages")
    kwargs = body.template_kwargs(state.settings.trust_request_chat_template)
    check_choices(1, body.n, state.settings.max_prompts_per_request)
    plan = shaping.plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.settings.tool_call_parser)
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
    tokenizer, parser = state.prompt_renderer, state.settings.reasoning_parser

    def output(prompts: Prompts) -> CompletionOutput:
        return CompletionOutput(
            chat=True,
            model=body.model,  # the served name, or the LoRA adapter's it selected
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
    check_choices(len(prompts), body.n, state.settings.max_prompts_per_request)
    if any(isinstance(p, str) for p in prompts) and state.prompt_renderer is None:
        raise APIError(400, "the served model has no tokenizer: send token ids", param="prompt")
    structured = shaping.structured_from_extra(body.model_extra or {})
    sampling = body.sampling(body.max_tokens, body.logprobs, structured)
    tokenizer = state.prompt_renderer
    output = CompletionOutput(
        chat=False,
        model=body.model,  # the served name, or the LoRA adapter's it selected
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
    await loras.load_modules(state)  # --lora-modules: served before the server says it is ready
    state.ready = True
    if state.on_ready is not None:
        state.on_ready()
