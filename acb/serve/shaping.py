"""What a request asks of the model's output beyond text, and the text made into a message.

Request side (the OpenAI fields to engine settings):

- :func:`structured_from_response_format` (chat's ``response_format``),
  :func:`structured_from_text_format` (the Responses API's ``text.format``) and
  :func:`structured_from_extra` (vLLM's ``structured_outputs`` object in the body) give an
  :class:`acb.StructuredOutputs` for the engine (constrained decoding).
- :func:`plan_tools` reads ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (chat or
  Responses shapes) into a :class:`ToolPlan`: the tools rendered by the chat template
  (``tools=`` of ``apply_chat_template``), and either a forced call enforced by constrained
  decoding (a named function: its arguments' schema; ``"required"``: an array of calls, whose
  schema keeps each tool's ``$defs``, see :func:`required_calls_schema`), or ``"auto"``, parsed
  from the text with the server's ``--tool-call-parser``.
- Each of these is a :class:`Constraint`: the spec and the request field it was built from, so
  that the errors about it (it does not compile, it can never be met) name that field;
  :func:`one_constraint` refuses two.
- :func:`history_message` checks the history's tool calls (a malformed one is a 400).

Response side: :class:`OutputShaper`, one per choice, turns the model's text (whole, or
streamed in deltas) into content, ``reasoning_content`` (``--reasoning-parser``) and tool
calls, the same either way. An output constrained from its first token is never reasoning,
nor parsed for ``"auto"`` calls: it is what the constraint made it.
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

__all__ = [
    "Constraint",
    "OutputShaper",
    "Shaped",
    "ToolPlan",
    "call_arguments",
    "check_parsers",
    "history_message",
    "one_constraint",
    "plan_tools",
    "required_calls_schema",
    "structured_from_extra",
    "structured_from_response_format",
    "structured_from_text_format",
]


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
        raise APIError(
            400, f"structured_outputs: unknown field(s) {unknown}; known: {sorted(known)}", param="structured_outputs"
        )
    return _spec("structured_outputs", **so)


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint and where in the request it came from.

    ``field``: the request field that set it (``response_format``, ``text.format``,
    ``structured_outputs``, ``tool_choice``), named when two fields both constrain the output;
    ``param``: the field its content came from, named by the errors about the constraint itself
    (a schema that does not compile, an unsatisfiable one): the field, or for a forced tool call
    the tool's ``parameters`` (``tools[i].function.parameters``; ``tools`` for ``"required"``,
    whose schema joins them all)."""

    field: str
    spec: StructuredOutputs
    param: str

    @classmethod
    def of(cls, field: str, spec: StructuredOutputs | None, param: str | None = None) -> Constraint | None:
        """The constraint ``spec`` set by ``field`` (``param``: where its content is, by default
        ``field``); ``None`` when ``spec`` is.

        Args:
            field: the request field that set the constraint.
            spec: the constraint, or ``None`` when the field does not constrain the output.
            param: the field the constraint's content came from, when it is not ``field``.

        Returns:
            The constraint, or ``None``.
        """
        return None if spec is None else cls(field, spec, param or field)


def one_constraint(*given: Constraint | None) -> Constraint | None:
    """The one constraint a request sets, among those its fields gave; two are a 400.

    Args:
        given: each field's constraint (``None`` where a field sets none).

    Returns:
        The request's constraint, or ``None``.

    Raises:
        APIError: two fields constrain the output (400, naming the second).
    """
    set_ = [c for c in given if c is not None]
    if len(set_) > 1:
        raise APIError(
            400, f"{set_[0].field} and {set_[1].field} both constrain the output; give one", param=set_[1].field
        )
    return set_[0] if set_ else None


# ---------------------------------------------------------------------------- tools
def _function(tool: Any, where: str) -> tuple[dict[str, Any], str, bool]:
    """A tool as ``{"name", "description"?, "parameters"}`` from the chat shape
    (``{"type": "function", "function": {...}}``) or the Responses shape (``{"type": "function",
    "name", ...}``), the request field of its parameters, and its ``strict`` (default true)."""
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise APIError(400, f"{where}: only function tools are supported", param="tools")
    nested = "function" in tool
    if nested and tool.get("name") is not None and not isinstance(tool["name"], str):
        raise APIError(400, f"{where}.name must be a string", param="tools")
    fn = tool.get("function", tool)
    if not isinstance(fn, Mapping):
        raise APIError(400, f"{where}.function must be an object", param="tools")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{where}: a function tool needs a name (a non-empty string)", param="tools")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise APIError(400, f"{where}: parameters must be a JSON schema object", param="tools")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{where}: description must be a string", param="tools")
    strict = fn.get("strict", True)
    if strict is None:
        strict = True
    if not isinstance(strict, bool):
        raise APIError(400, f"{where}: strict must be a boolean", param="tools")
    out = {"name": name, "parameters": dict(params)}
    if description is not None:
        out["description"] = description
    return out, f"{where}.function.parameters" if nested else f"{where}.parameters", strict


_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # their values are data, not schemas
# keywords whose value maps names (a property's, a definition's) to schemas: the names are no keywords
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` (``#...``, a JSON pointer into ``schema``) made to point
    into ``schema``'s copy at ``base`` (a pointer such as ``#/$defs/tool0``) instead."""
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebase_refs(sub, base) for name, sub in value.items()}
        else:
            out[key] = _rebase_refs(value, base)
    return out


def required_calls_schema(functions: Sequence[Mapping[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``tool_choice="required"``'s output: an array of
    ``{"name", "parameters"}`` calls to the given functions (one at most without ``parallel``).

    Each function's parameters schema keeps its own definitions: it is placed whole under the
    root's ``$defs`` (``tool0``, ``tool1``, ... in order, so that two tools' definitions of the
    same name cannot clash), and its local ``$ref`` entries (``#/$defs/Inner``, ``#`` for recursion,
    any JSON pointer into it) are rewritten to point into that copy (``#/$defs/tool0/$defs/Inner``).

    Args:
        functions: the tools, each ``{"name", "parameters", ...}`` (:class:`ToolPlan`'s).
        parallel: whether the output may hold more than one call.

    Returns:
        The schema.
    """
    defs: dict[str, Any] = {}
    items = []
    for i, fn in enumerate(functions):
        key = f"tool{i}"
        defs[key] = _rebase_refs(fn["parameters"], f"#/$defs/{key}")
        items.append(
            {
                "type": "object",
                "properties": {"name": {"enum": [fn["name"]]}, "parameters": {"$ref": f"#/$defs/{key}"}},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools are handled (:func:`plan_tools`)."""

    functions: tuple[dict[str, Any], ...] = ()  # {"name", "description"?, "parameters"}
    choice: str = "none"  # "none", "auto", "required" or "named"
    named: str | None = None  # the function a named tool_choice forces
    parallel: bool = True
    parser: str | None = None  # the tool call parser of "auto"
    params_fields: tuple[str, ...] = ()  # each function's parameters in the request (tools[i].function.parameters)
    strict: tuple[bool, ...] = ()  # each function's ``strict`` (the Responses API echoes it)

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
        constraint = self.constraint
        return None if constraint is None else constraint.spec

    @property
    def constraint(self) -> Constraint | None:
        """:attr:`structured` as the request's :class:`Constraint` (set by ``tool_choice``; its
        content is the named tool's ``parameters``, or all the tools' for ``"required"``)."""
        if self.choice == "named":
            i = next(i for i, f in enumerate(self.functions) if f["name"] == self.named)
            param = self.params_fields[i] if i < len(self.params_fields) else "tools"
            return Constraint("tool_choice", _spec(param, json=self.functions[i]["parameters"]), param)
        if self.choice == "required":
            return Constraint(
                "tool_choice", _spec("tools", json=required_calls_schema(self.functions, self.parallel)), "tools"
            )
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
    found = [_function(t, f"tools[{i}]") for i, t in enumerate(tools)]
    functions = tuple(f for f, _, _ in found)
    fields = tuple(where for _, where, _ in found)
    strict = tuple(s for _, _, s in found)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools have the same name", param="tools")
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, Mapping):  # {"type": "function", "function": {"name"}} or {"type": "function", "name"}
        fn = choice.get("function", choice)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                400,
                'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if name not in names:
            raise APIError(400, f"tool_choice: no tool is named {name!r}", param="tool_choice")
        return ToolPlan(functions, "named", name, parallel, params_fields=fields, strict=strict)
    if choice == "none":
        return ToolPlan(functions, "none", None, parallel, params_fields=fields, strict=strict)
    if choice == "required":
        return ToolPlan(functions, "required", None, parallel, params_fields=fields, strict=strict)
    if choice == "auto":
        if parser is None:
            raise APIError(
                400,
                "tool_choice 'auto' needs the server to be started with --tool-call-parser (hermes, "
                "llama3_json); 'required' or a named function work on any model",
                param="tool_choice",
            )
        return ToolPlan(functions, "auto", None, parallel, parser, fields, strict)
    raise APIError(
        400, f"tool_choice must be none, auto, required or a named function, got {choice!r}", param="tool_choice"
    )


def call_arguments(args: Any, where: str, param: str) -> dict[str, Any] | None:
    """A history tool call's ``arguments`` as chat templates take them: an object (JSON text from
    the client is parsed; empty text is ``{}``).

    Args:
        args: the call's ``arguments`` as the client sent them: JSON text, an object, or ``None``.
        where: their place in the request, for the error message.
        param: the request field the error names.

    Returns:
        The arguments as an object (``None`` when none were given).

    Raises:
        APIError: the arguments are not a JSON object (or JSON text of one), or are nested
            deeper than JSON is parsed (400).
    """
    if isinstance(args, str):
        if not args.strip():
            return {}
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json's recursion allows
            raise APIError(400, f"{where} is not JSON text (or is nested too deeply)", param=param) from None
    if args is None or isinstance(args, dict):
        return args
    if isinstance(args, Mapping):
        return dict(args)
    raise APIError(400, f"{where} must be a JSON object (or JSON text of one)", param=param)


def history_message(
    message: Mapping[str, Any], text: str | list[dict[str, Any]], where: str = "messages", param: str = "messages"
) -> dict[str, Any]:
    """A chat message of the history as chat templates take it: an assistant's ``tool_calls``
    with their arguments as objects (JSON text from the client is parsed), a tool result's
    ``tool_call_id`` and ``name``.

    Args:
        message: the message (chat completions' shape).
        text: its content as text.
        where: the message's place in the request, for error messages (``messages[2]``).
        param: the request field errors name.

    Returns:
        The message for the chat template.

    Raises:
        APIError: a malformed ``tool_calls`` (400).
    """
    out: dict[str, Any] = {"role": message["role"], "content": text}
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
            raise APIError(400, f"{where}.tool_calls must be a list of tool calls", param=param)
        rendered = []
        for j, call in enumerate(calls):
            at = f"{where}.tool_calls[{j}]"
            if not isinstance(call, Mapping):
                raise APIError(400, f"{at} must be an object", param=param)
            fn = call.get("function")
            if not isinstance(fn, Mapping):
                raise APIError(400, f"{at}.function must be an object", param=param)
            if not isinstance(fn.get("name"), str):
                raise APIError(400, f"{at}.function.name must be a string", param=param)
            call_id = call.get("id")
            if call_id is not None and not isinstance(call_id, str):
                raise APIError(400, f"{at}.id must be a string", param=param)
            fn = dict(fn)
            fn["arguments"] = call_arguments(fn.get("arguments"), f"{at}.function.arguments", param)
            rendered.append({"id": call_id, "type": "function", "function": fn})
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
    :attr:`tool_calls` hold the whole message.

    ``constrained``: the output is constrained from its first token (``response_format``,
    ``structured_outputs``, a forced tool call). Such an output is not reasoning, whatever the
    prompt opened, and is not searched for ``"auto"`` tool calls either: it is the content
    verbatim (or, for a forced call, the call), as the constraint made it. (A reasoning parser
    that starts in reasoning would otherwise take all of it as ``reasoning_content``.)
    """

    def __init__(
        self, plan: ToolPlan | None, reasoning_parser: str | None, prompt_text: str = "", *, constrained: bool = False
    ) -> None:
        self.plan = plan or ToolPlan()
        self._forced = self.plan.choice in ("named", "required")
        constrained = constrained or self._forced
        self._reports_reasoning = reasoning_parser is not None  # the message has reasoning_content
        self._reasoning: ReasoningParser | None = (
            REASONING_PARSERS[reasoning_parser].for_prompt(prompt_text)
            if reasoning_parser and not constrained
            else None
        )
        self._tools: ToolParser | None = None
        if self.plan.choice == "auto" and not constrained:
            assert self.plan.parser is not None
            self._tools = TOOL_PARSERS[self.plan.parser](tool_names=[f["name"] for f in self.plan.functions])
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
        return Shaped(
            first.content + last.content, first.reasoning + last.reasoning, first.tool_calls + last.tool_calls
        )

    def _after_reasoning(self, reasoning: str, content: str, *, final: bool) -> Shaped:
        out = Shaped(reasoning=reasoning)
        self.reasoning += reasoning
        if self._forced:
            self._held.append(content)
            if final:
                out.content, out.tool_calls = self._forced_calls("".join(self._held))
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

    def _forced_calls(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """``(content, calls)`` of a forced choice's output: the calls, when it is valid JSON of the
        constraint's shape; else (it ended before its constraint was met: ``max_tokens``, or a
        dead end of its grammar) the text is the content and there are no calls."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            value = None
        if self.plan.choice == "named":
            assert self.plan.named is not None
            pairs = [(self.plan.named, value)] if isinstance(value, dict) else []
        elif (
            isinstance(value, list)
            and value
            and all(isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c for c in value)
        ):
            pairs = [(c["name"], c["parameters"]) for c in value]
        else:
            pairs = []
        if not pairs:
            self._forced = False
            return text, []  # cut short: the client sees what there is
        deltas = []
        for i, (name, args) in enumerate(pairs):
            call = ToolCall(new_tool_call_id(), name, json.dumps(args, ensure_ascii=False))
            self.tool_calls.append(call)
            deltas.append(ToolCallDelta(i, call.id, call.name, call.arguments))
        return "", deltas

    def message(self) -> dict[str, Any]:
        """The assistant message of a finished choice (after :meth:`finish` or :meth:`shape_whole`)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.tool_calls else "")}
        if self._reports_reasoning:
            msg["reasoning_content"] = self.reasoning if self.has_reasoning else None
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` when the model called tools and stopped on its own (OpenAI's)."""
        if self.tool_calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason
