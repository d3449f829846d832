"""``POST /v1/responses``: the OpenAI Responses API on acb serve, stateless.

The request is a chat in another shape: ``instructions`` (a system message first) and ``input``
(a string, or message items, with ``function_call`` / ``function_call_output`` items of earlier
turns rendered as an assistant message's ``tool_calls`` and a ``tool`` message). It goes through
the serve pipeline (:func:`acb.serve.pipeline.serve`: parsing, rendering off the event loop, submit,
spans, disconnect and drain handling) with its own part (:func:`_job`: this module's input and
output) and :mod:`acb.serve.shaping` (``text.format`` and forced tool calls as constrained decoding,
the output made into reasoning, text and calls).

Stateless: nothing is stored. ``store`` is accepted and ignored (the response says
``"store": false``; OpenAI lets a client that never retrieves a response not care), while what
needs a stored response or conversation is a 400: ``previous_response_id``, ``conversation``,
``background``, ``prompt`` (a stored prompt template) and ``item_reference`` input items. A
client sends the whole conversation in ``input`` instead (with ``store=false``, as stateless
clients do). Other refusals (400): non-function tools, non-text content, logprobs
(``top_logprobs``, ``include=["message.output_text.logprobs"]``), ``max_tool_calls``, and
``text.format`` together with a forced tool call. Unknown fields are ignored, as OpenAI does.

The response: ``output`` holds a ``reasoning`` item (when the server has a ``--reasoning-parser``
and the output has a reasoning section, an empty one included; never for an output constrained
from its first token: ``text.format``, a forced call), a ``message`` item with one ``output_text`` part (left out when the
model only called tools, or only reasoned), then one ``function_call`` item per call. ``status``
is ``completed``, or ``incomplete`` with ``incomplete_details.reason = "max_output_tokens"``
when the length ran out (the last text item is then ``incomplete`` too). A finished response
(and the one ``response.completed`` / ``response.incomplete`` carries) has ``weight_version``: the
version of the weights its tokens were sampled under, as completions and chat have (spans
``[version, first token, end]`` when an update landed while it ran).

Streaming (``stream=true``): server-sent events, each ``event: <type>`` with a JSON body carrying
``type`` and an increasing ``sequence_number``::

    response.created, response.in_progress
    [reasoning]  response.output_item.added, response.content_part.added,
                 response.reasoning_text.delta..., response.reasoning_text.done,
                 response.content_part.done, response.output_item.done
    [message]    response.output_item.added, response.content_part.added,
                 response.output_text.delta..., response.output_text.done,
                 response.content_part.done, response.output_item.done
    [each call]  response.output_item.added, response.function_call_arguments.delta,
                 response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete   (the whole response, as without streaming)

Function calls come after the message is done, even when the ``auto`` parser found one before
the end: a call's text may be followed by more text, and the streamed items must be those of the
non-streamed response, in its order (the parser emits a call whole anyway, so holding it back
costs little). A failure after the stream began ends it with an ``error`` event (its ``code``,
``message`` and ``param``, and the OpenAI error body under ``error``, which the ``openai``
client raises as an ``APIError``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from acb.outputs import GenerationOutput, StreamDelta
from acb.sampling_params import SamplingParams
from acb.serve import routes, shaping
from acb.serve.formatting import finish_reason, samples, usage, weight_version
from acb.serve.media import content_parts
from acb.serve.pipeline import Job, Prompts, ServerState, render_messages, serve
from acb.serve.protocol import APIError, RequestBody, request_param
from acb.serve.reasoning import REASONING_PARSERS
from acb.serve.tool_parsers import ToolCall
from acb.structured_outputs import StructuredOutputs

__all__ = ["ResponsesRequest", "add_routes", "input_messages"]

# the SamplingParams fields a refusal carries (InvalidRequestError.field) that this API's client sends
_PARAMS = {
    "max_new_tokens": "max_output_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
}


class ResponsesRequest(RequestBody):
    """The body of ``POST /v1/responses`` (the fields acb reads; others are ignored, as OpenAI does)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    user: str | None = None
    # acb's extras (``extra_body`` in the openai client), as on the chat endpoint
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

    def check_refused(self) -> None:
        """400 for what would change the request's meaning and acb does not do (called by
        :func:`acb.serve.pipeline.parse`)."""
        extra = self.model_extra or {}
        stateful = {
            "previous_response_id": "a stored response",
            "conversation": "a stored conversation",
            "prompt": "a stored prompt template",
        }
        for name, what in stateful.items():
            if extra.get(name) is not None:
                raise APIError(
                    400,
                    f"{name!r} refers to {what}, but acb serve is stateless: send the whole conversation in 'input'",
                    param=name,
                )
        if extra.get("background"):
            raise APIError(400, "'background' needs stored responses; acb serve is stateless", param="background")
        if extra.get("max_tool_calls") is not None:
            raise APIError(400, "'max_tool_calls' is not supported by acb serve", param="max_tool_calls")
        if extra.get("top_logprobs"):
            raise APIError(400, "'top_logprobs' is not supported by acb serve's Responses API", param="top_logprobs")
        include = extra.get("include") or []
        if isinstance(include, list) and "message.output_text.logprobs" in include:
            raise APIError(400, "logprobs are not supported by acb serve's Responses API", param="include")
        if self.text is not None and not isinstance(self.text.get("format", {}), (Mapping, type(None))):
            raise APIError(400, "text.format must be an object", param="text.format")

    @property
    def text_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        return dict(fmt) if isinstance(fmt, Mapping) else None

    def sampling(self, structured: StructuredOutputs | None) -> SamplingParams:
        """The request as engine sampling settings; bad values are 400s naming the field."""
        try:
            return SamplingParams(
                max_new_tokens=self.max_output_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                seed=self.seed,
                structured_outputs=structured,
            )
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param=request_param(exc, _PARAMS)) from None


# ---------------------------------------------------------------------------- input
def _text_of(content: Any, where: str) -> str:
    """A message's (or a tool output's) text: a string, or ``input_text`` / ``output_text`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts", param="input")
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"{where}.content[{j}]: only input_text and output_text parts are supported here, got type {kind!r}",
                param="input",
            )
        pieces.append(part["text"])
    return "".join(pieces)


def _required_str(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string", param="input")
    return value


def input_messages(instructions: str | None, items: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The chat of a request, as chat templates take it (:func:`acb.serve.shaping.history_message`):
    ``instructions`` as a system message first, then ``input``. Consecutive ``function_call`` items
    (and one right after an assistant message) become that assistant turn's ``tool_calls``;
    ``reasoning`` items of earlier turns are dropped (chat templates drop earlier reasoning)."""
    chat: list[dict[str, Any]] = []  # chat-completions-shaped messages, made template-ready below
    if instructions:
        chat.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        chat.append({"role": "user", "content": items})
        items = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    400, f"{where}.role must be user, system, developer or assistant, got {role!r}", param="input"
                )
            content = content_parts(
                item.get("content"), where, "input", ("input_text", "output_text"), ("input_image",)
            )
            chat.append({"role": role, "content": content})
        elif kind == "function_call":
            call_id, name = _required_str(item, "call_id", where), _required_str(item, "name", where)
            args = shaping.call_arguments(_required_str(item, "arguments", where), f"{where}.arguments", "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            names[call_id] = name
            if chat and chat[-1]["role"] == "assistant":  # the same turn: its text, then its calls
                chat[-1].setdefault("tool_calls", []).append(call)
            else:
                chat.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _required_str(item, "call_id", where)
            if call_id not in names:
                raise APIError(400, f"{where}: no function_call item before it has call_id {call_id!r}", param="input")
            chat.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "name": names[call_id],
                    "content": _text_of(item.get("output"), where + ".output"),
                }
            )
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise APIError(400, f"{where}: item references need stored items; acb serve is stateless", param="input")
        else:
            raise APIError(
                400,
                f"{where}: input items of type {kind!r} are not supported (message, "
                "function_call, function_call_output, reasoning)",
                param="input",
            )
    if not chat:
        raise APIError(400, "input is empty", param="input")
    return [shaping.history_message(m, m["content"], "input", "input") for m in chat]


def _structured(body: ResponsesRequest, plan: shaping.ToolPlan) -> shaping.Constraint | None:
    """The request's constrained decoding (``text.format``, a forced tool call, or vLLM's
    ``structured_outputs`` extra) and where it came from; two at once is a 400."""
    return shaping.one_constraint(
        shaping.Constraint.of("text.format", shaping.structured_from_text_format(body.text_format)),
        plan.constraint,
        shaping.Constraint.of("structured_outputs", shaping.structured_from_extra(body.model_extra or {})),
    )


# ---------------------------------------------------------------------------- output
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if status == "in_progress" else [_text_part(text)],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "status": status,
        "content": [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}],
    }


def _call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status != "in_progress" else "",
        "status": status,
    }


class _Ids:
    """Output item ids, made once per response, so the streamed items and the final response agree."""

    def __init__(self) -> None:
        self.reasoning = _new_id("rs")
        self.message = _new_id("msg")
        self.calls: list[str] = []

    def call(self, i: int) -> str:
        while len(self.calls) <= i:
            self.calls.append(_new_id("fc"))
        return self.calls[i]


def _final_items(shaper: shaping.OutputShaper, ids: _Ids, length: bool) -> list[dict[str, Any]]:
    """The response's ``output`` once the text is shaped: reasoning, message, calls. An empty
    message is left out when there is anything else; when the length ran out, the last text
    item is ``incomplete``."""
    items: list[dict[str, Any]] = []
    with_message = bool(shaper.content) or not (shaper.tool_calls or shaper.has_reasoning)
    if shaper.has_reasoning:
        items.append(
            _reasoning_item(
                ids.reasoning, shaper.reasoning, "incomplete" if length and not with_message else "completed"
            )
        )
    if with_message:
        items.append(_message_item(ids.message, shaper.content, "incomplete" if length else "completed"))
    items.extend(_call_item(ids.call(i), c, "completed") for i, c in enumerate(shaper.tool_calls))
    return items


def _reasoning_tokens(state: ServerState, shaper: shaping.OutputShaper, tokens: Sequence[int]) -> int:
    """How many generated tokens were reasoning: those up to the one that completes the end tag
    (all of them when the reasoning never ended). Token bytes, not a re-tokenized text: the
    model's own tokens are counted."""
    name = state.settings.reasoning_parser
    if name is None or not shaper.has_reasoning:
        return 0
    end = REASONING_PARSERS[name].end_tag.encode()
    seen = bytearray()
    for i, t in enumerate(tokens):
        piece = bytes(state.texts.get(t)[1])
        seen += piece
        if end in seen[-(len(piece) + len(end)) :]:
            return i + 1
    return len(tokens)


class _Shell:
    """What a response says besides its output: the request echoed, as OpenAI's response does."""

    def __init__(self, state: ServerState, body: ResponsesRequest, plan: shaping.ToolPlan) -> None:
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.model = body.model  # the served name, or the LoRA adapter's it selected
        tools = [
            {
                "type": "function",
                "name": f["name"],
                "description": f.get("description"),
                "parameters": f["parameters"],
                "strict": strict,
            }
            for f, strict in zip(plan.functions, plan.strict)
        ]
        choice: Any = {"type": "function", "name": plan.named} if plan.choice == "named" else plan.choice
        text: dict[str, Any] = {"format": body.text_format or {"type": "text"}}
        if body.text and body.text.get("verbosity") is not None:
            text["verbosity"] = body.text["verbosity"]
        self.echo: dict[str, Any] = {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": plan.parallel,
            "previous_response_id": None,
            "reasoning": body.reasoning,
            "store": False,
            "temperature": body.temperature,
            "text": text,
            "tool_choice": choice,
            "tools": tools,
            "top_p": body.top_p,
            "truncation": body.truncation or "disabled",
            "user": body.user,
        }

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, version: Any = None
    ) -> dict[str, Any]:
        """The response object; a finished one (completed or incomplete) carries the
        ``weight_version`` its tokens were sampled under, as completions and chat do."""
        done = status in ("completed", "incomplete")
        extra = {"weight_version": version} if done else {}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model,
            "output": output,
            "usage": usage if done else None,
            **self.echo,
            **extra,
        }


def _response_usage(state: ServerState, out: GenerationOutput, reasoning_tokens: int) -> dict[str, Any]:
    u = usage([out])
    return {
        "input_tokens": u["prompt_tokens"],
        "output_tokens": u["completion_tokens"],
        "total_tokens": u["total_tokens"],
        # cache_write_tokens: OpenAI's explicit prompt caching, which acb does not offer
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"], "cache_write_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def _finished(
    state: ServerState, shaper: shaping.OutputShaper, out: GenerationOutput
) -> tuple[bool, int, dict[str, Any]]:
    """``(length ran out, reasoning tokens, usage)`` of a finished output."""
    sample = samples(out)[0]
    length = finish_reason(sample) == "length"
    reasoning = _reasoning_tokens(state, shaper, sample.generated_tokens)
    return length, reasoning, _response_usage(state, out, reasoning)


# ---------------------------------------------------------------------------- the route
def add_routes(app: FastAPI, state: ServerState) -> None:
    """Add ``POST /v1/responses`` to ``app``.

    Args:
        app: the server's app (:func:`acb.serve.app.build_app` calls this).
        state: its state.
    """

    @routes.add(app, routes.RESPONSES)
    async def responses(request: Request) -> Response:
        return await serve(state, request, ResponsesRequest, "chat", lambda body: _job(state, body))


def _job(state: ServerState, body: ResponsesRequest) -> Job:
    """A Responses request's part of the pipeline: its chat (instructions and input items),
    rendered by the model's template; its constraint; its output as items and events."""
    if state.prompt_renderer is None:
        raise APIError(400, "the served model has no tokenizer: the Responses API needs one", param="input")
    plan = shaping.plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.settings.tool_call_parser)
    constraint = _structured(body, plan)
    messages = input_messages(body.instructions, body.input)
    sampling = body.sampling(None if constraint is None else constraint.spec)
    kwargs = {"tools": plan.template_tools} if plan.template_tools else None
    shell = _Shell(state, body, plan)  # (everything is checked before the request is submitted)
    tokenizer, parser = state.prompt_renderer, state.settings.reasoning_parser

    def output(prompts: Prompts) -> _Output:
        shaper = shaping.OutputShaper(plan, parser, prompts.tail, constrained=constraint is not None)
        return _Output(state, shell, shaper)

    return Job(
        sampling,
        body.stream,
        render=lambda: render_messages(tokenizer, messages, kwargs, parser is not None, state, "input"),
        output=output,
        constraint=constraint,
        params={
            "prompt": "input",
            "prompt_ids": "input",
            "max_new_tokens": "max_output_tokens",
            "structured_outputs": None if constraint is None else constraint.param,
        },
    )


class _Output:
    """A response's formatting (:class:`acb.serve.pipeline.Output`): the response object, or its
    stream of events (see the module docstring for their order)."""

    def __init__(self, state: ServerState, shell: _Shell, shaper: shaping.OutputShaper) -> None:
        self.state = state
        self.shell = shell
        self.shaper = shaper
        self.ids = _Ids()
        self.events = _Events(self.ids)

    def body(self, outs: Sequence[GenerationOutput]) -> dict[str, Any]:
        (out,) = outs
        self.shaper.shape_whole(samples(out)[0].text or "")
        length, _, use = _finished(self.state, self.shaper, out)
        output = _final_items(self.shaper, self.ids, length)
        return self.shell.response("incomplete" if length else "completed", output, use, weight_version(outs))

    def start(self) -> list[str]:
        return [
            self.events.event("response.created", response=self.shell.response("in_progress", [], None)),
            self.events.event("response.in_progress", response=self.shell.response("in_progress", [], None)),
        ]

    def delta(self, p: int, delta: StreamDelta) -> list[str]:
        if not delta.text:
            return []
        shaped = self.shaper.feed(delta.text)
        return self.events.shaped(shaped.reasoning, shaped.content, self.shaper.has_reasoning)

    def end(self, finals: Sequence[GenerationOutput]) -> list[str]:
        if not finals:
            raise RuntimeError("the request's stream ended without its final output")
        self.shaper.finish()  # what it adds (the held text, the calls) is in the final items' text
        length, _, use = _finished(self.state, self.shaper, finals[-1])
        output = _final_items(self.shaper, self.ids, length)
        status = "incomplete" if length else "completed"
        return [
            *self.events.finish(output),
            self.events.event(
                f"response.{status}", response=self.shell.response(status, output, use, weight_version(finals[-1:]))
            ),
        ]

    def error(self, err: APIError) -> str:
        return self.events.error(err)


# ---------------------------------------------------------------------------- streaming
class _Events:
    """SSE events with their ``sequence_number``, and the state of the output items streamed so
    far (which one is open, what text each has sent)."""

    def __init__(self, ids: _Ids) -> None:
        self.ids = ids
        self.seq = 0
        self.index = 0  # output_index of the next item
        self.open: str | None = None  # "reasoning" or "message": the item taking deltas
        self.opened: set[str] = set()
        self.sent = {"reasoning": "", "message": ""}

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def error(self, err: APIError) -> str:
        # ResponseErrorEvent's fields, and the error body the openai client raises from
        return self.event(
            "error", code=err.code or err.type, message=err.message, param=err.param, error=err.body()["error"]
        )

    def _item_id(self, kind: str) -> str:
        return self.ids.reasoning if kind == "reasoning" else self.ids.message

    def _start(self, kind: str) -> list[str]:
        self.open = kind
        self.opened.add(kind)
        item_id = self._item_id(kind)
        item = (_reasoning_item if kind == "reasoning" else _message_item)(item_id, "", "in_progress")
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _text_part("")
        return [
            self.event("response.output_item.added", output_index=self.index, item=item),
            self.event(
                "response.content_part.added", item_id=item_id, output_index=self.index, content_index=0, part=part
            ),
        ]

    def close(self, item: dict[str, Any]) -> list[str]:
        """End the open text item as ``item`` (its final form): the rest of its text, then done."""
        kind = self.open
        assert kind is not None and item["type"] == kind
        text = item["content"][0]["text"]
        out = self.text(kind, text[len(self.sent[kind]) :])
        item_id = self._item_id(kind)
        where = {"item_id": item_id, "output_index": self.index, "content_index": 0}
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.done", text=text, **where))
        else:
            out.append(self.event("response.output_text.done", text=text, logprobs=[], **where))
        out.append(self.event("response.content_part.done", part=item["content"][0], **where))
        out.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.open = None
        self.index += 1
        return out

    def text(self, kind: str, delta: str) -> list[str]:
        """A text delta of the reasoning or the message, opening its item first (and closing the
        reasoning when the message begins)."""
        if not delta:
            return []
        out: list[str] = []
        if self.open != kind:
            if self.open == "reasoning":  # the message began: the reasoning is complete
                out += self.close(_reasoning_item(self.ids.reasoning, self.sent["reasoning"], "completed"))
            out += self._start(kind)
        self.sent[kind] += delta
        where = {"item_id": self._item_id(kind), "output_index": self.index, "content_index": 0}
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", delta=delta, **where))
        else:
            out.append(self.event("response.output_text.delta", delta=delta, logprobs=[], **where))
        return out

    def shaped(self, reasoning: str, content: str, has_reasoning: bool) -> list[str]:
        """The events of a stream delta's reasoning and content text (``has_reasoning``: whether
        the output has a reasoning section, as far as is known). An empty reasoning section
        (``</think>`` at once) still has its item, before the message's, as without streaming."""
        out = self.text("reasoning", reasoning)
        if content and has_reasoning and "reasoning" not in self.opened:
            out += self._start("reasoning")
        return out + self.text("message", content)

    def finish(self, items: list[dict[str, Any]]) -> list[str]:
        """The rest of the output, given its final form: the open item closed, the items not
        streamed yet (an empty message, the calls) added and done."""
        out: list[str] = []
        for item in items:
            kind = item["type"]
            if kind in ("reasoning", "message"):
                if kind in self.opened and self.open != kind:
                    continue  # streamed and closed already
                if self.open != kind:
                    if self.open is not None:
                        # cannot happen: a reasoning item opened after the message
                        raise AssertionError(f"{self.open} item still open before {kind}")
                    out += self._start(kind)
                out += self.close(item)
            else:
                added = {**item, "arguments": "", "status": "in_progress"}
                out.append(self.event("response.output_item.added", output_index=self.index, item=added))
                out.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self.index,
                        delta=item["arguments"],
                    )
                )
                out.append(
                    self.event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=self.index,
                        arguments=item["arguments"],
                        name=item["name"],
                    )
                )
                out.append(self.event("response.output_item.done", output_index=self.index, item=item))
                self.index += 1
        return out
