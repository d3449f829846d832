"""Does ``torch.compile`` (``default_compile_level``) make acb faster? The offline workload's
acb side (same model, prompts and engine settings as ``acb bench offline``) with compile level
0 and 1, each in a fresh process (dynamo stays out of the uncompiled run), engine start and a
warm-up generation (which triggers compilation) outside the timed region.

    python benchmarks/compile_bench.py [--device cuda] [--prompts 48]

Prints tokens/s per level and the speed-up; checks both levels generate the same tokens
(greedy); writes ``benchmarks/results/compile_{cpu,gpu}.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def one(level: int, device: str, prompts: int) -> dict:
    import torch

    import acb
    from acb.bench.common import ModelSpec, blocks_for_all, random_prompts
    from acb.bench.offline import MAX_BATCH_TOKENS, MAX_REQUESTS

    spec = ModelSpec("default", device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    model = spec.build()
    ps = random_prompts(prompts, 16, 256, spec.vocab, seed=0)
    g = torch.Generator().manual_seed(1)
    outs = torch.randint(16, 65, (prompts,), generator=g).tolist()
    cfg = acb.ContinuousBatchingConfig(
        page_size=32,
        num_blocks=blocks_for_all([len(p) + o for p, o in zip(ps, outs)], 32) + 1,
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_requests_per_batch=MAX_REQUESTS,
        default_compile_level=level,
    )
    t0 = time.perf_counter()
    with acb.Engine(model, cfg) as eng:
        # warm-up: a decode-only and a mixed step of several shapes, so compilation happens here
        warm = [
            eng.submit(p[:n], acb.SamplingParams(max_new_tokens=6, ignore_eos=True)) for p, n in zip(ps, (5, 40, 90))
        ]
        [h.result() for h in warm]
        setup = time.perf_counter() - t0
        t1 = time.perf_counter()
        hs = [eng.submit(p, acb.SamplingParams(max_new_tokens=o, ignore_eos=True)) for p, o in zip(ps, outs)]
        tokens = [h.result().generated_tokens for h in hs]
        dt = time.perf_counter() - t1
    n = sum(map(len, tokens))
    return {
        "level": level,
        "seconds": dt,
        "setup_s": setup,
        "tokens_per_s": n / dt,
        "output_tokens": n,
        "tokens": tokens,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(one(args.child, args.device, args.prompts)))
        return 0
    from acb.bench.common import machine_info, write_json

    runs = []
    for level in (0, 1):
        p = subprocess.run(
            [sys.executable, __file__, "--device", args.device, "--prompts", str(args.prompts), "--child", str(level)],
            capture_output=True,
            text=True,
        )
        if p.returncode != 0:
            print(p.stderr[-3000:], file=sys.stderr)
            return p.returncode
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    same = runs[0]["tokens"] == runs[1]["tokens"]
    for r in runs:
        r.pop("tokens")
    speedup = runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"]
    kind = "gpu" if args.device.startswith("cuda") else "cpu"
    doc = {
        "machine": machine_info(args.device),
        "workload": f"offline acb side, {args.prompts} prompts (lengths 16-256, outputs 16-64), default bench model",
        "runs": runs,
        "compiled_vs_eager": speedup,
        "same_tokens": same,
    }
    path = f"benchmarks/results/compile_{kind}.json"
    write_json(path, doc)
    for r in runs:
        print(
            f"default_compile_level={r['level']}: {r['tokens_per_s']:.1f} tok/s "
            f"({r['output_tokens']} tokens in {r['seconds']:.2f} s; start + warm-up {r['setup_s']:.1f} s)"
        )
    print(f"compiled / eager: {speedup:.2f}x; same tokens: {same}; wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
