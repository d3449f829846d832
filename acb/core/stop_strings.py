"""Stop strings: detected on the decoded tail of a request's generated tokens.

The text is cut right before the first stop string; the tokens are kept up to and
including the one that completed it (streamed tokens are never taken back).
"""

from __future__ import annotations

from typing import Any


class StopStrings:
    """Callable check run on the engine thread after each token of a request with stop strings."""

    __slots__ = ("tokenizer", "stops", "window")

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        # a token decodes to at least part of a character (at most 4 bytes per character)
        self.window = 4 * max(len(s) for s in stops) + 4

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def __call__(self, req: Any) -> bool:
        gen = req.token_ids[req.prompt_len :]
        tail = self._decode(gen[-self.window :])
        if not any(s in tail for s in self.stops):
            return False
        text = self._decode(gen)
        cut = min(i for i in (text.find(s) for s in self.stops) if i >= 0)
        req.output_text = text[:cut]
        return True

    def text(self, req: Any) -> str:
        """The decoded output of a request that did not stop on a stop string."""
        return self._decode(req.token_ids[req.prompt_len :])
