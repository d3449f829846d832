"""Wall time of a TRL GRPO step, rollouts through acb (`use_acb`) vs through transformers'
continuous batching, in the same process, with the same model, data, config and seeds.

    python benchmarks/grpo_step.py [--steps 4] [--out benchmarks/results/grpo_step_cpu.json]

Each optimizer step generates `per_device_train_batch_size` completions (prompts x
`num_generations`) and trains on them; the generation share is the time inside the model's
`generate_batch` (TRL's call), measured around it. The first step of each engine includes its
start-up and is reported apart from the steady steps.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from acb.integrations.trl import use_acb
from acb.models import build_tokenizer, default_model

CB = {"num_blocks": 512, "max_batch_tokens": 512}  # the same explicit sizing for both engines


class _StepTimes(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.steps.append(time.perf_counter() - self._t0)


def _timed(fn: Any, times: list[float], tokens: list[int]) -> Any:
    def call(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(o.generated_tokens) for o in out.values()))
        return out

    return call


def run(engine: str, steps: int, batch: int, generations: int, completion: int) -> dict:
    torch.manual_seed(0)
    model, tok = default_model(), build_tokenizer()
    data = Dataset.from_list(
        [
            {"prompt": f"Question {i}: write a sentence about the number {i}."}
            for i in range(steps * batch // generations)
        ]
    )
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        max_steps=steps,
        per_device_train_batch_size=batch,
        num_generations=generations,
        max_completion_length=completion,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        seed=0,
        logging_steps=steps,
        disable_tqdm=True,
        use_transformers_continuous_batching=True,
        transformers_continuous_batching_config=dict(CB),
    )
    timer = _StepTimes()
    trainer = GRPOTrainer(
        model=model,
        args=args,
        reward_funcs=lambda completions, **kw: [len(c) / 100.0 for c in completions],
        train_dataset=data,
        processing_class=tok,
        callbacks=[timer],
    )
    gen: list[float] = []
    tokens: list[int] = []
    t0 = time.perf_counter()
    if engine == "acb":
        with use_acb(trainer) as rollouts:
            model.generate_batch = _timed(rollouts, gen, tokens)  # around acb's generate_batch
            trainer.train()
            model.generate_batch = rollouts  # as installed, for use_acb to take back
    else:
        model.generate_batch = _timed(type(model).generate_batch.__get__(model), gen, tokens)
        trainer.train()
        del model.generate_batch
    total = time.perf_counter() - t0
    steady = timer.steps[1:] or timer.steps
    steady_gen = gen[1:] or gen
    return {
        "engine": engine,
        "steps": len(timer.steps),
        "total_s": round(total, 3),
        "first_step_s": round(timer.steps[0], 3),
        "first_generate_s": round(gen[0], 3),
        "step_s": round(statistics.mean(steady), 3),
        "generate_s": round(statistics.mean(steady_gen), 3),
        "generation_share": round(statistics.mean(steady_gen) / statistics.mean(steady), 3),
        "completion_tokens_per_step": round(statistics.mean(tokens), 1),
        "generate_tok_per_s": round(sum(tokens[1:] or tokens) / sum(steady_gen), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="completions per step (per_device_train_batch_size)")
    p.add_argument("--generations", type=int, default=8, help="num_generations (completions per prompt)")
    p.add_argument("--completion", type=int, default=64, help="max_completion_length")
    p.add_argument("--out", default="benchmarks/results/grpo_step_cpu.json")
    a = p.parse_args()
    rows = [run(e, a.steps, a.batch, a.generations, a.completion) for e in ("transformers", "acb")]
    tf, ours = rows
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "model": "acb default_model (random weights)",
        "config": {
            "steps": a.steps,
            "per_device_train_batch_size": a.batch,
            "num_generations": a.generations,
            "max_completion_length": a.completion,
            "continuous_batching_config": CB,
        },
        "runs": rows,
        "speedup_step": round(tf["step_s"] / ours["step_s"], 2),
        "speedup_generate": round(tf["generate_s"] / ours["generate_s"], 2),
    }
    for r in rows:
        print(
            f"{r['engine']:>12}: step {r['step_s']:.2f} s, generate {r['generate_s']:.2f} s "
            f"({100 * r['generation_share']:.0f}% of the step, {r['generate_tok_per_s']:.0f} tok/s); "
            f"first step {r['first_step_s']:.2f} s"
        )
    print(f"acb: {result['speedup_step']}x per step, {result['speedup_generate']}x on generation")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
