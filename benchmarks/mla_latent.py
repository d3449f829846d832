"""MLA paged as its latent (``mla_latent_cache=True``) against the expanded heads: offline time and KV
bytes per token, three engines alternating on one model in one run: the expanded heads, the latent
attended by B1 (the module's own ``expand_kv`` over the gathered context, ``acb.runner.latent.ABSORB
= False``) and by B3 (the absorbed query over the latent as one head: decode rows and short chunks).

A DeepSeek-V3-shaped model (hidden 256, 4 layers, 8 heads, latent 64 + 16, random weights), 16
requests of 128 and of 1,024 prompt tokens, 32 new tokens each (``total``), and the same with 1 new
token (``prefill``); ``decode`` is the difference of their bests (31 decode steps). Each side's best of ``--rounds``.

    python benchmarks/mla_latent.py [--rounds 2] [--threads N]

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


def run(model: torch.nn.Module, prompts: list[list[int]], latent: bool, absorb: bool) -> tuple[float, float, int]:
    from acb.runner import latent as latent_mod

    latent_mod.ABSORB = absorb  # read when the engine starts
    # no prefix caching: each run computes its prompts (the prefill-only run and the full one share them)
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=1400, page_size=32, mla_latent_cache=latent, allow_block_sharing=False
    )
    with acb.Engine(model, cfg) as eng:
        eng.generate_batch(prompts[:2], max_new_tokens=4, ignore_eos=True, progress_bar=False)  # warm-up
        t0 = time.perf_counter()
        eng.generate_batch(prompts, max_new_tokens=1, ignore_eos=True, progress_bar=False)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        eng.generate_batch(prompts, max_new_tokens=32, ignore_eos=True, progress_bar=False)
        total = time.perf_counter() - t0
        per_token = sum(eng.runner.kv_cache.spec.bytes_per_token().values())
    latent_mod.ABSORB = True
    return total, prefill, per_token


SIDES = {"expanded": (False, True), "latent_b1": (True, False), "latent_b3": (True, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("deepseek_v3", **CONFIG)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    results: dict[str, object] = {"torch_threads": torch.get_num_threads()}
    for ctx in (128, 1024):
        prompts = [torch.randint(3, 4000, (ctx,), generator=g).tolist() for _ in range(16)]
        best: dict[str, dict[str, float]] = {}
        size: dict[str, int] = {}
        for _ in range(args.rounds):
            for name, (latent, absorb) in SIDES.items():
                total, prefill, per_token = run(model, prompts, latent, absorb)
                b = best.setdefault(name, {"total_s": total, "prefill_s": prefill})
                b["total_s"] = min(b["total_s"], total)
                b["prefill_s"] = min(b["prefill_s"], prefill)
                size[name] = per_token
        for b in best.values():  # the best of each, less the best prefill (a difference per run is noisier)
            b["decode_s"] = b["total_s"] - b["prefill_s"]
        exp = best["expanded"]
        results[str(ctx)] = {
            **{name: {k: round(v, 3) for k, v in b.items()} for name, b in best.items()},
            "decode_over_expanded": {
                name: round(best[name]["decode_s"] / exp["decode_s"], 2) for name in ("latent_b1", "latent_b3")
            },
            "total_over_expanded": {
                name: round(best[name]["total_s"] / exp["total_s"], 2) for name in ("latent_b1", "latent_b3")
            },
            "bytes_per_token": size,
        }
    text = json.dumps(results, indent=1)
    print(text)
    (Path(__file__).parent / "results" / "mla_latent_cpu.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
