"""The scheduler driven as the engine drives it, sync or async, against a shadow of the KV cache.

No model: a "forward" writes, into each slot it computes, which request and position wrote
it, and checks that every position a request attends to holds the K/V of its own prefix
(resolved lazily, since with async batching a placeholder token is known only a step later).
Offload copies, swap-ins, fork copies and prefix-cache hits move or share those slots
exactly as the runner's copies would, so a lost or misordered copy, a block freed while
still read, or a request finished twice shows up here, in pure Python, in milliseconds.
"""

from __future__ import annotations

import os
import random

import pytest

from acb.core.block_pool import BlockPool, SwapSpace
from acb.core.messages import SchedulerOutput
from acb.core.request import Request, RequestGroup
from acb.core.scheduler import Scheduler
from acb.outputs import FinishReason, RequestStatus

VOCAB = 64
# workloads per configuration: 40 by default (about 4 s in all); the engine fuzz's soak knob scales it
SEEDS = 4 * max(10, int(os.environ.get("ACB_FUZZ_EXAMPLES", "10")))
SEED = int(os.environ.get("ACB_FUZZ_SEED", "0"))


def next_token(prefix: list[int]) -> int:
    """The "model": a deterministic function of the whole prefix."""
    return (sum(prefix[-5:]) * 31 + 7 * len(prefix)) % (VOCAB - 3) + 3


def expected_tokens(prompt: list[int], max_new: int, stop: frozenset[int]) -> list[int]:
    toks = list(prompt)
    for _ in range(max_new):
        toks.append(next_token(toks))
        if toks[-1] in stop:
            break
    return toks[len(prompt) :]


class ShadowKV:
    """Per device block and per host block, the (request, position) whose K/V each slot holds."""

    def __init__(self, num_blocks: int, num_host: int, block_size: int) -> None:
        self.bs = block_size
        self.dev: list[list] = [[None] * block_size for _ in range(num_blocks)]
        self.host: list[list] = [[None] * block_size for _ in range(num_host)]

    def run(self, out: SchedulerOutput) -> None:
        """The runner's order: offload, restore, the forward (reads, then writes), fork copies."""
        for d, h in out.swap_out:
            self.host[h] = list(self.dev[d])
        for h, d in out.swap_in:
            self.dev[d] = list(self.host[h])
        bs = self.bs
        for req, start, n in zip(out.requests, out.start_pos, out.num_new):
            assert len(req.block_ids) * bs >= start + n, f"{req}: too few blocks"
            for p in range(start):  # what this query attends to: its own prefix's K/V
                slot = self.dev[req.block_ids[p // bs]][p % bs]
                assert slot is not None, f"{req}: position {p} was never written"
                writer, wp = slot
                assert wp == p and writer.token_ids[: p + 1] == req.token_ids[: p + 1], (
                    f"{req}: position {p} holds {writer.request_id}'s K/V of another prefix"
                )
            for p in range(start, start + n):
                self.dev[req.block_ids[p // bs]][p % bs] = (req, p)
        for src, dst in out.block_copies_after:
            self.dev[dst] = list(self.dev[src])


def comparable(out: SchedulerOutput | None):
    """A step's output with requests named by id, for comparing two runs."""
    if out is None:
        return None
    ids = lambda reqs: [r.request_id for r in reqs]  # noqa: E731
    return (
        out.step_id,
        ids(out.requests),
        out.rows,
        out.num_new,
        out.start_pos,
        out.input_ids,
        out.sample_idx,
        ids(out.sample_reqs),
        out.sample_rows,
        out.sample_gen_idx,
        out.block_updates,
        ids(out.newly_admitted),
        ids(out.row_inits),
        out.freed_rows,
        out.block_copies_after,
        out.swap_out,
        out.swap_in,
        out.placeholders,
        out.num_prefill_tokens,
        out.num_decode_tokens,
    )


def drive(
    seed: int,
    *,
    async_batching: bool,
    caching: bool,
    swap_blocks: int,
    policy: str,
    fast_decode: bool = True,
    record: list | None = None,
) -> Scheduler:
    rnd = random.Random(seed)
    bs = rnd.choice([2, 4, 8])
    longest = 40
    num_blocks = 1 + -(-longest // bs) + rnd.choice([0, 1, 3, 8])
    s = Scheduler(
        BlockPool(num_blocks, enable_caching=caching),
        block_size=bs,
        max_batch_tokens=rnd.choice([5, 8, 16, 64]),
        max_running=rnd.choice([2, 3, 6]),
        policy=policy,
        safety_margin=0.0,
        swap=SwapSpace(swap_blocks) if swap_blocks else None,
        fast_decode=fast_decode,
    )
    kv = ShadowKV(num_blocks, swap_blocks, bs)
    base = [rnd.randrange(3, VOCAB) for _ in range(30)]
    todo: list[Request] = []
    for i in range(rnd.randint(4, 14)):
        prompt = base[: rnd.randint(1, 30)] + [rnd.randrange(3, VOCAB) for _ in range(rnd.randint(0, 3))]
        prompt = prompt[:30]
        max_new = rnd.randint(1, longest - len(prompt))
        stop = frozenset(rnd.sample(range(3, VOCAB), 3)) if rnd.random() < 0.3 else frozenset()
        n = rnd.choice([1, 1, 1, 2, 3])
        n = min(n, s.max_running)
        partial = len(prompt) % bs
        if len(prompt) // bs + (n if partial else 0) > num_blocks - 1:  # refused at submit by the engine
            n = 1
        members = [
            Request(f"r{i}" if k == 0 else f"r{i}#{k}", prompt, max_new_tokens=max_new, stop_token_ids=stop)
            for k in range(n)
        ]
        if n > 1:
            RequestGroup(f"r{i}", members)
        todo.append(members[0])
    outcome: dict[str, RequestStatus] = {}
    cancelled: set[str] = set()
    inflight: SchedulerOutput | None = None

    def complete(out: SchedulerOutput) -> None:
        sampled = [next_token(r.token_ids) for r in out.sample_reqs]  # resolved now: prefix known
        _, finished = s.update_from_output(out, sampled, None)
        for r in finished:
            assert r.request_id not in outcome, f"{r.request_id} finished twice"
            outcome[r.request_id] = r.status

    everyone: list[Request] = []
    steps = 0
    while todo or s.has_work() or inflight is not None:
        steps += 1
        assert steps < 5000, "no progress"
        while todo and rnd.random() < 0.5:
            r = todo.pop(0)
            s.add(r)
            everyone.extend(r.group.members if r.group else [r])
        if rnd.random() < 0.05 and s.live:  # a cancel arrives between steps
            rid = rnd.choice(sorted(s.live))
            head = s.live[rid]
            members = head.group.members if head.group else [head]
            for m in members:
                s.cancel(m.request_id)
            cancelled.update(m.request_id for m in members if m.status == RequestStatus.CANCELLED)
        out = s.schedule()
        if out is not None:
            kv.run(out)
        if record is not None:
            record.append(comparable(out))
        if async_batching:
            prev, inflight = inflight, out
        else:
            prev = out
        if prev is not None:
            complete(prev)
        elif out is None and s.has_work():
            raise AssertionError(f"no step could be scheduled: {s.running} running, {list(s.waiting)} waiting")
        s.check_invariants()
    assert s.pool.num_used == 0 and not s.live and s.host_blocks_held == 0
    for r in everyone:
        want = expected_tokens(r.token_ids[: r.prompt_len], r.max_new_tokens, r.stop_token_ids)
        got = r.token_ids[r.prompt_len :]
        if r.request_id in cancelled:
            assert r.status == RequestStatus.CANCELLED and got == want[: len(got)]
        else:
            assert r.status == RequestStatus.FINISHED, r
            assert outcome.get(r.request_id) == RequestStatus.FINISHED
            assert got == want, f"{r.request_id}: {got} != {want}"
            assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    return s


@pytest.mark.parametrize("async_batching", [False, True])
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("swap_blocks", [0, 3, 64])
@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_random_workloads_keep_kv_and_outcomes_right(async_batching, caching, swap_blocks, policy):
    preempted = swapped = 0
    for seed in range(SEED, SEED + SEEDS):
        try:
            s = drive(seed, async_batching=async_batching, caching=caching, swap_blocks=swap_blocks, policy=policy)
        except Exception as exc:
            raise AssertionError(f"workload seed={seed}: {exc!r}") from exc
        preempted += s.stats.preemptions
        swapped += s.stats.swapped_out_blocks
    assert preempted > 0  # the workloads are tight enough to exercise preemption
    if swap_blocks:
        assert swapped > 0


@pytest.mark.parametrize("async_batching", [False, True])
def test_decode_shortcut_gives_the_same_steps_as_the_general_path(async_batching):
    for seed in range(SEED, SEED + SEEDS // 2):
        for caching, swap_blocks, policy in ((False, 0, "fifo"), (True, 3, "prefill_first"), (True, 64, "fifo")):
            fast, general = [], []
            kw = dict(async_batching=async_batching, caching=caching, swap_blocks=swap_blocks, policy=policy)
            drive(seed, fast_decode=True, record=fast, **kw)
            drive(seed, fast_decode=False, record=general, **kw)
            assert fast == general, f"seed {seed} {kw}: the steps differ"
