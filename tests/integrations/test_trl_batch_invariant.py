"""``use_acb(trainer, ContinuousBatchingConfig(batch_invariant=True))``: TRL's GRPO trainer computes
its per-token logprobs with the engine's fixed-order ops (acb.integrations.trl.match_sampler), so
after training steps (gradient checkpointing on, as TRL sets it) the logprobs the engine's sampler
returns for a completion equal the trainer's own for it, bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import acb  # noqa: E402
from tests.integrations.test_trl import _model, _Recorder, _trainer  # noqa: E402


def test_use_acb_in_the_mode_gives_the_trainer_the_samplers_logprobs(tmp_path):
    from acb.integrations.trl import use_acb

    model, tok = _model()
    trainer = _trainer(model, tok, _Recorder(), greedy=False, tmp_path=tmp_path)
    config = acb.ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=256, batch_invariant=True)
    with use_acb(trainer, config) as rollouts:
        assert rollouts.matched is not None
        trainer.train()
        assert trainer.state.global_step == 2
        engine = rollouts.engine
        assert engine is not None and engine.config.batch_invariant
        sp = acb.SamplingParams(
            max_new_tokens=12, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, seed=3, logprobs=0, ignore_eos=True
        )
        prompts = [tok(f"question {i}: what is {i} plus {2 * i}?")["input_ids"] for i in range(3)]
        if engine.is_sleeping:
            engine.wake_up()
        outs = [engine.generate(p, sp) for p in prompts]
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p + o.generated_tokens])
            with torch.no_grad():
                got = trainer._get_per_token_logps_and_entropies(
                    trainer.model, ids, torch.ones_like(ids), len(o.generated_tokens)
                )[0][0]
            assert torch.equal(got.double(), torch.tensor(o.logprobs, dtype=torch.float64))
    assert "_get_per_token_logps_and_entropies" not in vars(trainer)  # closed: TRL's own back
    assert model.config._attn_implementation == "sdpa"
