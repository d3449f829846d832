"""Reasoning parsers: the split of a ``<think>…</think>`` model's output into ``reasoning_content``
and ``content`` (the OpenAI-compatible server's ``--reasoning-parser``), whole or streamed.

Pure Python, no engine: the server makes one parser per request and either calls
:meth:`ReasoningParser.split` on the finished text or feeds the text deltas to
:meth:`~ReasoningParser.feed` and calls :meth:`~ReasoningParser.finish` at the end. For any
chunking of a text, the concatenated deltas equal :meth:`~ReasoningParser.split` of the whole.
A tool parser (:mod:`acb.serve.tool_parsers`), when both are configured, runs on the content
side only::

    parser = REASONING_PARSERS["qwen3"].for_prompt(prompt_text)
    for delta in text_deltas:
        reasoning, content = parser.feed(delta)   # either may be ""
        ...
    reasoning, content = parser.finish()          # what was held back

Rules (both ways of parsing):

- The reasoning section is opened by ``<think>`` at the very start of the output (whitespace
  before it is dropped), or is already open when the parser starts in reasoning
  (``starts_in_reasoning``: the chat template put ``<think>`` in the prompt, as DeepSeek-R1's,
  Qwen3-Thinking-2507's and Qwen3.5's do; :meth:`ReasoningParser.for_prompt` reads that off
  the prompt). A ``<think>`` at the start is then dropped too (a model that repeats it).
- The first ``</think>`` closes it; everything after is content, verbatim (whitespace
  included: vLLM's choice too). Later tags are plain text of whichever side they fall on.
- No ``</think>`` (the output was cut by ``max_tokens``, or the model never closed it): all of
  the output after the opening is reasoning and the content is ``""``, as vLLM's
  ``deepseek_r1`` and ``qwen3`` parsers do.
- No reasoning section (not started in reasoning, and the output does not begin with
  ``<think>``): the reasoning is ``None`` and all of the output is content, verbatim. A
  ``<think>`` later in the output is not a reasoning section: a model writing about tags.

``deepseek_r1`` starts in reasoning unless told otherwise (R1's template ends the prompt with
``<think>\\n``; vLLM's ``deepseek_r1`` also takes tagless output as reasoning); ``qwen3`` does
not (Qwen3's original template lets the model write ``<think>``, and its
``enable_thinking=False`` closes an empty block in the prompt). Prefer
:meth:`ReasoningParser.for_prompt`, which decides from the rendered prompt.

Only text is examined, never token ids: the server's detokenizer must keep the tags in the
text (they are special tokens in some vocabularies, and ``skip_special_tokens`` would drop
them). Unlike vLLM's newest ``qwen3`` parser, a ``<tool_call>`` inside reasoning does not end it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from acb.text import partial_suffix

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser"]

# streaming states
_START = 0  # nothing but whitespace and a part of the opening tag seen yet
_REASONING = 1
_CONTENT = 2


class ReasoningParser:
    """Splits one ``<think>…</think>`` output into reasoning and content; see the module
    docstring for the rules. One instance per request: :meth:`split` is stateless, while
    :meth:`feed`/:meth:`finish` keep the state of one stream.

    ``starts_in_reasoning``: the output begins inside an open reasoning section (the prompt
    ended with ``<think>``); ``None`` takes the class default (:attr:`default_starts_in_reasoning`).
    """

    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    default_starts_in_reasoning: ClassVar[bool] = False

    def __init__(self, *, starts_in_reasoning: bool | None = None) -> None:
        self.starts_in_reasoning = (
            self.default_starts_in_reasoning if starts_in_reasoning is None else starts_in_reasoning
        )
        self._state = _START
        self._held = ""  # text not emitted yet: it may be (part of) a tag
        self._has_reasoning = self.starts_in_reasoning
        self._finished = False

    @classmethod
    def for_prompt(cls, prompt: str) -> Self:
        """A parser whose ``starts_in_reasoning`` is read off the rendered ``prompt``: true when
        the prompt's last ``<think>`` is not closed after it (DeepSeek-R1, Qwen3-Thinking), false
        when its last tag is ``</think>`` (Qwen3 with ``enable_thinking=False``, or a closed
        block of the history), the class default when the prompt has no tag at all."""
        opened, closed = prompt.rfind(cls.start_tag), prompt.rfind(cls.end_tag)
        if opened < 0 and closed < 0:
            return cls()
        return cls(starts_in_reasoning=opened > closed)

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a whole output. ``reasoning`` is ``None`` when the output
        has no reasoning section and may be ``""`` when it has an empty one; ``content`` is
        ``""`` when there is none (the server may send it as ``null``)."""
        stripped = text.lstrip()
        if stripped.startswith(self.start_tag):
            rest = stripped[len(self.start_tag) :]
        elif self.starts_in_reasoning:
            rest = text
        else:
            return None, text
        reasoning, _, content = rest.partition(self.end_tag)
        return reasoning, content

    @property
    def has_reasoning(self) -> bool:
        """Whether the stream has a reasoning section, as far as it is known yet (final after
        :meth:`finish`): the streaming counterpart of :meth:`split` giving ``None``."""
        return self._has_reasoning

    def feed(self, delta: str) -> tuple[str, str]:
        """``(reasoning_delta, content_delta)`` for the next piece of output text; either may be
        ``""``. Text that may be part of a tag (``"<th"``, ``"</thi"``, or leading whitespace
        before a possible ``<think>``) is held back until the next delta decides it."""
        if self._finished:
            raise RuntimeError("ReasoningParser.feed() after finish(); use a new parser per request")
        if self._state == _CONTENT:  # the common case once reasoning is over: no copy, no search
            return "", delta
        return self._advance(self._held + delta, final=False)

    def finish(self) -> tuple[str, str]:
        """``(reasoning_delta, content_delta)``: what :meth:`feed` held back, at the end of the
        output. The parser takes no more text after it."""
        if self._finished:
            raise RuntimeError("ReasoningParser.finish() called twice")
        self._finished = True
        return self._advance(self._held, final=True)

    def _advance(self, text: str, *, final: bool) -> tuple[str, str]:
        self._held = ""
        if self._state == _START:
            stripped = text.lstrip()
            if stripped.startswith(self.start_tag):
                self._has_reasoning = True
                self._state = _REASONING
                text = stripped[len(self.start_tag) :]
            elif self.start_tag.startswith(stripped) and not final:
                # whitespace, then possibly the start of "<think>": wait for more
                self._held = text
                return "", ""
            elif self.starts_in_reasoning:
                self._state = _REASONING
            else:
                self._state = _CONTENT
                return "", text
        if self._state == _REASONING:
            end = text.find(self.end_tag)
            if end >= 0:
                self._state = _CONTENT
                return text[:end], text[end + len(self.end_tag) :]
            keep = 0 if final else partial_suffix(text, self.end_tag)
            self._held = text[len(text) - keep :]
            return text[: len(text) - keep], ""
        return "", text


class DeepSeekR1ReasoningParser(ReasoningParser):
    """vLLM's ``deepseek_r1``: starts in reasoning by default (R1's template opens the block in
    the prompt, and output without tags is taken as reasoning)."""

    default_starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """vLLM's ``qwen3``: starts in content by default (Qwen3's original template lets the model
    write ``<think>``); use :meth:`for_prompt` for the templates that open it in the prompt."""

    default_starts_in_reasoning = False


#: ``--reasoning-parser`` names (vLLM's) to parser classes; construct one per request.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
