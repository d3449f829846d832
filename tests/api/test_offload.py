"""KV offload: preempted requests park their KV in host memory and resume without recompute."""

from __future__ import annotations

import acb
from tests.conftest import get_model, prompts_of_lengths, reference_generate, wait_until

PROMPTS = prompts_of_lengths([20, 31, 12, 25, 9, 17, 28, 14], seed=60)
MAX_NEW = 16


def _run(offload_gib: float, **kw):
    model = get_model("llama")
    # 16 usable blocks of 4 tokens for 8 requests of ~40 tokens: preemption is certain
    cfg = acb.ContinuousBatchingConfig(
        page_size=4, num_blocks=17, safety_margin=0.0, allow_block_sharing=False, cpu_offload_space=offload_gib, **kw
    )
    with acb.Engine(model, cfg) as eng:
        hs = [eng.submit(p, acb.SamplingParams(max_new_tokens=MAX_NEW)) for p in PROMPTS]
        outs = [h.result(timeout=120) for h in hs]
        return outs, eng.stats, eng.config


def test_offload_round_trip_no_recompute():
    model = get_model("llama")
    refs = [reference_generate(model, p, MAX_NEW) for p in PROMPTS]
    outs, st, cfg = _run(0.01)  # 10 MiB: room for every preempted request
    assert cfg.num_swap_blocks > 0
    assert [o.generated_tokens for o in outs] == refs
    assert st.preemptions > 0 and st.recomputed_preemptions == 0
    assert st.swapped_out_blocks == st.swapped_in_blocks > 0
    # every prompt token went through the model exactly once: resumed requests did not recompute
    assert st.prefill_tokens == sum(len(p) for p in PROMPTS)


def test_offload_full_falls_back_to_recompute():
    model = get_model("llama")
    refs = [reference_generate(model, p, MAX_NEW) for p in PROMPTS]
    outs, st, cfg = _run(0.0)
    assert cfg.num_swap_blocks == 0 and st.recomputed_preemptions == st.preemptions > 0
    assert [o.generated_tokens for o in outs] == refs
    assert st.prefill_tokens > sum(len(p) for p in PROMPTS)  # recomputed
    # a tiny offload space (2 blocks of 4 tokens): some preemptions offload, the rest recompute
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # K+V x layers x block x kv_heads x head_dim x fp32
    outs, st, cfg = _run(2 * block_bytes / 2**30)
    assert cfg.num_swap_blocks == 2
    assert [o.generated_tokens for o in outs] == refs


def test_cancel_while_offloaded_frees_host_blocks():
    model = get_model("llama")
    cfg = acb.ContinuousBatchingConfig(
        page_size=4, num_blocks=17, safety_margin=0.0, allow_block_sharing=False, cpu_offload_space=0.01
    )
    with acb.Engine(model, cfg) as eng:
        hs = [eng.submit(p, acb.SamplingParams(max_new_tokens=200, ignore_eos=True)) for p in PROMPTS]
        wait_until(lambda: eng.stats.swapped_out_blocks > 0, "a preempted request's blocks are offloaded")
        for h in hs:
            h.cancel()
        assert all(h.result(timeout=30).status == acb.RequestStatus.CANCELLED for h in hs)
    # the leak check (conftest) verifies the host blocks came back
