"""What one request's structured outputs may cost to compile: :class:`GrammarBudget`.

Two kinds of limit (``ContinuousBatchingConfig.grammar_*``), each refused at submit with a
``ValueError`` naming the limit and the config field that sets it:

- static ones, checked on the spec before anything is compiled (plain Python, microseconds): its
  size in bytes, and how far the counted repetitions (``{m,n}``) of its regexes expand. xgrammar
  0.2.8 turns a JSON schema's ``pattern`` ``a{1,N}`` into work quadratic in ``N`` (N = 30000 took
  over a minute on a 259-token vocabulary), and nested counts multiply.
- a wall-clock one, ``compile_timeout_s``, enforced by :class:`acb.structured.GrammarCompiler`,
  which compiles in worker processes and kills one that runs past it: the backstop for whatever
  is slow without a large number in it (a 50k-token vocabulary takes seconds for one
  ``maxLength``-bounded string).

What is not counted, and why: a JSON schema's ``minLength``/``maxLength``/``minItems``/``maxItems``
(xgrammar compiles them as bounded repetitions without unrolling: ``maxLength`` 100 and 100000 cost
the same, and it refuses values past 2**31 - 1 itself), and nesting (a schema deeper than
:data:`acb.structured_outputs.MAX_SCHEMA_DEPTH` is refused when the spec is made; xgrammar refuses
deeply nested regex and EBNF groups with its own message).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from acb.errors import InvalidRequestError

if TYPE_CHECKING:
    from acb.structured_outputs import StructuredOutputs

__all__ = ["GrammarBudget", "GrammarLimits", "repetition"]

DEFAULT_MAX_BYTES = 128 * 1024
DEFAULT_MAX_REPETITION = 1000
DEFAULT_COMPILE_TIMEOUT_S = 10.0


class GrammarLimits(Protocol):
    """What :meth:`GrammarBudget.from_config` reads of a config: the ``grammar_*`` fields of
    :class:`acb.ContinuousBatchingConfig` (a protocol, so this module, below the config, need not
    import it)."""

    @property
    def grammar_max_bytes(self) -> int: ...

    @property
    def grammar_max_repetition(self) -> int: ...

    @property
    def grammar_compile_timeout_s(self) -> float: ...


@dataclass(frozen=True)
class GrammarBudget:
    """The limits on one structured-outputs spec (see the module docstring).

    ``max_bytes``: the spec's size (a schema as canonical JSON text, a regex, a grammar, the
    choices as a JSON list). ``max_repetition``: the characters the counted repetitions
    (``{m}``, ``{m,}``, ``{m,n}``) of its regexes, JSON-schema ``pattern``s and EBNF may expand
    to, summed over the spec, nested counts multiplied (``(a{1,100}){1,100}`` is 10100).
    ``compile_timeout_s``: the wall-clock seconds one compile may take (None: no limit, for a
    tensor-parallel follower, which compiles what its leader already accepted).
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    max_repetition: int = DEFAULT_MAX_REPETITION
    compile_timeout_s: float | None = DEFAULT_COMPILE_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_repetition"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GrammarBudget.{name} must be an int >= 1, got {v!r}")
        t = self.compile_timeout_s
        if t is None:
            return
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"GrammarBudget.compile_timeout_s must be a number of seconds > 0, got {t!r}")

    @classmethod
    def from_config(cls, config: GrammarLimits) -> GrammarBudget:
        """The budget an engine's config sets (its ``grammar_*`` fields).

        Args:
            config: the engine's config.

        Returns:
            The :class:`GrammarBudget`.
        """
        return cls(
            max_bytes=config.grammar_max_bytes,
            max_repetition=config.grammar_max_repetition,
            compile_timeout_s=float(config.grammar_compile_timeout_s),
        )

    def check(self, spec: StructuredOutputs) -> None:
        """Refuse a spec over the static limits, before any compile.

        Args:
            spec: the request's structured outputs.

        Raises:
            ValueError: the spec is too large, or its repetitions expand too far; the message
                names the limit and its config field.
        """
        payload = spec.key.split("|", 2)[2]
        size = len(payload.encode("utf-8", errors="surrogatepass"))
        if size > self.max_bytes:
            raise InvalidRequestError(
                f"the {spec.kind} constraint is {size} bytes, more than the limit of {self.max_bytes} "
                "(ContinuousBatchingConfig.grammar_max_bytes)",
                "structured_outputs",
            )
        kind = spec.kind
        if kind == "regex":
            total = repetition(payload, self.max_repetition)
        elif kind == "grammar":
            total = repetition(payload, self.max_repetition, ebnf=True)
        elif kind == "json":
            import json

            total = 0
            for pattern in _schema_patterns(json.loads(payload)):
                total += repetition(pattern, self.max_repetition - total)
                if total > self.max_repetition:
                    break
        else:
            return
        if total > self.max_repetition:
            where = "its patterns'" if kind == "json" else "its"
            raise InvalidRequestError(
                f"the {kind} constraint's counted repetitions ({where} {{m,n}}) expand to more than "
                f"{self.max_repetition} characters, the limit (ContinuousBatchingConfig."
                f"grammar_max_repetition); nested counts multiply",
                "structured_outputs",
            )


_QUANTIFIER = re.compile(r"\{(\d*)(,?)(\d*)\}")
_WORD = re.compile(r"[A-Za-z0-9_-]+")


def repetition(pattern: str, limit: int | None = None, *, ebnf: bool = False) -> int:
    """How many characters the counted repetitions of a regex (or an EBNF grammar) expand to.

    Each ``{m}``, ``{m,}`` or ``{m,n}`` counts ``max(m, n)`` times the expanded size of what it
    repeats (a character, a class, a group: groups sum their items and carry the counts inside
    them, so nested counts multiply); uncounted items add nothing. One pass, no recursion.

    Args:
        pattern: the regex, or EBNF text (``ebnf=True``: string literals and rule names are one
            item each).
        limit: stop counting once past it (the result is then some value above ``limit``).
        ebnf: the pattern is an EBNF grammar.

    Returns:
        The expanded size of the counted repetitions (0 for none).
    """
    total = 0
    # per open group: [expanded size of its items so far, expanded size of its last item]
    stack: list[list[int]] = [[0, 0]]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        item = 1
        if c == "\\":
            i += 2
        elif c == "[":
            i = _class_end(pattern, i)
        elif ebnf and c in "\"'":
            end = _literal_end(pattern, i)
            item = max(1, end - i - 2)
            i = end
        elif ebnf and _WORD.match(pattern, i):
            i = _WORD.match(pattern, i).end()  # type: ignore[union-attr]  # (matched just above)
        elif c == "(":
            stack.append([0, 0])
            i += 3 if pattern.startswith("?:", i + 1) else 1
            continue
        elif c == ")" and len(stack) > 1:
            item = stack.pop()[0]
            i += 1
        elif c == "{" and (q := _QUANTIFIER.match(pattern, i)) is not None and (q.group(1) or q.group(3)):
            bound = max(int(q.group(1) or 0), int(q.group(3) or 0))
            frame = stack[-1]
            grown = frame[1] * bound
            frame[0] += grown - frame[1]
            frame[1] = grown
            total += grown
            if limit is not None and total > limit:
                return total
            i = q.end()
            continue
        elif c in "|*+?^$" or c.isspace():
            i += 1
            continue
        else:
            i += 1
        frame = stack[-1]
        frame[0] += item
        frame[1] = item
    return total


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class that opens at ``pattern[i] == "["``."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":  # a leading "]" is a member
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def _literal_end(text: str, i: int) -> int:
    """The index after the quoted literal that opens at ``text[i]``."""
    quote, j = text[i], i + 1
    while j < len(text) and text[j] != quote:
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _schema_patterns(schema: Any) -> list[str]:
    """Every regex of a JSON schema: ``pattern`` values and ``patternProperties`` keys, found
    without recursion (also inside ``enum``/``const`` values: counted, to be safe)."""
    found: list[str] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    found.append(value)
                elif key == "patternProperties" and isinstance(value, dict):
                    found.extend(k for k in value if isinstance(k, str))
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return found
