"""Sampler time per step: 256 rows with mixed per-request parameters vs greedy-only.

    python benchmarks/sampler_bench.py [--rows 256] [--vocab 32000] [--device cpu|cuda] [--json PATH]

Times ``acb.runner.sampler.sample`` (processing + sampling + logprobs packing, what runs on
the device each step) on random logits, median of ``--iters`` runs after warm-up. On CUDA
the device is synchronised around each run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from datetime import datetime, timezone

import torch

import acb
from acb.core.request import Request
from acb.runner.sampler import SamplingState, sample, stage_standalone
from acb.sampling_params import FALLBACK

MIXED = [
    acb.SamplingParams(temperature=0.0),
    acb.SamplingParams(temperature=0.7, top_p=0.9),
    acb.SamplingParams(temperature=1.0, top_k=50),
    acb.SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.1),
    acb.SamplingParams(temperature=1.0, top_k=40, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3),
    acb.SamplingParams(temperature=0.6, logprobs=5),
    acb.SamplingParams(temperature=0.0, logprobs=0, logprobs_mode="processed", logit_bias={5: 2.0}),
    acb.SamplingParams(temperature=1.2, seed=1234, min_new_tokens=4),
]
# the same, but every top-p row also has a top-k: no full-vocabulary sort
MIXED_TOPK = [replace(sp, top_k=100) if sp.top_p is not None and not sp.top_k else sp for sp in MIXED]

MIXES = {
    "greedy": lambda i: acb.SamplingParams(temperature=0.0),
    "temperature": lambda i: acb.SamplingParams(temperature=0.8),
    "mixed": lambda i: MIXED[i % len(MIXED)],
    "mixed-topk": lambda i: MIXED_TOPK[i % len(MIXED_TOPK)],
}


def bench(rows: int, vocab: int, device: torch.device, mix: str, iters: int) -> float:
    state = SamplingState(rows, vocab, device)
    g = torch.Generator().manual_seed(0)
    for r in range(rows):
        sp = MIXES[mix](r).merged_over(FALLBACK)
        prompt = torch.randint(3, vocab, (64,), generator=g).tolist()
        req = Request(f"r{r}", prompt, max_new_tokens=100, stop_token_ids=frozenset({2}), params=sp, seed=r)
        req.token_ids += torch.randint(3, vocab, (16,), generator=g).tolist()
        state.init_row(r, req)
    step, dev = stage_standalone(state, list(range(rows)), [16] * rows)
    logits = torch.randn(rows, vocab, generator=g).to(device)
    times = []
    for i in range(iters + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = sample(logits, step, state, dev)
        if device.type == "cuda":
            torch.cuda.synchronize()
        else:
            out.sum()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    )
    results = {m: bench(args.rows, args.vocab, device, m, args.iters) for m in MIXES}
    print(f"sampler time per step, {args.rows} rows x vocab {args.vocab}, device: {name}")
    print(f"{'mix':<12} {'ms/step':>9} {'vs greedy':>10}")
    for m, ms in results.items():
        print(f"{m:<12} {ms:>9.2f} {ms / results['greedy']:>9.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rows": args.rows,
                    "vocab": args.vocab,
                    "device": name,
                    "torch": torch.__version__,
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "ms_per_step": results,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
