"""Decode throughput of a hybrid linear-attention model (Qwen3.5 text: three gated-delta-rule
layers to one attention layer) against a dense model of the same size (Qwen3: attention in every
layer), on acb and on padded ``model.generate``, in one run; and the recurrent state per request.

    python benchmarks/hybrid_decode.py [--requests 16] [--prompt 64] [--tokens 64]

transformers' continuous batching (5.23) does not run linear-attention layers, so it is not a
baseline here. Both models: hidden 256, 8 layers, 8 heads (2 KV heads, head_dim 32), MLP 704,
vocabulary 4,096, float32 on CPU; random weights (greedy decode, EOS ignored). Writes
``benchmarks/results/hybrid_cpu.json``.
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

SIZE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
)
LINEAR = dict(
    linear_num_value_heads=8,
    linear_num_key_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
)


def models() -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    torch.manual_seed(0)
    return {
        "hybrid (qwen3_5)": AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**SIZE, **LINEAR)).eval(),
        "dense (qwen3)": AutoModelForCausalLM.from_config(Qwen3Config(**SIZE)).eval(),
    }


def params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def run_acb(model: torch.nn.Module, prompts: list[list[int]], tokens: int) -> dict:
    cfg = acb.ContinuousBatchingConfig(num_blocks=len(prompts) * (len(prompts[0]) + tokens) // 16 + 16, page_size=16)
    with acb.Engine(model, cfg) as eng:
        eng.generate_batch(prompts[:2], max_new_tokens=4, ignore_eos=True, progress_bar=False)  # warm-up
        t0 = time.perf_counter()
        res = eng.generate_batch(prompts, max_new_tokens=tokens, ignore_eos=True, progress_bar=False)
        wall = time.perf_counter() - t0
        runner = eng.runner
        states = runner.states.bytes_per_request() if runner is not None and runner.linear is not None else 0
        kv_per_token = eng.config.kv_cache_bytes / (eng.config.num_blocks * eng.config.block_size)
    out = sum(len(o.generated_tokens) for o in res.values())
    return {
        "tokens_per_s": out / wall,
        "wall_s": wall,
        "state_bytes_per_request": states,
        "kv_bytes_per_token": kv_per_token,
    }


def run_generate(model: torch.nn.Module, prompts: list[list[int]], tokens: int) -> dict:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.no_grad():
        model.generate(ids[:2], max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, attention_mask=torch.ones_like(ids)
        )
        wall = time.perf_counter() - t0
    return {"tokens_per_s": (out.shape[1] - ids.shape[1]) * ids.shape[0] / wall, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/hybrid_cpu.json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, SIZE["vocab_size"], (args.prompt,), generator=g).tolist() for _ in range(args.requests)]
    rows = []
    for name, model in models().items():
        a = run_acb(model, prompts, args.tokens)
        gen = run_generate(model, prompts, args.tokens)
        rows.append({"model": name, "params": params(model), "acb": a, "generate": gen})
        print(json.dumps(rows[-1]), file=sys.stderr)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "requests": args.requests,
        "prompt_tokens": args.prompt,
        "new_tokens": args.tokens,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{args.requests} requests of {args.prompt} prompt tokens, {args.tokens} new tokens each, "
        f"{result['date']}, {result['machine']}\n"
    )
    print(
        "| model | parameters | acb tok/s | padded generate tok/s | acb / generate | state per request | KV per token |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        a, gen = r["acb"], r["generate"]
        print(
            f"| {r['model']} | {r['params'] / 1e6:.1f} M | {a['tokens_per_s']:.0f} | {gen['tokens_per_s']:.0f} | "
            f"{a['tokens_per_s'] / gen['tokens_per_s']:.2f}x | {a['state_bytes_per_request'] / 1024:.0f} KiB | "
            f"{a['kv_bytes_per_token'] / 1024:.1f} KiB |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
