"""A GRPO-style RL loop on one acb engine that stays up while the model trains between rounds.

Each round samples `n` completions per prompt with the sampler's own logprobs
(`logprobs_mode="processed"`: the distribution each token was drawn from), scores them with a toy
reward (completions rich in vowels win), recomputes the policy's logprobs the way a trainer does
(`log_softmax(logits / temperature)`) and compares them with the sampler's (the importance ratio
starts at 1), then takes an optimizer step on the model in place. Between rounds the engine
sleeps (its KV cache freed for the backward pass) and wakes up; the optimizer step is noticed
and no stale prefix-cache entry is read: each round, a fresh engine on a copy of the weights
samples the same tokens with the same logprobs, bit for bit.

The sampler's and the trainer's logprobs are the same bits: the engine runs in the batch-invariant
mode (`batch_invariant=True`: every linear and attention sum in a fixed order, whatever else is in
the step), and the trainer's forward runs under `acb.runner.batch_invariant.enabled(model)`, the
same ops over the whole sequence (its backward through ordinary torch ops). So the importance ratio
is exactly 1 at the first step of a round, and the example checks it. (Without the mode the two
differ in the last bits, up to about 1e-4 in a logprob here: the engine computes each token in a
decode step beside other rows, the trainer the whole sequence in one forward, and float32 sums in
another order end in other last bits.) Two engines on the same weights compute the same bits:
the prompts of a round are submitted while the engine is paused, and sampling is seeded.

    python examples/grpo_loop.py --model ./my-checkpoint --rounds 3

Without --model it runs acb's embedded random-weight model (the reward then moves little).
"""

from __future__ import annotations

import argparse
import copy

import torch

import acb
from acb.models import build_tokenizer, default_model
from acb.runner.batch_invariant import enabled, token_logprobs

PROMPTS = ["Write a word:", "Say something:", "Name a colour:", "Count to three:"]


def reward(text: str) -> float:
    return sum(ch in "aeiou" for ch in text) / max(1, len(text))


def sample(engine: acb.Engine, prompt_ids: list[list[int]], sampling: acb.SamplingParams) -> list[acb.GenerationOutput]:
    """One round's samples, the prompts submitted while the engine is paused: they enter its first
    step together, so its batches are the same on every run and in every engine."""
    engine.pause()
    handles = [engine.submit(p, sampling) for p in prompt_ids]
    engine.resume()
    return [h.result() for h in handles]


def main(model_path: str | None, rounds: int, n: int, max_new_tokens: int) -> None:
    if model_path:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    else:
        model, tokenizer = default_model(), build_tokenizer()
    temperature = 0.9
    # top_k=0, top_p=1: no truncation, so "processed" logprobs are exactly log_softmax(logits / T)
    sampling = acb.SamplingParams(
        seed=0,  # with the same weights and batches, the same samples (a fresh engine checks each round)
        n=n,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        logprobs=0,
        logprobs_mode="processed",
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    # the batch-invariant mode: the sampler's logprobs are the trainer's forward's, bit for bit
    config = acb.ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=512, batch_invariant=True)
    with acb.Engine(model, config, tokenizer=tokenizer) as engine:
        for rnd in range(1, rounds + 1):
            outputs = sample(engine, prompt_ids, sampling)
            with acb.Engine(copy.deepcopy(model), config, tokenizer=tokenizer) as fresh:
                again = sample(fresh, prompt_ids, sampling)
            same = [(s.generated_tokens, s.logprobs) for o in outputs for s in o.samples or []] == [
                (s.generated_tokens, s.logprobs) for o in again for s in o.samples or []
            ]
            model.train()
            losses, worst = [], 0.0
            for prompt, out in zip(prompt_ids, outputs):
                samples = out.samples or []
                rewards = torch.tensor([reward(tokenizer.decode(s.generated_tokens)) for s in samples])
                advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
                for s, adv in zip(samples, advantages):
                    ids = torch.tensor([prompt + s.generated_tokens])
                    with enabled(model):  # the engine's fixed-order ops, forward and backward
                        logits = model(ids).logits[0, len(prompt) - 1 : -1]
                    new_lp = token_logprobs(logits, s.generated_tokens, temperature)  # log_softmax(logits / T)
                    old_lp = torch.tensor(s.logprobs)  # the sampler's, for the same weights
                    worst = max(worst, (new_lp.detach() - old_lp).abs().max().item())
                    ratio = (new_lp - old_lp).exp()  # 1 at the first step of a round
                    losses.append(-(ratio * adv).mean())
            mean_reward = sum(
                reward(tokenizer.decode(s.generated_tokens)) for o in outputs for s in (o.samples or [])
            ) / (len(prompt_ids) * n)
            freed = engine.sleep()  # the backward pass gets the KV cache's memory
            torch.stack(losses).mean().backward()
            optimizer.step()  # weights change in place; the engine notices before the next round
            optimizer.zero_grad()
            model.eval()
            engine.wake_up()
            print(
                f"round {rnd}: {len(prompt_ids)} prompts x {n} samples, mean reward {mean_reward:.3f}, "
                f"max |sampler - trainer logprob| {worst:.2e}, a fresh engine samples the same: {same}, "
                f"slept freeing {freed.total / 2**20:.1f} MiB"
            )
        print(
            f"engine: {engine.stats.finished} sequences generated, prefix cache dropped "
            f"{engine.core.weight_resets if engine.core else 0} times for new weights"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a local checkpoint directory (default: acb's embedded random model)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("-n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    a = p.parse_args()
    main(a.model, a.rounds, a.n, a.max_new_tokens)
