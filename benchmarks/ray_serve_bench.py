"""``acb serve --ray`` with 1 and 2 replicas against one plain ``acb serve``: the same load
generator (``acb.bench.serve``'s: streaming chat completions of the same chats, greedy, at fixed
concurrency), the same tiny checkpoint, in one run; and each server's start-up time (process
start to ``/health`` 200).

    python benchmarks/ray_serve_bench.py [--concurrency 16] [--requests 64] [--max-tokens 32]

On this 2-core machine two replicas share the same two cores as one, so the figures show the
routing layer's cost (Ray Serve's proxy and a handle hop per request) more than a gain; on a
machine with a device per replica the replicas' throughput adds up. Writes
``benchmarks/results/ray_serve_cpu.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from acb.bench.serve import Server, Target, _env, _free_port, at_concurrency, make_chats, save_checkpoint


def start(kind: str, ckpt: str, log_dir: str, replicas: int = 1) -> Server:
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "acb",
        "serve",
        "--model",
        ckpt,
        "--served-model-name",
        "bench",
        "--port",
        str(port),
        "--page-size",
        "16",
        "--num-blocks",
        "512",
        "--grace-period",
        "1",
    ]
    if kind == "ray":
        argv += ["--ray", "--num-replicas", str(replicas)]
    return Server(f"{kind}-{replicas}", argv, port, os.path.join(log_dir, f"{kind}-{replicas}.log"), _env())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/ray_serve_cpu.json")
    args = ap.parse_args()
    chats = make_chats(args.requests, 40, 400, seed=5)
    rows = []
    with tempfile.TemporaryDirectory(prefix="acb-ray-bench-") as tmp:
        ckpt = os.path.join(tmp, "model")
        model = save_checkpoint(ckpt, "default")
        for kind, replicas in (("plain", 1), ("ray", 1), ("ray", 2)):
            server = start(kind, ckpt, tmp, replicas)
            try:
                ready = server.wait_ready(timeout=300)
                target = Target(server.name, port=server.port, model="bench", extra_body={"ignore_eos": True})

                async def drive() -> dict:
                    await at_concurrency(target, chats[:8], 4, args.max_tokens)  # warm-up
                    row = await at_concurrency(target, chats, args.concurrency, args.max_tokens)
                    await target.close()
                    return row

                row = asyncio.run(drive())
                row.update(server=server.name, ready_s=ready)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
            finally:
                server.stop()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "model": model,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{args.requests} streamed chats at concurrency {args.concurrency}, {args.max_tokens} tokens each, "
        f"{result['date']}\n"
    )
    print("| server | start-up s | output tok/s | requests/s | TTFT p50 ms | TTFT p90 ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['server']} | {r['ready_s']:.1f} | {r['tokens_per_s']:.0f} | {r['requests_per_s']:.2f} | "
            f"{1e3 * r['ttft_s']['p50']:.0f} | {1e3 * r['ttft_s']['p90']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
