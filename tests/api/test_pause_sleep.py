"""A persistent engine across training rounds: ``pause()``/``resume()`` in each mode with requests
in flight, ``sleep()``/``wake_up()`` freeing the KV cache and the step buffers (measured), and
weights changed in place while asleep. Run with and without async batching, and with a cache
small enough to preempt and offload."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch

import acb
from acb.models import tiny_model
from tests.conftest import HANG_GUARD, get_model, prompts_of_lengths, reference_generate

PROMPTS = prompts_of_lengths([9, 23, 14, 31, 5, 18], seed=60)
MAX_NEW = 24


def _cfg(async_batching: bool, **kw) -> acb.ContinuousBatchingConfig:
    kw.setdefault("page_size", 8)
    kw.setdefault("num_blocks", 64)
    return acb.ContinuousBatchingConfig(use_async_batching=async_batching, **kw)


def _refs(model, max_new: int = MAX_NEW) -> list[list[int]]:
    return [reference_generate(model, p, max_new) for p in PROMPTS]


def _until(cond, timeout: float = HANG_GUARD) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.002)


def _still(eng: acb.Engine, rounds: int = 4) -> int:
    """Steps run while the engine thread goes ``rounds`` times round its loop (it answers a call at
    the top of each: drain the inbox, then a step if it may and has work). An engine that may step
    and has work runs one between two answered calls, whatever the machine's speed; a paused or
    sleeping one runs none."""
    before = eng.stats.steps
    for _ in range(rounds):
        eng.call(lambda c: None).result(HANG_GUARD)
    return eng.stats.steps - before


def _in_flight(eng: acb.Engine, n: int) -> None:
    """Wait until ``n`` requests run and have sampled (leaving a handle's ``for`` loop would cancel
    its request, so the engine's counters are watched instead)."""
    _until(lambda: eng.stats.running == n and eng.stats.generated_tokens >= n)


@pytest.mark.parametrize("async_batching", [False, True])
def test_pause_wait_finishes_the_live_requests_and_holds_new_ones(async_batching):
    model = get_model("llama")
    refs = _refs(model)
    with acb.Engine(model, _cfg(async_batching)) as eng:
        hs = [eng.submit(p, max_new_tokens=MAX_NEW) for p in PROMPTS[:4]]
        _in_flight(eng, len(hs))
        pausing = threading.Thread(target=eng.pause, kwargs={"mode": "wait", "timeout": 60})
        pausing.start()
        _until(lambda: eng.is_paused)
        late = [eng.submit(p, max_new_tokens=MAX_NEW) for p in PROMPTS[4:]]  # held while draining
        pausing.join(60)
        assert not pausing.is_alive()
        # pause() returned: every request live at the pause finished; the later ones did not start
        assert [h.result(timeout=0).generated_tokens for h in hs] == refs[:4]
        assert _still(eng) == 0
        assert eng.stats.waiting == 2 and eng.stats.running == 0 and eng.stats.paused
        eng.resume()
        assert [h.result(timeout=60).generated_tokens for h in late] == refs[4:]
        assert not eng.stats.paused


@pytest.mark.parametrize("async_batching", [False, True])
def test_pause_cancel_ends_the_live_requests(async_batching):
    model = get_model("llama")
    with acb.Engine(model, _cfg(async_batching)) as eng:
        hs = [eng.submit(p, max_new_tokens=200, ignore_eos=True) for p in PROMPTS]
        _in_flight(eng, len(hs))
        eng.pause("cancel", timeout=30)
        outs = [h.result(timeout=HANG_GUARD) for h in hs]
        assert all(o.finish_reason == acb.FinishReason.CANCELLED for o in outs)
        assert all(0 < len(o.generated_tokens) < 200 for o in outs[:1])
        assert eng.stats.running == eng.stats.waiting == 0 and eng.stats.kv_blocks_used == 0
        queued = eng.submit(PROMPTS[0], max_new_tokens=MAX_NEW)  # accepted while paused, waits
        assert _still(eng) == 0
        eng.resume()
        assert queued.result(timeout=60).generated_tokens == reference_generate(model, PROMPTS[0], MAX_NEW)


@pytest.mark.parametrize("async_batching", [False, True])
def test_pause_keep_parks_requests_where_they_are(async_batching):
    model = get_model("llama")
    refs = _refs(model)
    with acb.Engine(model, _cfg(async_batching)) as eng:
        hs = [eng.submit(p, max_new_tokens=MAX_NEW) for p in PROMPTS]
        _in_flight(eng, len(hs))
        eng.pause("keep", timeout=30)
        parked = eng.stats
        assert parked.running > 0 and parked.kv_blocks_used > 0  # they keep their KV blocks
        assert _still(eng) == 0 and eng.stats.generated_tokens == parked.generated_tokens
        with pytest.raises(TimeoutError):
            hs[0].result(timeout=0.1)
        eng.resume()
        assert [h.result(timeout=60).generated_tokens for h in hs] == refs
        assert eng.stats.preemptions == 0  # resumed in place, nothing recomputed


def test_pause_modes_are_checked_and_pauses_nest():
    with acb.Engine(get_model("llama"), _cfg(False)) as eng:
        with pytest.raises(ValueError, match="pause mode"):
            eng.pause("drain")
        eng.pause("keep")
        eng.pause("wait")  # already paused: returns at once
        eng.resume()
        eng.resume()  # not paused: nothing to do
        assert eng.generate(PROMPTS[0], max_new_tokens=3).generated_tokens == reference_generate(
            get_model("llama"), PROMPTS[0], 3
        )


@pytest.mark.parametrize("drain", [False, True])
def test_stopping_a_paused_engine_ends_every_request(drain):
    model = get_model("llama")
    eng = acb.Engine(model, _cfg(True))
    eng.start()
    hs = [eng.submit(p, max_new_tokens=MAX_NEW) for p in PROMPTS[:3]]
    _in_flight(eng, len(hs))
    eng.pause("keep")
    eng.shutdown(cancel_pending=not drain, timeout=60)
    outs = [h.result(timeout=HANG_GUARD) for h in hs]
    if drain:
        assert [o.generated_tokens for o in outs] == _refs(model)[:3]
    else:
        assert all(o.finish_reason == acb.FinishReason.CANCELLED for o in outs)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="measures the resident set on Linux")
def test_sleep_frees_the_kv_cache_and_wake_up_restores_service():
    model = get_model("llama")
    refs = _refs(model)
    # 4 per-layer K/V tensors of 64 MiB: above glibc's largest mmap threshold, so freeing them
    # returns the pages to the system and the resident set shows it
    cfg = _cfg(True, page_size=16, num_blocks=32768)
    with acb.Engine(model, cfg) as eng:
        hs = [eng.submit(p, max_new_tokens=MAX_NEW) for p in PROMPTS]
        _in_flight(eng, len(hs))
        kv = weakref.ref(eng.runner.kv_cache.k[0])
        backend = eng.runner.backend  # the torch backend: its gather workspace goes too
        workspace = sum(t.nbytes for t in list(backend._workspace.values()))  # only grows while running
        gc.collect()
        before = _rss()
        freed = eng.sleep()
        assert backend._workspace == {} and freed.other >= workspace
        gc.collect()
        dropped = before - _rss()
        assert freed.kv_cache == eng.config.kv_cache_bytes == 4 * 64 * 2**20
        assert freed.staging > 0 and freed.total > freed.kv_cache
        assert kv() is None  # the tensors are gone, not just unreferenced by the runner
        assert dropped >= 0.9 * freed.kv_cache, (dropped, freed)
        st = eng.stats
        assert st.asleep and st.paused and st.kv_blocks_used == 0 and st.kv_blocks_cached == 0
        assert st.running == 0 and st.waiting == len(PROMPTS)  # taken off the device, kept
        assert eng.sleep().total == 0  # asleep already
        with pytest.raises(RuntimeError, match="wake_up"):
            eng.resume()
        late = eng.submit(PROMPTS[0], max_new_tokens=MAX_NEW)  # accepted while asleep, waits
        assert _still(eng) == 0
        eng.wake_up()  # sleep() paused the engine, so waking resumes it
        assert not eng.is_sleeping and not eng.is_paused
        assert [h.result(timeout=60).generated_tokens for h in hs] == refs  # recomputed, same tokens
        assert late.result(timeout=60).generated_tokens == refs[0]
        assert eng.stats.recomputed_preemptions >= 1


def test_wake_up_after_an_explicit_pause_stays_paused():
    model = get_model("llama")
    with acb.Engine(model, _cfg(False)) as eng:
        eng.pause("wait")
        eng.sleep()
        eng.wake_up()
        assert eng.is_paused and not eng.is_sleeping
        h = eng.submit(PROMPTS[1], max_new_tokens=4)
        assert _still(eng) == 0
        eng.resume()
        assert h.result(timeout=30).generated_tokens == reference_generate(model, PROMPTS[1], 4)


@pytest.mark.parametrize("async_batching", [False, True])
def test_rounds_of_training_with_sleep_between_them(async_batching):
    """generate → sleep → an optimizer step in place → wake_up → generate: the second round equals
    a fresh engine on the new weights, with a cache small enough to preempt and offload, and the
    prefix cache never serves the old weights' K/V."""
    model = tiny_model("llama", seed=11)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    shared = prompts_of_lengths([16], seed=61)[0]
    prompts = [shared + p for p in prompts_of_lengths([3, 7, 12, 5, 9, 4], seed=62)]
    cfg = _cfg(async_batching, page_size=4, num_blocks=24, cpu_offload_space=0.001)
    rounds = []
    with acb.Engine(model, cfg) as eng:
        for _ in range(2):
            hs = [eng.submit(p, max_new_tokens=12) for p in prompts]
            rounds.append([h.result(timeout=120) for h in hs])
            eng.sleep()
            model.train()
            loss = model(torch.tensor([prompts[0]]), labels=torch.tensor([prompts[0]])).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            eng.wake_up()
        stats = eng.stats
    model.eval()
    assert stats.preemptions > 0
    # round 2 ran on the weights after one step (they have had two since): rebuild those
    assert all(o.num_cached_tokens == 0 for o in rounds[1][:1])  # nothing cached survives sleep
    fresh = tiny_model("llama", seed=11)
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.3)
    fresh.train()
    loss = fresh(torch.tensor([prompts[0]]), labels=torch.tensor([prompts[0]])).loss
    loss.backward()
    fopt.step()
    fresh.eval()
    assert [o.generated_tokens for o in rounds[1]] == [reference_generate(fresh, p, 12) for p in prompts]
    assert [o.generated_tokens for o in rounds[0]] == [
        reference_generate(tiny_model("llama", seed=11), p, 12) for p in prompts
    ]


@pytest.mark.anyio
async def test_async_engine_pause_sleep_wake_resume():
    model = get_model("llama")
    refs = _refs(model, 8)
    async with acb.AsyncEngine(model, _cfg(True)) as eng:
        hs = [await eng.submit(p, max_new_tokens=8) for p in PROMPTS]
        await eng.pause("keep")
        freed = await eng.sleep()
        assert freed.kv_cache == eng.config.kv_cache_bytes and eng.is_sleeping
        await eng.wake_up()
        assert eng.is_paused  # paused before sleep(): stays paused until resume()
        await eng.resume()
        assert [(await h.result()).generated_tokens for h in hs] == refs
        await eng.pause("wait")
        await eng.resume()
        assert (await eng.generate(PROMPTS[0], max_new_tokens=8)).generated_tokens == refs[0]


LIFECYCLE_OPS = ("pause_wait", "pause_keep", "pause_cancel", "resume", "sleep", "wake")


class LifecycleModel:
    """What the engine's lifecycle must do, as two independent holds: the caller's pause (None,
    "draining", "paused"; only resume ends it) and sleep (only wake_up ends it)."""

    def __init__(self) -> None:
        self.pause: str | None = None
        self.asleep = False
        self.cancelled = False  # pause("cancel") ended the live requests

    def apply(self, op: str) -> str | None:
        """Apply ``op``; returns the error it must raise, if any."""
        if op == "pause_wait":
            self.pause = self.pause or "draining"
        elif op in ("pause_keep", "pause_cancel"):
            self.pause = "paused"
            self.cancelled |= op == "pause_cancel"
        elif op == "resume":
            if self.asleep:
                return "wake_up"
            self.pause = None
        elif op == "sleep":
            self.asleep = True
        else:
            self.asleep = False
        return None


def _post(core, op: str):
    if op.startswith("pause_"):
        return core.pause(op[len("pause_") :])
    if op == "resume":
        return core.resume()
    return core.command("sleep" if op == "sleep" else "wake")


@pytest.mark.parametrize("async_batching", [False, True])
def test_lifecycle_transitions_compose_pairwise(async_batching):
    """Every ordered pair of lifecycle calls, posted back to back right after four requests (so
    the second lands while the first is in effect: a pause("wait") still draining when sleep()
    comes, issue 26 item 8), against :class:`LifecycleModel`: whether steps are held, what a pause waits
    for, which requests end how. A small cache (preemption) and offload."""
    model = get_model("llama")
    refs = _refs(model, 12)
    cfg = _cfg(async_batching, num_blocks=14, cpu_offload_space=0.01, max_requests_per_batch=4)
    with acb.Engine(model, cfg) as eng:
        core = eng.core
        for a in LIFECYCLE_OPS:
            for b in LIFECYCLE_OPS:
                label = f"{a} then {b}"
                gate = threading.Event()
                core.call(lambda c: gate.wait(30))  # what follows lands in one drain of the inbox
                live = [eng.submit(p, max_new_tokens=12) for p in PROMPTS[:4]]
                want = LifecycleModel()
                futs = []
                for op in (a, b):
                    futs.append((op, _post(core, op), want.apply(op)))
                late = eng.submit(PROMPTS[4], max_new_tokens=12)  # after both calls
                gate.set()
                for op, fut, err in futs:
                    if err is not None:
                        with pytest.raises(RuntimeError, match=err):
                            fut.result(30)
                    elif op != "pause_wait" or not want.asleep:
                        fut.result(30)  # a drain interrupted by sleep() completes only after wake_up()
                assert eng.is_sleeping == want.asleep, label
                assert eng.is_paused == (want.pause is not None or want.asleep), label
                if want.asleep or want.pause == "paused":
                    assert _still(eng) == 0, f"{label}: steps ran while held"
                    if not want.cancelled:
                        assert not any(h.done for h in live), f"{label}: a parked request ended"
                elif want.pause == "draining":
                    # the live requests finish, the one submitted after the pause is held
                    outs = [h.result(30) for h in live]
                    assert [o.generated_tokens for o in outs] == refs[:4], label
                    _until(lambda: eng.is_paused and eng.stats.running == 0)
                    assert _still(eng) == 0 and not late.done, label
                # back to running: wake (a drain goes on), resume, and everything ends
                if want.asleep:
                    eng.wake_up()
                    assert eng.is_paused == (want.pause is not None), label
                    if want.pause == "draining":
                        assert [h.result(30).generated_tokens for h in live] == refs[:4], label
                        assert not late.done, label
                        for op, fut, _err in futs:
                            if op == "pause_wait":
                                fut.result(30)  # the drain's pause() returns once it is done
                eng.resume()
                assert not eng.is_paused, label
                for h, ref in zip(live + [late], refs[:4] + [refs[4]]):
                    out = h.result(30)
                    if want.cancelled and h is not late:
                        assert out.status == acb.RequestStatus.CANCELLED, label
                    else:
                        assert out.generated_tokens == ref, label
                eng.call(lambda c: c.check_invariants()).result(30)
