"""lm-eval wall time with its model "acb" vs its own "hf" backend, same model, same process.

    python benchmarks/lm_eval_compare.py [--rows 200] [--size default|tiny] [--device cpu|cuda]

A multiple-choice task scored by loglikelihood (``--rows`` questions of 40-400 characters, four
answers of 5-40 characters each, so 4 x rows requests) is generated locally, as is the model
(acb's embedded random-weight Llama, ``--size default``, or the 2-layer test model), saved to a
temporary directory; both backends load it from there. Each backend first runs a few rows
untimed (imports, the dataset cache, allocator warm-up); the timed figure is the whole
``lm_eval.simple_evaluate`` call (model load included), the fastest of ``--repeats`` rounds.
``acb`` runs with the engine's defaults and with ``--acb-max-batch-tokens`` tokens per step (the
step size matters on CPU, where the attention is the torch reference); ``hf`` at its default
batch size (1) and at ``--hf-batch-size``. Checks that the backends agree (accuracy, and the
largest per-answer loglikelihood difference); writes
``benchmarks/results/lm_eval_compare_{cpu,gpu}.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

WORDS = (
    "the of and to in is was for on that with as by at from his her they this which be not are "
    "model token batch cache answer question river mountain seven blue quickly under over"
).split()


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    from acb.bench.eval import sentence as words_sentence

    return words_sentence(rng, lo, hi, WORDS)  # this script's own words: its recorded dataset stays the same


def write_task(folder: str, rows: int) -> str:
    rng = random.Random(0)
    data = os.path.join(folder, "mc.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for _ in range(rows):
            doc = {
                "q": sentence(rng, 40, 400) + "\nAnswer:",
                "choices": [" " + sentence(rng, 4, 39) for _ in range(4)],
                "gold": rng.randrange(4),
            }
            f.write(json.dumps(doc) + "\n")
    with open(os.path.join(folder, "bench_mc.yaml"), "w", encoding="utf-8") as f:
        f.write(
            f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "{{q}}"\n'
            'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"\ntarget_delimiter: ""\nmetric_list:\n'
            "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
            "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n"
        )
    return folder


def evaluate(model: str, model_args: str, tasks: Any, device: str, limit: int | None = None) -> tuple[dict, float]:
    import lm_eval

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["bench_mc"],
        task_manager=tasks,
        device=device,
        limit=limit,
        log_samples=True,
        verbosity="ERROR",
    )
    return out, time.perf_counter() - t0


def loglikelihoods(out: dict) -> list[float]:
    samples = sorted(out["samples"]["bench_mc"], key=lambda s: s["doc_id"])
    return [ll for s in samples for ll, _ in s["filtered_resps"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--size", choices=("default", "tiny"), default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--acb-max-batch-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per side (the fastest is reported)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from lm_eval.tasks import TaskManager

    importlib.import_module("acb.integrations.lm_eval")  # registers the model "acb" with lm-eval
    from acb.bench.common import machine_info, write_json
    from acb.models import build_tokenizer, default_model, tiny_model

    folder = tempfile.mkdtemp()
    tok = build_tokenizer()
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = (
        default_model(dtype=dtype) if args.size == "default" else tiny_model("llama", vocab_size=len(tok), dtype=dtype)
    )
    params = sum(p.numel() for p in model.parameters())
    path = os.path.join(folder, "model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    tasks = TaskManager(include_path=write_task(folder, args.rows), include_defaults=False)

    sides = {
        "acb": ("acb", f"pretrained={path}"),
        f"acb (max_batch_tokens={args.acb_max_batch_tokens})": (
            "acb",
            f"pretrained={path},max_batch_tokens={args.acb_max_batch_tokens}",
        ),
        "hf (batch_size=1)": ("hf", f"pretrained={path},batch_size=1"),
        f"hf (batch_size={args.hf_batch_size})": ("hf", f"pretrained={path},batch_size={args.hf_batch_size}"),
    }
    for model_name, model_args in sides.values():  # untimed warm-up
        evaluate(model_name, model_args, tasks, args.device, limit=4)
    times: dict[str, list[float]] = {label: [] for label in sides}
    results: dict[str, dict] = {}
    for _ in range(args.repeats):  # rounds interleave the sides, so that a slow spell of a shared machine hits all
        for label, (model_name, model_args) in sides.items():
            results[label], seconds = evaluate(model_name, model_args, tasks, args.device)
            times[label].append(seconds)
    runs: dict[str, dict[str, Any]] = {}
    lls: dict[str, list[float]] = {}
    for label, out in results.items():
        res = out["results"]["bench_mc"]
        lls[label] = loglikelihoods(out)
        seconds = min(times[label])
        runs[label] = {
            "seconds": seconds,
            "all_seconds": times[label],
            "requests_per_s": len(lls[label]) / seconds,
            "acc": res["acc,none"],
            "acc_norm": res["acc_norm,none"],
        }
        print(
            f"{label:<28} {seconds:7.2f} s  {runs[label]['requests_per_s']:7.1f} requests/s  "
            f"acc {res['acc,none']:.3f}  acc_norm {res['acc_norm,none']:.3f}  "
            f"(runs: {', '.join(f'{t:.1f}' for t in times[label])} s)",
            flush=True,
        )
    ref = lls["hf (batch_size=1)"]
    max_diff = {label: max(abs(a - b) for a, b in zip(ref, v)) for label, v in lls.items()}
    agree = len({(r["acc"], r["acc_norm"]) for r in runs.values()}) == 1
    speedup = {label: runs[label]["seconds"] / runs["acb"]["seconds"] for label in runs if label != "acb"}
    kind = "gpu" if args.device.startswith("cuda") else "cpu"
    doc = {
        "machine": machine_info(args.device),
        "workload": f"lm-eval multiple_choice, {args.rows} rows x 4 answers = {4 * args.rows} loglikelihood "
        f"requests (questions 40-400 chars, answers 5-40 chars, byte-level tokenizer); "
        f"{args.size} model ({params / 1e6:.1f}M parameters, random weights, {dtype}); "
        f"timed: the whole simple_evaluate call, fastest of {args.repeats} interleaved rounds, after an "
        "untimed 4-row run of each backend",
        "runs": runs,
        "hf_time_over_acb": speedup,
        "max_abs_loglikelihood_diff_vs_hf_bs1": max_diff,
        "same_metrics": agree,
    }
    out_path = f"benchmarks/results/lm_eval_compare_{kind}.json"
    write_json(out_path, doc)
    print("hf time / acb time: " + ", ".join(f"{k}: {v:.2f}x" for k, v in speedup.items()))
    print(
        f"same acc/acc_norm: {agree}; largest loglikelihood difference vs hf bs=1: "
        f"{max(max_diff.values()):.2e}; wrote {out_path}"
    )
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
