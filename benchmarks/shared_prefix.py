"""Shared-prefix workload: prefix caching on vs off, in one process, same model and prompts.

    python benchmarks/shared_prefix.py [--num-prompts 256] [--prefix-len 512] [--suffix-len 32]
                                       [--max-new-tokens 32] [--hidden 512] [--layers 8] [--json PATH]

Every prompt is one shared prefix (a system prompt / few-shot block) plus its own random
suffix. Reports output tokens/s, tokens prefilled, and the prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone

import torch
import transformers

import acb
from acb.models import tiny_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    model = tiny_model("llama", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=2048)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, args.vocab, (args.prefix_len,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, args.vocab, (args.suffix_len,), generator=g).tolist()
               for _ in range(args.num_prompts)]
    sp = acb.SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rows = {}
    outputs = {}
    for name, caching in (("cache off", False), ("cache on", True)):
        cfg = acb.ContinuousBatchingConfig(block_size=args.block_size, allow_block_sharing=caching)
        with acb.Engine(model, cfg) as eng:
            eng.generate(prompts[0][:8], acb.SamplingParams(max_new_tokens=2))  # warm-up (different prefix)
            base = eng.stats
            t0 = time.perf_counter()
            hs = [eng.submit(p, sp) for p in prompts]
            outs = [h.result() for h in hs]
            dt = time.perf_counter() - t0
            st = eng.stats
        tokens = sum(len(o.generated_tokens) for o in outs)
        queries = st.prefix_queries - base.prefix_queries
        hits = st.prefix_hits - base.prefix_hits
        rows[name] = {
            "seconds": dt, "output_tokens": tokens, "tokens_per_s": tokens / dt,
            "prefill_tokens": st.prefill_tokens - base.prefill_tokens,
            "prefix_hit_rate": hits / queries if queries else 0.0,
        }
        outputs[name] = [o.generated_tokens for o in outs]
    same = outputs["cache on"] == outputs["cache off"]
    dev = f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    print(f"shared-prefix workload: {args.num_prompts} prompts = {args.prefix_len}-token shared prefix + "
          f"{args.suffix_len}-token suffix, {args.max_new_tokens} output tokens each, greedy")
    print(f"model: random Llama {n_params / 1e6:.1f}M params, float32; device: {dev}; "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{'':<10} {'seconds':>8} {'tok/s':>8} {'prefilled':>10} {'hit rate':>9}")
    for name, r in rows.items():
        print(f"{name:<10} {r['seconds']:>8.2f} {r['tokens_per_s']:>8.1f} {r['prefill_tokens']:>10} "
              f"{r['prefix_hit_rate']:>8.1%}")
    print(f"speed-up with caching: {rows['cache on']['tokens_per_s'] / rows['cache off']['tokens_per_s']:.2f}x; "
          f"outputs identical: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": vars(args), "params": n_params, "device": dev, "torch": torch.__version__,
                       "transformers": transformers.__version__,
                       "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "results": rows, "outputs_identical": same}, f, indent=2)


if __name__ == "__main__":
    main()
