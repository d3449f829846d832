"""DeepSeek V3.2 (indexed sparse attention) offline decode: the indexer's segments in one padded
call where every query selects all its keys (``acb.runner.indexed.BATCH_SEGMENTS``) against one
call per request, beside padded ``model.generate``, alternating in one process.

    python benchmarks/dsa_indexer_batch.py [--requests 32] [--tokens 64] [--rounds 3]

The model is ``flagship_decode.py``'s DeepSeek V3.2 (hidden 256, 8 layers, float32 on CPU), run
with two top-k sizes: 64 (the flagship benchmark's, so that most of its 16-256-token prompts
attend to a selection and take a call of their own) and 512 (every context here within it, as a
real V3.2's 2,048 covers most requests of an evaluation or a chat). Prints each side's best of
``--rounds`` and writes ``benchmarks/results/dsa_indexer_batch_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flagship_decode import COMMON, FAMILIES, run_generate  # noqa: E402

import acb  # noqa: E402
from acb.runner import indexed  # noqa: E402


def build(topk: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(COMMON, **FAMILIES["deepseek_v32"])
    kw["index_topk"] = topk
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v32", **kw), dtype=torch.float32).eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/dsa_indexer_batch_cpu.json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 257, (args.requests,), generator=g).tolist()
    prompts = [torch.randint(3, COMMON["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    blocks = sum(len(p) + args.tokens for p in prompts) // 16 + 2 * len(prompts) + 16
    rows = []
    for topk in (64, 512):
        model = build(topk)
        walls: dict[str, list[float]] = {"one call": [], "per request": [], "generate": []}
        tokens = {}
        with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=blocks, page_size=16)) as eng:
            eng.generate_batch(prompts[:2], max_new_tokens=4, ignore_eos=True, progress_bar=False)  # warm-up
            for _ in range(args.rounds):
                for side, on in (("one call", True), ("per request", False)):
                    indexed.BATCH_SEGMENTS = on
                    t0 = time.perf_counter()
                    res = eng.generate_batch(prompts, max_new_tokens=args.tokens, ignore_eos=True, progress_bar=False)
                    walls[side].append(time.perf_counter() - t0)
                    tokens[side] = [o.generated_tokens for o in res.values()]
                walls["generate"].append(run_generate(model, prompts, args.tokens)["wall_s"])
                print(topk, {k: round(v[-1], 2) for k, v in walls.items()}, file=sys.stderr, flush=True)
        indexed.BATCH_SEGMENTS = True
        best = {k: min(v) for k, v in walls.items()}
        rows.append(
            {
                "index_topk": topk,
                "best_wall_s": best,
                "walls": walls,
                "same_tokens": tokens["one call"] == tokens["per request"],
            }
        )
    out = args.requests * args.tokens
    print(f"{args.requests} requests of {min(lengths)}-{max(lengths)} prompt tokens, {args.tokens} new tokens each")
    print(
        "| index_topk | one call tok/s | per request tok/s | padded generate tok/s | one call / generate | per request / generate |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        b = r["best_wall_s"]
        print(
            f"| {r['index_topk']} | {out / b['one call']:.0f} | {out / b['per request']:.0f} | {out / b['generate']:.0f} | "
            f"{b['generate'] / b['one call']:.2f}x | {b['generate'] / b['per request']:.2f}x |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
