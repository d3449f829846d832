"""acb and padded ``model.generate`` on a quiet machine and beside a CPU hog, in one run.

    python benchmarks/contention.py [--arch llama] [--prompts 32] [--new 32] [--hogs 0,1] [--repeats 3]
        [--out benchmarks/results/contention_{arch}_cpu.json]

The question (issue 54 item 6): when another process takes cores (a trainer beside the sampler,
another job on the machine), does acb lose more of its lead over ``model.generate`` than
``generate`` loses itself? A hog is a separate process spinning on one core (``--hogs N``: N such
processes). For each hog count, the sides run alternately, ``--repeats`` times each, best kept:

- ``generate``: padded ``model.generate`` in groups of 16 (left-padded, sorted by length), on the
  main thread, torch's default intra-op threads;
- ``acb``: ``generate_batch`` on one engine, as shipped (``cpu_threads="auto"``);
- ``acb N threads`` for each N in ``--fixed`` (default: 1 and torch's default): the engine thread's
  intra-op threads pinned to N (``cpu_threads=N``).

Greedy tokens are compared between all sides. Workload: ``--prompts`` random prompts of
``--min-len``..``--max-len`` tokens, ``--new`` new tokens each, EOS ignored; the model is
``acb bench``'s ``--arch`` at ``--size``. Each row reports tok/s, and each side's slowdown from
the quiet machine to the hogged one; ``acb``'s ratio to ``generate`` per hog count.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import acb  # noqa: E402
from acb.bench.common import (  # noqa: E402
    MODEL_SHAPES,
    bench_model,
    blocks_for_all,
    machine_info,
    random_prompts,
    write_json,
)

HOG = "import os\nos.nice(0)\nx = 0\nwhile True:\n    x += 1\n"


def padded_generate(model: Any, prompts: list[list[int]], new: int, batch: int = 16) -> list[list[int]]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: dict[int, list[int]] = {}
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        group = [prompts[i] for i in idx]
        L = max(map(len, group))
        ids = torch.zeros((len(group), L), dtype=torch.long)
        mask = torch.zeros((len(group), L), dtype=torch.long)
        for r, p in enumerate(group):
            ids[r, L - len(p) :] = torch.tensor(p)
            mask[r, L - len(p) :] = 1
        with torch.no_grad():
            gen = model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
        for r, i in enumerate(idx):
            out[i] = gen[r, L:].tolist()
    return [out[i] for i in range(len(prompts))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--size", default="default", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--hogs", default="0,1")
    ap.add_argument("--fixed", default=None, help="pinned thread counts to add, e.g. 1,2 (default: 1 and torch's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/contention_{arch}_cpu.json")
    args = ap.parse_args()
    args.out = args.out or f"benchmarks/results/contention_{args.arch}_cpu.json"

    shape = dict(MODEL_SHAPES[args.size])
    model = bench_model(args.arch, **shape)
    vocab = model.config.vocab_size
    prompts = random_prompts(args.prompts, args.min_len, args.max_len, vocab, seed=0)
    fixed = (
        [int(x) for x in args.fixed.split(",") if x] if args.fixed is not None else sorted({1, torch.get_num_threads()})
    )
    hogs = [int(x) for x in args.hogs.split(",")]

    def engine(threads: int | str) -> acb.Engine:
        cfg = acb.ContinuousBatchingConfig(
            page_size=32,
            num_blocks=blocks_for_all([len(p) + args.new for p in prompts], 32) + 1,
            cpu_threads=threads,
            seed=0,
        )
        e = acb.Engine(model, cfg)
        e.start()
        e.generate_batch(prompts[:2], max_new_tokens=2, ignore_eos=True, temperature=0.0, progress_bar=False)
        return e

    engines: dict[str, acb.Engine] = {"acb": engine("auto")}
    for n in fixed:
        engines[f"acb {n} thread{'s' if n > 1 else ''}"] = engine(n)
    padded_generate(model, prompts[:2], 2)  # warm-up

    def run(side: str) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        if side == "generate":
            toks = padded_generate(model, prompts, args.new)
        else:
            e = engines[side]
            e.reset_prefix_cache()
            outs = e.generate_batch(
                prompts, max_new_tokens=args.new, ignore_eos=True, temperature=0.0, progress_bar=False
            )
            toks = [o.generated_tokens for o in outs.values()]
        return time.perf_counter() - t0, toks

    sides = ["generate", *engines]
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] | None = None
    total = args.prompts * args.new
    try:
        for h in hogs:
            procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(h)]
            try:
                time.sleep(0.5 if h else 0)
                best: dict[str, float] = {}
                for _ in range(args.repeats):
                    for side in sides:
                        dt, toks = run(side)
                        reference = reference or toks
                        if toks != reference:
                            print(f"  !! {side} with {h} hogs: tokens differ from the first side's", flush=True)
                        best[side] = min(best.get(side, float("inf")), dt)
                        tuner = engines[side].core.runner.threads if side in engines else None
                        note = f", now {tuner.current} threads after {tuner.probes} probes" if tuner else ""
                        print(f"  hogs={h} {side}: {dt:.2f} s ({total / dt:.0f} tok/s{note})", flush=True)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            for side in sides:
                rows.append(dict(hogs=h, side=side, seconds=best[side], tok_s=total / best[side]))
    finally:
        for e in engines.values():
            e.shutdown()

    print(
        f"\n{args.arch} ({args.size}), {args.prompts} prompts of {args.min_len}-{args.max_len} tokens, {args.new} new each"
    )
    print(
        "| side | " + " | ".join(f"{h} hog{'s' if h != 1 else ''}: tok/s" for h in hogs) + " | slowdown | vs generate |"
    )
    print("|---|" + "---|" * (len(hogs) + 2))
    by = {(r["hogs"], r["side"]): r for r in rows}
    for side in sides:
        tps = [by[(h, side)]["tok_s"] for h in hogs]
        slow = tps[0] / tps[-1]
        vs = " / ".join(f"{by[(h, side)]['tok_s'] / by[(h, 'generate')]['tok_s']:.2f}x" for h in hogs)
        print(f"| {side} | " + " | ".join(f"{t:.0f}" for t in tps) + f" | {slow:.2f}x | {vs} |")
    write_json(
        args.out,
        dict(
            machine=machine_info("cpu"),
            arch=args.arch,
            size=args.size,
            workload=dict(prompts=args.prompts, min_len=args.min_len, max_len=args.max_len, new=args.new),
            rows=rows,
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
