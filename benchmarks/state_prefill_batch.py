"""A step's prefill segments through each state layer in as few calls as exactness allows
(``acb.runner.linear_state``: fresh prompts left-padded in groups of neighbouring lengths;
resumed segments of up to 8 tokens stepped together in the decode form, longer ones of one length
in one call) against one call per segment, on one engine, alternating.

    python benchmarks/state_prefill_batch.py [--prompts 16] [--min-len 64] [--max-len 256] [--repeats 3]
        [--eval DOCS]

``acb.runner.linear_state.BATCH_PREFILL`` switches the two (decode rows are batched either way).
Models (random weights, float32 on CPU): a Qwen3.5-shaped hybrid as ``acb bench eval --arch
qwen3_5`` builds it (hidden 512, MLP 1536, 8 heads; gated-DeltaNet x6 + full attention x2) and a
Mamba2 (hidden 512, 8 layers, 16 heads of 64, state 64). Workloads, the same prompts on both
sides (lengths uniform in [min, max], seeded), the prefix cache emptied before each run:

- ``first token``: ``generate_batch`` with one new token (an evaluation's one-letter answers);
- ``score``: ``score_batch``, each prompt with 4 continuations of 1-8 tokens (a multiple choice:
  the continuations resume from their context's state);
- ``generate``: ``generate_batch`` with ``--new-tokens`` (16) new tokens.

Each workload runs batched and per-segment alternately, ``--repeats`` times each, and keeps each
side's best wall and CPU seconds (the machine is shared: alternating spreads a slow spell over
both sides). The greedy tokens of the two sides are compared (score: the largest logprob
difference). ``--eval DOCS`` also A/Bs ``acb bench eval --arch qwen3_5 --docs DOCS`` (acb's side).
Writes ``benchmarks/results/state_prefill_batch_cpu.json``.

Measured 2026-11-29 on the 2-core CPU shared with other workers (figures taken while the load
average stayed near 1; under a load of 4-5 the same runs took 3-15x longer and swung either way),
best of 3 alternating, batched vs per-segment:

| prompts | model | first token | score | generate |
|---|---|---|---|---|
| 16 x 64-256 tokens | hybrid | 1.66 vs 1.76 s (1.06x); 0.97x | 2.52 vs 3.00 s (1.19x); 1.18x | 2.28 vs 2.25 s (0.99x); 0.98x |
| 16 x 64-256 tokens | Mamba2 | 2.83 vs 2.82 s (1.00x); 0.96x | 4.12 vs 8.59 s (2.08x); 1.90x | 4.06 vs 4.03 s (0.99x); 1.09x |
| 32 x 8-48 tokens | hybrid | 0.74 vs 1.10 s (1.48x); 1.36x | (1.46 vs 2.39 s, 1.64x) | 2.06 vs 2.20 s (1.07x); 1.15x |
| 32 x 8-48 tokens | Mamba2 | 3.61 vs 3.15 s (0.87x); 0.91x | (5.39 vs 13.55 s, 2.52x) | 4.92 vs 4.65 s (0.94x); 0.77x |

(the figure after each ";", and the short prompts' scoring pair in brackets: an earlier run of
the same code but for the 8-row cap on a padded group.) Fresh prompts of 64-256 tokens gain
nothing here: transformers' torch fallbacks (no flash-linear-attention, no mamba_ssm) cost per
token at these lengths, not per call; Mamba2's scan is no faster per row in a padded batch.
Greedy tokens were the same on both sides but once: in the short hybrid run one prompt's first
token was a near-tie (logits 14.37548 and 14.37488) that the left-padded batch resolved the other
way; float rounding of another order, as a padded ``model.generate`` batch has (the pads' decay
enters the chunk's cumulative sums). Scoring logprobs differ by at most 9e-4.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import acb  # noqa: E402
from acb.runner import linear_state  # noqa: E402

VOCAB = 4096


def build(name: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from acb.bench.common import bench_model
    from acb.bench.eval import SHAPES

    if name == "qwen3_5":
        return bench_model("qwen3_5", **dict(SHAPES["default"], vocab_size=VOCAB))
    cfg = AutoConfig.for_model(
        "mamba2",
        hidden_size=512,
        num_hidden_layers=8,
        expand=2,
        num_heads=16,
        head_dim=64,
        n_groups=1,
        state_size=64,
        vocab_size=VOCAB,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def workload(eng: acb.Engine, kind: str, ps: list[list[int]], new_tokens: int = 32) -> tuple[float, float, Any]:
    """One timed run of ``kind`` on ``ps`` (the prefix cache emptied first): its wall and CPU
    seconds (the process's, every thread), and its greedy result."""
    eng.reset_prefix_cache()
    rng = random.Random(1)
    t, cpu = time.perf_counter(), time.process_time()
    if kind == "score":
        items = [(p, [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(4)]) for p in ps]
        out = eng.score_batch(items, progress_bar=False)
        result: Any = [lp for o in out for c in o.continuations for lp in c.logprobs]
    else:
        new = 1 if kind == "first token" else new_tokens
        res = eng.generate_batch(ps, max_new_tokens=new, ignore_eos=True, progress_bar=False)
        result = [res[f"req_{i}"].generated_tokens for i in range(len(ps))]
    return time.perf_counter() - t, time.process_time() - cpu, result


def eval_ab(docs: int, repeats: int) -> list[dict[str, Any]]:
    """``acb bench eval --arch qwen3_5 --docs N`` (lm-eval, acb's side only: four tasks, each timed
    call starting its own engine) with prefill batching on and off, alternating."""
    from acb.bench.common import ModelSpec
    from acb.bench.eval import run

    spec = ModelSpec(size="default", arch="qwen3_5")
    runs: list[dict[str, Any]] = []
    for i in range(repeats):
        for batched in (True, False):
            linear_state.BATCH_PREFILL = batched
            doc = run("default", spec, baselines=False, docs=docs, warmup=i == 0 and batched)
            row = doc["rows"][0]
            runs.append({"batched": batched, "seconds": row["seconds"], "per_task": row["per_task"]})
            tasks = ", ".join(f"{t} {v:.1f}" for t, v in row["per_task"].items())
            print(
                f"  eval docs={docs} {'batched' if batched else 'per-segment'}: {row['seconds']:.1f} s ({tasks})",
                flush=True,
            )
    linear_state.BATCH_PREFILL = True
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16, help="the generate workload's new tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="qwen3_5,mamba2")
    ap.add_argument("--workloads", default="first token,score,generate")
    ap.add_argument(
        "--eval", type=int, default=0, metavar="DOCS", help="also acb bench eval on the hybrid, DOCS per task"
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "state_prefill_batch_cpu.json"))
    args = ap.parse_args()
    ps = prompts(args.prompts, args.min_len, args.max_len)
    rows = []
    for name in args.models.split(",") if args.models else ():
        model = build(name)
        with acb.Engine(model, acb.ContinuousBatchingConfig()) as eng:
            workload(eng, "first token", ps[:4])  # warm-up (and the layer class's start-up try)
            for kind in args.workloads.split(","):
                wall: dict[bool, list[float]] = {True: [], False: []}
                cpu: dict[bool, list[float]] = {True: [], False: []}
                results: dict[bool, Any] = {}
                for _ in range(args.repeats):
                    for batched in (True, False):  # alternating: a slow spell hits both sides
                        linear_state.BATCH_PREFILL = batched
                        w, c, results[batched] = workload(eng, kind, ps, args.new_tokens)
                        wall[batched].append(w)
                        cpu[batched].append(c)
                        print(
                            f"  {name} {kind} {'batched' if batched else 'per-segment'}: {w:.2f} s wall, {c:.2f} s CPU"
                        )
                linear_state.BATCH_PREFILL = True
                row: dict[str, Any] = {
                    "model": name,
                    "workload": kind,
                    "batched_s": min(wall[True]),
                    "per_segment_s": min(wall[False]),
                    "speedup": min(wall[False]) / min(wall[True]),
                    "batched_cpu_s": min(cpu[True]),
                    "per_segment_cpu_s": min(cpu[False]),
                    "cpu_speedup": min(cpu[False]) / min(cpu[True]),
                    "wall_runs": {"batched": wall[True], "per_segment": wall[False]},
                }
                if kind == "score":  # (float rounding of another order: the largest logprob difference)
                    row["max_logprob_diff"] = max(abs(a - b) for a, b in zip(results[True], results[False]))
                else:
                    row["same_tokens"] = results[True] == results[False]
                rows.append(row)
                same = {k: v for k, v in row.items() if k in ("max_logprob_diff", "same_tokens")}
                print(
                    f"{name:8s} {kind:12s} batched {row['batched_s']:.2f} s  per-segment {row['per_segment_s']:.2f} s  "
                    f"{row['speedup']:.2f}x wall; CPU {row['batched_cpu_s']:.2f} vs {row['per_segment_cpu_s']:.2f} s  "
                    f"{row['cpu_speedup']:.2f}x  {same}",
                    flush=True,
                )
    evals = eval_ab(args.eval, args.repeats) if args.eval else []
    if evals:
        best = {b: min(r["seconds"] for r in evals if r["batched"] is b) for b in (True, False)}
        print(
            f"eval (hybrid, docs={args.eval}) batched {best[True]:.1f} s  per-segment {best[False]:.1f} s  "
            f"{best[False] / best[True]:.2f}x"
        )
    lengths = [len(p) for p in ps]
    doc = {
        "benchmark": "state_prefill_batch",
        "prompts": len(ps),
        "prompt_tokens": sum(lengths),
        "lengths": [min(lengths), max(lengths)],
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "rows": rows,
        "eval": {"docs": args.eval, "runs": evals} if evals else None,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
