"""Waiting threads handing back their OpenMP workers (``acb/runner/host_threads.py``), A/B in one run.

    python benchmarks/omp_workers.py [--batches 1,8,32] [--repeats 2] [--out benchmarks/results/omp_workers_cpu.json]

Two models: ``acb generate``'s default (3.3M parameters) and ``acb bench``'s default (40M), float32.
For each, one engine; before each timed call the main thread runs a parallel region (as a script
that builds its model does), then the engine's decode step is measured (``decode_step_ms``: a
call of 1 + 48 new tokens less a call of one, over 48) twice per repeat, alternating:

- ``held``: the hand-back turned off (``release_idle_threads`` a no-op everywhere acb calls it),
  so the main thread's pool stays alive beside the engine thread's, as before 2026-11-28;
- ``handed back``: acb as shipped.

Greedy tokens are compared between the two. Each figure is the best of its repeats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import acb  # noqa: E402
import acb.api.base  # noqa: E402
import acb.runner.model_runner  # noqa: E402
from acb.bench.common import ModelSpec, decode_step_ms, machine_info, write_json  # noqa: E402
from acb.models import default_model  # noqa: E402
from acb.runner import host_threads  # noqa: E402

CALLERS = (acb.api.base, acb.runner.model_runner)  # the modules that call it


def hand_back(on: bool) -> None:
    fn = host_threads.release_idle_threads if on else (lambda: False)
    for mod in CALLERS:
        mod.release_idle_threads = fn  # type: ignore[attr-defined]


def main_thread_region() -> None:
    torch.randn(1 << 20).exp_()  # one parallel region on this thread: its pool exists again


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--out", default="benchmarks/results/omp_workers_cpu.json")
    a = ap.parse_args()
    if host_threads.loaded_libgomp() is None:
        print("torch does not run on GNU OpenMP here: nothing to compare")
        return 0
    rows: list[dict[str, Any]] = []
    models = {
        "acb generate default (3.3M)": lambda: default_model(),
        "acb bench default (40M)": lambda: ModelSpec("default").build().eval(),
    }
    for name, build in models.items():
        model = build()
        vocab = model.config.vocab_size
        with acb.Engine(model) as engine:
            for b in [int(x) for x in a.batches.split(",")]:
                g = torch.Generator().manual_seed(b)
                ps = torch.randint(3, vocab, (b, 100), generator=g).tolist()

                def run(n: int, ps: list[list[int]] = ps) -> Any:
                    sp = acb.SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.0)
                    return engine.generate_batch(ps, sp, progress_bar=False)

                run(2)  # (warm)
                best: dict[str, float] = {}
                toks: dict[str, list[list[int]]] = {}
                for _ in range(a.repeats):
                    for label, on in (("held", False), ("handed back", True)):
                        hand_back(on)
                        try:
                            main_thread_region()
                            ms, out = decode_step_ms(run, a.steps)
                        finally:
                            hand_back(True)
                        best[label] = min(best.get(label, float("inf")), ms)
                        toks[label] = [o.generated_tokens for o in out.values()]
                row = {
                    "model": name,
                    "batch": b,
                    "held_ms": best["held"],
                    "handed_back_ms": best["handed back"],
                    "speedup": best["held"] / best["handed back"],
                    "same_tokens": toks["held"] == toks["handed back"],
                }
                rows.append(row)
                print(
                    f"{name}, B={b}: held {row['held_ms']:.2f} ms/step, handed back {row['handed_back_ms']:.2f} "
                    f"({row['speedup']:.2f}x), same tokens: {row['same_tokens']}",
                    flush=True,
                )
    write_json(a.out, {"machine": machine_info(), "settings": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
