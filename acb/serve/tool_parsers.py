"""Tool-call parsers: the tool calls in a model's output text, for ``tool_choice="auto"`` (the
OpenAI-compatible server's ``--tool-call-parser``), whole or streamed, and the check of the
parsed calls against a request's ``tools``.

Pure Python, no engine. The server makes one parser per request (``TOOL_PARSERS[name](...)``)
and either calls :meth:`ToolParser.extract` on the finished text or feeds the text deltas to
:meth:`~ToolParser.feed` and calls :meth:`~ToolParser.finish` at the end::

    names = None if request_tools is None else tool_names(request_tools)
    parser = TOOL_PARSERS["hermes"](tool_names=names)
    for delta in text_deltas:
        content, calls = parser.feed(delta)     # content: str, maybe ""; calls: [ToolCallDelta]
        ...                                     # the chunk: content, [c.to_openai() for c in calls]
    content, calls = parser.finish()
    finish_reason = "tool_calls" if parser.tool_calls else ...

For any chunking of a text, the concatenated content deltas and the streamed calls equal what
:meth:`~ToolParser.extract` gives for the whole text (up to the random call ids).

Formats:

- ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, anywhere in the output. A ``<tool_call>`` left open at the end of the
  output still counts when its JSON is complete (the model stopped before ``</tool_call>``).
  The first ``</tool_call>`` closes a call, even inside a JSON string.
- ``llama3_json`` (Llama 3.1/3.2/3.3 JSON tool calling): the output is the calls, nothing else:
  optional ``<|python_tag|>``, then ``{"name": ..., "parameters": {...}}`` objects separated by
  ``;``. An output that does not begin (after whitespace) with the tag or ``{`` has no calls.

Choices, the same in both ways of parsing:

- A call object is ``{"name": <non-empty str>, "arguments" | "parameters": <object>}`` (either
  key, not both, and an optional ``"type": "function"``; nothing else). ``arguments`` may also
  be a string holding a JSON object (some fine-tunes write that). ``ToolCall.arguments`` is
  that object re-serialized with ``json.dumps(..., ensure_ascii=False)``.
- A call that is not such an object (malformed or truncated JSON, a wrong shape), or that names
  a tool outside ``tool_names`` when that is given, is not a call: its text stays in the content
  verbatim, tags included (for ``llama3_json``: the whole output when no call came before it,
  else the output from the failing point on; the blanks and ``;`` between calls are dropped). The client then sees what the model wrote, instead of
  an empty message or a call it cannot run.
- Whitespace around a (valid) ``hermes`` call is dropped: models put newlines between calls.
  The content is all the text outside the calls, usually only the text before them; it is
  ``None`` from :meth:`~ToolParser.extract` when empty (``""`` deltas when streaming).
- Streaming holds text back only while it may still become a call: a trailing part of
  ``<tool_call>`` (and the whitespace before it), an open ``<tool_call>`` until its close, for
  ``llama3_json`` the output until its first non-blank character decides, and an object until
  its closing brace. A call is emitted once complete and checked: one :class:`ToolCallDelta`
  with its index, id, name and all of its arguments (clients concatenating ``arguments``
  fragments get the same string). Streaming the arguments token by token would commit to a call
  before knowing it is valid, so a malformed call could not fall back to content, and the stream
  could disagree with the non-streamed response; tool calls are short, so the delay is small.

Only text is examined, never token ids: the server's detokenizer must keep the tags in the text
(``<|python_tag|>`` is a special token that ``skip_special_tokens`` drops; the llama3_json
parser also accepts the output without it).
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from acb.text import partial_suffix

__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "filter_tool_calls",
    "new_tool_call_id",
    "tool_names",
]

_ID_ALPHABET = string.ascii_letters + string.digits
_CALL_KEYS = frozenset({"name", "arguments", "parameters", "type"})


def new_tool_call_id() -> str:
    """A tool-call id in OpenAI's shape: ``"call_"`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call; ``arguments`` is a JSON object as a string (OpenAI's type)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The call as an element of an OpenAI chat message's ``tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """One element of a streamed chunk's ``delta.tool_calls``: ``index`` counts the calls of the
    response from 0; ``id`` and ``name`` are set on the first delta of a call only, and a call's
    ``arguments`` are the concatenation of its deltas' ``arguments``."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The delta in OpenAI's streaming shape (``id``, ``type`` and ``name`` only when set)."""
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


def tool_names(tools: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """The function names of a request's ``tools``: chat completions' shape
    (``{"type": "function", "function": {"name": ...}}``) or the Responses API's flat one
    (``{"type": "function", "name": ...}``). Tools of other types, or without a string name, are
    left out."""
    names: set[str] = set()
    for tool in tools:
        if tool.get("type", "function") != "function":
            continue
        function = tool.get("function")
        name = function.get("name") if isinstance(function, Mapping) else tool.get("name")
        if isinstance(name, str):
            names.add(name)
    return frozenset(names)


def filter_tool_calls(
    calls: Sequence[ToolCall], tools: Iterable[Mapping[str, Any]]
) -> tuple[list[ToolCall], list[ToolCall]]:
    """``(known, unknown)``: ``calls`` split by whether they name one of the request's ``tools``
    (see :func:`tool_names`), each in its original order. For calls parsed without
    ``tool_names``; a parser given ``tool_names`` never returns unknown calls (it leaves their
    text in the content, which suits streaming: a call cannot be taken back once sent)."""
    names = tool_names(tools)
    known = [call for call in calls if call.name in names]
    unknown = [call for call in calls if call.name not in names]
    return known, unknown


def _call_from_json(obj: object, names: frozenset[str] | None) -> ToolCall | None:
    """The call that the decoded JSON ``obj`` stands for, or ``None`` when it is not a call (the
    module docstring's shape) or names a tool outside ``names``."""
    if not isinstance(obj, dict) or not obj.keys() <= _CALL_KEYS or obj.get("type", "function") != "function":
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    if ("arguments" in obj) == ("parameters" in obj):
        return None
    arguments = obj["arguments"] if "arguments" in obj else obj["parameters"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=new_tool_call_id(), name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _parse_call(text: str, names: frozenset[str] | None) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than json's recursion allows
        return None
    return _call_from_json(obj, names)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class ToolParser(ABC):
    """Finds the tool calls in one output; one instance per request. :meth:`extract` is
    stateless; :meth:`feed`/:meth:`finish` keep the state of one stream.

    ``tool_names``: the names of the request's tools (see :func:`tool_names`); a call to another
    name is not taken as a call (its text stays content). ``None``: any name.
    """

    def __init__(self, *, tool_names: Collection[str] | None = None) -> None:
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self._calls: list[ToolCall] = []
        self._finished = False

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole output: the text outside the calls (``None`` when
        empty; all of ``text`` when there is no call) and the calls in order."""

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls streamed so far (a copy), with the ids their deltas carried."""
        return list(self._calls)

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """``(content_delta, call_deltas)`` for the next piece of output text; ``content_delta``
        may be ``""``. Text that may still become a call is held back (module docstring)."""
        if self._finished:
            raise RuntimeError(f"{type(self).__name__}.feed() after finish(); use a new parser per request")
        return self._advance(delta, final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """``(content_delta, call_deltas)``: what :meth:`feed` held back, decided now that the
        output has ended. The parser takes no more text after it."""
        if self._finished:
            raise RuntimeError(f"{type(self).__name__}.finish() called twice")
        self._finished = True
        return self._advance("", final=True)

    @abstractmethod
    def _advance(self, delta: str, *, final: bool) -> tuple[str, list[ToolCallDelta]]: ...

    def _emit(self, call: ToolCall) -> ToolCallDelta:
        self._calls.append(call)
        return ToolCallDelta(index=len(self._calls) - 1, id=call.id, name=call.name, arguments=call.arguments)


# HermesToolParser's streaming states
_H_CONTENT = 0
_H_CALL = 1  # inside <tool_call>, waiting for </tool_call>
_H_AFTER_CALL = 2  # right after a valid call: whitespace is dropped


class HermesToolParser(ToolParser):
    """vLLM's ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` calls
    (Hermes 2 Pro, Qwen2.5, Qwen3)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, *, tool_names: Collection[str] | None = None) -> None:
        super().__init__(tool_names=tool_names)
        self._state = _H_CONTENT
        # Text not emitted yet. In _H_CALL it is the whitespace before the tag, the tag and the
        # body so far: all of it is content again if the call turns out malformed.
        self._held = ""
        self._body_at = 0  # _H_CALL: where the body starts in _held
        self._search_at = 0  # _H_CALL: where to look for end_tag next (no rescans of the body)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (opened := text.find(self.start_tag, pos)) >= 0:
            body_at = opened + len(self.start_tag)
            closed = text.find(self.end_tag, body_at)
            body_end, after = (len(text), len(text)) if closed < 0 else (closed, closed + len(self.end_tag))
            call = _parse_call(text[body_at:body_end], self.tool_names)
            if call is None:
                content.append(text[pos:after])
                pos = after
            else:
                content.append(text[pos:opened].rstrip())
                calls.append(call)
                pos = _skip_ws(text, after)
        content.append(text[pos:])
        return "".join(content) or None, calls

    def _advance(self, delta: str, *, final: bool) -> tuple[str, list[ToolCallDelta]]:
        text = self._held + delta
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._state == _H_AFTER_CALL:
                text = text.lstrip()
                if not text:
                    break
                self._state = _H_CONTENT
            if self._state == _H_CONTENT:
                opened = text.find(self.start_tag)
                if opened < 0:
                    # hold back a possible start of the tag and the whitespace before it (dropped
                    # if a call follows)
                    keep = 0 if final else partial_suffix(text, self.start_tag)
                    cut = len(text) - keep if final else len(text[: len(text) - keep].rstrip())
                    content.append(text[:cut])
                    text = text[cut:]
                    break
                cut = len(text[:opened].rstrip())
                content.append(text[:cut])
                text = text[cut:]
                self._state = _H_CALL
                self._body_at = self._search_at = opened - cut + len(self.start_tag)
            # _H_CALL
            closed = text.find(self.end_tag, self._search_at)
            if closed < 0 and not final:
                self._search_at = max(self._body_at, len(text) - len(self.end_tag) + 1)
                break
            body_end, after = (len(text), len(text)) if closed < 0 else (closed, closed + len(self.end_tag))
            call = _parse_call(text[self._body_at : body_end], self.tool_names)
            if call is None:
                content.append(text[:after])
                self._state = _H_CONTENT
            else:
                deltas.append(self._emit(call))
                self._state = _H_AFTER_CALL
            text = text[after:]
            if final and not text:
                break
        self._held = text
        return "".join(content), deltas


# Llama3JsonToolParser's streaming states
_L_PREFIX = 0  # before the first non-blank character after an optional <|python_tag|>
_L_OBJECT = 1  # inside a call object, waiting for its closing brace
_L_AFTER_OBJECT = 2  # after a call: whitespace, then ";" or the end
_L_NEXT = 3  # after ";": whitespace, then "{" or the end
_L_CONTENT = 4  # no (more) calls: all is content


class Llama3JsonToolParser(ToolParser):
    """vLLM's ``llama3_json``: an output that is ``[<|python_tag|>]{"name": ..., "parameters":
    {...}}`` objects separated by ``;`` (Llama 3.1/3.2/3.3 JSON tool calling)."""

    python_tag = "<|python_tag|>"

    def __init__(self, *, tool_names: Collection[str] | None = None) -> None:
        super().__init__(tool_names=tool_names)
        self._state = _L_PREFIX
        # The output from the point where a failure would make it content (the very start until
        # the first call, then the current object); _pos: how far it has been read.
        self._held = ""
        self._pos = 0
        self._object_at = 0
        # the object's brace scanner: nesting depth, inside a string, after a backslash in one
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        pos = _skip_ws(text, 0)
        if text.startswith(self.python_tag, pos):
            pos = _skip_ws(text, pos + len(self.python_tag))
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        while pos < len(text):
            call, end = None, pos
            if text[pos] == "{":
                try:
                    obj, end = decoder.raw_decode(text, pos)
                    call = _call_from_json(obj, self.tool_names)
                except (ValueError, RecursionError):
                    pass
            if call is None:
                return (text if not calls else text[pos:]) or None, calls
            calls.append(call)
            pos = _skip_ws(text, end)
            if pos < len(text):
                if text[pos] != ";":
                    return text[pos:], calls
                pos = _skip_ws(text, pos + 1)
        return (text if not calls else "") or None, calls

    def _advance(self, delta: str, *, final: bool) -> tuple[str, list[ToolCallDelta]]:
        if self._state == _L_CONTENT:
            return delta, []
        text = self._held = self._held + delta
        deltas: list[ToolCallDelta] = []
        while True:
            pos = self._pos
            if self._state == _L_PREFIX:
                start = _skip_ws(text, 0)
                if text.startswith(self.python_tag, start):
                    pos = _skip_ws(text, start + len(self.python_tag))
                elif self.python_tag.startswith(text[start:]) and not final:
                    return "", deltas  # blank so far, or a part of the tag: undecided
                else:
                    pos = start
                if pos == len(text):
                    return (text if final else ""), deltas  # final: blank or a bare tag, no call
                if text[pos] != "{":
                    return self._fail(0), deltas
                self._start_object(pos)
            elif self._state in (_L_AFTER_OBJECT, _L_NEXT):
                pos = _skip_ws(text, pos)
                if pos == len(text):
                    self._held, self._pos = "", 0  # blanks and ";" between calls are dropped
                    return "", deltas
                if self._state == _L_AFTER_OBJECT and text[pos] == ";":
                    self._state, self._pos = _L_NEXT, pos + 1
                    continue
                if self._state == _L_AFTER_OBJECT or text[pos] != "{":
                    return self._fail(pos), deltas
                self._start_object(pos)
            # _L_OBJECT
            end = self._scan_object(text)
            if end < 0:
                return (self._fail(self._object_at) if final else ""), deltas
            call = _parse_call(text[self._object_at : end], self.tool_names)
            if call is None:
                return self._fail(self._object_at), deltas
            deltas.append(self._emit(call))
            # the text up to here is consumed: a later failure does not give it back as content
            text = self._held = text[end:]
            self._state, self._pos = _L_AFTER_OBJECT, 0

    def _start_object(self, at: int) -> None:
        self._state = _L_OBJECT
        self._object_at = self._pos = at
        self._depth, self._in_string, self._escaped = 0, False, False

    def _scan_object(self, text: str) -> int:
        """Reads on from ``_pos`` to the brace that closes the object at ``_object_at``: the
        index after it, or -1 if it has not come yet. Braces in strings do not count; any other
        malformation is json's to find."""
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        end = -1
        for i in range(self._pos, len(text)):
            c = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    end = i + 1
                    break
        self._depth, self._in_string, self._escaped = depth, in_string, escaped
        self._pos = len(text) if end < 0 else end
        return end

    def _fail(self, at: int) -> str:
        """No more calls: the held output from ``at`` (all of it before the first call) is
        content, and so is everything after."""
        text = self._held if not self._calls else self._held[at:]
        self._state, self._held, self._pos = _L_CONTENT, "", 0
        return text


#: ``--tool-call-parser`` names (vLLM's) to parser classes; construct one per request.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
