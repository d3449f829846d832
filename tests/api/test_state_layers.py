"""State-space (Mamba, Mamba2) and other linear-attention layers, recognised by the cache
interfaces they speak (``acb.runner.linear_state.STATE_INTERFACES``), exact against
``model.generate``: pure state models (Mamba, Mamba2, Falcon-Mamba: no KV cache at all), hybrids
of state and attention layers (Jamba, Bamba, Granite 4 hybrid, Nemotron-H with its MLP and MoE
layers, Falcon-H1 with attention and a state layer side by side in each layer, Zamba2 with a
shared attention block at its hybrid layers), and the other
linear-attention kinds (Kimi Linear's delta attention, OLMo hybrid's gated delta rule, Zaya's
convolutional attention projection, MiniMax's lightning attention) and short convolutions (LFM2,
LFM2-MoE, LFM3).

Each family's tiny config is the catalogue sweep's (``benchmarks/model_sweep.py``: the hand-written
ones keep every layer kind of the real checkpoints). Mamba1's scan cannot resume a prefill from a
state, so its models prefill each prompt whole (``whole_prefill``); the chunked runs check that
this holds the output exact.
"""

from __future__ import annotations

import functools

import pytest
import torch

import acb
from tests.conftest import assert_scores_match_forward, prompts_of_lengths
from tests.test_model_sweep import ms

# family -> (state layer class, whether its prompts are prefilled whole, KV cache layers)
FAMILIES = {
    "mamba": ("MambaMixer", True, 0),
    "mamba2": ("Mamba2Mixer", False, 0),
    "falcon_mamba": ("FalconMambaMixer", True, 0),
    "jamba": ("JambaMambaMixer", True, 2),
    "bamba": ("BambaMixer", False, 2),
    "granitemoehybrid": ("GraniteMoeHybridMambaLayer", False, 2),
    "nemotron_h": ("NemotronHMamba2Mixer", False, 1),
    "falcon_h1": ("FalconH1Mixer", False, 3),
    # (pages for the attention layers only: not for a shared block's own layer -1, nor for Kimi's
    # delta attention, whose q/o projections make it look like attention)
    "zamba2": ("Zamba2MambaMixer", False, 2),
    "kimi_linear": ("KimiLinearDeltaAttention", False, 1),
    "olmo_hybrid": ("OlmoHybridGatedDeltaNet", False, 1),
    # a state inside attention: Zaya's compressed convolutional q/k projection and delayed values
    # (its cache argument is past_key_values, and it returns query, key and value)
    "zaya": ("ZayaCCAProjection", False, None),
    # a recurrent state under other names (MiniMax's lightning attention: get/set_linear_cache; its
    # forward also requires rotary embeddings and a mask, and returns its state beside its output)
    "minimax": ("MiniMaxLightningAttention", False, 1),
    # a convolution state alone (LFM's short convolutions: get/update_conv_state)
    "lfm2": ("Lfm2ShortConv", False, 2),
    "lfm2_moe": ("Lfm2MoeShortConv", False, 2),
    "lfm3": ("Lfm3ShortConv", False, 2),
}
MAX_NEW = 6


@functools.cache
def model_of(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(ms.tiny_config(arch), dtype=torch.float32).eval()


@functools.cache
def reference(arch: str, prompt: tuple[int, ...], max_new: int = MAX_NEW) -> list[int]:
    """Greedy tokens of plain ``model.generate`` on one unpadded prompt, EOS not stopping it."""
    with torch.no_grad():
        out = model_of(arch).generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def prompts(lengths, seed=1, arch="mamba"):
    vocab = model_of(arch).config.get_text_config().vocab_size
    return prompts_of_lengths(lengths, vocab=min(vocab, 256), seed=seed)


def run(eng, ps, **kw):
    return eng.generate_batch(ps, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False, **kw)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_layers_are_found_by_their_interface(arch):
    """The engine drives the family's state layers (found by what they call, no list of names),
    gives its attention layers alone a KV cache, and prefills whole where the scan cannot resume."""
    cls, whole, kv_layers = FAMILIES[arch]
    with acb.Engine(model_of(arch), acb.ContinuousBatchingConfig(num_blocks=32, page_size=8)) as eng:
        runner = eng.runner
        assert runner.linear is not None and {type(m).__name__ for m in runner.linear.layers} == {cls}
        assert runner.cfg.whole_prefill is whole
        if kv_layers is not None:
            assert len(runner.kv_cache.k) == kv_layers
        # prefix caching through snapshots of the state, where every state layer resumes a prefill
        # (Mamba1, prefilled whole, resumes a hit a token at a time)
        assert runner.cfg.prefix_caching and runner.cfg.state_snapshots > 0
        assert runner.cfg.num_swap_blocks == 0


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(max_batch_tokens=8),  # chunked prefill (or, for Mamba1, whole prompts past the budget)
        # preemption with offload (the KV blocks and the row of state to host memory and back), async
        dict(num_blocks=12, page_size=4, max_batch_tokens=16, use_async_batching=True, cpu_offload_space=0.01),
    ],
    ids=["whole", "chunked", "offload-async"],
)
@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_greedy_parity(arch, cfg):
    ps = prompts([5, 17, 30, 9], arch=arch)
    config = acb.ContinuousBatchingConfig(**{"num_blocks": 64, "page_size": 8, **cfg})
    with acb.Engine(model_of(arch), config) as eng:
        got = [o.generated_tokens for o in run(eng, ps).values()]
        if "num_blocks" in cfg:
            assert eng.stats.preemptions > 0
            # resumed from host memory, not recomputed
            assert eng.stats.swapped_out_rows > 0 and eng.stats.recomputed_preemptions == 0, eng.stats
    assert got == [reference(arch, tuple(p)) for p in ps]


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_a_shared_prefix_is_reused_from_a_snapshot_of_the_state(arch):
    """A prefix of five blocks sent once (its prompt exactly the prefix), then three requests that
    extend it, in chunks of 12 tokens (so snapshots fall inside chunks, at their ends and at the
    prompt's end) under async batching: the three hit the prefix (its KV and the state layers'
    state where it ends, restored from a snapshot) and give ``model.generate``'s tokens. Mamba1's
    scan cannot resume a prefill from a state: its models prefill whole, and after a hit its layers
    take the rest of the prompt a token at a time (the other layers still take it whole)."""
    prefix = prompts([40], seed=11, arch=arch)[0]
    ps = [prefix + t for t in prompts([3, 9, 17], seed=12, arch=arch)]
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, page_size=8, max_batch_tokens=12, use_async_batching=True)
    with acb.Engine(model_of(arch), cfg) as eng:
        eng.generate(prefix, max_new_tokens=1, ignore_eos=True)
        outs = list(run(eng, ps).values())
        snaps = eng.call(lambda core: core.pool.snapshots).result(timeout=60)
    assert [o.num_cached_tokens for o in outs] == [40] * 3
    assert [o.generated_tokens for o in outs] == [reference(arch, tuple(p)) for p in ps]
    assert snaps is not None and snaps.restores == 3


@pytest.mark.parametrize("arch", ["mamba", "bamba", "nemotron_h", "minimax", "lfm3"])
def test_samples_scoring_cancel_and_sleep(arch):
    """n = 3 samples forked from the prompt's state; scoring equal to a plain forward's
    log-softmax; a request cancelled mid-prefill leaves nothing behind; sleep / wake drops the
    states and the requests recompute exactly."""
    model = model_of(arch)
    ps = prompts([23, 7], seed=2, arch=arch)
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=8)
    with acb.Engine(model, cfg) as eng:
        out = eng.generate(ps[0], max_new_tokens=MAX_NEW, ignore_eos=True, n=3)
        assert [s.generated_tokens for s in out.samples] == [reference(arch, tuple(ps[0]))] * 3
        context, conts = ps[0][:11], [ps[1][:3], ps[1][3:4]]
        assert_scores_match_forward(eng, model, context, conts)
        # cancelled while its prompt is being computed (chunks of 8; Mamba1: a whole prefill)
        long = prompts([90], seed=5, arch=arch)[0]
        h = eng.submit(long, max_new_tokens=MAX_NEW, ignore_eos=True)

        def started(core) -> bool:  # (on the engine thread, between two steps)
            return any(r.request_id == h.request_id and r.num_computed_tokens for r in core.scheduler.running)

        while not eng.call(started).result(timeout=120) and not h.done:
            pass
        h.cancel()
        assert h.result(timeout=120).status in (acb.RequestStatus.CANCELLED, acb.RequestStatus.FINISHED)
        hs = [eng.submit(p, max_new_tokens=MAX_NEW, ignore_eos=True) for p in ps]
        eng.sleep()
        assert eng.runner.states.nbytes() == 0
        eng.wake_up()
        assert [x.result(timeout=120).generated_tokens for x in hs] == [reference(arch, tuple(p)) for p in ps]


@pytest.mark.parametrize("arch", ["mamba", "qwen3_next"])
def test_two_engines_on_one_model_at_once(arch):
    """Two engines open on one model (one with prefix caching, one without) share one interception
    of its state layers (each engine steps on its own thread): both give ``model.generate``'s
    tokens, and the layers get their own ``forward`` back when the last engine closes. (A second
    interception over the first once cut each step's batch twice.)"""
    model = model_of(arch)
    ps = prompts([33, 9], seed=21, arch=arch)
    with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=64, page_size=8)) as a:
        cfg = acb.ContinuousBatchingConfig(num_blocks=64, page_size=8, allow_block_sharing=False)
        with acb.Engine(model, cfg) as b:
            got = [o.generated_tokens for o in run(a, ps).values()], [o.generated_tokens for o in run(b, ps).values()]
        again = [o.generated_tokens for o in run(a, ps).values()]  # b closed: a's interception holds
    want = [reference(arch, tuple(p)) for p in ps]
    assert got == (want, want) and again == want
    assert not any("forward" in vars(m) for m in model.modules())
