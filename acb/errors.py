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
Nothing else is affected by a rejected submit. acb's own refusals are
:class:`InvalidRequestError` (a ``ValueError``) and :class:`InvalidRequestTypeError` (a
``TypeError``): each carries the ``field`` it is about, so that a server names it without
reading the message::

    ValueError
    └── InvalidRequestError      a bad value at submit; ``.field`` names the argument
    TypeError
    └── InvalidRequestTypeError  an argument of the wrong type; ``.field`` names it
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from acb.outputs import GenerationOutput

_E = TypeVar("_E", bound=BaseException)


class InvalidRequestError(ValueError):
    """A submit refused for a bad value. ``field`` is the public name of what it is about: an
    argument (``prompt``, ``request_id``, ``continuations``, ``items``...) or a field of
    :class:`acb.SamplingParams` (``max_new_tokens``, ``structured_outputs``...); None when unknown.

    Args:
        message: what is wrong and why.
        field: the argument or field it is about.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type[InvalidRequestError], tuple[str, str | None]]:
        return type(self), (str(self), self.field)  # (pickles with its field: Ray ships errors)


class InvalidRequestTypeError(TypeError):
    """A submit refused for an argument of the wrong type; ``field`` as in
    :class:`InvalidRequestError`.

    Args:
        message: what is wrong.
        field: the argument or field it is about.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type[InvalidRequestTypeError], tuple[str, str | None]]:
        return type(self), (str(self), self.field)


def field_of(exc: BaseException) -> str | None:
    """The field a refusal is about.

    Args:
        exc: any exception.

    Returns:
        ``exc.field`` for :class:`InvalidRequestError` and :class:`InvalidRequestTypeError`, else None.
    """
    return exc.field if isinstance(exc, (InvalidRequestError, InvalidRequestTypeError)) else None


def prefixed(exc: _E, prefix: str) -> _E:
    """The same refusal with ``prefix: `` before its message (which batch row, which method); its
    type and field are kept.

    Args:
        exc: a ``ValueError``/``TypeError`` (or a subclass whose constructor takes the message).
        prefix: what to put first.

    Returns:
        A new exception of ``exc``'s type.
    """
    message = f"{prefix}: {exc}"
    if isinstance(exc, (InvalidRequestError, InvalidRequestTypeError)):
        return type(exc)(message, exc.field)
    return type(exc)(message)


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

    def __init__(self, message: str, output: GenerationOutput | None = None) -> None:
        super().__init__(message)
        self.output = output


class UnsupportedModelError(AcbError):
    """The model cannot be run by acb; the message names the reason."""


class WeightUpdateError(ValueError):
    """A weight update refused before anything was written (the old weights still serve): an
    unknown name, a shape or dtype that does not fit, a checkpoint that does not read, a sender
    that died half-way. The message says what was wrong."""
