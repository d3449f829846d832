"""Stop strings: detected on the decoded tail of a request's generated tokens.

The text is cut right before the first stop string; the tokens are kept up to and
including the one that completed it (streamed tokens are never taken back).

The text searched is the text the caller gets: decoded with the request's
``skip_special_tokens`` (so a stop string that appears only once special tokens are left out
ends the request, and one that a special token splits does not), the same text the stream's
incremental detokenizer (:class:`acb.text.IncrementalDetokenizer`) shows.
"""

from __future__ import annotations

from typing import Any


class StopStrings:
    """Callable check run on the engine thread after each token of a request with stop strings."""

    __slots__ = ("tokenizer", "stops", "window", "skip_special_tokens", "special_ids")

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.skip_special_tokens = skip_special_tokens
        # tokens that decode to nothing in the caller's text: not counted in the window
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()) or ()) if skip_special_tokens \
            else frozenset()
        # a token decodes to at least part of a character (at most 4 bytes per character)
        self.window = 4 * max(len(s) for s in stops) + 4

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _tail(self, gen: list[int]) -> list[int]:
        """The last ``window`` tokens that show in the text (and the special ones among them)."""
        special = self.special_ids
        if not special:
            return gen[-self.window :]
        need, i = self.window, len(gen)
        while i > 0 and need > 0:
            i -= 1
            if gen[i] not in special:
                need -= 1
        return gen[i:]

    def __call__(self, req: Any) -> bool:
        gen = req.token_ids[req.prompt_len :]
        tail = self._decode(self._tail(gen))
        if not any(s in tail for s in self.stops):
            return False
        text = self._decode(gen)
        cut = min(i for i in (text.find(s) for s in self.stops) if i >= 0)
        req.output_text = text[:cut]
        return True

    def text(self, req: Any) -> str:
        """The decoded output of a request that did not stop on a stop string."""
        return self._decode(req.token_ids[req.prompt_len :])
