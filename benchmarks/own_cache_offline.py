"""The second runner path (the model on its own cache objects) against padded ``model.generate``,
in one run, on ``acb bench offline``'s mixed-length workload.

    python benchmarks/own_cache_offline.py [--prompts 64] [--out benchmarks/results/own_cache_cpu.json]

Models (random weights, float32, CPU): a GPT-J-shaped model (hidden 256, 8 layers, 8 heads,
vocabulary 4,096: attention outside transformers' attention interface, so only this path runs
it) and the same-sized Llama twice, forced onto this path and on acb's paged path, so that the
table shows what the paged path buys. Workload as ``acb bench offline``: prompts of 16 to 256
random tokens, each with its own output length of 16 to 128 tokens, EOS ignored. Padded
``generate`` runs groups of 32 prompts (left-padded, ``min_new_tokens = max_new_tokens =`` the
group's largest), credited with each request's own tokens only. Engine start (and its start-up
tries) is outside the timed region; one warm-up request runs first on each side.
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

SHAPE = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=8, num_attention_heads=8, max_position_embeddings=1024)


def build(arch: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch == "gptj":
        cfg = AutoConfig.for_model(
            "gptj",
            vocab_size=SHAPE["vocab_size"],
            n_embd=SHAPE["hidden_size"],
            n_layer=SHAPE["num_hidden_layers"],
            n_head=SHAPE["num_attention_heads"],
            n_positions=SHAPE["max_position_embeddings"],
            rotary_dim=16,
            n_inner=4 * SHAPE["hidden_size"],
        )
    else:
        cfg = AutoConfig.for_model("llama", intermediate_size=688, num_key_value_heads=8, **SHAPE)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def run_acb(model: torch.nn.Module, prompts: list[list[int]], outs: list[int], runner: str | None) -> dict:
    cfg = acb.ContinuousBatchingConfig(runner=runner, max_requests_per_batch=32, max_batch_tokens=2048)
    with acb.Engine(model, cfg) as eng:
        eng.generate(prompts[0][:8], max_new_tokens=2, ignore_eos=True)  # warm-up
        path = "own cache" if eng.runner.own_forward is not None else "paged"
        params = [acb.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in outs]
        t0 = time.perf_counter()
        res = eng.generate_batch(prompts, params, progress_bar=False)
        wall = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in res.values())
    assert tokens == sum(outs), (tokens, sum(outs))
    return {"path": path, "tokens_per_s": tokens / wall, "wall_s": wall}


def run_generate(model: torch.nn.Module, prompts: list[list[int]], outs: list[int], batch: int = 32) -> dict:
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=2, **kw)  # warm-up
        t0 = time.perf_counter()
        for a in range(0, len(prompts), batch):
            group, want = prompts[a : a + batch], outs[a : a + batch]
            width = max(len(p) for p in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(group):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            n = max(want)
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **kw)
        wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(outs) / wall, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/own_cache_cpu.json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 257, (args.prompts,), generator=g).tolist()
    outs = torch.randint(16, 129, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    rows = []
    for arch, runner in (("gptj", None), ("llama", "own_cache"), ("llama", None)):
        model = build(arch)
        a = run_acb(model, prompts, outs, runner)
        gen = run_generate(model, prompts, outs)
        rows.append({"model": arch, "acb": a, "generate": gen})
        print(json.dumps(rows[-1]), file=sys.stderr)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "prompts": args.prompts,
        "prompt_tokens": "16-256",
        "new_tokens": "16-128",
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.prompts} prompts of 16-256 tokens, 16-128 new tokens each, {result['date']}, {result['machine']}\n")
    print("| model | acb path | acb tok/s | padded generate tok/s | acb / generate |")
    print("|---|---|---|---|---|")
    for r in rows:
        a, gen = r["acb"], r["generate"]
        print(
            f"| {r['model']} | {a['path']} | {a['tokens_per_s']:.0f} | {gen['tokens_per_s']:.0f} | "
            f"{a['tokens_per_s'] / gen['tokens_per_s']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
