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
    # a matmul of several rows whose bits depend on the thread count (its work is split by it):
    # which count a thread's matmuls run on, read from their bits
    g = torch.Generator().manual_seed(0)
    probes = [(torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)) for m, k, n in
              [(7, 64, 256), (5, 256, 1024), (9, 128, 512), (3, 512, 2048)]]
    def bits_at(threads):
        torch.set_num_threads(threads)
        return [torch.nn.functional.linear(a, w) for a, w in probes]
    by_count = {1: bits_at(1), 2: bits_at(2)}
    torch.set_num_threads(2)
    which = [i for i in range(len(probes)) if not torch.equal(by_count[1][i], by_count[2][i])]
    out["probe"] = bool(which)
    def count_of_bits(_core=None):
        got = [torch.nn.functional.linear(*probes[i]) for i in which]
        return [t for t in (1, 2) if all(torch.equal(x, by_count[t][i]) for x, i in zip(got, which))]

    eng = acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=32, page_size=8, max_batch_tokens=64))
    eng.start()
    with_engine = base + 1  # the engine thread, no workers (it has not stepped yet)
    out["after_start"] = settle(with_engine) - with_engine
    out["engine_bits_first"] = eng.call(count_of_bits).result()  # its first matmuls
    outs = eng.generate_batch([[5, 6, 7, 8] * 4] * 4, acb.SamplingParams(max_new_tokens=8), progress_bar=False)
    out["finished"] = all(o.status == acb.RequestStatus.FINISHED for o in outs.values())
    out["idle_engine"] = settle(with_engine) - with_engine
    out["engine_bits_after_release"] = eng.call(count_of_bits).result()  # its pool went: a new one
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
    if out["probe"]:  # (a CPU where no probe's bits depend on the thread count tells nothing)
        # the engine thread's matmuls run on the thread count set where it started (2), before
        # and after its pool is handed back (the new pool is made with the thread's own setting)
        assert out["engine_bits_first"] == out["engine_bits_after_release"] == [2], out
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
