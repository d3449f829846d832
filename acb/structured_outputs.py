"""What a request's output must match: :class:`StructuredOutputs` (plain data, no xgrammar or
torch: it travels in :class:`acb.SamplingParams` through every layer; :mod:`acb.structured`
compiles and matches it)."""

from __future__ import annotations

import itertools
import json as _json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from acb.errors import InvalidRequestError, InvalidRequestTypeError

__all__ = ["MAX_SCHEMA_DEPTH", "StructuredOutputs"]

# every refusal here is about the request's structured_outputs (InvalidRequestError.field)
_FIELD = "structured_outputs"

# The deepest JSON schema accepted, in nested JSON containers (``{"type": "string"}`` is 1 deep;
# each ``"properties"`` level adds 2). Deeper ones are refused when the spec is made: walking them
# (canonical keys, JSON text, xgrammar's converter) recurses once per level, and Python's stack
# ends near 1000 frames, so the refusal must come before any recursive walk.
MAX_SCHEMA_DEPTH = 128

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True, eq=False)
class StructuredOutputs:
    """What a request's output must match; exactly one kind is set.

    - ``json``: a JSON schema (a dict, or its JSON text). Objects carry only the properties the
      schema declares (xgrammar's strict mode), in the schema's order.
    - ``json_object``: any JSON object.
    - ``regex``: a regular expression the whole output matches (xgrammar's dialect, close to
      ECMAScript's).
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: an EBNF grammar (xgrammar's GBNF dialect) whose start rule is ``root``.

    ``whitespace_flexible`` (``json``/``json_object`` only): by default JSON is compact, with no
    whitespace outside strings (``{"a":1,"b":[2,3]}``), as OpenAI's structured outputs; when true
    the model may put any whitespace between tokens, as ``json.loads`` accepts.

    A ``json`` schema nested deeper than :data:`MAX_SCHEMA_DEPTH` JSON containers is refused
    (``ValueError``).

    Two specs are equal (and hash equal) iff their ``key`` is: the kind, the payload (a schema
    canonicalised with sorted keys and no spaces, so a dict and its text are one key) and the flag.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False
    key: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise InvalidRequestTypeError(f"json_object must be a bool, got {type(self.json_object).__name__}", _FIELD)
        if not isinstance(self.whitespace_flexible, bool):
            raise InvalidRequestTypeError(
                f"whitespace_flexible must be a bool, got {type(self.whitespace_flexible).__name__}", _FIELD
            )
        given = [
            name
            for name, on in (
                ("json", self.json is not None),
                ("json_object", self.json_object),
                ("regex", self.regex is not None),
                ("choice", self.choice is not None),
                ("grammar", self.grammar is not None),
            )
            if on
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                "StructuredOutputs needs exactly one of json, json_object, regex, choice, grammar; "
                + (f"got {', '.join(given)}" if given else "got none"),
                _FIELD,
            )
        kind: Kind = given[0]  # type: ignore[assignment]
        if self.whitespace_flexible and kind not in ("json", "json_object"):
            raise InvalidRequestError(f"whitespace_flexible applies to json and json_object only, not {kind}", _FIELD)
        payload: str
        if kind == "json":
            payload = _canonical_schema(self.json)
        elif kind == "json_object":
            payload = ""
        elif kind == "regex":
            payload = _nonempty_str("regex", self.regex)
        elif kind == "grammar":
            payload = _nonempty_str("grammar", self.grammar)
        else:
            choice = self.choice
            if isinstance(choice, (str, bytes)) or not isinstance(choice, Sequence):
                raise InvalidRequestTypeError(
                    f"choice must be a sequence of strings, got {type(choice).__name__}", _FIELD
                )
            bad = [c for c in choice if not isinstance(c, str)]
            if bad:
                raise InvalidRequestTypeError(
                    f"choice must hold strings only, got {type(bad[0]).__name__} {bad[0]!r}", _FIELD
                )
            if not choice:
                raise InvalidRequestError("choice must hold at least one string", _FIELD)
            # a tuple, so that the frozen spec is not changed through the caller's list
            object.__setattr__(self, "choice", tuple(choice))
            payload = _json.dumps(list(choice), ensure_ascii=False)
        object.__setattr__(self, "key", f"{kind}|ws={int(self.whitespace_flexible)}|{payload}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (a schema as its canonical JSON text): ``StructuredOutputs(**d)``
        rebuilds an equal spec."""
        kind = self.kind
        value: Any = self.key.split("|", 2)[2] if kind == "json" else getattr(self, kind)
        d: dict[str, Any] = {kind: list(value) if kind == "choice" else value}
        if self.whitespace_flexible:
            d["whitespace_flexible"] = True
        return d

    @property
    def kind(self) -> Kind:
        """Which of the five kinds is set."""
        return self.key.split("|", 1)[0]  # type: ignore[return-value]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputs) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


def _nonempty_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidRequestTypeError(f"{name} must be a str, got {type(value).__name__}", _FIELD)
    if not value.strip():
        raise InvalidRequestError(f"{name} must not be empty", _FIELD)
    return value


def _canonical_schema(schema: object) -> str:
    if isinstance(schema, str):
        text = schema
        try:
            schema = _json.loads(text)
        except RecursionError:  # the C parser recurses per level: name the depth, from the text
            raise InvalidRequestError(_too_deep(_text_depth(text)), _FIELD) from None
        except ValueError as exc:
            raise InvalidRequestError(f"json is not valid JSON text: {exc}", _FIELD) from None
        if not isinstance(schema, dict):
            # ValueError: a str is the right type; the JSON it holds is the wrong value
            raise InvalidRequestError(f"json must be a JSON schema object, got JSON {type(schema).__name__}", _FIELD)  # noqa: TRY004
    elif not isinstance(schema, dict):
        raise InvalidRequestTypeError(
            f"json must be a JSON schema as a dict or str, got {type(schema).__name__}", _FIELD
        )
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(_too_deep(depth), _FIELD)
    try:
        return _json.dumps(_sorted_keys(schema), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"json schema is not JSON-serialisable: {exc}", _FIELD) from None


def _too_deep(depth: int) -> str:
    return f"json schema nests {depth} levels deep (JSON objects and arrays), more than the limit of {MAX_SCHEMA_DEPTH}"


def _depth(value: object) -> int:
    """How many JSON containers deep ``value`` nests, walked without recursion.

    Raises:
        ValueError: a dict or list contains itself (no JSON text can).
    """
    deepest = 0
    on_path: set[int] = set()
    # (node, depth, leaving): a container is on the path from its entry until its leave marker
    stack: list[tuple[object, int, bool]] = [(value, 1, False)]
    while stack:
        node, d, leaving = stack.pop()
        if leaving:
            on_path.discard(id(node))
            continue
        if isinstance(node, dict):
            items: Any = node.values()
        elif isinstance(node, (list, tuple)):
            items = node
        else:
            continue
        if id(node) in on_path:
            raise InvalidRequestError("json schema contains itself (a dict or list inside itself is no JSON)", _FIELD)
        on_path.add(id(node))
        deepest = max(deepest, d)
        stack.append((node, d, True))
        stack.extend((v, d + 1, False) for v in items)
    return deepest


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _text_depth(text: str) -> int:
    """The bracket depth of JSON text (strings left out), for text too deep to parse."""
    steps = {"{": 1, "[": 1, "}": -1, "]": -1}
    brackets = (steps[c] for c in _JSON_STRING.sub("", text) if c in steps)
    return max(itertools.accumulate(brackets, initial=0))


def _sorted_keys(value: Any, keep_order: bool = False) -> Any:
    """``value`` with every object's keys sorted, except a ``properties`` map: its order is the
    order the generated object's keys come in, so two schemas differing there are different."""
    if isinstance(value, dict):
        items = list(value.items()) if keep_order else sorted(value.items())
        return {k: _sorted_keys(v, keep_order=k == "properties" and not keep_order) for k, v in items}
    if isinstance(value, (list, tuple)):
        return [_sorted_keys(v) for v in value]
    return value
