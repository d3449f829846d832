"""Structured outputs on the engine thread: the grammar compiler, and each step's token bitmask.

The compiler (:class:`acb.structured.GrammarCompiler`, behind :class:`GrammarSupport`) is built
when the first constrained request reaches the engine; an engine that never sees one never builds
it and skips the masks altogether. The scheduler ends each :meth:`acb.core.scheduler.Scheduler.schedule`
with :meth:`GrammarMasks.fill`, so the :class:`acb.core.messages.SchedulerOutput` it returns
already carries the step's ``grammar`` (the bitmask of its constrained samples, filled on the host
by their matchers), which the runner's sampler applies before every other processor.

Dead ends: a constrained sample whose mask, less the tokens the sampler never lets it pick
(:meth:`acb.sampling_params.SamplingParams.never_sampled`), allows nothing cannot go on. Its
request is marked (``Request.dead_end``): it ends with ``FinishReason.GRAMMAR`` when this step's
token comes back, and that token is not recorded. Its row is opened so that no row of the step is
all ``-inf``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from acb.core.messages import EngineRequest, GrammarMask, SchedulerOutput

if TYPE_CHECKING:
    import torch

__all__ = ["GrammarMasks", "GrammarSupport"]


class GrammarSupport(Protocol):
    """What the core needs to constrain outputs (:class:`acb.structured.GrammarCompiler`)."""

    def compile_now(self, spec: Any) -> Any: ...  # -> a compiled grammar with .matcher()
    def bitmask(self, rows: int) -> torch.Tensor: ...
    # the rows of a filled bitmask with no token left once each row's excluded ones are out
    def dead_ends(
        self, bitmask: torch.Tensor, rows: Sequence[int], excluded: Sequence[Collection[int]]
    ) -> list[int]: ...


class GrammarMasks:
    """The engine's grammar compiler, built on demand, and the filling of each step's masks."""

    def __init__(self, factory: Callable[[], GrammarSupport] | None) -> None:
        """Args:
        factory: builds (once) the grammar compiler, when the first constrained request comes;
            None: this engine has none (a request with structured outputs is then an error).
        """
        self._factory = factory
        self.compiler: GrammarSupport | None = None  # built for the first constrained request

    def compiler_for(self, er: EngineRequest) -> GrammarSupport | None:
        """The compiler, built now if ``er`` is the first request with structured outputs.

        Raises:
            RuntimeError: ``er`` has structured outputs and this engine has no compiler.
        """
        if er.params.structured_outputs is not None and self.compiler is None:
            if self._factory is None:
                raise RuntimeError("a request has structured outputs and this engine has no grammar compiler")
            self.compiler = self._factory()
        return self.compiler

    def fill(self, sched: SchedulerOutput) -> None:
        """Set ``sched.grammar``: each constrained sample's row of the step's token bitmask, from
        its matcher (up to date: a constrained request is never scheduled with a token in flight),
        and mark the samples at a dead end. A step without constrained samples keeps None."""
        reqs = sched.sample_reqs
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if not rows:
            return
        assert self.compiler is not None  # (a matcher comes from it)
        bitmask = self.compiler.bitmask(len(reqs))
        for i in rows:
            reqs[i].matcher.fill_mask(bitmask, i)
        gen_idx = sched.sample_gen_idx
        excluded = [reqs[i].params.never_sampled(reqs[i].stop_token_ids, gen_idx[i]) for i in rows]
        for i in self.compiler.dead_ends(bitmask, rows, excluded):  # (it opens their rows)
            reqs[i].dead_end = True
        sched.grammar = GrammarMask(bitmask, rows)
