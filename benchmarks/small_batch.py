"""Small batches: acb against ``model.generate`` at B = 1, 4, 16, 64 with equal lengths, and
one streamed request's time to first token and inter-token time, in one run.

    python benchmarks/small_batch.py [--prompt 128] [--new 128] [--repeats 2] [--out benchmarks/results/small_batch_cpu.json]

The model is ``acb bench``'s default shape (a 40M-parameter random Llama, float32). Each B runs
B prompts of ``--prompt`` tokens, ``--new`` new tokens each (EOS ignored), greedy:

- acb: ``Engine.generate_batch`` on an engine started once (its start-up is not counted), with
  the default settings for the device;
- ``model.generate``: one call on the B prompts (equal lengths: no padding), SDPA attention.

The two alternate ``--repeats`` times per B; each figure is the best of its repeats, and the
greedy tokens are checked equal. One more acb call per B splits its steps by phase (the
engine's own timers: schedule, staging, output processing on the host; the compute: forward,
sampling and the one sync), in ms per step. The streamed request: one ``AsyncEngine`` stream of the same
lengths, the time to its first token and the median gap between tokens, against ``generate``'s
own with a streamer on the same prompt; the two alternate ``max(3, --repeats)`` times, and each
side's figures are its best time to first token and its best median gap.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import acb  # noqa: E402
from acb.bench.common import ModelSpec, acb_greedy, greedy_generate, machine_info, phase_ms, write_json  # noqa: E402


def prompts(b: int, n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + b)
    return torch.randint(3, vocab, (b, n), generator=g).tolist()


def run_generate(model: Any, ps: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = greedy_generate(model, ps, new)
    return time.perf_counter() - t0, out.tolist()


def run_acb(engine: acb.Engine, ps: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    toks = acb_greedy(engine, ps, new)
    return time.perf_counter() - t0, toks


def step_phases(engine: acb.Engine, ps: list[list[int]], new: int) -> dict[str, float]:
    """One call's engine steps split by phase (``EngineStats``), in ms per step: the host's
    schedule, input staging and output processing, and the compute (forward, sampling, the sync)."""
    before = engine.stats
    run_acb(engine, ps, new)
    return phase_ms(before, engine.stats)


def stream_acb(model: Any, p: list[int], new: int) -> tuple[float, float]:
    async def go() -> tuple[float, float]:
        async with acb.AsyncEngine(model) as engine:
            await (await engine.submit(p, acb.SamplingParams(max_new_tokens=4, temperature=0.0))).result()  # warm
            times = []
            t0 = time.perf_counter()
            h = await engine.submit(p, acb.SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
            async for delta in h:
                times.extend([time.perf_counter()] * len(delta.token_ids))
            return times[0] - t0, statistics.median(b - a for a, b in zip(times, times[1:]) if b > a)

    return asyncio.run(go())


def stream_generate(model: Any, p: list[int], new: int) -> tuple[float, float]:
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.first = True

        def put(self, value: Any) -> None:
            if self.first:  # (the prompt)
                self.first = False
                return
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    clock = Clock()
    t0 = time.perf_counter()
    greedy_generate(model, [p], new, clock)
    t = clock.times
    return t[0] - t0, statistics.median(b - a for a, b in zip(t, t[1:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/small_batch_cpu.json")
    a = ap.parse_args()
    spec = ModelSpec("default")
    model = spec.build().eval()
    rows = []
    with acb.Engine(model) as engine:
        run_acb(engine, prompts(2, a.prompt, spec.vocab, 99), 8)  # (warm)
        run_generate(model, prompts(2, a.prompt, spec.vocab, 99), 8)
        for b in [int(x) for x in a.batches.split(",")]:
            ps = prompts(b, a.prompt, spec.vocab)
            acb_s, gen_s = [], []
            same = True
            for _ in range(a.repeats):
                s, toks = run_acb(engine, ps, a.new)
                acb_s.append(s)
                s, ref = run_generate(model, ps, a.new)
                gen_s.append(s)
                same &= toks == ref
            row = {
                "batch": b,
                "acb_s": min(acb_s),
                "generate_s": min(gen_s),
                "acb_speedup": min(gen_s) / min(acb_s),
                "same_tokens": same,
                "acb_ms_per_step": 1000 * min(acb_s) / a.new,
                "generate_ms_per_step": 1000 * min(gen_s) / a.new,
            }
            row["acb_step_phases"] = step_phases(engine, ps, a.new)
            rows.append(row)
            print(
                f"B={b:3d}: acb {row['acb_s']:.2f} s, generate {row['generate_s']:.2f} s, "
                f"{row['acb_speedup']:.2f}x, same tokens: {same}; acb per step: "
                + ", ".join(f"{k} {v:.2f}" for k, v in row["acb_step_phases"].items() if k != "steps"),
                flush=True,
            )
    p = prompts(1, a.prompt, spec.vocab, 7)[0]
    # the two alternate (a slow spell hits both); each side's best TTFT and best median gap
    runs: dict[str, list[tuple[float, float]]] = {"acb": [], "generate": []}
    for _ in range(max(3, a.repeats)):
        runs["acb"].append(stream_acb(model, p, a.new))
        runs["generate"].append(stream_generate(model, p, a.new))
    stream = {
        side: {
            "ttft_ms": 1000 * min(t for t, _ in r),
            "itl_ms": 1000 * min(i for _, i in r),
            "runs_ms": [[1000 * t, 1000 * i] for t, i in r],
        }
        for side, r in runs.items()
    }
    print(
        f"one stream: acb TTFT {stream['acb']['ttft_ms']:.1f} ms, ITL {stream['acb']['itl_ms']:.1f} ms; "
        f"generate TTFT {stream['generate']['ttft_ms']:.1f} ms, ITL {stream['generate']['itl_ms']:.1f} ms"
    )
    result = {
        "machine": machine_info(),
        "model": spec.describe(model),
        "settings": {"prompt": a.prompt, "new": a.new, "repeats": a.repeats},
        "rows": rows,
        "stream": stream,
    }
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
