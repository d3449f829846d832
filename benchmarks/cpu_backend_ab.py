"""Decode steps on CPU with each attention backend: acb's ``"cpu"`` backend (decode rows read
K/V in their pages through acb's kernel) against the ``"torch"`` reference (pages gathered, then
SDPA), and ``model.generate``, in one run.

    python benchmarks/cpu_backend_ab.py [--batches 1,4,16,64] [--prompt 128] [--new 48] [--repeats 3] [--out ...]

``acb bench``'s default model (a 40M-parameter random Llama, float32), two engines on it that
differ only in ``attn_backend``, B prompts of ``--prompt`` tokens, greedy, EOS ignored. A decode
step's time is a call of 1 + ``--new`` new tokens less a call of 1, over ``--new``; the three
sides alternate ``--repeats`` times and each figure is the best. Also reported: whether each
backend's greedy tokens equal ``generate``'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import acb  # noqa: E402
from acb.bench.common import ModelSpec, acb_greedy, decode_step_ms, greedy_generate, machine_info, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/cpu_backend_ab.json"))
    args = ap.parse_args()
    spec = ModelSpec(size="default")
    model = spec.build().eval()
    g = torch.Generator().manual_seed(0)
    engines = {b: acb.Engine(model, acb.ContinuousBatchingConfig(attn_backend=b)) for b in ("cpu", "torch")}
    rows = []
    with engines["cpu"], engines["torch"]:
        for b in (int(x) for x in args.batches.split(",")):
            ps = torch.randint(3, spec.vocab, (b, args.prompt), generator=g).tolist()
            sides: dict[str, Callable[[int], Any]] = {
                name: (lambda k, e=e: acb_greedy(e, ps, k)) for name, e in engines.items()
            }
            sides["generate"] = lambda k: greedy_generate(model, ps, k).tolist()
            for fn in sides.values():
                fn(2)
            ms: dict[str, list[float]] = {k: [] for k in sides}
            toks: dict[str, Any] = {}
            for _ in range(args.repeats):
                for name, fn in sides.items():
                    t, toks[name] = decode_step_ms(fn, args.new)
                    ms[name].append(t)
            row: dict[str, Any] = {"batch": b, **{f"{k}_ms": min(v) for k, v in ms.items()}, "all_ms": ms}
            row["cpu_vs_torch"] = row["torch_ms"] / row["cpu_ms"]
            row["cpu_vs_generate"] = row["generate_ms"] / row["cpu_ms"]
            row["torch_vs_generate"] = row["generate_ms"] / row["torch_ms"]
            for name in engines:
                row[f"{name}_rows_equal_generate"] = sum(a == r for a, r in zip(toks[name], toks["generate"]))
            print(
                f"B={b}: cpu {row['cpu_ms']:.2f}, torch {row['torch_ms']:.2f}, generate {row['generate_ms']:.2f} "
                f"ms/step; cpu vs torch {row['cpu_vs_torch']:.2f}x, vs generate {row['cpu_vs_generate']:.2f}x "
                f"(torch {row['torch_vs_generate']:.2f}x); rows equal to generate: cpu "
                f"{row['cpu_rows_equal_generate']}/{b}, torch {row['torch_rows_equal_generate']}/{b}",
                flush=True,
            )
            rows.append(row)
    write_json(args.out, dict(machine=machine_info("cpu"), settings=vars(args), rows=rows))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
