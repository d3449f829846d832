"""The engine loop itself, with a fake runner and no torch: step order, async placeholders,
a failing step, stop and drain, stats."""

from __future__ import annotations

import threading
import time

import pytest

from acb.config import ResolvedConfig
from acb.core.engine_core import EngineCore
from acb.core.messages import Delivery, EngineRequest, ModelRunnerOutput
from acb.outputs import FailureKind, RequestStatus
from acb.sampling_params import FALLBACK

VOCAB = 50


def token_at(prompt: tuple[int, ...], pos: int) -> int:
    """The fake model: the token a request samples at position ``pos`` of its sequence."""
    return (sum(prompt) * 7 + pos * 13) % (VOCAB - 3) + 3


class FakeRunner:
    """Samples ``token_at``; fills async placeholders from its own previous samples, as the
    device does, and checks that each placeholder points at its own request's last sample."""

    vocab_size = 256
    input_vocab_size = 256
    asleep = False
    last_stage_s = 0.0

    def __init__(self, fail_execute_at: int = -1, fail_finish_at: int = -1) -> None:
        self.cfg: ResolvedConfig | None = None  # set by make_core
        self.calls: list[tuple[str, int]] = []
        self.prev: tuple[list, list[int]] | None = None  # (sample_reqs, sampled) of the last launched step
        self.fail_execute_at = fail_execute_at
        self.fail_finish_at = fail_finish_at
        self.idle_at: list[int] = []  # at each idle() (the core went to wait with no work): steps finished

    # the rest of acb.core.messages.Runner: no memory to free, weights that never change
    def sleep(self):
        self.asleep = True

    def wake_up(self):
        self.asleep = False

    def idle(self):
        self.idle_at.append(sum(1 for kind, _ in self.calls if kind == "finish"))

    def weights_changed(self) -> bool:
        return False

    def forget_weights(self) -> None:
        pass

    def execute(self, sched):
        self.calls.append(("execute", sched.step_id))
        if sched.step_id == self.fail_execute_at:
            raise RuntimeError("execute failed")
        owner = [r for r, n in zip(sched.requests, sched.num_new) for _ in range(n)]
        ids = list(sched.input_ids)
        for i, k in sched.placeholders:
            reqs, sampled = self.prev
            assert reqs[k] is owner[i], f"placeholder {i} of {owner[i]} points at {reqs[k]}'s sample"
            ids[i] = sampled[k]
        pos = [p + j for p, n in zip(sched.start_pos, sched.num_new) for j in range(n)]
        for i, r in enumerate(owner):  # every computed token is the request's own
            want = (
                r.token_ids[pos[i]] if pos[i] < r.prompt_len else token_at(tuple(r.token_ids[: r.prompt_len]), pos[i])
            )
            assert ids[i] == want, f"{r}: position {pos[i]} got {ids[i]}, want {want}"
        sampled = []
        for r in sched.sample_reqs:
            sampled.append(token_at(tuple(r.token_ids[: r.prompt_len]), r.num_computed_tokens))
        self.prev = (list(sched.sample_reqs), sampled)
        return (sched.step_id, sampled)

    def finish(self, handle):
        step_id, sampled = handle
        self.calls.append(("finish", step_id))
        if step_id == self.fail_finish_at:
            raise RuntimeError("finish failed")
        return ModelRunnerOutput(sampled)


class Collector:
    """The ``deliver`` callback: every Delivery, and an event once ``expected`` outcomes arrived."""

    def __init__(self, expected: int) -> None:
        self.items: list[Delivery] = []
        self.finals: dict[str, object] = {}
        self.expected = expected
        self.done = threading.Event()

    def __call__(self, items: list[Delivery]) -> None:
        self.items.extend(items)
        for d in items:
            if d.final is not None:
                assert d.final.request_id not in self.finals, f"{d.final.request_id}: two outcomes"
                self.finals[d.final.request_id] = d.final
        if len(self.finals) >= self.expected:
            self.done.set()


def make_core(runner, collector, *, async_batching, num_blocks=64, budget=16, release_id=None) -> EngineCore:
    runner.cfg = ResolvedConfig(
        block_size=4,
        num_blocks=num_blocks,
        max_batch_tokens=budget,
        max_requests_per_batch=4,
        max_model_len=64,
        scheduler_type="fifo",
        safety_margin=0.0,
        max_queue_size=0,
        return_logprobs=False,
        seed=None,
        attn_backend="none",
        device="none",
        kv_cache_bytes=0,
        async_batching=async_batching,
    )
    return EngineCore(runner, deliver=collector, release_id=release_id)


def requests(n: int = 6, max_new: int = 7) -> list[EngineRequest]:
    """Request ``r<i>``, delivered under sink key ``i``."""
    return [
        EngineRequest(f"r{i}", i, tuple(range(3 + i, 3 + i + 2 + 3 * i)), FALLBACK, max_new, frozenset(), 0)
        for i in range(n)
    ]


def expected(r: EngineRequest, max_new: int) -> list[int]:
    return [token_at(r.prompt_ids, len(r.prompt_ids) + j) for j in range(max_new)]


@pytest.mark.parametrize("async_batching", [False, True])
def test_steps_in_order_and_outputs_right(async_batching):
    runner, col = FakeRunner(), Collector(6)
    core = make_core(runner, col, async_batching=async_batching, num_blocks=12)  # tight: preemption too
    core.start()
    for r in requests():
        core.add(r)
    assert col.done.wait(30)
    core.stop(timeout=30)
    for rid, out in col.finals.items():
        r = next(x for x in requests() if x.request_id == rid)
        assert out.status == RequestStatus.FINISHED and out.generated_tokens == expected(r, 7)
    # streamed tokens add up to the outputs, and every sink got only its own request's results
    for i in range(6):
        toks = [t for d in col.items if d.key == i for t in d.token_ids]
        assert toks == col.finals[f"r{i}"].generated_tokens
    calls = runner.calls
    launched = [s for kind, s in calls if kind == "execute"]
    assert [s for kind, s in calls if kind == "finish"] == launched  # each step completed once, in order
    at = {c: i for i, c in enumerate(calls)}
    if async_batching:  # step N+1 is launched before step N is read (except when nothing could be)
        overlapped = sum(1 for s in launched if ("execute", s + 1) in at and at[("execute", s + 1)] < at[("finish", s)])
        assert overlapped >= len(launched) // 2
    else:
        assert all(
            calls[i][0] == "execute" and calls[i + 1] == ("finish", calls[i][1]) for i in range(0, len(calls), 2)
        )
    st = core.stats
    assert st.finished == 6 and st.generated_tokens == 42 and st.failed == 0 and st.running == 0
    assert st.steps == len(launched)
    core.check_invariants()


@pytest.mark.parametrize("async_batching", [False, True])
def test_the_runner_is_told_when_the_core_runs_out_of_work(async_batching):
    # (where the runner hands back its thread pool: acb.runner.host_threads); never mid-work
    runner, col = FakeRunner(), Collector(6)
    core = make_core(runner, col, async_batching=async_batching)
    steps_at_idle = runner.idle_at
    core.start()
    for r in requests():
        core.add(r)
    assert col.done.wait(30)
    end = time.monotonic() + 30
    while not steps_at_idle or steps_at_idle[-1] != len([c for c in runner.calls if c[0] == "finish"]):
        assert time.monotonic() < end, "the core never went idle after its work"
        time.sleep(0.01)
    core.stop(timeout=30)
    finished = len([c for c in runner.calls if c[0] == "finish"])
    assert steps_at_idle[-1] == finished  # told after the last step was read
    assert len(steps_at_idle) < finished  # not once per step: only when out of work


@pytest.mark.parametrize("where", ["execute", "finish"])
@pytest.mark.parametrize("async_batching", [False, True])
def test_a_failing_step_fails_only_its_requests(where, async_batching):
    runner = FakeRunner(**{f"fail_{where}_at": 3})
    col = Collector(6)
    core = make_core(runner, col, async_batching=async_batching)
    core.start()
    for r in requests():
        core.add(r)
    assert col.done.wait(30)
    core.stop(timeout=30)
    failed = {rid for rid, o in col.finals.items() if o.status == RequestStatus.FAILED}
    assert failed and len(failed) < 6
    for rid in failed:
        o = col.finals[rid]
        assert o.failure == FailureKind.REQUEST and f"{where} failed" in o.error
    assert core.stats.failed == len(failed) and core.stats.finished == 6 - len(failed)
    assert core.dead_error is None
    core.check_invariants()


@pytest.mark.parametrize("drain", [False, True])
def test_stop_cancels_or_drains(drain):
    runner, col = FakeRunner(), Collector(6)
    core = make_core(runner, col, async_batching=True)
    gate = threading.Event()
    core.start()
    core.call(lambda c: gate.wait(30))  # everything below lands before the first step
    for r in requests(max_new=50):
        core.add(r)
    core.stop(drain=drain, timeout=0)
    gate.set()
    core.join(30)
    assert not core.is_running and col.done.is_set()
    statuses = {o.status for o in col.finals.values()}
    assert statuses == ({RequestStatus.FINISHED} if drain else {RequestStatus.CANCELLED})
    assert core.stats.cancelled == (0 if drain else 6)
    core.check_invariants()


def test_a_dead_engine_fails_everyone_and_holds_nothing(monkeypatch):
    runner, col = FakeRunner(), Collector(6)
    released: list[str] = []
    core = make_core(runner, col, async_batching=True, release_id=released.append)
    core.start()
    gate = threading.Event()
    core.call(lambda c: gate.wait(30))
    for r in requests():
        core.add(r)

    def broken():
        raise AssertionError("scheduler bug")

    monkeypatch.setattr(core.scheduler, "schedule", broken)
    gate.set()
    assert col.done.wait(30)
    core.join(30)
    assert isinstance(core.dead_error, AssertionError)
    assert all(o.failure == FailureKind.ENGINE_DEAD for o in col.finals.values())
    assert core.pool.num_used == 0 and set(released) == {r.request_id for r in requests()}  # every id given back
    core.check_invariants()
