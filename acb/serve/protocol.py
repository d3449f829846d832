"""Request schemas of the OpenAI-compatible server (pydantic), and OpenAI-style errors.

Fields follow OpenAI's chat/completions and completions APIs. Unknown fields are ignored, as
OpenAI does; fields that would change the meaning of a request and that acb does not
implement (tools, response formats, ...) are refused with a 400 naming them. acb's extras
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``skip_special_tokens``, ``chat_template_kwargs``) are accepted at the top level, as the
``openai`` client's ``extra_body`` sends them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from acb.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from starlette.requests import Request


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        """The message's text; content parts must be text (acb serves text-only models)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"only text content parts are supported, got type {part.get('type')!r}",
                               param="messages")
            pieces.append(part["text"])
        return "".join(pieces)


class _Common(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI does

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: Union[str, list[str], None] = None
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

    def sampling(self, max_new_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The request as acb sampling settings; bad values raise :class:`APIError` (400)."""
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
                max_new_tokens=max_new_tokens, min_new_tokens=self.min_tokens,
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, logit_bias=bias, stop=tuple(stop) if stop else None, seed=self.seed,
                n=self.n, logprobs=logprobs, ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
            )
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param=_param_of(str(exc))) from None


_ACB_TO_OPENAI = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def _param_of(message: str) -> str | None:
    """The request field an acb validation message is about (its first word)."""
    head = message.split(" ", 1)[0].split("[", 1)[0].strip(":()")
    return _ACB_TO_OPENAI.get(head, head) or None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    _refused = ("tools", "tool_choice", "functions", "function_call", "response_format", "audio",
                "prediction", "parallel_tool_calls")

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                           param="top_logprobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
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
