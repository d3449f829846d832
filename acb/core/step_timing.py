"""The host time of the engine's steps, kept beside the loop rather than in it.

Each phase of a step is timed with a :class:`Stopwatch` (``with Stopwatch() as w: ...``); once a
step is completed, :meth:`StepTimer.record` adds its phases to the running sums
(:class:`StepTimes`: ``EngineCore.timing``, published as ``EngineStats.host_*_s`` and
``compute_s``) and, when a log is kept (``EngineCore.step_log``, a list the benchmarks set), appends
the step's row::

    (seqs, tokens, decode tokens, schedule s, stage s, compute s, process s, completed at)

``compute`` is the runner's ``execute`` less its input staging, plus ``finish`` (the forward, the
sampler and the one sync that reads the sampled ids); ``completed at`` is a ``perf_counter`` time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from acb.core.messages import LaunchedStep

__all__ = ["StepTimer", "StepTimes", "Stopwatch"]


@dataclass
class StepTimes:
    """Host seconds spent per phase, summed over the steps so far."""

    schedule: float = 0.0
    stage: float = 0.0  # the runner's input preparation, inside execute
    compute: float = 0.0  # forward + sampling + the sync that reads the sampled ids
    process: float = 0.0  # recording the outputs and building the deliveries


class Stopwatch:
    """Times the block it wraps: ``seconds`` it took, and ``end``, the ``perf_counter`` time it
    ended (both set when it exits, whether by return or by an exception)."""

    __slots__ = ("start", "end", "seconds")

    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.end = time.perf_counter()
        self.seconds = self.end - self.start


class StepTimer:
    """The sums of every completed step's phases (``times``), and the per-step log (``log``)."""

    def __init__(self) -> None:
        self.times = StepTimes()
        self.log: list[tuple] | None = None  # one row per completed step, when set to a list

    def stats(self) -> dict[str, Any]:
        """The sums, under the names of :class:`acb.core.messages.EngineStats`."""
        tm = self.times
        return {
            "host_schedule_s": tm.schedule,
            "host_stage_s": tm.stage,
            "compute_s": tm.compute,
            "host_process_s": tm.process,
        }

    def record(self, launched: LaunchedStep, finish_s: float, process_s: float, completed_at: float) -> None:
        """Add a completed step.

        Args:
            launched: the step, with its schedule, stage and launch (``execute``) seconds.
            finish_s: ``Runner.finish``'s seconds (the sync).
            process_s: recording its output and building its deliveries.
            completed_at: when that ended (``perf_counter``).
        """
        compute = launched.launch_s - launched.stage_s + finish_s
        tm = self.times
        tm.schedule += launched.schedule_s
        tm.stage += launched.stage_s
        tm.compute += compute
        tm.process += process_s
        if self.log is not None:
            sched = launched.sched
            self.log.append(
                (
                    sched.num_seqs,
                    sched.num_tokens,
                    sched.num_decode_tokens,
                    launched.schedule_s,
                    launched.stage_s,
                    compute,
                    process_s,
                    completed_at,
                )
            )
