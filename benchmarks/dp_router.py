"""``acb serve --data-parallel``: throughput of 1 vs 2 replicas, and the router's added latency.

Runs ``acb serve`` on the embedded default model as real processes on this machine:

- throughput: ``--requests`` completions (distinct prompts, ``--max-tokens`` each, EOS ignored)
  sent all at once, with ``--data-parallel 1`` (one plain ``acb serve``) and then 2 (the router
  and two replicas); generated tokens / wall time;
- overhead: with the 2-replica router up, ``--latency-samples`` sequential 1-token requests
  through the router and the same directly to one replica (its port from ``/router/stats``);
  the difference of the medians is what the extra hop costs.

Writes ``benchmarks/results/dp_router_{cpu|gpu}.json``. On a CPU, the replicas share the
cores: set ``OMP_NUM_THREADS`` to cores / replicas for a fair split.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from acb.serve.router import httpx  # noqa: E402  (httpx or httpx2, whichever is installed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start(dp: int, extra: list[str], device: str) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "acb", "serve", "--data-parallel", str(dp), "--port", str(port),
                             "--device", device, *extra], env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"acb serve exited with {proc.returncode}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("acb serve did not start")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)


async def throughput(port: int, n: int, max_tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600,
                                 limits=httpx.Limits(max_connections=None)) as client:
        async def one(i: int) -> int:
            r = await client.post("/v1/completions", json={
                "model": "acb-default", "prompt": f"request {i}: " + "lorem ipsum " * (4 + i % 8),
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            tokens: int = r.json()["usage"]["completion_tokens"]
            return tokens

        await one(-1)  # warm up
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return {"requests": n, "generated_tokens": sum(tokens), "wall_s": round(wall, 3),
            "tokens_per_s": round(sum(tokens) / wall, 1), "requests_per_s": round(n / wall, 2)}


def latency(port: int, samples: int) -> float:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        times = []
        for i in range(samples + 3):
            t0 = time.perf_counter()
            r = client.post("/v1/completions", json={"model": "acb-default", "prompt": "hi", "max_tokens": 1,
                                                     "temperature": 0})
            r.raise_for_status()
            if i >= 3:  # the first few warm the connection and the engine up
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--latency-samples", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    extra = ["--num-blocks", "256"]
    doc: dict[str, Any] = {"benchmark": "dp_router", "device": args.device, "cpu_count": os.cpu_count(),
                           "platform": platform.platform(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                           "model": "embedded default (8M-parameter random Llama)", "engine_flags": extra}
    for dp in (1, 2):
        proc, port = start(dp, extra, args.device)
        try:
            doc[f"dp{dp}"] = asyncio.run(throughput(port, args.requests, args.max_tokens))
            print(f"dp={dp}: {doc[f'dp{dp}']}", flush=True)
            if dp == 2:
                stats = httpx.get(f"http://127.0.0.1:{port}/router/stats").json()
                doc["dp2"]["routed_per_replica"] = [r["routed"] for r in stats["replicas"]]
                via = latency(port, args.latency_samples)
                direct = latency(stats["replicas"][0]["port"], args.latency_samples)
                doc["router_latency"] = {"samples": args.latency_samples, "via_router_median_ms": round(via, 2),
                                         "direct_median_ms": round(direct, 2),
                                         "added_median_ms": round(via - direct, 2)}
                print(f"1-token request: {doc['router_latency']}", flush=True)
        finally:
            stop(proc)
    doc["speedup_dp2_over_dp1"] = round(doc["dp2"]["tokens_per_s"] / doc["dp1"]["tokens_per_s"], 2)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"dp_router_{'cpu' if args.device == 'cpu' else 'gpu'}.json")
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
