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
"""

from __future__ import annotations

import ctypes
import logging
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
