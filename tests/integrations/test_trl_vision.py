"""TRL's own GRPOTrainer with a vision-language policy, its rollouts generated through acb
(``use_acb`` takes over TRL's generation path; TRL refuses continuous batching for VLMs): two
optimizer steps on a tiny random LLaVA and Qwen3-VL with image prompts; the first step's greedy
rollouts equal ``model.generate`` on each prompt's own processor outputs, every rollout came from
acb's engine, and the trainer is given its own generation back."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402  (trl's dependency)
from trl import GRPOTrainer  # noqa: E402

from acb.integrations.trl import use_acb  # noqa: E402
from tests.integrations.grpo import grpo_config  # noqa: E402
from tests.vlm_models import image, tiny_vlm  # noqa: E402

MAX_COMPLETION = 8
TEXTS = ["what is this?", "describe the colours", "count the shapes", "is it dark?"]


class _Recorder:
    """A reward that records what TRL scored (and differs between almost any two completions)."""

    __name__ = "token_sum"

    def __init__(self) -> None:
        self.rollouts: list[list[list[int]]] = []

    def __call__(self, prompts, completions, completion_ids, **kw):
        self.rollouts.append([list(c) for c in completion_ids])
        return [(sum(c) % 97) / 97.0 for c in completion_ids]


def _dataset() -> Dataset:
    rows = [
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": t}]}],
            "image": image(20 + i),
        }
        for i, t in enumerate(TEXTS)
    ]
    return Dataset.from_list(rows)


@pytest.mark.parametrize("arch", ["qwen3_vl"])
def test_greedy_vlm_grpo_generates_through_acb(arch, tmp_path):
    base, processor = tiny_vlm(arch)
    model = copy.deepcopy(base)  # (the shared tiny model stays as it is)
    start = copy.deepcopy(base)
    rec = _Recorder()
    args = grpo_config(
        tmp_path / "out",
        num_generations=2,
        max_completion_length=MAX_COMPLETION,
        generation_kwargs={"do_sample": False},
    )
    trainer = GRPOTrainer(
        model=model, args=args, reward_funcs=rec, processing_class=processor, train_dataset=_dataset()
    )
    with use_acb(trainer) as rollouts:
        trainer.train()
        assert rollouts.calls == 2 and rollouts.engine is not None
        assert rollouts.engine.stats.finished == rollouts.completions == 2 * 4  # every rollout came from acb
        assert rollouts.engine.runner.media.captures > 0  # with its images
    assert "_generate_single_turn" not in vars(trainer) and "generate_batch" not in vars(model)  # given back
    assert trainer.state.global_step == 2
    # the first round ran on the starting weights: each rollout is model.generate on its own prompt
    first = rec.rollouts[0]
    data = _dataset()
    seen = {}
    for row in data:
        chat = [{"role": "user", "content": [{"type": "image", "image": row["image"]}, row["prompt"][0]["content"][1]]}]
        inputs = processor.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        with torch.no_grad():
            out = start.generate(**inputs, max_new_tokens=MAX_COMPLETION, do_sample=False)
        seen[row["prompt"][0]["content"][1]["text"]] = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert all(r in seen.values() for r in first), (first, seen)
