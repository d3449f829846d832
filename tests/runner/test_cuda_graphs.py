"""Decode CUDA graphs: padded batch sizes, static buffers, graph keys, replay parity.

On CPU this runs the eager twin (``acb.runner.cuda_graphs.EagerGraph``) with the Triton kernels
in the interpreter (``TRITON_INTERPRET=1``, set here before triton is imported); on a CUDA
machine run with ``TRITON_INTERPRET=0`` and the same tests capture and replay real graphs.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import acb  # noqa: E402
from acb.models import tiny_model  # noqa: E402
from acb.runner import cuda_graphs  # noqa: E402
from acb.runner.attention import triton_kernels as tk  # noqa: E402
from tests.conftest import prompts_of_lengths, triton_test_device  # noqa: E402

DEVICE = triton_test_device()

# the interpreter's own numpy deprecation noise; compiled for a GPU, these are `gpu` tests too
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.*")] + (
    [pytest.mark.gpu] if DEVICE.type == "cuda" else []
)


def test_graph_sizes():
    assert cuda_graphs.graph_sizes(1) == [1]
    assert cuda_graphs.graph_sizes(6) == [1, 2, 4, 6]
    s = cuda_graphs.graph_sizes(256)
    assert s[:8] == [1, 2, 4, 8, 16, 24, 32, 40] and s[-3:] == [224, 240, 256]
    assert all(b - a == 16 for a, b in zip(s[s.index(64) :], s[s.index(64) + 1 :]))
    assert cuda_graphs.graph_sizes(50, step=16) == [1, 2, 4, 8, 24, 40, 50]


def _reference(model, prompt, n):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=DEVICE),
            max_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=DEVICE),
        )
    return out[0, len(prompt) :].tolist()


# async batching only (the CUDA default): the sync path's replays are checked against eager by
# test_graph_replay_equals_eager_with_sampling_and_n (the CPU default config), and each case here
# costs half a minute of the Triton interpreter
@pytest.mark.parametrize("async_batching", [True])
def test_decode_graphs_match_generate_across_sizes_and_context_lengths(monkeypatch, async_batching):
    # splits start at 32 tokens of context here, so both graph variants of a size are used:
    # the long-context one while the 40-token prompt decodes, the one-split one after it ends
    monkeypatch.setattr(tk, "MIN_TOKENS_PER_SPLIT", 32)
    model = tiny_model("llama").to(DEVICE)
    prompts = prompts_of_lengths([3, 9, 2, 40, 5], seed=7)
    news = [12, 12, 12, 4, 7]
    refs = [_reference(model, p, n) for p, n in zip(prompts, news)]
    cfg = acb.ContinuousBatchingConfig(
        page_size=8,
        num_blocks=64,
        max_model_len=64,  # the long-context variant splits in 2 (the interpreter runs every program of the grid)
        attn_backend="triton",
        use_cuda_graph=True,
        max_requests_per_batch=6,
        use_async_batching=async_batching,
    )
    with acb.Engine(model, cfg) as eng:
        graphs = eng.runner.graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4, 6]
        assert graphs.twin == (DEVICE.type == "cpu")
        hs = [eng.submit(p, acb.SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, news)]
        outs = [h.result(timeout=600) for h in hs]
        # then a lone request: the batch-1 graph
        lone = prompts_of_lengths([6], seed=8)[0]
        lone_out = eng.generate(lone, acb.SamplingParams(max_new_tokens=5))
        replays = dict(graphs.replays)
    assert [o.generated_tokens for o in outs] == refs
    assert lone_out.generated_tokens == _reference(model, lone, 5)
    assert all(not lora for *_, lora in replays)  # (no LoRA: no adapter graphs)
    used = {(b, v) for (b, v, _), n in replays.items() if n}
    assert any(v > 1 for _, v in used), f"no long-context graph replayed: {replays}"
    assert any(v == 1 and b > 1 for b, v in used), f"no one-split graph replayed: {replays}"
    assert (1, 1) in used
    assert any(b == 6 for b, _ in used) or any(b == 4 for b, _ in used)  # 5 requests: padded to 6


def test_graph_replay_equals_eager_with_sampling_and_n(monkeypatch):
    model = tiny_model("qwen3").to(DEVICE)
    prompts = prompts_of_lengths([4, 11, 1], seed=9)
    sp = [
        acb.SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, seed=3),
        acb.SamplingParams(max_new_tokens=8, n=2, temperature=1.1, seed=4, logprobs=2),
        acb.SamplingParams(max_new_tokens=8),
    ]
    results = {}
    for graphs in (False, True):
        cfg = acb.ContinuousBatchingConfig(
            page_size=4, num_blocks=64, attn_backend="triton", use_cuda_graph=graphs, max_requests_per_batch=8
        )
        with acb.Engine(model, cfg) as eng:
            # submitted while paused, so that both runs batch the same requests in the same steps
            # (logprobs depend on the batch's shapes in their last bits; on a busy machine the engine
            # thread once started stepping between two submits of one run and not the other's)
            eng.pause()
            handles = [eng.submit(p, s) for p, s in zip(prompts, sp)]
            eng.resume()
            outs = [h.result(timeout=600) for h in handles]
            # one-token prompts, one with n=3: their first step is decode-only and samples rows
            # 0, 0, 0, 1 of the logits (logits_indices is not the identity)
            eng.pause()
            pair = [
                eng.submit([9], acb.SamplingParams(max_new_tokens=4, n=3, temperature=1.0, seed=6)),
                eng.submit([11], acb.SamplingParams(max_new_tokens=4)),
            ]
            eng.resume()
            outs += [h.result(timeout=600) for h in pair]
            if graphs:
                assert sum(eng.runner.graphs.replays.values()) > 0
        results[graphs] = [
            (
                o.generated_tokens,
                o.logprobs,
                [(s.generated_tokens, s.logprobs, s.top_logprobs) for s in o.samples or []],
            )
            for o in outs
        ]
    if DEVICE.type == "cpu":
        assert results[True] == results[False]
    else:  # a padded batch may take different GEMM kernels: logprobs agree to rounding
        for a, b in zip(results[True], results[False]):
            assert a[0] == b[0] and [s[0] for s in a[2]] == [s[0] for s in b[2]]
            if a[1]:
                torch.testing.assert_close(torch.tensor(a[1]), torch.tensor(b[1]), atol=1e-4, rtol=1e-4)
    assert len(results[True][1][2]) == 2 and all(len(s[0]) == 8 for s in results[True][1][2])


def test_graphs_refused_by_the_torch_backend(caplog):
    model = tiny_model("llama").to(DEVICE)
    cfg = acb.ContinuousBatchingConfig(num_blocks=16, attn_backend="torch", use_cuda_graph=True)
    with caplog.at_level(logging.WARNING, logger="acb"), acb.Engine(model, cfg) as eng:
        assert not eng.config.cuda_graphs and eng.runner.graphs is None
        assert len(eng.generate([5, 6, 7], acb.SamplingParams(max_new_tokens=3)).generated_tokens) == 3
    assert "use_cuda_graph is ignored" in caplog.text


def test_failed_graph_check_raises_when_graphs_were_asked_for(monkeypatch):
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "self_check", lambda self: "replay differs")
    model = tiny_model("llama").to(DEVICE)
    before = model.config._attn_implementation
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=16, attn_backend="triton", use_cuda_graph=True, max_requests_per_batch=2
    )
    with pytest.raises(RuntimeError, match="replay differs"):
        acb.Engine(model, cfg).start()
    assert model.config._attn_implementation == before


def test_self_check_catches_a_graph_whose_inputs_were_frozen_at_capture(monkeypatch):
    """The start-up check compares replay with eager on rows of different lengths and every
    split variant: it passes on the real graphs and fails on graphs that replay with the
    inputs they saw at capture (the bug class of a value baked into a graph)."""
    monkeypatch.setattr(tk, "MIN_TOKENS_PER_SPLIT", 32)  # so the sizes have a split variant
    model = tiny_model("llama").to(DEVICE)
    cfg = acb.ContinuousBatchingConfig(
        page_size=8,
        num_blocks=64,
        max_model_len=64,  # a split variant of 2 splits
        attn_backend="triton",
        use_cuda_graph=True,
        max_requests_per_batch=4,
    )
    with acb.Engine(model, cfg) as eng:
        graphs = eng.runner.graphs
        assert any(len(v) == 2 for v in graphs.variants.values())
        assert graphs.self_check() is None
        frozen = graphs.static.clone()  # what every capture saw: padding rows
        for g in graphs.graphs.values():

            def stale(replay=g.replay):
                live = graphs.static.clone()
                graphs.static.copy_(frozen)
                try:
                    return replay()
                finally:
                    graphs.static.copy_(live)

            monkeypatch.setattr(g, "replay", stale)
        problem = graphs.self_check()
    assert problem is not None and "differs from eager" in problem


def test_padded_rows_are_reset_when_the_batch_shrinks():
    from acb.runner.attention import BatchInputs
    from acb.runner.input_batch import PreparedBatch

    model = tiny_model("llama").to(DEVICE)
    cfg = acb.ContinuousBatchingConfig(
        page_size=8, num_blocks=16, attn_backend="triton", use_cuda_graph=True, max_requests_per_batch=4
    )
    with acb.Engine(model, cfg) as eng:
        runner = eng.runner
        graphs = runner.graphs

        def batch(n):  # harmless rows: nothing stored (slot -1), nothing read (length 0)
            ar = torch.arange(n, device=DEVICE)
            attn = BatchInputs(
                slot_mapping=torch.full((n,), -1, device=DEVICE),
                block_table=None,
                seq_lens=torch.zeros(n, dtype=torch.long, device=DEVICE),
                query_start_loc=torch.arange(n + 1, device=DEVICE),
                num_new=[1] * n,
                start_pos=[0] * n,
                max_seq_len=1,
            )
            return PreparedBatch(
                input_ids=(ar + 10)[None],
                position_ids=(ar + 20)[None],
                logits_indices=ar,
                attn=attn,
                rows=torch.full((n,), runner.inputs.scratch_row, device=DEVICE),
                decode_only=True,
                logits_identity=True,
            )

        with torch.inference_mode():
            assert graphs.run(batch(4)).shape[0] == 4
            assert graphs.static[0, :4].tolist() == [10, 11, 12, 13]
            assert graphs.run(batch(3)).shape[0] == 3
        assert graphs.static[:, 3].tolist() == graphs.pad[:, 0].tolist()
        assert graphs.replays[(4, 1, False)] == 2


def test_graphs_with_async_preemption_offload_prefix_cache_and_groups():
    """Rows freed and re-initialised by preemption, blocks swapped out and in, shared prefixes
    and forked samples, all through graph replays: the block table the replays gather from
    must follow every change."""
    model = tiny_model("llama").to(DEVICE)
    base = prompts_of_lengths([30], seed=71)[0]
    prompts = [base[:20], base, base[:9] + [5, 6], base[:28]] + prompts_of_lengths([17, 25, 12], seed=72)
    refs = [_reference(model, p, 14) for p in prompts]
    cfg = acb.ContinuousBatchingConfig(
        page_size=4,
        num_blocks=24,
        safety_margin=0.0,
        cpu_offload_space=0.01,
        attn_backend="triton",
        use_cuda_graph=True,
        use_async_batching=True,
        max_requests_per_batch=8,
    )
    with acb.Engine(model, cfg) as eng:
        hs = [eng.submit(p, acb.SamplingParams(max_new_tokens=14, n=2 if i == 1 else 1)) for i, p in enumerate(prompts)]
        outs = [h.result(timeout=600) for h in hs]
        assert eng.stats.preemptions > 0
        assert sum(eng.runner.graphs.replays.values()) > 0
    assert [o.generated_tokens for o in outs] == refs
    assert [s.generated_tokens for s in outs[1].samples] == [refs[1]] * 2


def test_the_graphs_self_check_stores_nothing():
    """The start-up check's synthetic step must leave the KV cache as it was: all its rows share
    block 0, and rows writing one slot at once race on a GPU (the eager forward and the replay then
    read different caches, and the check fails at large batch with nothing wrong in the graphs)."""
    model = tiny_model("llama").to(DEVICE)
    cfg = acb.ContinuousBatchingConfig(
        page_size=8, num_blocks=16, attn_backend="triton", use_cuda_graph=True, max_requests_per_batch=4
    )
    with acb.Engine(model, cfg) as eng:
        graphs = eng.runner.graphs
        assert graphs is not None
        cache = eng.runner.kv_cache
        for t in cache.k + cache.v:  # warm-up ran the check already: start from a cache it did not write
            t.fill_(0.5)
        before = [(k.clone(), v.clone()) for k, v in zip(cache.k, cache.v)]
        assert graphs.self_check() is None
        for (k0, v0), k, v in zip(before, cache.k, cache.v):
            assert torch.equal(k0, k) and torch.equal(v0, v)


@pytest.fixture(scope="module")
def lora_llama(tmp_path_factory):
    """test_lora.py's Llama fixture: two saved PEFT adapters, six prompts, PeftModel.generate's refs."""
    from tests.runner.test_lora import _setup

    return _setup("llama", tmp_path_factory)


# async with preemption only: the sync case repeated it step for step (the suite's 15-minute limit)
@pytest.mark.parametrize("async_batching", [True], ids=["async_preempted"])
def test_adapter_decode_steps_replay_graphs_and_see_slot_changes(lora_llama, monkeypatch, async_batching):
    """Decode steps with adapter rows replay the graphs' LoRA form (keys ``(b, v, True)``; the
    per-row slot in the static buffer, base and padded rows slot 0), also under async batching
    with preemption: each row of a mixed batch (two adapters and the base model) gets
    PeftModel.generate's greedy tokens, and no adapter decode step runs eagerly. Then (async) an
    adapter updated in place, one removed and another added in its slot: the replays read the new
    buffers."""
    import copy

    from acb.runner.kinds import LoraHooks
    from tests.runner.test_lora import MAX_NEW, TARGETS, _generate, _peft

    s = lora_llama
    model = s.base if DEVICE.type == "cpu" else copy.deepcopy(s.base).to(DEVICE)
    eager: list[tuple[bool, bool]] = []  # (decode-only, adapter rows) of each step run eagerly
    original = LoraHooks.step

    def step(self, sched, batch):
        eager.append((batch.decode_only, batch.lora is not None))
        return original(self, sched, batch)

    monkeypatch.setattr(LoraHooks, "step", step)
    cfg = acb.ContinuousBatchingConfig(
        page_size=4,
        num_blocks=14 if async_batching else 64,  # (async) the six requests need 31 blocks at once: preemption
        safety_margin=0.0,
        max_model_len=64,
        max_loras=2,
        attn_backend="triton",
        use_cuda_graph=True,
        use_async_batching=async_batching,
        max_requests_per_batch=6,
    )

    if async_batching:  # the second batch's adapters (made, with their refs, before the engine takes the model)
        c = _peft(s.base, TARGETS["llama"][1], 3)  # b's modules, new weights
        loras = ["a2", "b", None, "b", "a2", None]
        models = {"a2": s.peft["b"], "b": c, None: s.base}
        want = [_generate(models[lo], p) for lo, p in zip(loras, s.prompts)]
        assert want != s.refs

    def replays(graphs, lora: bool) -> int:
        return sum(n for (_, _, lo), n in graphs.replays.items() if lo == lora)

    with acb.Engine(model, cfg) as eng:
        for name, folder in s.folders.items():
            eng.add_lora(name, str(folder))
        graphs = eng.runner.graphs
        assert graphs is not None and {lora for *_, lora in graphs.graphs} == {False, True}

        def run(loras):
            res = eng.generate_batch(s.prompts, max_new_tokens=MAX_NEW, ignore_eos=True, lora=loras, progress_bar=False)
            return [o.generated_tokens for o in res.values()]

        assert run(s.loras) == s.refs
        first = replays(graphs, True)
        assert first > 0, graphs.replays
        assert (True, True) not in eager, "an adapter decode step ran eagerly"
        if not async_batching:  # a step without adapter rows replays the base graphs
            base = replays(graphs, False)
            assert eng.generate(s.prompts[0], max_new_tokens=3).generated_tokens == s.refs[0][:3]
            assert replays(graphs, False) > base and replays(graphs, True) == first
            return
        assert eng.stats.preemptions > 0

        # the adapter in a slot changes between replays: updated in place, removed, another added
        slot_a = {i.name: i.slot for i in eng.list_loras()}["a"]
        eng.update_lora("b", c)
        eng.remove_lora("a")
        assert eng.add_lora("a2", str(s.folders["b"])).slot == slot_a
        assert run(loras) == want
        assert replays(graphs, True) > first
        assert (True, True) not in eager
