"""Whether the batch-invariant mode (:mod:`acb.runner.batch_invariant`) is on for the calling
thread: a leaf module, so the mode's family forms and the layers' mode-only branches read it
without importing the mode's module (which imports them)."""

from __future__ import annotations

import threading

TLS = threading.local()  # .on: the mode is on for this thread (set by acb.runner.batch_invariant)


def is_on() -> bool:
    """Whether the mode is on for the calling thread."""
    return bool(getattr(TLS, "on", False))
