"""oneDNN-packed linear weights on CPU (``cpu_packed_linears``, on by default there).

The engine's forward runs its float32 ``nn.Linear`` layers on packed copies of their weights
(by default for models of at least 250k linear parameters per layer, on steps of at most 128
tokens; the tiny models here turn it on explicitly).
These tests check that the copies are used, that they follow every kind of weight change (an
in-place update, a replaced ``.data``, a fused optimizer step, and a ``.data`` write followed by
``reset_prefix_cache()``), that the tokens stay those of ``model.generate`` with async batching
on (also with preemption and offload), that nothing leaks into the user's own forward, and
that sleep frees them.
"""

from __future__ import annotations

import copy as copy_module
import threading

import pytest
import torch

import acb
from acb.models import tiny_model
from acb.runner.cpu_linear import (
    _TLS,
    MAX_STEP_TOKENS,
    MIN_LAYER_PARAMS,
    MIN_STEP_TOKENS,
    PackedLinears,
    linear_params_per_layer,
)
from tests.conftest import prompts_of_lengths, reference_generate

CFG = dict(page_size=8, num_blocks=96)
ON = dict(CFG, cpu_packed_linears=True)


def _linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def _active(ctx) -> bool:
    """Whether the context routes this thread's packed linears to oneDNN."""
    with ctx:
        return getattr(_TLS, "table", None) is not None


def test_the_route_sends_calls_on_packed_weights_to_onednn_on_this_thread_only():
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(32, 48)
    other = torch.nn.Linear(32, 8, bias=False)
    model = torch.nn.Sequential(lin, other)
    packed = PackedLinears(model, lambda: 0)
    packed.refresh()
    assert len(packed) == 2 and packed.packs == 1 and packed.nbytes == (32 * 48 + 32 * 8) * 4
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, *a):
            calls.append(a[1])
            return real(*a)

    x = torch.randn(3, 5, 32, generator=g)
    with torch.no_grad():
        want = [torch.nn.functional.linear(x, lin.weight, lin.bias), torch.nn.functional.linear(x, other.weight)]
        orig = torch.ops.mkldnn._linear_pointwise
        try:
            torch.ops.mkldnn._linear_pointwise = Spy()  # type: ignore[attr-defined]
            outside = lin(x)  # not in a step: the class's own forward
            with packed.active(MIN_STEP_TOKENS):
                got = [lin(x), other(x)]
                plain = torch.nn.functional.linear(x, lin.weight, lin.bias)  # a direct call: the usual path
                wide = lin.to(torch.float64)(x.double())  # a float64 call falls through too
                elsewhere = []
                t = threading.Thread(target=lambda: elsewhere.append(other(x)))  # another thread: its own forward
                t.start()
                t.join()
            copy = copy_module.deepcopy(model)  # the copy's route is bound to the copy
            with torch.no_grad():
                copy[1].weight.mul_(2)
            with packed.active(MIN_STEP_TOKENS):
                doubled = copy[1](x)  # not among the packed weights: its own forward, its own weight
        finally:
            torch.ops.mkldnn._linear_pointwise = orig  # type: ignore[attr-defined]
    assert len(calls) == 2 and all(c.is_mkldnn for c in calls)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outside, want[0], atol=0, rtol=0)
    torch.testing.assert_close(elsewhere[0], want[1], atol=0, rtol=0)
    torch.testing.assert_close(doubled, 2 * want[1], atol=1e-5, rtol=1e-5)
    assert plain.shape == (3, 5, 48) and wide.dtype == torch.float64
    packed.remove()
    assert "forward" not in vars(lin) and "forward" not in vars(other) and packed.nbytes == 0


def test_two_engines_on_one_model_share_the_route():
    lin = torch.nn.Linear(8, 8)
    a, b = PackedLinears(lin, lambda: 0), PackedLinears(lin, lambda: 0)
    a.refresh()
    b.refresh()
    a.remove()
    assert "forward" in vars(lin)  # b still routes it
    with torch.no_grad(), b.active(MIN_STEP_TOKENS):
        x = torch.randn(4, 8)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    b.remove()
    assert "forward" not in vars(lin)


def test_on_by_default_for_models_large_enough_and_for_small_steps_only():
    big = tiny_model(
        "llama",
        seed=3,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=256,
    )
    assert linear_params_per_layer(big) >= MIN_LAYER_PARAMS
    with acb.Engine(big, acb.ContinuousBatchingConfig(**CFG)) as eng:
        packed = eng.core.runner.packed
        assert packed is not None and eng.core.runner.cfg.packed_linears == len(_linears(big))
        assert _active(packed.active(MAX_STEP_TOKENS))
        assert not _active(packed.active(MAX_STEP_TOKENS + 1))  # prefill chunks: MKL
        assert _active(packed.active(MIN_STEP_TOKENS))
        assert not _active(packed.active(1))  # one request decoding: MKL's GEMV
        assert all("forward" in vars(m) for m in _linears(big))
    assert all("forward" not in vars(m) for m in _linears(big))  # closed: the model's own forwards back
    small = tiny_model("llama", seed=3)
    assert linear_params_per_layer(small) < MIN_LAYER_PARAMS
    with acb.Engine(small, acb.ContinuousBatchingConfig(**CFG)) as eng:
        assert eng.core.runner.packed is None


def test_generate_parity_with_async_batching_and_steps_on_both_sides_of_the_limit():
    model = tiny_model("qwen3", seed=3)
    prompts = prompts_of_lengths([5, 17, 30, 9, 150], seed=60)  # the 150-token prefill step runs unpacked
    cfg = acb.ContinuousBatchingConfig(**CFG, use_async_batching=True, cpu_packed_linears=True)
    with acb.Engine(model, cfg) as eng:
        runner = eng.core.runner
        assert runner.packed is not None and runner.cfg.packed_linears == len(_linears(model)) > 0
        handles = [eng.submit(p, acb.SamplingParams(max_new_tokens=12)) for p in prompts]
        outs = [h.result() for h in handles]
        assert runner.packed.packs == 1  # packed once, at start
    assert [o.generated_tokens for o in outs] == [reference_generate(model, p, 12) for p in prompts]


def test_off_when_asked_or_when_it_does_not_apply(caplog):
    model = tiny_model("llama", seed=3)
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG, cpu_packed_linears=False)) as eng:
        assert eng.core.runner.packed is None and eng.core.runner.cfg.packed_linears == 0
    bf16 = tiny_model("llama", seed=3, dtype=torch.bfloat16)
    with (
        caplog.at_level("WARNING"),
        acb.Engine(bf16, acb.ContinuousBatchingConfig(**CFG, cpu_packed_linears=True)) as eng,
    ):
        assert eng.core.runner.packed is None
    assert "cpu_packed_linears is ignored: the model has no plain float32 nn.Linear" in caplog.text


def _perturbed(model, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) * 0.2 for n, p in model.named_parameters() if p.dim() == 2}


def test_the_copies_follow_every_kind_of_weight_change():
    """Each change below alters the greedy tokens; each time the engine's equal model.generate's
    on the new weights, so the packed copies were made again."""
    model = tiny_model("llama", seed=11)
    prompt = prompts_of_lengths([20], seed=61)[0]
    params = dict(model.named_parameters())
    sp = acb.SamplingParams(max_new_tokens=10)
    seen = []
    with acb.Engine(model, acb.ContinuousBatchingConfig(**ON, allow_block_sharing=False)) as eng:
        packed = eng.core.runner.packed

        def check(what):
            out = eng.generate(prompt, sp).generated_tokens
            assert out == reference_generate(model, prompt, 10), what
            seen.append(out)

        check("start")
        with torch.no_grad():  # in place: the version counters move
            for n, d in _perturbed(model, 1).items():
                params[n].add_(d)
        check("in place")
        for n, d in _perturbed(model, 2).items():  # a new .data: the storages move
            params[n].data = params[n].data + d
        check("replaced .data")
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)  # invisible to version counters
        model(torch.tensor([prompt]), labels=torch.tensor([prompt])).loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        check("fused optimizer step")
        before = packed.packs
        for n, d in _perturbed(model, 3).items():  # through .data in place: unseen until told
            params[n].data.add_(d)
        eng.reset_prefix_cache()
        check("reset_prefix_cache after a .data write")
        assert packed.packs == before + 1
    assert len({tuple(s) for s in seen}) == len(seen)  # every change changed the tokens


def test_the_users_forward_on_another_thread_is_untouched():
    model = tiny_model("llama", seed=12)
    ids = torch.tensor(prompts_of_lengths([16], seed=62))
    with torch.no_grad():
        alone = model(ids).logits
    with acb.Engine(model, acb.ContinuousBatchingConfig(**ON)) as eng:
        assert eng.core.runner.packed is not None
        handles = [
            eng.submit(p, acb.SamplingParams(max_new_tokens=40, ignore_eos=True))
            for p in prompts_of_lengths([8] * 6, seed=63)
        ]
        # the engine thread is inside its packed forwards meanwhile; this thread's forward and
        # backward see no packed table and take the model's own linears
        assert getattr(_TLS, "table", None) is None
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        model.eval()
        assert all(p.grad is not None for p in model.parameters() if p.dim() == 2)
        with torch.no_grad():
            during = model(ids).logits
        for h in handles:
            h.result()
    torch.testing.assert_close(during, alone, atol=0, rtol=0)


def test_sleep_frees_the_copies_and_wake_up_packs_again():
    model = tiny_model("llama", seed=13)
    prompt = prompts_of_lengths([12], seed=64)[0]
    with acb.Engine(model, acb.ContinuousBatchingConfig(**ON)) as eng:
        packed = eng.core.runner.packed
        nbytes = packed.nbytes
        assert nbytes == sum(m.weight.numel() * 4 for m in _linears(model)) > 0
        released = eng.sleep()
        assert released.other >= nbytes and packed.nbytes == 0
        eng.wake_up()
        out = eng.generate(prompt, acb.SamplingParams(max_new_tokens=8))
        assert packed.nbytes == nbytes and packed.packs == 2
    assert out.generated_tokens == reference_generate(model, prompt, 8)


@pytest.mark.parametrize("level", [1])
def test_a_compiled_forward_is_left_to_inductor(level, caplog):
    model = tiny_model("llama", seed=3)
    cfg = acb.ContinuousBatchingConfig(**CFG, default_compile_level=level, cpu_packed_linears=True)
    with caplog.at_level("WARNING"), acb.Engine(model, cfg) as eng:
        assert eng.core.runner.packed is None
    assert "the forward is compiled" in caplog.text


@pytest.mark.parametrize("offload", [False, True])
def test_packed_and_chunked_under_async_batching_preemption_and_offload(offload, monkeypatch):
    """Packed linears with the torch backend attending one decode row per chunk, async batching
    on and a KV cache too small for the batch (requests preempted: recomputed, or offloaded):
    every request still equals model.generate, and no KV block leaks (tests/conftest.py)."""
    from acb.runner.attention import torch_backend

    monkeypatch.setattr(torch_backend, "CHUNK_BYTES", 1)
    model = tiny_model("qwen2", seed=14)
    prompts = prompts_of_lengths([20, 31, 12, 25, 9, 17, 28, 14], seed=65)
    cfg = acb.ContinuousBatchingConfig(
        page_size=4,
        num_blocks=17,
        safety_margin=0.0,
        use_async_batching=True,
        cpu_packed_linears=True,
        cpu_offload_space=0.01 if offload else 0.0,
    )
    with acb.Engine(model, cfg) as eng:
        assert eng.core.runner.packed is not None
        handles = [eng.submit(p, acb.SamplingParams(max_new_tokens=16)) for p in prompts]
        outs = [h.result(timeout=120) for h in handles]
        stats = eng.stats
    assert stats.preemptions > 0 and (stats.swapped_out_blocks > 0) == offload
    assert [o.generated_tokens for o in outs] == [reference_generate(model, p, 16) for p in prompts]
