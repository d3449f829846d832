"""An engine that stays up while its model trains between rounds (RL): weights changed in place
invalidate the prefix cache (detected from the parameters' version counters), a model left in
train() mode generates without dropout, and the user's mode is given back."""

from __future__ import annotations

import pytest
import torch

import acb
from acb.models import tiny_model
from tests.conftest import prompts_of_lengths, reference_generate

CFG = dict(page_size=8, num_blocks=64)


def _model(**kw):
    return tiny_model("llama", seed=7, **kw)


def test_weights_changed_in_place_invalidate_the_prefix_cache():
    model = _model()
    prompt = prompts_of_lengths([40], seed=50)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        first = eng.generate(prompt, acb.SamplingParams(max_new_tokens=8))
        hit = eng.generate(prompt, acb.SamplingParams(max_new_tokens=8))
        assert hit.num_cached_tokens >= 32 and hit.generated_tokens == first.generated_tokens
        # an optimizer step on the live model (its weights change in place)
        model.train()
        loss = model(torch.tensor([prompt]), labels=torch.tensor([prompt])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        after = eng.generate(prompt, acb.SamplingParams(max_new_tokens=8))
        assert after.num_cached_tokens == 0  # the stale prefix was not read
        assert eng.core.weight_resets >= 1
        # load_state_dict (copy_ into the parameters) is caught too
        state = {k: v.clone() * 0.9 for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        again = eng.generate(prompt, acb.SamplingParams(max_new_tokens=8))
        assert again.num_cached_tokens == 0
    model.eval()
    assert again.generated_tokens == reference_generate(model, prompt, 8)


def test_a_model_in_train_mode_generates_without_dropout_and_keeps_its_mode():
    model = _model(attention_dropout=0.5)  # dropout that would change every forward in train mode
    prompt = prompts_of_lengths([12], seed=51)[0]
    ref = reference_generate(model.eval(), prompt, 10)
    model.train()
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG, use_async_batching=True)) as eng:
        assert model.training  # the engine leaves the model's mode alone ...
        out = eng.generate(prompt, acb.SamplingParams(max_new_tokens=10))
        model.eval()
        model.train()  # ... whatever the user sets between rounds ...
        again = eng.generate(prompt, acb.SamplingParams(max_new_tokens=10))
        assert model.training  # ... and its steps run in eval semantics all the same
    assert out.generated_tokens == again.generated_tokens == ref  # no dropout in either
    assert model.training
    model.eval()
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        eng.generate(prompt, acb.SamplingParams(max_new_tokens=2))
    assert not model.training


def test_the_users_own_forward_while_the_engine_runs_is_the_models_own():
    """A forward the user runs while an engine holds the model (a padded training batch) gets the
    model's own attention and masks: the same logits as with no engine."""
    import pytest

    for impl in ("sdpa", "eager"):
        model = tiny_model("llama", seed=8, attn_implementation=impl)
        ids = torch.tensor(prompts_of_lengths([10, 10], seed=52))
        mask = torch.ones_like(ids)
        mask[1, :4] = 0  # left padding in the second row
        with torch.no_grad():
            alone = model(ids, attention_mask=mask).logits
        with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
            eng.generate([5, 6, 7], acb.SamplingParams(max_new_tokens=2))
            with torch.no_grad():
                during = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(during, alone, atol=1e-5, rtol=0, msg=impl)
        assert model.config._attn_implementation == impl
    with pytest.raises(RuntimeError, match="only on a model an acb engine uses"):
        from acb.runner.attention import _own_name

        _own_name(object())


def test_a_fused_optimizer_step_is_noticed():
    """Fused AdamW (transformers' Trainer default) writes the parameters without bumping their
    version counters: the engine counts optimizer steps on its model's parameters instead."""
    model = _model()
    prompt = prompts_of_lengths([40], seed=53)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        eng.generate(prompt, acb.SamplingParams(max_new_tokens=4))
        versions = [p._version for p in model.parameters()]
        model(torch.tensor([prompt]), labels=torch.tensor([prompt])).loss.backward()
        opt.step()
        assert [p._version for p in model.parameters()] == versions  # invisible to version counters
        other = torch.optim.SGD(tiny_model("llama", seed=9).parameters(), lr=0.1)
        other.step()  # another model's optimizer: not this engine's business
        after = eng.generate(prompt, acb.SamplingParams(max_new_tokens=8))
        assert after.num_cached_tokens == 0 and eng.core.weight_resets == 1
    model.eval()
    assert after.generated_tokens == reference_generate(model, prompt, 8)


def test_processed_logprobs_of_every_sample_are_what_a_trainer_recomputes():
    """GRPO's importance ratio compares the sampler's logprob of each token with the trainer's
    recomputation, ``log_softmax(logits / temperature)`` on the same weights: with
    ``logprobs_mode="processed"`` (and no truncation) they agree for every sample of ``n``;
    ``"raw"`` is the same without the temperature."""
    model = tiny_model("llama", seed=12)
    prompt = prompts_of_lengths([11], seed=54)[0]
    temp = 0.7
    for mode, scale in (("processed", temp), ("raw", 1.0)):
        sp = acb.SamplingParams(
            max_new_tokens=10,
            n=4,
            do_sample=True,
            temperature=temp,
            top_k=0,
            top_p=1.0,
            logprobs=0,
            logprobs_mode=mode,
            seed=5,
            ignore_eos=True,
        )
        with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG, use_async_batching=True)) as eng:
            out = eng.generate(prompt, sp)
        assert out.samples is not None and len({tuple(s.generated_tokens) for s in out.samples}) > 1
        for s in out.samples:
            ids = torch.tensor([prompt + s.generated_tokens])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1]
            trainer = (logits / scale).log_softmax(-1).gather(-1, torch.tensor(s.generated_tokens)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(s.logprobs), trainer, atol=1e-5, rtol=1e-5)


def _perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("async_batching", [True, False])
def test_a_step_in_flight_across_a_weight_change_does_not_fill_the_prefix_cache(async_batching):
    """The weights change while a step that prefills a prompt is in flight (async batching
    registers its blocks only after the next step was launched, and the next launch is where the
    change is seen): those blocks hold K/V of the old weights and must not be found by a later
    request with the same prefix. Issue 26 item 2: with async batching the later request read 32
    stale tokens and its greedy output differed from ``model.generate``."""
    model = _model()
    prompt = prompts_of_lengths([40], seed=56)[0]
    cfg = acb.ContinuousBatchingConfig(**CFG, max_requests_per_batch=1, use_async_batching=async_batching)
    with acb.Engine(model, cfg) as eng:
        runner = eng.runner
        original = runner.execute
        calls = []

        def execute(sched):
            handle = original(sched)
            calls.append(sched.num_tokens)
            if len(calls) == 1:  # the prefill of the first request has run: the trainer steps now
                _perturb(model, 3)
            return handle

        runner.execute = execute
        try:
            # one row: the second request waits while the first decodes, so the engine looks at
            # the weights again at the next launch (it does so when requests are waiting)
            first, second = eng.generate_batch(
                [prompt, prompt], acb.SamplingParams(max_new_tokens=6), progress_bar=False
            ).values()
        finally:
            runner.execute = original
        assert eng.core.weight_resets == 1
        assert second.num_cached_tokens == 0, "the later request read K/V computed with the old weights"
        third = eng.generate(prompt, acb.SamplingParams(max_new_tokens=6))
        assert third.num_cached_tokens >= 32  # the new weights' prefix is cached and found again
    model.eval()
    want = reference_generate(model, prompt, 6)
    assert second.generated_tokens == want and third.generated_tokens == want


@pytest.mark.parametrize("async_batching", [True, False])
def test_training_on_another_thread_while_the_engine_generates(async_batching):
    """An RL trainer training the engine's model on its own thread at the same time (dropout 0.5
    in train mode): the engine's steps run without dropout and the trainer's forwards with it,
    every one of them, and ``model.training`` stays what the trainer set. Issue 26 item 7: engine
    steps flipped the shared flag; 12/12 greedy outputs were wrong and 23% of the user's dropout
    calls ran in eval mode."""
    import threading

    model = tiny_model("phi3", seed=11, resid_pdrop=0.5, attention_dropout=0.5)
    prompts = prompts_of_lengths([9, 13, 17, 11, 8, 15, 12, 10, 14, 16, 7, 9], seed=57)
    refs = [reference_generate(model.eval(), p, 8) for p in prompts]
    drop = next(m for m in model.modules() if isinstance(m, torch.nn.Dropout))
    seen = {"engine": [0, 0], "user": [0, 0]}  # [calls, calls that changed their input]
    engine_thread: list[threading.Thread] = []

    def hook(module, args, out):
        who = "engine" if engine_thread and threading.current_thread() is engine_thread[0] else "user"
        seen[who][0] += 1
        seen[who][1] += int(not torch.equal(args[0], out))

    handle = drop.register_forward_hook(hook)
    model.train()
    stop = threading.Event()
    flags: list[bool] = []

    def trainer():
        ids = torch.tensor([prompts[0]])
        while not stop.is_set():
            with torch.no_grad():
                model(ids)
            flags.append(model.training)

    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG, use_async_batching=async_batching)) as eng:
        engine_thread.append(eng.core.thread)
        t = threading.Thread(target=trainer)
        t.start()
        try:
            outs = eng.generate_batch(prompts, acb.SamplingParams(max_new_tokens=8), progress_bar=False)
        finally:
            stop.set()
            t.join()
    handle.remove()
    assert [o.generated_tokens for o in outs.values()] == refs
    assert seen["engine"][0] > 0 and seen["engine"][1] == 0  # no dropout in any engine step
    assert seen["user"][0] > 0 and seen["user"][1] == seen["user"][0]  # dropout in every user forward
    assert flags and all(flags) and model.training


def _replace_by_load_state_dict(model):
    state = {k: v.clone() * 0.9 for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # new Parameter objects, not a copy into the old ones


def _replace_a_parameter(model):
    proj = model.model.layers[0].mlp.down_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach() * -1.5)


def _replace_a_module(model):
    old = model.model.layers[1].self_attn.o_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(old.weight.flip(0))
    model.model.layers[1].self_attn.o_proj = new


def _add_a_parameter(model):
    proj = model.model.layers[0].self_attn.o_proj  # (no bias: attention_bias is off)
    assert proj.bias is None
    proj.bias = torch.nn.Parameter(torch.full((proj.out_features,), 0.5))


def _replace_a_buffer(model):
    rotary = model.model.rotary_emb
    rotary.inv_freq = rotary.inv_freq * 0.25  # a tensor assigned to a registered buffer's name


def _swap_parameters_dict_entry(model):
    # a write into the module's dict that no registration hook sees
    mlp = model.model.layers[1].mlp
    mlp.up_proj._parameters["weight"] = torch.nn.Parameter(mlp.up_proj.weight.detach().roll(1, 0))


def _delete_a_parameter(model):
    proj = model.model.layers[0].mlp.gate_proj
    w = proj.weight.detach() * 2
    del proj.weight
    proj.weight = torch.nn.Parameter(w)  # (deleted, then registered again: another object)


@pytest.mark.parametrize(
    "change",
    [
        _replace_by_load_state_dict,
        _replace_a_parameter,
        _replace_a_module,
        _add_a_parameter,
        _replace_a_buffer,
        _swap_parameters_dict_entry,
        _delete_a_parameter,
    ],
)
@pytest.mark.parametrize("async_batching,packed", [(False, False), (True, True)])
def test_weights_replaced_by_new_objects_invalidate_the_prefix_cache(change, async_batching, packed):
    """Weights replaced by assignment (new Parameter objects: ``load_state_dict(assign=True)``,
    ``module.weight = nn.Parameter(...)``, a new submodule, an added bias, a buffer, the module's
    own dict) are seen like in-place updates: no stale prefix is read, generation and scoring use
    the new weights. A cache of 16 blocks of 4 for two 30-token prompts (preemption), and the
    oneDNN-packed linears (repacked from the new weights) with async batching."""
    model = _model()
    prompts = prompts_of_lengths([30, 26], seed=55)
    cfg = acb.ContinuousBatchingConfig(
        page_size=4, num_blocks=16, use_async_batching=async_batching, cpu_packed_linears=packed
    )
    with acb.Engine(model, cfg) as eng:
        eng.generate_batch(prompts, max_new_tokens=6, progress_bar=False)
        hit = eng.generate(prompts[0], max_new_tokens=2)
        assert hit.num_cached_tokens > 0 and eng.core.weight_resets == 0  # (the engine's own steps change nothing)
        with torch.no_grad():
            change(model)
        outs = eng.generate_batch(prompts, max_new_tokens=6, progress_bar=False)
        score = eng.score(prompts[1], [[5, 6, 7], [9]])
        if packed:
            assert eng.runner.packed is not None and len(eng.runner.packed) > 0
        assert outs["req_0"].num_cached_tokens == 0 and eng.core.weight_resets == 1  # the stale prefix was not read
    model.eval()
    assert [o.generated_tokens for o in outs.values()] == [reference_generate(model, p, 6) for p in prompts]
    from tests.api.test_scoring import check

    check(model, score, prompts[1], [[5, 6, 7], [9]])
