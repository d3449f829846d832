"""How requests end outside a step's recorded output (engine thread only).

A request ends in a step's output when it stops, reaches its length or its grammar's dead end
(:meth:`acb.core.scheduler.Scheduler.update_from_output`). Every other end is here:

- cancelled: by its caller (:meth:`Endings.cancel`), or with every other live request at a stop
  or a ``pause("cancel")`` (:meth:`Endings.cancel_all`);
- failed with the step that held it (:meth:`Endings.fail_step`; under tensor parallelism a failed
  step kills the engine instead: the ranks' collectives are out of step);
- never scheduled: added while the engine stopped, or still in the inbox as it exits
  (:meth:`Endings.unscheduled`, :meth:`Endings.never_ran`);
- failed because the engine died (:meth:`Endings.engine_died`), where nothing may depend on what
  can fail.

Each end delivers the request's final output (its group's once, for ``n > 1``) through the
engine's ``deliver`` callback, and a request that never reached a step frees its place in the
API's queue (``on_dequeued``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from acb.core.deliveries import DeliveryBuilder
from acb.core.holds import Holds
from acb.core.messages import Delivery, EngineRequest, SchedulerOutput
from acb.core.request import Request
from acb.core.request_builder import build_request
from acb.core.scheduler import Scheduler
from acb.outputs import FailureKind, FinishReason, RequestStatus

__all__ = ["Endings"]

logger = logging.getLogger(__name__)


class Endings:
    """Ends requests outside a step's output, and delivers their outcomes."""

    def __init__(
        self,
        scheduler: Scheduler,
        holds: Holds[Request],
        outputs: DeliveryBuilder,
        *,
        deliver: Callable[[list[Delivery]], None],
        on_dequeued: Callable[[int], None],
        changed: Callable[[], None],
        release_id: Callable[[str], None],
        lockstep: bool,
    ) -> None:
        """Args:
        scheduler: the engine's scheduler (the live requests).
        holds: the pause's holds (requests added while draining for a pause).
        outputs: builds the final outputs.
        deliver: hands deliveries to the callers (the engine's callback).
        on_dequeued: frees ``n`` places in the API's queue (requests that never reached a step).
        changed: publishes the engine's counters.
        release_id: gives a request id back to the API's registry.
        lockstep: tensor parallelism: a failed step cannot be survived.
        """
        self.scheduler = scheduler
        self.holds = holds
        self.outputs = outputs
        self._deliver = deliver
        self._on_dequeued = on_dequeued
        self._changed = changed
        self._release_id = release_id
        self.lockstep = lockstep

    def deliver_finals(self, reqs: Iterable[Request]) -> None:
        """Deliver the outcomes of requests that ended (each group's once)."""
        items = self.outputs.finals(reqs)
        if items:
            self._deliver(items)

    def unscheduled(self, req: Request, status: RequestStatus) -> None:
        """End a request that never reached the scheduler (all its samples, for n > 1)."""
        members = req.group.members if req.group is not None else [req]
        for m in members:
            m.status = status
            m.error, m.failure = req.error, req.failure
            m.finish_reason = FinishReason.CANCELLED if status == RequestStatus.CANCELLED else FinishReason.ERROR
            m.finish_time = time.perf_counter()
        self._on_dequeued(1)
        self.deliver_finals(members)

    def never_ran(self, adds: list[EngineRequest], dead_error: BaseException | None) -> None:
        """End the adds left in the inbox as the engine exits: cancelled, or failed when it died."""
        for req in [build_request(er, None, runs=False) for er in adds]:
            if dead_error is None:
                self.unscheduled(req, RequestStatus.CANCELLED)
            else:
                req.error = f"the engine died: {dead_error!r}"
                req.failure = FailureKind.ENGINE_DEAD
                self.unscheduled(req, RequestStatus.FAILED)

    def cancel(self, request_id: str) -> bool:
        """Cancel a live or held request (all its samples); False if there is none."""
        head = self.scheduler.live.get(request_id)
        if head is None:
            held = self.holds.unhold(lambda r: r.request_id == request_id)
            if held is None:
                return False
            held.finish_reason = FinishReason.CANCELLED
            self.unscheduled(held, RequestStatus.CANCELLED)
            return True
        never_scheduled = head.first_scheduled_time is None
        members = head.group.members if head.group is not None else [head]
        ended = []
        for req in members:
            if self.scheduler.cancel(req.request_id) is not None:
                req.finish_reason = FinishReason.CANCELLED
                ended.append(req)
        if never_scheduled:
            self._on_dequeued(1)
        self._changed()
        self.deliver_finals(ended)
        return True

    def cancel_all(self) -> None:
        """Cancel every live and held request."""
        for held in self.holds.take_held():  # added while draining for a pause: never reached the scheduler
            held.finish_reason = FinishReason.CANCELLED
            self.unscheduled(held, RequestStatus.CANCELLED)
        reqs = list(self.scheduler.live.values())
        for req in reqs:
            never_scheduled = req.first_scheduled_time is None and req.sample_index == 0
            if self.scheduler.cancel(req.request_id) is not None:
                req.finish_reason = FinishReason.CANCELLED
            if never_scheduled:
                self._on_dequeued(1)
        # adds that arrive after the stop are cancelled as they are applied
        self._changed()
        self.deliver_finals(reqs)

    def fail_step(self, sched: SchedulerOutput, exc: Exception) -> None:
        """A step raised (launching it, or reading its results): fail its requests alone.

        Raises:
            Exception: ``exc`` itself under tensor parallelism (the engine dies on every rank).
        """
        if self.lockstep:
            # the ranks' collectives are out of step once one rank's step failed: nothing can
            # carry on, so the engine dies (every handle fails) on every rank
            raise exc
        logger.error("step %d failed; failing its %d requests", sched.step_id, sched.num_seqs, exc_info=exc)
        msg = f"{type(exc).__name__}: {exc}"
        self.scheduler.abandon_step(sched.step_id)
        failed = [r for r in sched.requests if not r.status.is_terminal]
        for req in failed:
            self.scheduler.fail(req, msg)
        for req in sched.sample_reqs:
            req.in_flight = max(0, req.in_flight - 1)
        self._changed()
        self.deliver_finals(failed)

    def engine_died(self, exc: BaseException, adds: list[EngineRequest]) -> None:
        """The engine is dying: every live, held and queued request (``adds``: those still in the
        inbox) gets a FAILED outcome. Nothing here may depend on what can fail (decoding, a sink's
        callbacks): each final output falls back to a bare one, and each delivery is tried on its
        own."""
        reqs = list(self.scheduler.live.values())
        queued = [build_request(er, None, runs=False) for er in adds] + self.holds.take_held()
        queued_adds = [m for r in queued for m in (r.group.members if r.group is not None else [r])]
        msg = f"the engine died: {type(exc).__name__}: {exc}"
        for req in reqs + queued_adds:
            req.status = RequestStatus.FAILED
            req.finish_reason = FinishReason.ERROR
            req.error, req.failure = msg, FailureKind.ENGINE_DEAD
            req.finish_time = time.perf_counter()
        # a dead engine holds nothing: blocks, rows and ids go back before anyone hears of the death
        # (best effort: the state that killed it may be broken)
        try:
            self.scheduler.release_all()
        except BaseException:  # noqa: BLE001
            logger.exception("could not release the dead engine's KV blocks")
        for req in reqs + queued_adds:
            self._release_id(req.request_id)
        for req in reqs + queued_adds:
            try:
                final = self.outputs.final_of(req)
            except BaseException:  # noqa: BLE001
                logger.exception("could not build the failed output of %r", req.request_id)
                final = self.outputs.dead_output(req, msg)
            if final is None:
                continue
            try:
                self._deliver([Delivery(req.out.key, [], final=final)])
            except BaseException:  # noqa: BLE001
                logger.exception("could not deliver the failure of %r after the engine died", req.request_id)
