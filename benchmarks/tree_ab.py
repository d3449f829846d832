"""Same speed? ``acb bench`` workloads on two trees of acb, alternating, in one run.

A refactor must not cost speed (issue 55 item 6). This script unpacks a base revision with
``git archive`` into a temporary folder and runs ``python -m acb bench WORKLOAD --no-baselines``
in a fresh process per run, alternating between the base tree and the working tree (each
process imports acb from its tree through ``PYTHONPATH``, which wins over the editable
install), ``--rounds`` times each; each side's best is kept. Figures:

- ``offline``: acb's output tokens per second on the documented mixed-length workload;
- ``overhead``: the engine's host microseconds per step (schedule + stage + process, a null model)
  at each running count;
- ``steps``: the same figure at 1, 64 and 1,024 running requests without ``overhead``'s baselines
  and telemetry rounds (a run is seconds, so more alternations fit in the same time).

Writes ``results/tree_ab_cpu.json``. The machine's load is printed at each run: compare only
within one run, on a quiet machine.

    python benchmarks/tree_ab.py --base 19243f0 [--rounds 3] [--workloads offline,overhead] [--size tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def unpack(rev: str, into: Path) -> Path:
    """The tree of ``rev`` under ``into`` (``acb/`` only is needed to import it)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "acb"], check=True, capture_output=True).stdout
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


# ``steps``: the engine's host microseconds per all-decode step alone (``acb bench overhead``'s acb
# side, without its baselines and telemetry rounds: shorter, so more alternations fit)
STEPS = """
import json
from acb.bench.overhead import _acb
print(json.dumps({n: _acb(n, 40)["host_us"] for n in (1, 64, 1024)}))
"""


def run_one(tree: Path, workload: str, out: Path, size: str) -> dict[str, Any]:
    """One ``acb bench`` run importing acb from ``tree``; returns its JSON."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    if workload == "steps":
        got = subprocess.run(
            [sys.executable, "-c", STEPS], check=True, env=env, cwd=tree, capture_output=True, text=True
        )
        return {"steps": json.loads(got.stdout.strip().splitlines()[-1])}
    cmd = [
        sys.executable,
        "-m",
        "acb",
        "bench",
        workload,
        "--no-baselines",
        "--no-plot",
        "--size",
        size,
        "--out-dir",
        str(out),
    ]
    subprocess.run(cmd, check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL)
    (written,) = out.glob(f"cpu_{workload}*.json")  # (a size other than the default is in the name)
    return json.loads(written.read_text())


def figures(workload: str, data: dict[str, Any]) -> dict[str, float]:
    """The figures compared: higher is better for tokens/s, lower for microseconds."""
    if workload == "steps":
        return {f"host_us@{n}": us for n, us in data["steps"].items()}
    rows = data["result"]["rows"]
    if workload == "offline":
        return {"tokens_per_s": next(r["tokens_per_s"] for r in rows if r["engine"] == "acb")}
    if workload == "overhead":
        return {f"host_us@{r['running']}": r["acb"]["host_us"] for r in rows}
    raise ValueError(f"no figures for {workload!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the base revision (a commit of this repository)")
    ap.add_argument("--new", default=None, help="the new revision (default: the working tree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="default", help="acb bench's --size (tiny: a smoke test)")
    ap.add_argument("--workloads", default="offline,overhead")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tree_ab_cpu.json"))
    args = ap.parse_args()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "acb"], capture_output=True, text=True)
    sides = {"base": args.base, "new": args.new or head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")}
    best: dict[str, dict[str, dict[str, float]]] = {w: {"base": {}, "new": {}} for w in args.workloads.split(",")}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = unpack(args.base, Path(tmp) / "base")
        trees = {"base": base_tree, "new": unpack(args.new, Path(tmp) / "new") if args.new else ROOT}
        for rnd in range(args.rounds):
            for workload in best:
                order = ("base", "new") if rnd % 2 == 0 else ("new", "base")
                for side in order:
                    load = os.getloadavg()[0]
                    out = Path(tmp) / f"{side}_{workload}_{rnd}"
                    got = figures(workload, run_one(trees[side], workload, out, args.size))
                    runs.append({"round": rnd, "workload": workload, "side": side, "load": load, **got})
                    print(f"round {rnd} {workload:9s} {side:4s} load {load:4.2f} {got}", flush=True)
                    keep = best[workload][side]
                    for k, v in got.items():
                        better = max if k == "tokens_per_s" else min
                        keep[k] = better(keep.get(k, v), v)
    print(f"\nbest of {args.rounds} (base {sides['base']}, new {sides['new']}):")
    for workload, both in best.items():
        for k in both["base"]:
            b, n = both["base"][k], both["new"][k]
            print(f"  {workload:9s} {k:16s} base {b:10.1f}  new {n:10.1f}  new/base {n / b:5.3f}")
    Path(args.out).write_text(json.dumps({"sides": sides, "rounds": args.rounds, "best": best, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
