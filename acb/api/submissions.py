"""Where a checked submit becomes the caller's, and where it is undone: :class:`Submissions`.

The input processor (:mod:`acb.api.processor`) checks a submit and builds its
:class:`~acb.core.messages.EngineRequest` without touching anything. Every facade's submit then
goes through :meth:`Submissions.open` (by way of :meth:`acb.api.base.EngineBase.make_request`, or
:func:`acb.api.scoring.make_score_request` for a scoring group), the one place with side effects: the request's ids are claimed (its
samples' too: all of them, or none), a seed is drawn for a request without one, its sink is made,
its trace begun and its detokenizers set, and the sink is registered under a fresh key. The
result is a :class:`Submission`, which the facade posts (:meth:`acb.api.base.EngineBase.admit`)
or gives back (:meth:`Submissions.abandon`: the sink and the ids, exactly what ``open`` took).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from acb.errors import InvalidRequestError, prefixed
from acb.outputs import FailureKind, FinishReason, GenerationOutput, RequestStatus
from acb.telemetry import begin
from acb.text import IncrementalDetokenizer

if TYPE_CHECKING:
    from acb.api.ids import RequestIds
    from acb.api.loras import Loras
    from acb.api.processor import Processed
    from acb.api.sinks import SinkRegistry
    from acb.core.messages import EngineRequest
    from acb.text import TokenizerLike

__all__ = ["Submission", "Submissions", "member_ids"]


def member_ids(request_id: str, n: int) -> list[str]:
    """The ids a request of ``n`` samples (or scoring members) claims: its own, then its samples'
    (as :attr:`acb.core.messages.EngineRequest.member_ids` names them)."""
    return [request_id] + [f"{request_id}#{i}" for i in range(1, n)]


class Submission:
    """A submit on the caller's side (what :meth:`Submissions.open` returns): the
    :class:`EngineRequest` to post, and the sink its results go to. Its request ids are claimed
    and its sink registered until it is posted (:meth:`acb.api.base.EngineBase.admit`) or given
    back (:meth:`acb.api.base.EngineBase.abandon`)."""

    __slots__ = ("engine_request", "sink")

    def __init__(self, engine_request: EngineRequest, sink: Any) -> None:
        self.engine_request = engine_request
        self.sink = sink

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id

    def failed_output(self, error: str, failure: FailureKind) -> GenerationOutput:
        """The outcome of a submit that never reached the engine (it died first).

        Args:
            error: the error's text.
            failure: its kind.

        Returns:
            A FAILED output with the request's id and prompt.
        """
        er = self.engine_request
        return GenerationOutput(
            request_id=er.request_id,
            prompt_ids=list(er.prompt_ids),
            status=RequestStatus.FAILED,
            finish_reason=FinishReason.ERROR,
            error=error,
            failure=failure,
        )


class Submissions:
    """Opens checked submits and undoes them (see the module docstring).

    Args:
        ids: the engine's registry of live request ids.
        sinks: the engine's sinks, by key (where it delivers).
        seed: seeds the draws of the requests without a seed (the engine's ``seed``), so that
            runs repeat.
        loras: the engine's LoRA adapters (a submit's ids are recorded as using its adapter).
    """

    def __init__(self, ids: RequestIds, sinks: SinkRegistry, seed: int | None, loras: Loras | None = None) -> None:
        self.ids = ids
        self.sinks = sinks
        self.loras = loras
        # requests without a seed draw one here, so that the engine's seed makes runs repeatable
        self._seeds = random.Random(seed)
        self._fresh = itertools.count()  # the <n> of fresh req_<n> / score_<n> ids

    def open(
        self, made: Processed, sink_factory: Callable[[str], Any], tokenizer: TokenizerLike | None, model_name: str
    ) -> Submission:
        """Claim a checked request's ids (a fresh one when it has none: an id no live request
        has, nor its samples), draw its seed, make its sink (``sink_factory(request_id)``), begin
        its trace, and register the sink.

        Args:
            made: what the input processor returned.
            sink_factory: makes the sink its results go to (a ``ThreadSink`` or an ``AsyncSink``).
            tokenizer: the engine's (its text is decoded on the consumer's side with it).
            model_name: the model's name in telemetry.

        Returns:
            The :class:`Submission`.

        Raises:
            InvalidRequestError: its id, or one of its samples', is live (field ``request_id``);
                its LoRA adapter was removed since it was checked (field ``lora``); nothing is
                left behind.
        """
        er, params = made.request, made.request.params
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request_id = self._claim(made.request_id, "req" if er.score is None else "score", er.n)
        try:
            if self.loras is not None:  # (after the claim: an adapter is not removed under a live id)
                self.loras.attach(made.lora, member_ids(request_id, er.n))
            sink = sink_factory(request_id)
            sink.state.trace = begin(made.prompt, model_name, params)
            if tokenizer is not None and er.score is None and not params.stop:
                # text for the stream and the output, decoded on the consumer's side (with stop
                # strings, the engine thread decodes it as it matches them)
                skip = params.skip_special_tokens is not False
                sink.state.detokenizers = [IncrementalDetokenizer(tokenizer, skip) for _ in range(er.n)]
            er = replace(
                er,
                request_id=request_id,
                sink_key=self.sinks.register(sink),
                seed=seed,
                created_time=time.perf_counter(),
            )
        except BaseException:
            self.ids.release_all(member_ids(request_id, er.n))
            raise
        return Submission(er, sink)

    def _claim(self, request_id: str | None, prefix: str, n: int) -> str:
        if request_id is None:  # a fresh id whose samples' ids are free too (a caller may hold "req_3#1")
            request_id = f"{prefix}_{next(self._fresh)}"
            while self.ids.claim(member_ids(request_id, n)) is not None:
                request_id = f"{prefix}_{next(self._fresh)}"
            return request_id
        taken = self.ids.claim(member_ids(request_id, n))
        if taken == request_id:
            raise InvalidRequestError(f"request_id {request_id!r} is already used by a live request", "request_id")
        if taken is not None:  # the samples' internal ids must not collide either
            raise InvalidRequestError(f"request id {taken!r} (sample of {request_id!r}) is already live", "request_id")
        return request_id

    def abandon(self, sub: Submission) -> None:
        """Undo :meth:`open` for a submit that will not be posted: its sink and its ids given back.

        Args:
            sub: what :meth:`open` returned.
        """
        self.sinks.discard(sub.engine_request.sink_key)
        self.ids.release_all(sub.engine_request.member_ids)

    def make_all(self, field: str, makers: Iterable[tuple[int, Callable[[], Submission]]]) -> list[Submission]:
        """Several submits made together (a batch call): all of them, or none.

        Args:
            field: the argument's name in errors (``inputs[i]: ...``).
            makers: ``(i, maker)`` pairs, each ``maker()`` an
                :meth:`acb.api.base.EngineBase.make_request` call (or
                :func:`acb.api.scoring.make_score_request`).

        Returns:
            The submissions, in order.

        Raises:
            ValueError: the first bad one, named ``field[i]`` (the others are given back; an
                :class:`InvalidRequestError` keeps its field).
            TypeError: likewise, for an argument of the wrong type.
        """
        made: list[Submission] = []
        try:
            for i, make in makers:
                try:
                    made.append(make())
                except (ValueError, TypeError) as exc:
                    raise prefixed(exc, f"{field}[{i}]") from None
        except BaseException:
            for r in made:
                self.abandon(r)
            raise
        return made
