"""The cost of keeping tensor-parallel ranks in lock step: acb's per-iteration command broadcast,
in microseconds and as a share of the step, with 1 and 64 running requests.

    torchrun --nproc-per-node 2 benchmarks/tp_overhead.py [--out benchmarks/results/tp_overhead_cpu.json]

The embedded model is loaded tensor-parallel (``DistributedConfig(tp_plan="auto")``) on every rank;
rank 0 runs decode-heavy batches (short prompts, 64 new tokens, EOS ignored) and times every
``StepSync.exchange`` (the broadcast, and on rank 0 the encoding of what it sends) against the
wall time of the engine loop. On CPU the model's own collectives (an all-reduce per row-parallel
layer, an all-gather of the logits) are inside the step and are not counted here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import acb
from acb.models import default_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/tp_overhead_cpu.json")
    p.add_argument("--new-tokens", type=int, default=64)
    a = p.parse_args()
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    with tempfile.TemporaryDirectory() as tmp:
        # each rank saves its own copy of the same seeded weights, before the process group
        # exists (once it does, save_pretrained writes on rank 0 only)
        default_model().save_pretrained(tmp)
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        model = AutoModelForCausalLM.from_pretrained(tmp, distributed_config=DistributedConfig(tp_plan="auto")).eval()
    rank = dist.get_rank()
    rows = []
    for running in (1, 64):
        cfg = acb.ContinuousBatchingConfig(num_blocks=1024, max_requests_per_batch=64)
        with acb.Engine(model, cfg) as eng:
            sync = eng.core.sync  # type: ignore[union-attr]
            assert sync is not None
            spent = [0.0, 0]
            real = sync.exchange

            def timed(cmds, real=real, spent=spent):
                t0 = time.perf_counter()
                out = real(cmds)
                spent[0] += time.perf_counter() - t0
                spent[1] += 1
                return out

            sync.exchange = timed  # type: ignore[method-assign]
            prompts = [[(7 * i + j) % 200 + 3 for j in range(8)] for i in range(running)]
            eng.generate_batch(prompts[:1], max_new_tokens=4, ignore_eos=True, progress_bar=False)  # warm-up
            spent[0], spent[1] = 0.0, 0
            steps0 = eng.stats.steps
            t0 = time.perf_counter()
            eng.generate_batch(prompts, max_new_tokens=a.new_tokens, ignore_eos=True, progress_bar=False)
            wall = time.perf_counter() - t0
            steps = eng.stats.steps - steps0
        if rank == 0:
            rows.append(
                {
                    "running": running,
                    "steps": steps,
                    "broadcasts": spent[1],
                    "wall_s": round(wall, 3),
                    "step_ms": round(1e3 * wall / max(steps, 1), 3),
                    "exchange_us": round(1e6 * spent[0] / max(spent[1], 1), 1),
                    "exchange_share": round(spent[0] / wall, 4),
                }
            )
    if rank == 0:
        result = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads per rank",
            "ranks": dist.get_world_size(),
            "backend": "gloo",
            "torch": torch.__version__,
            "model": "acb default_model (8 heads / 4 KV heads), tensor-parallel over the ranks",
            "new_tokens": a.new_tokens,
            "rows": rows,
        }
        for r in rows:
            print(
                f"{r['running']:>3} running: {r['step_ms']:.2f} ms/step, command broadcast {r['exchange_us']:.0f} µs "
                f"({100 * r['exchange_share']:.1f}% of the loop's wall time)"
            )
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
