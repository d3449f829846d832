"""MLA paged as its latent (``mla_latent_cache=True``) against the expanded heads (the default):
offline decode time and KV bytes per token, the two engines alternating on one model in one run.

A DeepSeek-V3-shaped model (hidden 256, 4 layers, 8 heads, latent 64 + 16, random weights), 16
requests of 128 and of 1,024 prompt tokens, 32 new tokens each. Each side's best of ``--rounds``.

    python benchmarks/mla_latent.py [--rounds 2]

Writes ``results/mla_latent_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import acb

CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=4,
    max_position_embeddings=4096,
)


def run(model: torch.nn.Module, prompts: list[list[int]], latent: bool) -> tuple[float, int]:
    cfg = acb.ContinuousBatchingConfig(num_blocks=1400, page_size=32, mla_latent_cache=latent)
    with acb.Engine(model, cfg) as eng:
        eng.generate_batch(prompts[:2], max_new_tokens=4, ignore_eos=True, progress_bar=False)  # warm-up
        t0 = time.perf_counter()
        eng.generate_batch(prompts, max_new_tokens=32, ignore_eos=True, progress_bar=False)
        wall = time.perf_counter() - t0
        per_token = sum(eng.runner.kv_cache.spec.bytes_per_token().values())
    return wall, per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("deepseek_v3", **CONFIG)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    results = {}
    for ctx in (128, 1024):
        prompts = [torch.randint(3, 4000, (ctx,), generator=g).tolist() for _ in range(16)]
        best: dict[str, float] = {}
        size: dict[str, int] = {}
        for _ in range(args.rounds):
            for name, latent in (("expanded", False), ("latent", True)):
                wall, per_token = run(model, prompts, latent)
                best[name] = min(best.get(name, wall), wall)
                size[name] = per_token
        results[ctx] = {
            "expanded_s": round(best["expanded"], 2),
            "latent_s": round(best["latent"], 2),
            "latent_over_expanded": round(best["latent"] / best["expanded"], 2),
            "bytes_per_token": size,
        }
    text = json.dumps(results, indent=1)
    print(text)
    (Path(__file__).parent / "results" / "mla_latent_cpu.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
