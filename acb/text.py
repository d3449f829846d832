"""The tokenizer side: prompts as text or chats, and streaming detokenization.

The engine core only ever sees token ids. This module turns what a user submits into ids
(:func:`encode_prompt`) and the ids a request generates back into text, a few tokens at a
time (:class:`IncrementalDetokenizer`), for the stream deltas and the final output.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, cast, overload

if TYPE_CHECKING:
    import numpy as np
    import torch
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

    # what the engines take as ``tokenizer=``: a tokenizer, or a processor that wraps one
    TokenizerLike: TypeAlias = "PreTrainedTokenizerBase | ProcessorMixin"
    # what they take as a prompt: token ids (a list, a 1-D tensor or array, a [1, T] tensor),
    # a string, or a chat (a list of {"role", "content"} messages)
    Prompt: TypeAlias = "str | Sequence[int] | Sequence[Mapping[str, Any]] | torch.Tensor | np.ndarray"

# what a chat message looks like: {"role": ..., "content": ...}
_CHAT_KEYS = {"role", "content"}


@overload
def text_tokenizer(tokenizer: None) -> None: ...
@overload
def text_tokenizer(tokenizer: TokenizerLike) -> PreTrainedTokenizerBase: ...
def text_tokenizer(tokenizer: TokenizerLike | None) -> PreTrainedTokenizerBase | None:
    """The text tokenizer of a tokenizer or a processor that wraps one (``processor.tokenizer``)."""
    if tokenizer is None:
        return None
    inner: PreTrainedTokenizerBase | None = getattr(tokenizer, "tokenizer", None)
    if inner is not None and hasattr(inner, "decode"):
        return inner
    # a tokenizer, or a processor without a text tokenizer that is used as one (called, decode)
    return cast("PreTrainedTokenizerBase", tokenizer)


def is_chat(prompt: object) -> bool:
    """A chat: a non-empty list of ``{"role", "content"}`` mappings."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, (str, bytes))
        and len(prompt) > 0
        and all(isinstance(m, Mapping) and _CHAT_KEYS <= set(m) for m in prompt)
    )


class RenderedChat(list):  # type: ignore[type-arg]  # list[dict[str, Any]]
    """A chat (a list of ``{"role", "content"}`` messages) with its token ids already rendered:
    :func:`encode_prompt` takes the ids as they are. A caller that renders chats elsewhere (``acb
    serve`` does it in worker threads, off its event loop, within a time bound) submits this, and
    the request still reads as a chat (telemetry's operation name and captured content)."""

    def __init__(self, messages: Sequence[Mapping[str, Any]], token_ids: Sequence[int]) -> None:
        super().__init__(dict(m) for m in messages)
        self.token_ids = list(token_ids)


class TokenizedText(str):
    """A text prompt with its token ids already made (as :class:`RenderedChat` for a chat)."""

    token_ids: list[int]

    def __new__(cls, text: str, token_ids: Sequence[int]) -> TokenizedText:
        obj = super().__new__(cls, text)
        obj.token_ids = list(token_ids)
        return obj


def encode_prompt(
    tokenizer: TokenizerLike | None, prompt: Prompt, chat_template_kwargs: Mapping[str, Any] | None = None
) -> Any:
    """Token ids for a text or chat prompt; anything else is returned as it is (ids, checked later).

    Text is tokenized as transformers does by default (with the model's special tokens); a
    chat is rendered with the tokenizer's chat template, ``add_generation_prompt=True``. A chat
    template that raises (``raise_exception(...)``, as templates do for chats their model does
    not take, or any other template error) is a ``ValueError`` naming it. A
    :class:`RenderedChat` or :class:`TokenizedText` gives its ids.
    """
    if isinstance(prompt, (RenderedChat, TokenizedText)):
        return list(prompt.token_ids)
    text_like = isinstance(prompt, str) or is_chat(prompt)
    if not text_like:
        return prompt
    if tokenizer is None:
        kind = "text" if isinstance(prompt, str) else "a chat"
        raise TypeError(
            f"the prompt is {kind}, but the engine has no tokenizer: pass tokenizer=... to the engine "
            "(or use Engine.from_pretrained / AsyncEngine.from_pretrained), or submit token ids"
        )
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is an empty string: a request needs at least one prompt token")
        return list(text_tokenizer(tokenizer)(prompt)["input_ids"])
    return render_chat(tokenizer, cast("Sequence[Mapping[str, Any]]", prompt), chat_template_kwargs)


def render_chat(
    tokenizer: TokenizerLike, chat: Sequence[Mapping[str, Any]], chat_template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    """A chat's token ids by the tokenizer's chat template (``add_generation_prompt=True`` unless
    the kwargs say otherwise). Template errors become ``ValueError``: a template that calls
    ``raise_exception`` refuses that chat, which is bad input like any other."""
    kwargs = {"add_generation_prompt": True, **(chat_template_kwargs or {})}
    if (
        getattr(text_tokenizer(tokenizer), "chat_template", None) is None
        and getattr(tokenizer, "chat_template", None) is None
        and kwargs.get("chat_template") is None
    ):
        raise ValueError("the prompt is a chat, but the tokenizer has no chat template (set tokenizer.chat_template)")
    try:
        ids = tokenizer.apply_chat_template([dict(m) for m in chat], tokenize=True, **kwargs)
    except _template_errors() as exc:
        raise ValueError(f"the chat template refused this chat: {type(exc).__name__}: {exc}") from None
    if isinstance(ids, Mapping):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return list(ids)


@functools.lru_cache(maxsize=1)
def _template_errors() -> tuple[type[BaseException], ...]:
    """jinja2's ``TemplateError`` (what ``raise_exception`` raises, and syntax, undefined and
    sandbox errors), when jinja2 (which chat templates need) is installed."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers' chat templates need jinja2
        return ()
    return (TemplateError,)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``: what a stream
    parser holds back (the reasoning and tool-call parsers of ``acb serve``), because the next
    delta may complete the tag."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class IncrementalDetokenizer:
    """Text of a growing token sequence, in pieces: amortised O(new tokens) per step.

    Each call decodes only a short window: the tokens from the last emitted boundary's
    predecessor on, and the same window without the new tokens; the difference is the new
    text. Starting both decodes at the same earlier token keeps tokenizers whose decode of a
    token depends on its neighbour (SentencePiece's leading space) right, and text that ends in
    an incomplete UTF-8 character (U+FFFD) is held back until the character is complete, so a
    byte-level emoji split over tokens comes out whole. ``flush`` at the end emits whatever is
    left, so the pieces always add up to ``decode(all ids)``.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "stops", "hold", "ids", "prefix", "read", "text", "emitted", "cut")

    def __init__(self, tokenizer: TokenizerLike, skip_special_tokens: bool = True, stops: Sequence[str] = ()) -> None:
        self.tokenizer = text_tokenizer(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        # with stop strings, the stream never shows one: it keeps back the longest one's length
        # - 1 characters (a stop string may be forming) and ends where the first one starts, as
        # the engine's output text does
        self.stops = tuple(stops)
        self.hold = max((len(st) for st in self.stops), default=1) - 1
        self.cut: int | None = None  # where the first stop string starts, once seen
        self.ids: list[int] = []
        self.prefix = 0  # the window's first token (context for the first new one)
        self.read = 0  # tokens whose text has been decoded
        self.text = ""  # everything decoded so far
        self.emitted = 0  # characters of it handed out

    def _decode(self, ids: list[int]) -> str:
        # one sequence of ids decodes to one str (decode is typed for batches too)
        return cast(
            str,
            self.tokenizer.decode(
                ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
            ),
        )

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self.ids.extend(new_ids)
        self._advance(final=False)
        return self._emit(len(self.text) - self.hold)

    def flush(self, limit: int | None = None) -> str:
        """The text still held back (an incomplete character at the very end, the ``hold``),
        up to character ``limit`` of the whole text (where a stop string cut it)."""
        self._advance(final=True)
        return self._emit(len(self.text) if limit is None else limit)

    def _emit(self, upto: int) -> str:
        if self.stops:
            if self.cut is None:
                start = max(0, self.emitted - self.hold)  # text before it was checked already
                found = [i for i in (self.text.find(st, start) for st in self.stops) if i >= 0]
                if found:
                    self.cut = min(found)
            if self.cut is not None:
                upto = min(upto, self.cut)
        if upto <= self.emitted:
            return ""
        piece = self.text[self.emitted : upto]
        self.emitted = upto
        return piece

    def _advance(self, final: bool) -> None:
        if self.read >= len(self.ids):
            return
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return  # nothing printable yet, or a character still incomplete
        # the next window starts where this piece did: its tokens are the context of the next ones
        self.prefix, self.read = self.read, len(self.ids)
        self.text += after[len(before) :]


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer: TokenizerLike, token_id: int) -> bytes:
    """The bytes one token stands for, even when they are only part of a UTF-8 character
    (what OpenAI's logprobs ``bytes`` hold): byte-level BPE pieces mapped back through the
    byte alphabet, SentencePiece byte-fallback pieces (``<0xE2>``), else the token's text."""
    tok = text_tokenizer(tokenizer)
    piece = tok.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str):
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        backend = getattr(tok, "backend_tokenizer", None)
        decoder = type(getattr(backend, "decoder", None)).__name__
        if decoder == "ByteLevel" and piece not in tok.all_special_tokens:
            table = _byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
    return str(tok.decode([int(token_id)], skip_special_tokens=False)).encode()
