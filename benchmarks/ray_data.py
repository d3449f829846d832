"""Ray Data offline generation (``acb.distributed.ray``): throughput with 1 vs 2 actors.

One local Ray, the offline benchmark's default model shape (random weights), ``--num-prompts``
token-id prompts of random lengths, ``--max-new-tokens`` each with EOS ignored. Three sides,
same prompts, same process:

- ``in-process``: one ``acb.Engine.generate_batch`` over every prompt (no Ray), all cores;
- ``ray x1``: ``generate_dataset(concurrency=1)``, the actor reserving every CPU;
- ``ray xN``: ``concurrency=N`` actors sharing the CPUs (``cpus // N`` each; Ray sets each
  actor's torch threads to its CPUs).

Ray's wall time includes starting the actors and building their models; ``first_row_s`` is
when the first output row reached the driver. Every Ray side's tokens are checked against the
in-process side's. Writes ``benchmarks/results/ray_data_{cpu|gpu}.json``. On a GPU cluster
pass ``--address auto --gpus`` and the actors take one GPU each instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

import acb  # noqa: E402
from acb.bench.common import ModelSpec, machine_info, random_prompts  # noqa: E402
from acb.distributed.ray import generate_dataset  # noqa: E402

CONFIG = {"page_size": 32, "num_blocks": 1024, "max_batch_tokens": 2048}


def build_model() -> tuple[Any, None]:
    """The model factory the actors run (module-level: Ray pickles it by reference)."""
    return ModelSpec("default").build(), None


def in_process(prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
    model, _ = build_model()
    sp = acb.SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CONFIG)) as engine:
        engine.generate_batch(prompts[:2], acb.SamplingParams(max_new_tokens=2), progress_bar=False)  # warm-up
        t0 = time.perf_counter()
        out = engine.generate_batch(prompts, sp, progress_bar=False)
        wall = time.perf_counter() - t0
    return wall, [o.generated_tokens for o in out.values()]


def on_ray(
    prompts: list[list[int]], max_new: int, actors: int, cpus: int, gpus: bool, batch_size: int
) -> dict[str, Any]:
    ds = ray.data.from_items(
        [{"id": i, "prompt": p} for i, p in enumerate(prompts)], override_num_blocks=max(4, len(prompts) // batch_size)
    )
    out = generate_dataset(
        ds,
        model_factory=build_model,
        concurrency=actors,
        batch_size=batch_size,
        num_gpus_per_actor=1 if gpus else 0,
        num_cpus_per_actor=None if gpus else cpus // actors,
        config=CONFIG,
        sampling={"max_new_tokens": max_new, "ignore_eos": True},
        device="cuda" if gpus else "cpu",
        worker_column="worker",
    )
    t0 = time.perf_counter()
    first = None
    rows = []
    for row in out.iter_rows():
        if first is None:
            first = time.perf_counter() - t0
        rows.append(row)
    wall = time.perf_counter() - t0
    rows.sort(key=lambda r: r["id"])
    tokens = sum(int(r["num_generated_tokens"]) for r in rows)
    return dict(
        actors=actors,
        wall_s=wall,
        first_row_s=first,
        tokens=tokens,
        tokens_per_s=tokens / wall,
        workers=len({r["worker"] for r in rows}),
        generated=[list(map(int, r["generated_token_ids"])) for r in rows],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32, help="rows per map_batches call")
    p.add_argument("--actors", type=int, default=2, help="N of the last side")
    p.add_argument("--address", default=None, help="a running Ray cluster; default: a local one")
    p.add_argument("--gpus", action="store_true", help="one GPU per actor (the in-process side on cuda:0)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    cpus = os.cpu_count() or 1
    prompts = random_prompts(args.num_prompts, 16, 256, ModelSpec("default").vocab, seed=1)
    base_wall, base_tokens = in_process(prompts, args.max_new_tokens)
    total = sum(map(len, base_tokens))
    sides: list[dict[str, Any]] = [
        dict(side="in-process", actors=0, wall_s=base_wall, tokens=total, tokens_per_s=total / base_wall)
    ]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with tempfile.TemporaryDirectory(prefix="acb-ray-") as tmp:
        if args.address:
            ray.init(address=args.address)
        else:
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.wait_for_min_actors_s = 300
        try:
            for n in sorted({1, args.actors}):
                r = on_ray(prompts, args.max_new_tokens, n, cpus, args.gpus, args.batch_size)
                r["tokens_match_in_process"] = r.pop("generated") == base_tokens
                sides.append(dict(side=f"ray x{n}", **r))
                print(json.dumps(sides[-1]))
        finally:
            ray.shutdown()
    for s in sides:
        s["vs_in_process"] = s["tokens_per_s"] / sides[0]["tokens_per_s"]
    result = dict(
        benchmark="ray_data",
        machine=machine_info("cuda" if args.gpus else "cpu"),
        ray=ray.__version__,
        settings=dict(
            num_prompts=args.num_prompts,
            prompt_len="16-256",
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            config=CONFIG,
            model="offline default shape",
        ),
        sides=sides,
    )
    out = args.out or str(ROOT / "benchmarks" / "results" / f"ray_data_{'gpu' if args.gpus else 'cpu'}.json")
    Path(out).write_text(json.dumps(result, indent=2, default=str))
    for s in sides:
        print(
            f"{s['side']:>11}: {s['tokens_per_s']:7.1f} tokens/s  wall {s['wall_s']:6.1f} s"
            + (
                f"  first row {s['first_row_s']:.1f} s, {s['workers']} worker(s), match={s['tokens_match_in_process']}"
                if s["actors"]
                else ""
            )
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
