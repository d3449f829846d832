"""TRL's own GRPOTrainer generating its rollouts through acb (``use_acb``): two optimizer steps
on a tiny random model, rollouts counted by acb's engine, greedy rollouts equal to transformers'
continuous batching on the same weights, and the model given back as it was."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402  (trl's dependency)
from transformers import GenerationConfig, TrainerCallback  # noqa: E402
from transformers.generation import ContinuousBatchingConfig  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import acb  # noqa: E402
from acb.integrations.trl import AcbRollouts, use_acb  # noqa: E402
from acb.models import build_tokenizer, tiny_model  # noqa: E402
from tests.integrations.grpo import grpo_config  # noqa: E402

MAX_COMPLETION = 12
TF_CB = {"num_blocks": 64, "max_batch_tokens": 256}  # transformers' default sizing costs seconds per call on CPU
PROMPTS = [f"question {i}: what is {i} plus {2 * i}?" for i in range(8)]


def _model():
    tok = build_tokenizer()
    return tiny_model("llama", seed=3, vocab_size=len(tok)), tok


def _trainer(model, tok, reward, *, greedy: bool, callbacks=(), tmp_path):
    args = grpo_config(
        tmp_path / "out",
        max_completion_length=MAX_COMPLETION,
        temperature=1.0,
        use_transformers_continuous_batching=True,
        transformers_continuous_batching_config=dict(TF_CB),
        generation_kwargs={"do_sample": False} if greedy else None,
    )
    return GRPOTrainer(
        model=model,
        args=args,
        reward_funcs=reward,
        processing_class=tok,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
        callbacks=list(callbacks),
    )


class _Recorder:
    """A reward function that records the rollouts TRL scored. Its reward (the token ids' sum,
    folded) differs between almost any two completions, so sampled groups have non-zero
    advantages and every step changes the weights."""

    __name__ = "token_sum"

    def __init__(self):
        self.rollouts: list[list[list[int]]] = []

    def __call__(self, prompts, completions, completion_ids, **kw):
        self.rollouts.append([list(c) for c in completion_ids])
        return [(sum(c) % 97) / 97.0 for c in completion_ids]


def _transformers_cb(model, prompt_ids, gc):
    out = type(model).generate_batch(
        model,
        prompt_ids,
        generation_config=gc,
        continuous_batching_config=ContinuousBatchingConfig(**TF_CB),
        progress_bar=False,
    )
    return [o.generated_tokens for o in out.values()]


def test_greedy_grpo_rollouts_equal_transformers_continuous_batching(tmp_path):
    """The same greedy GRPO run, rollouts through acb and through transformers' continuous
    batching: TRL receives the same completions at each step, and the trained weights agree."""
    runs = []
    for through_acb in (True, False):
        model, tok = _model()
        rec = _Recorder()
        trainer = _trainer(model, tok, rec, greedy=True, tmp_path=tmp_path)
        if through_acb:
            with use_acb(trainer) as rollouts:
                trainer.train()
                assert rollouts.calls == 2 and rollouts.engine is not None
                assert rollouts.engine.stats.finished == rollouts.completions == 2 * 4  # the rollouts came from acb
            assert "generate_batch" not in vars(model)  # given back
        else:
            trainer.train()
        assert trainer.state.global_step == 2
        runs.append((rec.rollouts, [p.detach().clone() for p in model.parameters()]))
    (acb_rollouts, acb_weights), (tf_rollouts, tf_weights) = runs
    assert len(acb_rollouts) == 2 and acb_rollouts == tf_rollouts
    assert all(torch.equal(a, b) for a, b in zip(acb_weights, tf_weights))


def test_sampled_grpo_keeps_one_engine_across_optimizer_steps(tmp_path):
    """A sampled GRPO run (the weights change at each step) on one persistent acb engine that
    sleeps between rounds: after each optimizer step the engine's greedy rollouts equal
    transformers' continuous batching on a copy of the stepped weights."""
    model, tok = _model()
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS[:4]]
    greedy = GenerationConfig(
        do_sample=False, max_new_tokens=MAX_COMPLETION, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    seen: list[tuple[dict, list[list[int]]]] = []

    class AfterStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            out = model.generate_batch(prompt_ids, generation_config=greedy, progress_bar=False)  # acb's
            assert isinstance(vars(model)["generate_batch"], AcbRollouts)
            seen.append(
                (
                    {k: v.detach().clone() for k, v in model.state_dict().items()},
                    [o.generated_tokens for o in out.values()],
                )
            )

    rec = _Recorder()
    trainer = _trainer(model, tok, rec, greedy=False, callbacks=[AfterStep()], tmp_path=tmp_path)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # acb's own config (a seed for the engine's sampling: the run is repeatable)
    config = acb.ContinuousBatchingConfig(**TF_CB, seed=0)
    with use_acb(trainer, config, sleep=True) as rollouts:
        trainer.train()
        engine = rollouts.engine
        assert engine is not None and engine.is_sleeping  # slept after the last round
        assert rollouts.calls == 4 and engine.stats.finished == rollouts.completions == 2 * 4 + 2 * 4
        assert engine.core.weight_resets >= 1  # the optimizer steps were noticed
    assert trainer.state.global_step == 2 and model.training  # TRL's mode, left as TRL set it
    assert len(seen) == 2
    assert any(not torch.equal(initial[k], v) for k, v in seen[0][0].items())  # step 1 trained
    assert any(not torch.equal(seen[0][0][k], v) for k, v in seen[1][0].items())  # and so did step 2
    for state, acb_tokens in seen:
        fresh, _ = _model()
        fresh.load_state_dict(state)
        fresh.eval()
        assert acb_tokens == _transformers_cb(fresh, prompt_ids, greedy)


def test_use_acb_needs_a_continuous_batching_trainer(tmp_path):
    model, tok = _model()
    args = GRPOConfig(
        output_dir=str(tmp_path / "o"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=model,
        args=args,
        reward_funcs=_Recorder(),
        processing_class=tok,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
    )
    with pytest.raises(ValueError, match="use_transformers_continuous_batching"):
        use_acb(trainer)
    with use_acb(model) as rollouts:
        with pytest.raises(RuntimeError, match="already replaced"):
            use_acb(model)
        out = model.generate_batch(
            [[5, 6, 7]], generation_config=GenerationConfig(do_sample=False, max_new_tokens=3), progress_bar=False
        )
        assert rollouts.calls == 1 and len(out["req_0"].generated_tokens) == 3
    assert "generate_batch" not in vars(model)
    # closed: a stale reference refuses to start an engine that nothing would stop
    with pytest.raises(RuntimeError, match="closed"):
        rollouts([[5, 6, 7]], generation_config=GenerationConfig(do_sample=False, max_new_tokens=3), progress_bar=False)
    assert rollouts.engine is None and rollouts.calls == 1
    with pytest.raises(RuntimeError, match="closed"):
        rollouts.install()
    assert "generate_batch" not in vars(model)
    rollouts.close()  # idempotent
    with use_acb(model) as again:  # a new one works
        assert again.closed is False


def test_grpo_structured_outputs_regex_constrains_every_rollout(tmp_path):
    """``GRPOConfig.vllm_structured_outputs_regex`` (TRL applies it on its vLLM path only): with
    use_acb every sampled rollout of the real trainer matches it."""
    import re

    pytest.importorskip("xgrammar")
    regex = r"(yes|no|maybe)![0-9]{1,2}"
    model, tok = _model()
    rec = _Recorder()
    trainer = _trainer(model, tok, rec, greedy=False, tmp_path=tmp_path)
    trainer.args.vllm_structured_outputs_regex = regex
    with use_acb(trainer, acb.ContinuousBatchingConfig(**TF_CB, seed=0)) as rollouts:
        assert rollouts.structured_outputs == acb.StructuredOutputs(regex=regex)
        trainer.train()
    texts = [tok.decode(c, skip_special_tokens=True) for step in rec.rollouts for c in step]
    assert len(texts) == 2 * 4 and all(re.fullmatch(regex, t) for t in texts), texts


def test_greedy_grpo_on_a_model_only_the_own_cache_path_runs(tmp_path):
    """GRPO on a GPT-J policy (attention outside transformers' attention interface, which
    transformers' continuous batching refuses): acb runs it on the model's own cache objects, and
    the first step's greedy rollouts are plain ``model.generate``'s on the initial weights."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_tokenizer()
    cfg = AutoConfig.for_model(
        "gptj",
        vocab_size=len(tok),
        n_embd=64,
        n_layer=2,
        n_head=4,
        rotary_dim=8,
        n_positions=256,
        n_inner=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        initializer_range=0.2,  # peaked logits: greedy parity does not hinge on near-ties
    )
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg)
    initial = copy.deepcopy(model).eval()
    seen: list[list[tuple[str, list[int]]]] = []

    def reward(prompts, completions, completion_ids, **kw):  # records which prompt each rollout answers
        seen.append([(p, list(c)) for p, c in zip(prompts, completion_ids)])
        return [(sum(c) % 97) / 97.0 for c in completion_ids]

    reward.__name__ = "token_sum"
    trainer = _trainer(model, tok, reward, greedy=True, tmp_path=tmp_path)
    with use_acb(trainer) as rollouts:
        trainer.train()
        assert rollouts.engine.runner.own_cache_runner is not None and rollouts.calls == 2
    assert trainer.state.global_step == 2 and len(seen[0]) == 4
    for prompt, got in seen[0]:
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            out = initial.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_COMPLETION,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        want = out[0, len(ids) :].tolist()
        if tok.eos_token_id in want:
            want = want[: want.index(tok.eos_token_id) + 1]
        assert got == want
