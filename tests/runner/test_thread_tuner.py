"""The engine thread's intra-op thread count (acb.runner.host_threads.ThreadTuner, ``cpu_threads``).

The tuner is driven by a simulated machine (each step's seconds from a table of seconds per token
per thread count, which the test changes as a neighbour would) so that its choices are exact and
repeatable; the engine-level tests check what makes a change of count safe: a request's tokens
and logprobs are the same bits at 1 thread and at 2, whatever the layer kinds."""

from __future__ import annotations

import threading

import pytest
import torch

import acb
from acb.bench.common import MODEL_SHAPES, bench_model
from acb.runner.host_threads import ThreadTuner
from tests.conftest import get_model, prompts_of_lengths, reference_generate


class Machine:
    """Seconds per token at each thread count; a step's seconds are ``tokens * cost[threads]``."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost = dict(cost)
        self.applied: list[int] = []
        self.threads = None

    def set(self, n: int) -> None:
        self.applied.append(n)
        self.threads = n

    def run(self, tuner: ThreadTuner, steps: int, tokens: int = 16, decode: bool = True) -> list[int]:
        used = []
        for _ in range(steps):
            n = tuner.begin(tokens, decode)
            assert n == self.threads, "the tuner must set the count it reports"
            used.append(n)
            tuner.end(tokens * self.cost[n])
        return used


def _overhead(m: Machine, used: list[int], best: int, tokens: int = 16) -> float:
    """The time lost to steps not at ``best``, as a fraction of the time at ``best``."""
    spent = sum(tokens * m.cost[n] for n in used)
    ideal = len(used) * tokens * m.cost[best]
    return spent / ideal - 1.0


def test_the_tuner_keeps_the_faster_count_and_follows_a_change() -> None:
    m = Machine({1: 2.0, 2: 1.0})  # quiet: 2 threads twice as fast
    tuner = ThreadTuner(2, m.set)
    assert tuner.ladder == [1, 2]
    used = m.run(tuner, 1000)
    assert tuner.current == 2 and tuner.switches == 0
    # each probe ends on its first counted step; they back off to a bounded cost
    assert used.count(1) <= 2 * tuner.probes and tuner.probes <= 8, (used.count(1), tuner.probes)
    assert _overhead(m, used, 2) < 0.03

    m.cost = {1: 3.0, 2: 30.0}  # a neighbour takes a core: 2 threads now 10x slower
    used = m.run(tuner, 1000)
    assert tuner.current == 1 and tuner.switches == 1
    assert used.index(1) < 8, "a drift of the step's time probes at once"
    assert _overhead(m, used, 1) < 0.15  # the probes back to 2 threads, each ended on its first step

    m.cost = {1: 2.0, 2: 1.0}  # the neighbour leaves: a scheduled probe finds 2 threads faster again
    used = m.run(tuner, ThreadTuner.MAX_INTERVAL + 10)
    assert tuner.current == 2 and tuner.switches == 2


def test_probes_cost_little_when_steps_differ_in_length() -> None:
    """An evaluation's steps: short decode steps and, every eighth, a 2,048-token prefill. A probe
    that lands on the long step costs that step's extra seconds; the next waits until the steps'
    time covers it at the budget, so probing costs under 2% where the count is right already."""
    m = Machine({1: 1.8, 2: 1.0})
    tuner = ThreadTuner(2, m.set)
    spent = ideal = 0.0
    for i in range(3000):
        tokens, decode = (2048, False) if i % 8 == 7 else (16, True)
        n = tuner.begin(tokens, decode)
        spent, ideal = spent + tokens * m.cost[n], ideal + tokens * m.cost[2]
        tuner.end(tokens * m.cost[n])
    assert tuner.current == 2 and tuner.probes >= 3
    assert spent / ideal - 1 < 0.02, spent / ideal - 1


def test_noise_within_the_margin_does_not_switch() -> None:
    m = Machine({1: 1.05, 2: 1.0})  # 1 thread 5% slower: not worth a switch either way
    tuner = ThreadTuner(2, m.set)
    m.run(tuner, 500)
    assert tuner.current == 2 and tuner.switches == 0
    m.cost = {1: 0.95, 2: 1.0}  # 5% faster at 1: still under the margin (BETTER)
    m.run(tuner, 500)
    assert tuner.switches == 0


def test_steps_of_other_shapes_are_compared_with_their_own_kind() -> None:
    """A probe step is compared with the current count's mean for steps of its shape only: a
    long prefill step at the probed count is not 'slower' than a short decode step."""
    m = Machine({1: 1.0, 2: 1.0})
    tuner = ThreadTuner(2, m.set)
    for _ in range(30):
        m.run(tuner, 3, tokens=4, decode=True)
        m.run(tuner, 1, tokens=900, decode=False)
    assert tuner.switches == 0 and tuner.probes > 0


def test_a_wide_ladder_and_a_pinned_count() -> None:
    m = Machine({16: 1.0, 8: 0.5, 4: 0.6, 2: 1.0, 1: 2.0})
    tuner = ThreadTuner(16, m.set)
    assert tuner.ladder == [1, 2, 4, 8, 16]
    m.run(tuner, 300)
    assert tuner.current == 8  # 8 beats both 16 and 4

    pinned = Machine({1: 1.0, 3: 9.0})
    tuner = ThreadTuner(3, pinned.set, pinned=True)
    assert pinned.run(tuner, 300) == [3] * 300 and pinned.applied == [3] and tuner.probes == 0


def test_cpu_threads_is_validated() -> None:
    for bad in (0, -1, "fast", 1.5, True):
        with pytest.raises(ValueError, match="cpu_threads"):
            acb.ContinuousBatchingConfig(cpu_threads=bad).validate()


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_tokens_and_logprobs_at_one_and_two_threads(arch: str) -> None:
    """What a change of count mid-run changes: the same requests pinned at 1 and at 2 threads (a
    mixed batch: prefill chunks and decode rows) give the same greedy tokens; on the attention
    model with oneDNN-packed linears, the same logprob bits too. MKL's float32 GEMM (the linears
    not packed, the hybrid's state layers) rounds some small row counts (5-7, 9-11 rows measured)
    differently at 2 threads, so there logprobs differ in the last bits, as they do between batch
    compositions (docs/performance.md: pin ``cpu_threads`` for bitwise repeatable runs)."""
    model = get_model(arch) if arch == "llama" else bench_model(arch, **MODEL_SHAPES["tiny"])
    prompts = prompts_of_lengths([5, 17, 40, 9, 33, 64], vocab=model.config.vocab_size, seed=3)
    runs = []
    for n in (1, 2):
        cfg = acb.ContinuousBatchingConfig(
            page_size=8, num_blocks=64, max_batch_tokens=48, cpu_threads=n, cpu_packed_linears=arch == "llama"
        )
        with acb.Engine(model, cfg) as eng:
            assert eng.core.runner.threads.ladder == [n]
            outs = eng.generate_batch(prompts, max_new_tokens=12, ignore_eos=True, logprobs=2, progress_bar=False)
        runs.append([(o.generated_tokens, o.logprobs) for o in outs.values()])
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]]
    if arch == "llama":
        assert runs[0] == runs[1]
    else:
        worst = max(abs(a - b) for (_, la), (_, lb) in zip(*runs) for a, b in zip(la, lb))
        assert worst < 1e-4, worst


def test_an_auto_engine_tunes_and_stays_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cpu_threads="auto"`` (the default outside this suite, which keeps torch's count through
    ``ACB_CPU_THREADS=fixed`` so that its bitwise comparisons between engines do not hang on the load):
    the engine thread measures its steps from torch's count, and its tokens are generate's."""
    model = get_model("llama")
    prompts = prompts_of_lengths([7, 30, 12, 50], vocab=model.config.vocab_size, seed=5)
    want = [reference_generate(model, p, 16, ignore_eos=True) for p in prompts]
    cfg = acb.ContinuousBatchingConfig(page_size=8, num_blocks=64, cpu_threads="auto", use_async_batching=True)
    with acb.Engine(model, cfg) as eng:
        tuner = eng.core.runner.threads
        for _ in range(3):
            outs = eng.generate_batch(prompts, max_new_tokens=16, ignore_eos=True, progress_bar=False)
            assert [o.generated_tokens for o in outs.values()] == want
    if torch.get_num_threads() > 1:
        assert tuner is not None and tuner.ladder[-1] == torch.get_num_threads() and tuner.probes > 0
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=16, cpu_threads="fixed")) as eng:
        assert eng.core.runner.threads is None  # torch's count for the thread, unmeasured
    monkeypatch.setenv("ACB_CPU_THREADS", "many")
    with pytest.raises(ValueError, match="ACB_CPU_THREADS"):
        acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=16)).start()


def test_the_engine_thread_count_is_its_own_and_put_back() -> None:
    """A pinned count applies on the engine thread only; the caller's stays, and a thread started
    after the engine stopped starts with the count it had before."""
    before = torch.get_num_threads()
    seen: dict[str, int] = {}
    model = get_model("llama")
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32, cpu_threads=1)) as eng:
        eng.generate_batch([[5, 6, 7]], max_new_tokens=3, progress_bar=False)
        seen["engine"] = eng.core.call(lambda core: torch.get_num_threads()).result()
        seen["caller"] = torch.get_num_threads()
    t = threading.Thread(target=lambda: seen.__setitem__("later", torch.get_num_threads()))
    t.start()
    t.join()
    assert seen == {"engine": 1, "caller": before, "later": before}
