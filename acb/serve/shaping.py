"""What a request asks of the model's output beyond text, and the text made into a message.

Request side (the OpenAI fields to engine settings):

- :func:`structured_from_response_format` (chat's ``response_format``),
  :func:`structured_from_text_format` (the Responses API's ``text.format``) and
  :func:`structured_from_extra` (vLLM's ``structured_outputs`` object in the body) give an
  :class:`acb.StructuredOutputs` for the engine (constrained decoding).
- :func:`plan_tools` reads ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (chat or
  Responses shapes) into a :class:`ToolPlan`: the tools rendered by the chat template
  (``tools=`` of ``apply_chat_template``), and either a forced call enforced by constrained
  decoding (a named function: its arguments' schema; ``"required"``: an array of calls), or
  ``"auto"``, parsed from the text with the server's ``--tool-call-parser``.

Response side: :class:`OutputShaper`, one per choice, turns the model's text (whole, or
streamed in deltas) into content, ``reasoning_content`` (``--reasoning-parser``) and tool
calls, the same either way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from acb.serve.protocol import APIError
from acb.serve.reasoning import REASONING_PARSERS, ReasoningParser
from acb.serve.tool_parsers import TOOL_PARSERS, ToolCall, ToolCallDelta, ToolParser, new_tool_call_id
from acb.structured_outputs import StructuredOutputs

__all__ = ["OutputShaper", "Shaped", "ToolPlan", "check_parsers", "history_message", "one_constraint", "plan_tools",
           "structured_from_extra",
           "structured_from_response_format", "structured_from_text_format"]


def check_parsers(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Refuse unknown parser names (the server's flags), naming the known ones."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {tool_call_parser!r}; choose from {sorted(TOOL_PARSERS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; choose from {sorted(REASONING_PARSERS)}")


# ------------------------------------------------------------------ structured outputs
def _spec(param: str, **kw: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**kw)
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None


def _schema_of(param: str, holder: Mapping[str, Any]) -> Any:
    schema = holder.get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: a JSON schema object is required (got {type(schema).__name__})", param=param)
    return schema


def _from_format(value: Any, param: str, schema_holder: Any) -> StructuredOutputs | None:
    """``text`` (nothing), ``json_object`` or ``json_schema`` (its schema in ``schema_holder(value)``)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise APIError(400, f"{param} must be an object", param=param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec(param, json_object=True)
    if kind == "json_schema":
        holder = schema_holder(value)
        if not isinstance(holder, Mapping):
            raise APIError(400, f"{param}.json_schema must be an object", param=param)
        return _spec(param, json=_schema_of(param, holder))
    raise APIError(400, f"{param} type {kind!r} is not one of text, json_object, json_schema", param=param)


def structured_from_response_format(rf: Any) -> StructuredOutputs | None:
    """Chat's ``response_format``: ``text`` (nothing), ``json_object``, or ``json_schema``
    (``{"json_schema": {"name", "schema", "strict"}}``; strict or not, the output fits the schema)."""
    return _from_format(rf, "response_format", lambda v: v.get("json_schema"))


def structured_from_text_format(fmt: Any) -> StructuredOutputs | None:
    """The Responses API's ``text.format``: ``text``, ``json_object`` or ``json_schema``
    (``{"type": "json_schema", "name", "schema", "strict"}``)."""
    return _from_format(fmt, "text.format", lambda v: v)


def structured_from_extra(extra: Mapping[str, Any]) -> StructuredOutputs | None:
    """vLLM's ``structured_outputs`` object of the body (``extra_body`` in the openai client):
    ``{"json" | "json_object" | "regex" | "choice" | "grammar": ..., "whitespace_flexible"?}``."""
    so = extra.get("structured_outputs")
    if so is None:
        return None
    if not isinstance(so, Mapping):
        raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
    known = {"json", "json_object", "regex", "choice", "grammar", "whitespace_flexible"}
    unknown = sorted(set(so) - known)
    if unknown:
        raise APIError(400, f"structured_outputs: unknown field(s) {unknown}; known: {sorted(known)}",
                       param="structured_outputs")
    return _spec("structured_outputs", **so)


def one_constraint(*given: tuple[str, StructuredOutputs | None]) -> StructuredOutputs | None:
    """The one constraint a request sets, among ``(field, spec)`` pairs; two are a 400."""
    set_ = [(name, spec) for name, spec in given if spec is not None]
    if len(set_) > 1:
        raise APIError(400, f"{set_[0][0]} and {set_[1][0]} both constrain the output; give one", param=set_[1][0])
    return set_[0][1] if set_ else None


# ---------------------------------------------------------------------------- tools
def _function(tool: Any, where: str) -> dict[str, Any]:
    """A tool as ``{"name", "description"?, "parameters"}`` from the chat shape
    (``{"type": "function", "function": {...}}``) or the Responses shape (``{"type": "function",
    "name", ...}``)."""
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise APIError(400, f"{where}: only function tools are supported", param="tools")
    fn = tool.get("function", tool)
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{where}: a function tool needs a name", param="tools")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise APIError(400, f"{where}: parameters must be a JSON schema object", param="tools")
    out = {"name": name, "parameters": dict(params)}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return out


@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools are handled (:func:`plan_tools`)."""

    functions: tuple[dict[str, Any], ...] = ()  # {"name", "description"?, "parameters"}
    choice: str = "none"  # "none", "auto", "required" or "named"
    named: str | None = None  # the function a named tool_choice forces
    parallel: bool = True
    parser: str | None = None  # the tool call parser of "auto"

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (``apply_chat_template(tools=...)``)."""
        if not self.functions:
            return None
        return [{"type": "function", "function": f} for f in self.functions]

    @property
    def structured(self) -> StructuredOutputs | None:
        """Constrained decoding for a forced call: the named function's arguments, or an array
        of ``{"name", "parameters"}`` calls (one at most without ``parallel_tool_calls``)."""
        if self.choice == "named":
            fn = next(f for f in self.functions if f["name"] == self.named)
            return _spec("tools", json=fn["parameters"])
        if self.choice == "required":
            items = {"anyOf": [{"type": "object", "properties": {"name": {"enum": [f["name"]]},
                                                                  "parameters": f["parameters"]},
                                "required": ["name", "parameters"], "additionalProperties": False}
                               for f in self.functions]}
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
            if not self.parallel:
                schema["maxItems"] = 1
            return _spec("tools", json=schema)
        return None


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any, parser: str | None) -> ToolPlan:
    """The request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; bad ones are 400s.
    ``tool_choice`` defaults to ``"auto"`` when there are tools, which needs ``parser`` (the
    server's ``--tool-call-parser``); named and ``"required"`` choices work on any model."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan()
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise APIError(400, "tools must be a list", param="tools")
    functions = tuple(_function(t, f"tools[{i}]") for i, t in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools have the same name", param="tools")
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, Mapping):  # {"type": "function", "function": {"name"}} or {"type": "function", "name"}
        fn = choice.get("function", choice)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(400, "tool_choice: a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           param="tool_choice")
        if name not in names:
            raise APIError(400, f"tool_choice: no tool is named {name!r}", param="tool_choice")
        return ToolPlan(functions, "named", name, parallel)
    if choice == "none":
        return ToolPlan(functions, "none", None, parallel)
    if choice == "required":
        return ToolPlan(functions, "required", None, parallel)
    if choice == "auto":
        if parser is None:
            raise APIError(400, "tool_choice 'auto' needs the server to be started with --tool-call-parser (hermes, "
                                "llama3_json); 'required' or a named function work on any model",
                           param="tool_choice")
        return ToolPlan(functions, "auto", None, parallel, parser)
    raise APIError(400, f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                   param="tool_choice")


def history_message(message: Mapping[str, Any], text: str) -> dict[str, Any]:
    """A chat message of the history as chat templates take it: an assistant's ``tool_calls``
    with their arguments as objects (JSON text from the client is parsed), a tool result's
    ``tool_call_id`` and ``name``."""
    out: dict[str, Any] = {"role": message["role"], "content": text}
    calls = message.get("tool_calls")
    if calls:
        rendered = []
        for call in calls:
            fn = dict(call.get("function") or {}) if isinstance(call, Mapping) else {}
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise APIError(400, "messages: a tool call's arguments are not JSON", param="messages") from None
            rendered.append({"id": call.get("id"), "type": "function", "function": fn})
        out["tool_calls"] = rendered
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


# --------------------------------------------------------------------- the response
@dataclass
class Shaped:
    """Pieces of a message (a stream delta, or the whole when the output ended)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class OutputShaper:
    """One choice's text made into a message: reasoning first (``<think>``), then tool calls
    (parsed for ``"auto"``; a forced call is the whole constrained output, read at the end).
    Feed text deltas, then :meth:`finish`; :attr:`content`, :attr:`reasoning` and
    :attr:`tool_calls` hold the whole message."""

    def __init__(self, plan: ToolPlan | None, reasoning_parser: str | None, prompt_text: str = "") -> None:
        self.plan = plan or ToolPlan()
        self._reasoning: ReasoningParser | None = (
            REASONING_PARSERS[reasoning_parser].for_prompt(prompt_text) if reasoning_parser else None)
        self._tools: ToolParser | None = None
        if self.plan.choice == "auto":
            assert self.plan.parser is not None
            self._tools = TOOL_PARSERS[self.plan.parser](tool_names=[f["name"] for f in self.plan.functions])
        self._forced = self.plan.choice in ("named", "required")
        self._held: list[str] = []  # a forced call's text, read whole at the end
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[ToolCall] = []

    @property
    def has_reasoning(self) -> bool:
        return self._reasoning is not None and self._reasoning.has_reasoning

    def feed(self, text: str) -> Shaped:
        reasoning, content = self._reasoning.feed(text) if self._reasoning is not None else ("", text)
        return self._after_reasoning(reasoning, content, final=False)

    def finish(self) -> Shaped:
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        return self._after_reasoning(reasoning, content, final=True)

    def shape_whole(self, text: str) -> Shaped:
        """The whole text at once (a non-streamed response): what the stream would add up to."""
        first, last = self.feed(text), self.finish()
        return Shaped(first.content + last.content, first.reasoning + last.reasoning,
                      first.tool_calls + last.tool_calls)

    def _after_reasoning(self, reasoning: str, content: str, *, final: bool) -> Shaped:
        out = Shaped(reasoning=reasoning)
        self.reasoning += reasoning
        if self._forced:
            self._held.append(content)
            if final:
                out.tool_calls = self._forced_calls("".join(self._held))
        elif self._tools is not None:
            text, calls = self._tools.feed(content) if content else ("", [])
            if final:
                more, tail = self._tools.finish()
                text, calls = text + more, calls + tail
            out.content, out.tool_calls = text, calls
            self.tool_calls = list(self._tools.tool_calls)
        else:
            out.content = content
        self.content += out.content
        return out

    def _forced_calls(self, text: str) -> list[ToolCallDelta]:
        """The calls of a forced choice's output (valid JSON unless the length ran out: then the
        text is the content and there are no calls)."""
        try:
            value = json.loads(text)
        except ValueError:
            self.content += text  # cut short by max_tokens: the client sees what there is
            self._forced = False
            return []
        if self.plan.choice == "named":
            assert self.plan.named is not None
            pairs = [(self.plan.named, value)]
        else:
            pairs = [(c["name"], c["parameters"]) for c in value]
        deltas = []
        for i, (name, args) in enumerate(pairs):
            call = ToolCall(new_tool_call_id(), name, json.dumps(args, ensure_ascii=False))
            self.tool_calls.append(call)
            deltas.append(ToolCallDelta(i, call.id, call.name, call.arguments))
        return deltas

    def message(self) -> dict[str, Any]:
        """The assistant message of a finished choice (after :meth:`finish` or :meth:`shape_whole`)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.tool_calls else "")}
        if self._reasoning is not None:
            msg["reasoning_content"] = self.reasoning if self._reasoning.has_reasoning else None
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` when the model called tools and stopped on its own (OpenAI's)."""
        if self.tool_calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason
