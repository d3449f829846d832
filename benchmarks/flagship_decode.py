"""Decode throughput of the late-2026 layer kinds issue 39 added, acb against padded
``model.generate`` in one run, and what a request costs in memory at a 4k context.

    python benchmarks/flagship_decode.py [--requests 32] [--tokens 64]

Four families at one size (hidden 256, 8 layers, vocabulary 4,096, float32 on CPU, random
weights, greedy, EOS ignored): Gemma 4 text (per-layer page shapes: full-attention layers twice
as wide, one KV head, the last two layers reading earlier ones' K/V), Bamba (Mamba2 state layers
beside attention layers, 3 to 1), Jamba (Mamba1 state layers beside attention, whose prompts
acb prefills whole) and DeepSeek V3.2 (indexed sparse attention: each layer's indexer selects
64 cached tokens per query; acb pages the indexer keys beside the latent attention's K/V, which
it caches expanded per head). ``--requests`` prompts of mixed lengths (16 to 256 tokens), each decoding
``--tokens`` tokens; ``generate`` gets them as one left-padded batch. Memory at 4k: the KV bytes
of 4,096 tokens (every cache group's pages) plus the per-request state of the state layers.
Writes ``benchmarks/results/flagship_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import acb

COMMON = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=8,
    num_attention_heads=8,
    max_position_embeddings=4096,
)
FAMILIES = {
    "gemma4_text": dict(
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        sliding_window=128,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=4096,
    ),
    "bamba": dict(
        num_key_value_heads=2,
        attn_layer_indices=[3, 7],
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=32,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
    ),
    "jamba": dict(
        num_key_value_heads=2,
        attn_layer_period=4,
        attn_layer_offset=3,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=16,
    ),
    # indexed sparse attention (DSA): latent attention whose every layer's indexer picks the 64
    # cached tokens each query attends to (most of these prompts are longer)
    "deepseek_v32": dict(
        num_key_value_heads=8,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=64,
        layer_types=["indexed_attention"] * 8,
        mlp_layer_types=["dense"] * 8,
    ),
}


def build(arch: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(COMMON, **FAMILIES[arch])
    if arch == "gemma4_text":
        kw["layer_types"] = kw["layer_types"] * 2
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kw), dtype=torch.float32).eval()


def run_acb(model: torch.nn.Module, prompts: list[list[int]], tokens: int) -> dict:
    blocks = sum(len(p) + tokens for p in prompts) // 16 + 2 * len(prompts) + 16
    with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=blocks, page_size=16)) as eng:
        eng.generate_batch(prompts[:2], max_new_tokens=4, ignore_eos=True, progress_bar=False)  # warm-up
        t0 = time.perf_counter()
        res = eng.generate_batch(prompts, max_new_tokens=tokens, ignore_eos=True, progress_bar=False)
        wall = time.perf_counter() - t0
        runner = eng.runner
        spec = runner.kv_cache.spec
        state = runner.states.bytes_per_request() if runner.linear is not None else 0
        groups = {f"{h}x{d}": len(layers) for (h, d), layers in spec.kv_shapes().items()}
        if spec.index_layers:  # the indexers' key-only layers (one key per token each)
            groups[f"index keys 1x{spec.shape_of(spec.layers_of('index keys')[0])[1]}"] = len(spec.index_layers)
        kv_per_token = sum(spec.bytes_per_token().values())
        whole = runner.cfg.whole_prefill
    out = sum(len(o.generated_tokens) for o in res.values())
    return {
        "tokens_per_s": out / wall,
        "wall_s": wall,
        "kv_groups": groups,
        "kv_bytes_per_token": kv_per_token,
        "state_bytes_per_request": state,
        "bytes_per_request_at_4k": 4096 * kv_per_token + state,
        "whole_prefill": whole,
    }


def run_generate(model: torch.nn.Module, prompts: list[list[int]], tokens: int) -> dict:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate wants for a decoder
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, **kw)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
        wall = time.perf_counter() - t0
    return {"tokens_per_s": (out.shape[1] - width) * len(prompts) / wall, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--only", help="comma-separated families")
    ap.add_argument("--out", default="benchmarks/results/flagship_cpu.json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 257, (args.requests,), generator=g).tolist()
    prompts = [torch.randint(3, COMMON["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    rows = []
    for arch in args.only.split(",") if args.only else FAMILIES:
        model = build(arch)
        a = run_acb(model, prompts, args.tokens)
        gen = run_generate(model, prompts, args.tokens)
        rows.append({"model": arch, "params": sum(p.numel() for p in model.parameters()), "acb": a, "generate": gen})
        print(json.dumps(rows[-1]), file=sys.stderr)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "requests": args.requests,
        "prompt_tokens": f"{min(lengths)}-{max(lengths)}",
        "new_tokens": args.tokens,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{args.requests} requests of {result['prompt_tokens']} prompt tokens, {args.tokens} new tokens each, "
        f"{result['date']}, {result['machine']}\n"
    )
    print(
        "| model | parameters | acb tok/s | padded generate tok/s | acb / generate | KV groups (heads x dim: layers) "
        "| KV per token | state per request | per request at 4k |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, gen = r["acb"], r["generate"]
        groups = ", ".join(f"{k}: {v}" for k, v in a["kv_groups"].items()) or "none"
        print(
            f"| {r['model']} | {r['params'] / 1e6:.1f} M | {a['tokens_per_s']:.0f} | {gen['tokens_per_s']:.0f} | "
            f"{a['tokens_per_s'] / gen['tokens_per_s']:.2f}x | {groups} | {a['kv_bytes_per_token'] / 1024:.1f} KiB | "
            f"{a['state_bytes_per_request'] / 1024:.0f} KiB | {a['bytes_per_request_at_4k'] / 2**20:.1f} MiB |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
