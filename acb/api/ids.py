"""The request ids live requests hold: the API's registry, claimed at submit.

An id is claimed (all of a request's sample ids, or none) when a submit is made, and given back
when its final output is built (on the engine thread, through the ``release`` callback the engine
core is built with) or when the submit is undone before it reached the engine. Thread-safe: submits
claim from callers' threads while the engine thread releases.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

__all__ = ["RequestIds"]


class RequestIds:
    """The set of request ids held by live requests (and by submits being made)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[str] = set()

    def claim(self, ids: Sequence[str]) -> str | None:
        """Claim every id of ``ids``, or none of them.

        Returns:
            None when all were claimed; else the first id a live request already holds (nothing
            is claimed then).
        """
        with self._lock:
            for i in ids:
                if i in self._live:
                    return i
            self._live.update(ids)
            return None

    def release(self, request_id: str) -> None:
        """Give an id back (its request ended, or was never posted)."""
        with self._lock:
            self._live.discard(request_id)

    def release_all(self, ids: Iterable[str]) -> None:
        """Give several ids back."""
        with self._lock:
            self._live.difference_update(ids)

    def is_live(self, request_id: str) -> bool:
        """Whether a live request holds ``request_id``."""
        with self._lock:
            return request_id in self._live

    @property
    def live(self) -> frozenset[str]:
        """The ids held now (a snapshot)."""
        with self._lock:
            return frozenset(self._live)
