"""A thread's idle OpenMP workers, handed back, so that the engine thread's own keep spinning.

torch's CPU wheels run their intra-op parallelism on GNU OpenMP (``libgomp``). libgomp keeps one
pool of worker threads per thread that ever opened a parallel region (the main thread that built
the model; the engine thread), for the life of that thread. Between two regions a worker spins
for a while, then sleeps on a futex; but once libgomp's workers, all pools counted, outnumber
the CPUs, it spins only about a hundred times before sleeping (``gomp_throttled_spin_count_var``,
documented in libgomp's ``GOMP_SPINCOUNT``). With the main thread's pool and the engine's alive
on a 2-core machine, that is the case, and every parallel region of the engine's step (each
matmul, each kernel call) starts by waking a sleeping worker: measured on this project's 2-core
VM, a ``[8, 256] x [256, 512]`` linear took 53 us on a thread alone and 235-330 us on a second
thread while the main thread's pool existed, a fixed ~170 us added to every parallel region
(``OMP_WAIT_POLICY``/``GOMP_SPINCOUNT`` do not help: the throttled count only goes down).

OpenMP 5.0's ``omp_pause_resource`` on the host device frees the *calling* thread's pool (libgomp:
``gomp_pause_host``; the workers exit and are no longer counted); its next parallel region makes
a new one, which costs one thread start. So, for an engine on the CPU, acb hands back

- the pool of the thread that starts the engine (it built the model), of a thread that blocks on
  it (``generate_batch``, ``score_batch``, ``generate``, ``submit``: it waits, it computes
  nothing) and of the event loop's thread that submits to an ``AsyncEngine``;
- the engine thread's own, each time the engine runs out of work (a trainer's thread, or a
  ``model.generate`` on the main thread, then runs unthrottled while the engine waits).

A GPU engine's thread opens few parallel regions (its work is on the device), so nothing is
handed back there. Same-run figures: ``benchmarks/omp_workers.py``.

Only with libgomp loaded (Linux); elsewhere (LLVM's libomp, no OpenMP) nothing is done.

The engine thread's count itself is :class:`ThreadTuner`'s: measured by its own steps, so that a
busy machine does not leave every parallel region waiting on a descheduled worker.
"""

from __future__ import annotations

import ctypes
import logging
import math
import sys
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft

_lock = threading.Lock()
_resolved = False
_pause: tuple[Callable[[int, int], int], int] | None = None  # (omp_pause_resource, the host device's number)


def loaded_libgomp() -> str | None:
    """The path of the libgomp this process has loaded (torch's), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if path.startswith("/") and path.rsplit("/", 1)[-1].startswith("libgomp"):
                    return path
    except OSError:
        return None
    return None


def _resolve() -> tuple[Callable[[int, int], int], int] | None:
    global _resolved, _pause
    if _resolved:  # (every submit and every idle engine asks: no lock once it is known)
        return _pause
    with _lock:
        if not _resolved:
            import torch  # noqa: F401 - loads torch's libgomp first, so the one found is the one it runs on

            path = loaded_libgomp()
            if path is not None:
                try:
                    lib = ctypes.CDLL(path)  # already loaded: the same library, not a second copy
                    fn = lib.omp_pause_resource
                    fn.argtypes = [ctypes.c_int, ctypes.c_int]
                    fn.restype = ctypes.c_int
                    initial = lib.omp_get_initial_device
                    initial.restype = ctypes.c_int
                    _pause = (fn, int(initial()))
                except (OSError, AttributeError) as exc:  # an older libgomp (before OpenMP 5.0)
                    logger.debug("no omp_pause_resource in %s: %s", path, exc)
            _resolved = True  # (last: the lock-free read above must not see it before _pause)
        return _pause


def release_idle_threads() -> bool:
    """Free the calling thread's OpenMP worker pool (its workers exit; its next parallel region
    starts a new pool). Call it only on a thread about to wait, not in a parallel region (libgomp
    refuses there). Returns whether it was done (False: not libgomp, or refused)."""
    pause = _resolve()
    if pause is None:
        return False
    fn, device = pause
    return fn(OMP_PAUSE_SOFT, device) == 0


class ThreadTuner:
    """The engine thread's intra-op thread count, chosen by measuring its own steps.

    Why: with every core busy (a trainer beside the sampler, another job on the machine), a
    parallel region of ``N`` threads ends only when its slowest worker does, and a worker that
    shares its core with another process waits for a time slice (milliseconds) at every region's
    barrier. On this project's 2-core VM beside one spinning process, a 40M-parameter Llama's
    decode ran 3-30x slower at 2 threads than at 1, ``model.generate`` alike
    (``benchmarks/contention.py``); on a quiet machine 2 threads are the faster. No fixed count
    is right for both, and what is busy changes while an engine runs, so it measures:

    - steps are keyed by their shape (decode-only or not, tokens rounded up to a power of two),
      and each key keeps a moving mean of the step's seconds per token at the current count;
    - now and then the next few steps run at a neighbouring count (half, or twice, alternately
      where both exist): after ``FIRST_PROBE`` steps, then at intervals that grow while the count
      holds (doubling, and long enough that losing probes cost at most ``BUDGET`` of the time, up
      to ``MAX_INTERVAL``), and sooner when a key's mean drifts ``DRIFT``-fold from where it
      settled, as when a neighbour starts or stops. Each probe step is compared with the current
      count's mean of its key: the first ends the probe if ``WORSE_FIRST`` times slower (it may
      also start a thread pool, so it is not counted otherwise), a later one if ``WORSE`` times;
      a geometric mean of the counted ones under ``BETTER`` makes the probed count the current.

    A count change does not change results: acb's CPU kernels and torch's float32 linears and
    reductions split their work by output rows, not along a sum (``tests/runner/test_threads.py``
    checks an engine's logprobs bit for bit at 1 and at ``N`` threads). ``set_threads`` is
    :func:`torch.set_num_threads` on the engine thread (OpenMP's and MKL's counts are per thread:
    other threads keep theirs); :meth:`close` puts the first count back.
    """

    FIRST_PROBE = 8
    MAX_INTERVAL = 512
    PROBE_STEPS = 3  # measured steps per probe, after the one not counted
    WORSE = 1.5  # a counted probe step this much slower than the current count's ends the probe
    WORSE_FIRST = 3.0  # the same for the first probe step (which may also start a thread pool)
    BETTER = 0.8
    DRIFT = 1.6
    ALPHA = 0.3  # weight of a new step in a key's moving mean
    BUDGET = 0.05  # what losing probes may cost, as a fraction of the steps' time

    def __init__(
        self, max_threads: int, set_threads: Callable[[int], None] | None = None, *, pinned: bool = False
    ) -> None:
        import torch

        self._initial = torch.get_num_threads()  # (the constructing thread's: what close puts back)
        self.max_threads = max(1, int(max_threads))
        ladder = {self.max_threads}
        n = self.max_threads
        while n > 1 and not pinned:
            n //= 2
            ladder.add(max(n, 1))
        self.ladder = sorted(ladder)  # the counts tried: N, N/2, N/4, ..., 1 (pinned: N only)
        self.current = self.max_threads
        self._set = set_threads or torch.set_num_threads
        self._applied: int | None = None
        self._mean: dict[tuple[bool, int], float] = {}
        self._settled: dict[tuple[bool, int], float] = {}  # each key's mean when the count last changed
        self._interval = self.FIRST_PROBE
        self._countdown = self.FIRST_PROBE
        self._down = True  # the next scheduled probe tries fewer threads (where both ways exist)
        self._drift: bool | None = None  # a drift's probe: fewer threads (True) or more (False)
        self._probe: int | None = None
        self._warming = False
        self._ratios: list[float] = []
        self._unmatched = 0
        self._cost = 0.0  # the running probe's extra time, in steps of the current count
        self._cost_s = 0.0  # the same in seconds
        self._since = 0  # steps since the last probe ended
        self._elapsed = 0.0  # seconds of steps since the last probe ended
        self._due_s = 0.0  # seconds of steps the next probe waits for (the last loss's cost over the budget)
        self._key: tuple[bool, int] = (True, 1)
        self._tokens = 1
        self.switches = 0  # count changes kept (for stats and tests)
        self.probes = 0

    @property
    def threads(self) -> int:
        """The count the next step runs at."""
        return self._probe if self._probe is not None else self.current

    def _apply(self, n: int) -> None:
        if n != self._applied:
            self._set(n)
            self._applied = n

    def _neighbour(self, down: bool | None) -> int | None:
        """The count to probe: fewer threads (``down``), more, or (None) alternately where both exist."""
        i = self.ladder.index(self.current)
        lower = self.ladder[i - 1] if i > 0 else None
        upper = self.ladder[i + 1] if i + 1 < len(self.ladder) else None
        if down is None:
            if lower is not None and upper is not None:
                pick = lower if self._down else upper
                self._down = not self._down
                return pick
            return lower if lower is not None else upper
        return lower if down else upper

    def begin(self, num_tokens: int, decode_only: bool) -> int:
        """Before a step of ``num_tokens`` tokens: set this thread's count for it; returns the count."""
        self._tokens = max(int(num_tokens), 1)
        key = self._key = (decode_only, self._tokens.bit_length())
        if self._probe is None:
            self._since += 1
        if self._probe is None and len(self.ladder) > 1 and key in self._mean:
            if self._countdown > 0:
                self._countdown -= 1
            elif self._elapsed >= self._gate(self._mean[key] * self._tokens):
                self._probe = self._neighbour(self._drift)
                self._drift = None
                if self._probe is not None:
                    self._warming, self._ratios, self._unmatched = True, [], 0
                    self._cost = self._cost_s = 0.0
                    self.probes += 1
                else:
                    self._countdown = self._interval
        self._apply(self.threads)
        return self.threads

    def _gate(self, expected: float) -> float:
        """Seconds of steps since the last probe before one may start on a step expected to take
        ``expected`` seconds: the last loss's cost over the budget, and this step's own possible
        loss (a first probe step may take up to ``WORSE_FIRST`` times as long) over the budget;
        an eighth of that for a drift's probe (the drift is evidence that it may pay)."""
        gate = max(self._due_s, (self.WORSE_FIRST - 1.0) * expected / self.BUDGET)
        return gate if self._drift is None else gate / 8

    def end(self, seconds: float) -> None:
        """After the step :meth:`begin` announced: its wall seconds."""
        raw, key, seconds = seconds, self._key, seconds / self._tokens
        if self._probe is None:
            self._elapsed += raw
            old = self._mean.get(key)
            mean = seconds if old is None else old + self.ALPHA * (seconds - old)
            self._mean[key] = mean
            settled = self._settled.setdefault(key, mean)
            if old is not None and not (settled / self.DRIFT <= mean <= settled * self.DRIFT):
                # the machine changed under us (a neighbour started or stopped): slower steps
                # probe fewer threads now, faster ones more, where the ladder has them (but not
                # sooner than a quarter of the interval the last probes' cost set)
                down = mean > settled
                self._settled[key] = mean
                if self._neighbour(down) is not None and self._since >= self._interval // 4:
                    self._drift, self._countdown = down, 0
            return
        base = self._mean.get(key)
        ratio = seconds / max(base, 1e-9) if base is not None else None
        if ratio is not None and base is not None:
            self._cost += max(ratio - 1.0, 0.0)
            self._cost_s += max(raw - base * self._tokens, 0.0)
        if self._warming:
            self._warming = False
            if ratio is not None and ratio > self.WORSE_FIRST:
                self._end_probe(False)
            return
        if ratio is None:
            self._unmatched += 1
            if self._unmatched > 2 * self.PROBE_STEPS:
                self._end_probe(False)
            return
        if ratio > self.WORSE:
            self._end_probe(False)
            return
        self._ratios.append(ratio)
        if len(self._ratios) >= self.PROBE_STEPS:
            geo = math.exp(sum(map(math.log, self._ratios)) / len(self._ratios))
            self._end_probe(geo < self.BETTER, geo)

    def _end_probe(self, won: bool, ratio: float = 1.0) -> None:
        """End the probe. The next one is due after an interval long enough that a losing probe
        costs at most ``BUDGET`` of the steps' time: after a loss, twice the last interval or the
        lost probe's cost over the budget, in steps, and its extra seconds over the budget in
        seconds of steps (steps differ in length: a probe that lands on a long prefill costs
        more); after a win, what a probe back would cost by the win's own ratio (at least
        ``FIRST_PROBE`` steps)."""
        probe, self._probe = self._probe, None
        self._drift = None
        self._since = 0
        self._elapsed = 0.0
        self._due_s = 0.0 if won else self._cost_s / self.BUDGET
        if won and probe is not None:
            logger.info("acb engine thread: %d intra-op threads (measured faster than %d)", probe, self.current)
            self.current = probe
            self.switches += 1
            self._mean.clear()
            self._settled.clear()
            back = 2 * (1.0 / max(ratio, 1e-3) - 1.0)  # a probe back: its first step and one counted
            self._interval = max(self.FIRST_PROBE, math.ceil(back / self.BUDGET))
        else:
            self._interval = max(2 * self._interval, math.ceil(self._cost / self.BUDGET))
        self._interval = min(self._interval, self.MAX_INTERVAL)
        self._countdown = self._interval
        self._apply(self.current)

    def close(self) -> None:
        """Put the count the engine started from back (on the engine thread, as it exits: torch
        also keeps the last count set as the one new threads start with)."""
        if self._applied is not None and self._applied != self._initial:
            self._set(self._initial)
            self._applied = self._initial
