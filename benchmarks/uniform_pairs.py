"""acb against padded ``generate`` on the ``offline-uniform`` workload, alternating in one process.

The ``offline-uniform`` workload (96 prompts of 128 tokens, 64 output tokens each, batch 32 for
``generate``) is padded ``generate``'s best case, and the two are close there; on a shared
machine one pair of runs can land either way. This runs ``--pairs`` acb / padded-generate pairs
back to back (the bench's own ``run_acb`` / ``run_generate``) and prints each pair's ratio.
Writes ``benchmarks/results/uniform_pairs_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from acb.bench.common import ModelSpec, machine_info, random_prompts  # noqa: E402
from acb.bench.offline import UNIFORM_SIZES, run_acb, run_generate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    p = UNIFORM_SIZES["default"]
    spec = ModelSpec("default")
    prompts = random_prompts(p["num_prompts"], p["min_prompt_len"], p["max_prompt_len"], spec.vocab, seed=1)
    outs = [p["max_new"]] * len(prompts)
    pairs = []
    for _ in range(args.pairs):
        a = run_acb(spec, prompts, outs)
        g = run_generate(spec, prompts, outs, p["batch_size"])
        assert [len(t) for t in a["tokens"]] == [len(t) for t in g["tokens"]] == outs
        pairs.append(dict(acb_s=a["seconds"], generate_s=g["seconds"], acb_speedup=g["seconds"] / a["seconds"]))
        print(
            f"acb {a['seconds']:.2f} s  padded generate {g['seconds']:.2f} s  acb {pairs[-1]['acb_speedup']:.2f}x",
            flush=True,
        )
    out = ROOT / "benchmarks" / "results" / "uniform_pairs_cpu.json"
    out.write_text(json.dumps(dict(machine=machine_info(), settings=p, pairs=pairs), indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
