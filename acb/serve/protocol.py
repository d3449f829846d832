"""Request schemas of the OpenAI-compatible server (pydantic), OpenAI-style errors, and what
``acb serve`` shares about requests: the size-limited body reader
and the shutdown :class:`Drain`.

Fields follow OpenAI's chat/completions and completions APIs. Unknown fields are ignored, as
OpenAI does; fields that would change the meaning of a request and that acb does not
implement (tools, response formats, ...) are refused with a 400 naming them. acb's extras
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``skip_special_tokens``, ``chat_template_kwargs``) are accepted at the top level, as the
``openai`` client's ``extra_body`` sends them. A chat template of the client's own
(``chat_template``, at the top level or in ``chat_template_kwargs``) is refused unless the
operator trusts clients with it (``--trust-request-chat-template``, vLLM's flag): a template is
code the server runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, Field

from acb.errors import field_of
from acb.sampling_params import MAX_LOGPROBS, SamplingParams
from acb.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)
T = TypeVar("T")


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def sse(self) -> str:
        """A stream's last words: this error as an SSE event (what the ``openai`` client raises
        from), then ``[DONE]``, so that every stream ends well-formed."""
        return f"data: {json.dumps(self.body())}\n\ndata: [DONE]\n\n"


def internal_error(exc: BaseException) -> APIError:
    """A 500 for an error nothing else answered (the server's bug, or its engine's)."""
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, refused with a 413 once it passes ``max_bytes`` (by its declared
    Content-Length, or while it streams in without one)."""
    too_big = APIError(413, f"request body is larger than {max_bytes} bytes", code="body_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class RequestBody(BaseModel):
    """What the body of every generating route has (:func:`acb.serve.pipeline.parse` reads it):
    the served model's name, and the refusal of what acb does not do. Unknown fields are
    ignored, as OpenAI does."""

    model_config = ConfigDict(extra="allow")

    model: str

    def check_refused(self) -> None:
        """Refuse what would change the request's meaning and acb does not do (none here).

        Raises:
            APIError: 400 naming the field.
        """


class _Common(RequestBody):
    """What chat and text completions share."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # acb's extras (``extra_body`` in the openai client)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    # vLLM's: the prompt's and each choice's token ids in the response (RL rollouts); logprobs
    # are then the processed ones, of the distribution each token was drawn from
    return_token_ids: bool = False

    # fields that change what a request means, which acb does not implement
    _refused: tuple[str, ...] = ()

    def check_refused(self) -> None:
        extra = self.model_extra or {}
        for name in self._refused:
            value = extra.get(name)
            if value is None or value == [] or value is False:
                continue
            if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
                continue
            raise APIError(400, f"{name!r} is not supported by acb serve", param=name)

    def sampling(
        self, max_new_tokens: int | None, logprobs: int | None, structured: StructuredOutputs | None = None
    ) -> SamplingParams:
        """The request as acb sampling settings; bad values raise :class:`APIError` (400).
        ``structured``: the output's constraint (``response_format``, a forced tool call, vLLM's
        ``structured_outputs``)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
        if self.n < 1:
            raise APIError(400, f"n must be >= 1, got {self.n}", param="n")
        try:
            return SamplingParams(
                max_new_tokens=max_new_tokens,
                min_new_tokens=self.min_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                logit_bias=bias,
                stop=tuple(stop) if stop else None,
                seed=self.seed,
                n=self.n,
                logprobs=logprobs,
                logprobs_mode="processed" if self.return_token_ids and logprobs is not None else None,
                ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                structured_outputs=structured,
            )
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param=request_param(exc)) from None


# the engine's field a refusal is about (InvalidRequestError.field: an argument of submit or a
# SamplingParams field) -> the OpenAI request's param; a field a client cannot send maps to None
ENGINE_PARAMS: dict[str, str | None] = {
    "prompt": "prompt",
    "n": "n",
    "logprobs": "logprobs",
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "stop": "stop",
    "structured_outputs": "structured_outputs",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    "seed": "seed",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "lora": "model",  # the LoRA adapter the request's model named (removed as it was submitted)
}


def request_param(exc: BaseException, params: Mapping[str, str | None] = ENGINE_PARAMS) -> str | None:
    """The request's param an engine refusal is about, from the field it carries
    (:class:`acb.InvalidRequestError`), not from its message.

    Args:
        exc: the refusal.
        params: engine field -> the endpoint's param (default: the completions endpoints').

    Returns:
        The param, or None when the refusal names no field the client sent.
    """
    field = field_of(exc)
    return None if field is None else params.get(field)


def check_choices(num_prompts: int, n: int, limit: int) -> None:
    """A request asks for ``num_prompts`` × ``n`` completions; more than ``limit`` is a 400 (each
    is an engine request and a task on the server's event loop: the work is the client's to pick)."""
    if num_prompts * n <= limit:
        return
    if num_prompts > limit:
        raise APIError(
            400,
            f"prompt: {num_prompts} prompts in one request; this server takes at most {limit} "
            "(--max-prompts-per-request)",
            param="prompt",
            code="too_many_prompts",
        )
    raise APIError(
        400,
        f"n: {num_prompts} prompt(s) × n={n} is {num_prompts * n} completions in one request; "
        f"this server makes at most {limit} (--max-prompts-per-request)",
        param="n",
        code="too_many_prompts",
    )


# apply_chat_template's own parameters that change how the prompt is tokenized or returned, not
# what the template renders: never taken from a client
_TOKENIZATION_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
    }
)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's extra; only with --trust-request-chat-template
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def template_kwargs(self, trust_request_chat_template: bool) -> dict[str, Any] | None:
        """``chat_template_kwargs`` for rendering: the template's variables. A client's own
        template is refused (400) unless the operator trusts clients with it, and so are
        tokenizer options (``tokenize``, ``padding``, ``max_length``...): the server tokenizes."""
        kwargs = dict(self.chat_template_kwargs or {})
        tokenization = sorted(kwargs.keys() & _TOKENIZATION_KWARGS)
        if tokenization:
            raise APIError(
                400,
                f"chat_template_kwargs: {tokenization[0]!r} is not a chat template variable (it "
                "would change how the server tokenizes the prompt)",
                param="chat_template_kwargs",
            )
        if self.chat_template is not None:
            if "chat_template" in kwargs:
                raise APIError(
                    400,
                    "chat_template is given twice (at the top level and in chat_template_kwargs)",
                    param="chat_template",
                )
            kwargs["chat_template"] = self.chat_template
        if kwargs.get("chat_template") is not None and not trust_request_chat_template:
            where = "chat_template" if self.chat_template is not None else "chat_template_kwargs"
            raise APIError(
                400,
                "a chat template of the request's own is not accepted by this server (it runs the "
                "model's; the operator may allow them with --trust-request-chat-template)",
                param=where,
                code="chat_template_not_allowed",
            )
        if "chat_template" in kwargs and not isinstance(kwargs["chat_template"], (str, type(None))):
            raise APIError(400, "chat_template must be a string", param="chat_template")
        return kwargs or None

    _refused = ("functions", "function_call", "audio", "prediction")

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(
                400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}", param="top_logprobs"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False

    _refused = ("suffix",)

    def check_refused(self) -> None:
        super().check_refused()
        if self.echo:
            raise APIError(400, "'echo' is not supported by acb serve", param="echo")
        best_of = (self.model_extra or {}).get("best_of")
        if best_of is not None and best_of != self.n:
            raise APIError(400, "'best_of' other than n is not supported by acb serve", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# ------------------------------------------------------------------ shutdown
class ShutdownExpired(Exception):
    """The server's grace period ended before this request did."""


def shutdown_error() -> APIError:
    """What a request still running at the end of the grace period gets (503: try elsewhere)."""
    return APIError(
        503,
        "the server shut down before this request finished (its grace period ended)",
        type="server_error",
        code="server_shutdown",
        headers={"Retry-After": "1"},
    )


DRAIN_FLUSH_S = 5.0  # after the grace period: how long the ended requests get to send their ends


class Drain:
    """A server's stop on SIGINT/SIGTERM in which every client gets a proper end.

    uvicorn alone, on a signal, closes the listening socket at once (a load balancer's probe of
    ``/health`` then finds a closed port, not a 503) and, past its graceful timeout, cancels the
    requests' tasks: a stream is cut mid-chunk, a non-streamed request gets a plain-text 500.
    A Drain runs in the app's lifespan (:meth:`watch_signals`) and puts itself in front of the
    server's signal handlers (uvicorn's, or any server's that installed its own): on the first
    signal the app stays up but is :attr:`closing` (``/health`` and new requests answer 503);
    requests in flight get ``grace_period`` seconds; those still running then :meth:`expire`:
    every callback registered with :meth:`on_expire` runs (the server cancels their engine
    requests, cancel scopes end what waits), and they answer with :func:`shutdown_error` (a 503
    body, or an SSE error event then ``[DONE]``). Only then is the server's own handler called,
    and it stops as usual, with nothing left to cut. A second signal ends the grace period at once.
    (A request whose end cannot come, an engine step that never returns or a client that stopped
    reading, is still cut by the server's own timeout after that, as before.)

    In flight means an ``/v1`` POST between its arrival and its response's last byte
    (:class:`DrainMiddleware` counts them).
    """

    def __init__(self, grace_period: float | None = None) -> None:
        self.grace_period = grace_period  # None: the server's own (uvicorn's timeout_graceful_shutdown)
        self.closing = False
        self.expired = False
        self.in_flight = 0
        self._on_expire: set[Callable[[], Any]] = set()
        self._signal: tuple[int, Any] | None = None
        self._hurry = False  # a second signal came
        self._forwarded = False

    @contextmanager
    def counting(self) -> Iterator[None]:
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    @contextmanager
    def on_expire(self, callback: Callable[[], Any]) -> Iterator[None]:
        """Within the block, ``callback()`` runs if the grace period ends (at once if it has)."""
        if self.expired:
            callback()
        self._on_expire.add(callback)
        try:
            yield
        finally:
            self._on_expire.discard(callback)

    def expire(self) -> None:
        """End the grace period: every registered callback runs."""
        if self.expired:
            return
        self.expired = True
        for callback in list(self._on_expire):
            try:
                callback()
            except Exception:  # noqa: BLE001 - one request's cleanup must not spare the others
                logger.exception("acb serve: ending a request at shutdown failed")

    async def until_expired(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``await fn()``, unless the grace period ends first: :class:`ShutdownExpired`."""
        if self.expired:
            raise ShutdownExpired
        with anyio.CancelScope() as scope, self.on_expire(scope.cancel):
            return await fn()
        raise ShutdownExpired  # the scope was cancelled: the grace period ended

    async def watch_signals(self) -> None:
        """For the app's lifespan task group: drains on the first SIGINT/SIGTERM, then hands the
        signal to the server's handler. Does nothing outside the main thread (signals go there
        only) or where no server handler is installed (nobody to hand the stop to)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous: dict[int, Callable[[int, Any], Any]] = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(signum)
            if callable(handler) and handler is not signal.default_int_handler:
                previous[int(signum)] = handler
        if not previous:
            return
        loop = asyncio.get_running_loop()
        woken = anyio.Event()

        def on_signal(sig: int, frame: Any) -> None:  # in the main thread, between two bytecodes
            if self._forwarded:
                previous[sig](sig, frame)
            elif self._signal is None:
                self._signal = (sig, frame)
                loop.call_soon_threadsafe(woken.set)
            else:
                self._hurry = True

        for num in previous:
            signal.signal(num, on_signal)
        try:
            await woken.wait()
            assert self._signal is not None
            got, frame = self._signal
            await self._drain(self._grace(previous[got]))
            self._forwarded = True
            previous[got](got, frame)  # the server stops now
            await anyio.sleep_forever()  # later signals go to the server's handler, until the lifespan ends
        finally:
            for num, handler in previous.items():
                if signal.getsignal(num) is on_signal:
                    signal.signal(num, handler)

    def _grace(self, handler: Callable[..., Any]) -> float:
        if self.grace_period is not None:
            return self.grace_period
        # the handler of a uvicorn.Server (a bound method): its graceful timeout (None: no limit)
        config = getattr(getattr(handler, "__self__", None), "config", None)
        timeout = getattr(config, "timeout_graceful_shutdown", 30.0)
        return math.inf if timeout is None else float(timeout)

    async def _drain(self, grace: float) -> None:
        self.closing = True
        logger.warning("acb serve: stopping; %d request(s) in flight get %s s", self.in_flight, grace)
        deadline = time.monotonic() + grace
        while self.in_flight and not self._hurry and time.monotonic() < deadline:
            await anyio.sleep(0.05)
        if not self.in_flight:
            return
        logger.warning("acb serve: the grace period is over; ending %d request(s)", self.in_flight)
        self.expire()
        deadline = time.monotonic() + DRAIN_FLUSH_S
        while self.in_flight and time.monotonic() < deadline:
            await anyio.sleep(0.05)


class DrainMiddleware:
    """ASGI middleware counting a :class:`Drain`'s requests in flight: ``/v1`` POSTs, from their
    arrival to their response's last byte (a stream's included)."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        with self.drain.counting():
            await self.app(scope, receive, send)


def install_error_handlers(app: Any) -> None:
    """Make every failure of a FastAPI ``app`` answer with an OpenAI error body: an
    :class:`APIError` as it says, the end of a drain's grace period as a 503, Starlette's own
    HTTP errors (404, 405) with their status, and anything else as a 500."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ShutdownExpired)
    async def _expired(request: Request, exc: ShutdownExpired) -> JSONResponse:
        err = shutdown_error()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises the exception after this answer, and uvicorn logs it
        return JSONResponse(internal_error(exc).body(), status_code=500)
