"""The OpenMP workers of threads that wait on the engine are handed back (acb.runner.host_threads).

Counted as OS threads of a fresh process (a libgomp worker is one), so that no other test's
threads are in the count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from acb.runner.host_threads import loaded_libgomp, release_idle_threads

SCRIPT = textwrap.dedent(
    """
    import json, os, threading, time
    import torch
    import acb
    from acb.models import tiny_model
    from acb.runner import host_threads

    def threads():
        return len(os.listdir("/proc/self/task"))

    def settle(expect, timeout=10.0):  # a released worker exits shortly after
        end = time.monotonic() + timeout
        while threads() != expect and time.monotonic() < end:
            time.sleep(0.01)
        return threads()

    def parallel():  # one parallel region on this thread (elementwise, above torch's grain size)
        torch.randn(1 << 20).exp_()

    out = {"libgomp": host_threads.loaded_libgomp() is not None}
    torch.set_num_threads(2)
    model = tiny_model("llama", seed=0)
    base = threads()
    parallel()
    out["after_region"] = threads() - base  # this thread's pool: one worker
    out["released"] = host_threads.release_idle_threads()
    out["threads_kept"] = torch.get_num_threads()  # the thread's own setting outlives its pool
    torch.set_num_threads(1)
    parallel()
    host_threads.release_idle_threads()
    out["threads_kept_1"] = torch.get_num_threads()
    torch.set_num_threads(2)
    out["after_release"] = settle(base) - base
    parallel()  # a new pool on the next region
    out["again"] = threads() - base

    # an engine: starting it hands back the starting thread's pool; the engine thread's own
    # pool is handed back whenever the engine runs out of work
    eng = acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=32, page_size=8, max_batch_tokens=64))
    eng.start()
    with_engine = base + 1  # the engine thread, no workers (it has not stepped yet)
    out["after_start"] = settle(with_engine) - with_engine
    outs = eng.generate_batch([[5, 6, 7, 8] * 4] * 4, acb.SamplingParams(max_new_tokens=8), progress_bar=False)
    out["finished"] = all(o.status == acb.RequestStatus.FINISHED for o in outs.values())
    out["idle_engine"] = settle(with_engine) - with_engine
    parallel()  # the caller computes again while the engine is idle: only its own pool exists
    out["caller_again"] = threads() - with_engine
    eng.shutdown()
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(loaded_libgomp() is None, reason="torch does not run on GNU OpenMP here")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: no OpenMP workers")
def test_waiting_threads_hand_back_their_workers() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["libgomp"]
    assert out["after_region"] == 1, out  # a parallel region made this thread a pool of one worker
    assert out["released"] and out["after_release"] == 0, out
    assert out["threads_kept"] == 2 and out["threads_kept_1"] == 1, out  # torch.set_num_threads survives it
    assert out["again"] == 1, out
    assert out["after_start"] == 0, out  # Engine.start handed back the starting thread's worker
    assert out["finished"]
    assert out["idle_engine"] == 0, out  # the engine's pool went when its work did
    assert out["caller_again"] == 1, out


def test_release_without_a_pool() -> None:
    # a thread that never opened a parallel region has no pool: done (nothing to free) where
    # libgomp runs torch, not done (and no error) where it does not
    import threading

    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(release_idle_threads()))
    t.start()
    t.join()
    assert done == [loaded_libgomp() is not None]
