"""The exception tree of acb.

Every exception acb raises on purpose derives from :class:`AcbError`, except input
validation, which raises the built-in ``ValueError`` / ``TypeError`` so that callers
can treat acb like any other library::

    AcbError
    ├── EngineDeadError        the engine thread died; every pending and future call raises it
    ├── EngineNotRunningError  the engine was never started, or has been shut down
    ├── QueueFullError         ``submit_nowait`` found ``max_queue_size`` requests waiting
    ├── RequestFailedError     one request failed inside a step (``.output`` holds its partial output)
    └── UnsupportedModelError  the model cannot run in acb (the message says why); raised at engine start

``ValueError`` / ``TypeError`` — bad input at submit (empty prompt, token id outside the
vocabulary, prompt that can never fit, bad sampling values, duplicate live request id).
Nothing else is affected by a rejected submit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from acb.outputs import GenerationOutput


class AcbError(Exception):
    """Base class of the errors acb raises on purpose."""


class EngineDeadError(AcbError):
    """The engine thread died. The original exception is chained as ``__cause__``."""


class EngineNotRunningError(AcbError):
    """The engine is not running (not started yet, or already shut down)."""


class QueueFullError(AcbError):
    """``submit_nowait`` was called while ``max_queue_size`` requests were already waiting."""


class RequestFailedError(AcbError):
    """A request failed inside an engine step; ``output`` holds what it had generated so far."""

    def __init__(self, message: str, output: "GenerationOutput | None" = None) -> None:
        super().__init__(message)
        self.output = output


class UnsupportedModelError(AcbError):
    """The model cannot be run by acb; the message names the reason."""
