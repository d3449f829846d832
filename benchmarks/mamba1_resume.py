"""Mamba1 after a prefix hit: the rest of the prompt a token at a time vs recomputing it all.

    python benchmarks/mamba1_resume.py [--arch mamba|jamba] [--prefix 512] [--tails 16,64,256,1024]

Mamba1's selective scan takes no initial state, so after a prefix hit acb runs the Mamba layers
over the rest of the prompt one token at a time (their decode form, which reads the state), while
the other layers take it whole (``acb.runner.linear_state.STEPWISE``). This measures, for each
tail length, one request of prefix + tail (one new token) on an engine where the prefix is cached
(sent once before, untimed) against the same request on an engine without prefix caching (the
whole prompt in one scan), the two engines alternating, best of ``--repeats``. The tail length
past which the hit stops paying is where stepping costs more than the scan over prefix + tail.
Writes ``benchmarks/results/mamba1_resume_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import acb  # noqa: E402


def build(arch: str, hidden: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch == "mamba":
        cfg = AutoConfig.for_model("mamba", hidden_size=hidden, num_hidden_layers=4, vocab_size=512, state_size=16)
    else:
        cfg = AutoConfig.for_model(
            "jamba",
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=4,
            attn_layer_period=4,
            attn_layer_offset=3,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            use_mamba_kernels=False,
        )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def timed(eng: acb.Engine, prompt: list[int]) -> float:
    t = time.perf_counter()
    eng.generate(prompt, max_new_tokens=1, ignore_eos=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="mamba", choices=("mamba", "jamba"))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--tails", default="16,64,256,1024")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    model = build(args.arch, args.hidden)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 500, (args.prefix,), generator=g).tolist()
    rows = {}
    cfg = {"num_blocks": 512, "page_size": 16, "max_batch_tokens": 4096}
    hit_cfg = acb.ContinuousBatchingConfig(**cfg)
    cold_cfg = acb.ContinuousBatchingConfig(allow_block_sharing=False, **cfg)
    with acb.Engine(model, hit_cfg) as hit, acb.Engine(model, cold_cfg) as cold:
        timed(hit, prefix[:32] + [1]), timed(cold, prefix[:32] + [1])  # warm-up
        for tail_len in [int(t) for t in args.tails.split(",")]:
            best_hit = best_cold = float("inf")
            for _ in range(args.repeats):
                tail = torch.randint(3, 500, (tail_len,), generator=g).tolist()
                hit.reset_prefix_cache()
                hit.generate(prefix, max_new_tokens=1, ignore_eos=True)  # cached, untimed
                before = hit.stats.prefix_hits
                best_hit = min(best_hit, timed(hit, prefix + tail))
                assert hit.stats.prefix_hits - before >= args.prefix - 16, hit.stats
                best_cold = min(best_cold, timed(cold, prefix + tail))
            rows[tail_len] = {
                "hit_stepwise_s": round(best_hit, 4),
                "recompute_s": round(best_cold, 4),
                "hit_over_recompute": round(best_hit / best_cold, 3),
            }
            print(tail_len, rows[tail_len], flush=True)
    out = {
        "arch": args.arch,
        "hidden": args.hidden,
        "prefix": args.prefix,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "loadavg_at_end": os.getloadavg(),
        "rows": rows,
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "mamba1_resume_cpu.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
