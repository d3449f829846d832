"""``online``: requests arrive as a Poisson process through ``AsyncEngine`` and stream.

Per arrival rate: time to first token (submit -> first streamed delta, measured by the
client), inter-token latency (gaps between the engine timestamps of consecutive tokens),
end-to-end latency, and the achieved output tokens/s.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import torch

from acb.api.async_engine import AsyncEngine
from acb.bench.common import ModelSpec, peak_memory_bytes, percentiles, random_prompts, reset_peak_memory
from acb.config import ContinuousBatchingConfig
from acb.sampling_params import SamplingParams

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(num_requests=8, rates=[20.0, 80.0], min_prompt_len=4, max_prompt_len=16, min_new=4, max_new=8),
    "small": dict(num_requests=16, rates=[2.0, 8.0], min_prompt_len=16, max_prompt_len=128, min_new=8, max_new=32),
    "default": dict(
        num_requests=32, rates=[0.5, 1.0, 2.0, 4.0], min_prompt_len=16, max_prompt_len=256, min_new=16, max_new=64
    ),
}


async def _one_rate(model: Any, prompts: list[list[int]], outs: list[int], rate: float, seed: int) -> dict[str, Any]:
    rnd = random.Random(seed)
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    async with AsyncEngine(model, ContinuousBatchingConfig(page_size=32)) as eng:
        await eng.generate([5, 6, 7], SamplingParams(max_new_tokens=2))  # warm-up

        async def client(p: list[int], n: int) -> int:
            t0 = time.perf_counter()
            h = await eng.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True), record_timestamps=True)
            first = None
            async for _ in h:
                if first is None:
                    first = time.perf_counter()
                    ttft.append(first - t0)
            out = await h.result()
            e2e.append(time.perf_counter() - t0)
            ts = out.timestamps or []
            itl.extend(b - a for a, b in zip(ts, ts[1:]))
            return len(out.generated_tokens)

        start = time.perf_counter()
        tasks = []
        for p, n in zip(prompts, outs):
            tasks.append(asyncio.create_task(client(p, n)))
            await asyncio.sleep(rnd.expovariate(rate))
        tokens = sum(await asyncio.gather(*tasks))
        dt = time.perf_counter() - start
    return dict(
        rate=rate,
        seconds=dt,
        output_tokens=tokens,
        tokens_per_s=tokens / dt,
        requests_per_s=len(prompts) / dt,
        ttft_s=percentiles(ttft),
        itl_s=percentiles(itl),
        e2e_s=percentiles(e2e),
    )


def run(size: str, spec: ModelSpec, baselines: bool = True) -> dict[str, Any]:
    p = SIZES[size]
    model = spec.build()
    prompts = random_prompts(p["num_requests"], p["min_prompt_len"], p["max_prompt_len"], spec.vocab, seed=3)
    g = torch.Generator().manual_seed(4)
    outs = torch.randint(p["min_new"], p["max_new"] + 1, (len(prompts),), generator=g).tolist()
    rows = []
    for i, rate in enumerate(p["rates"]):
        reset_peak_memory(spec.device)
        row = asyncio.run(_one_rate(model, prompts, outs, rate, seed=10 + i))
        row["engine"] = "acb AsyncEngine"
        row["peak_memory"] = peak_memory_bytes(spec.device)
        rows.append(row)
    return dict(
        workload="online",
        settings=dict(p, greedy=True, ignore_eos=True, streaming=True),
        rows=rows,
        notes=["TTFT: client-side, submit to first streamed delta; ITL: engine timestamps of consecutive tokens"],
    )
