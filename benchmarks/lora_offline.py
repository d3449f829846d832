"""LoRA adapters (issue 56, item 6): offline throughput with 0, 1, 4 and 16 adapters spread over a
batch, against the base model alone, the grouped form against the gathered one and the per-step
pick (``acb.runner.lora.GATHERED``: False, True, None), and against ``PeftModel.generate`` (padded) with one adapter; and
the memory per adapter. One run, one process.

    python benchmarks/lora_offline.py [--prompts 48] [--new 32] [--rounds 2] [--rank 16]
        [--out benchmarks/results/lora_cpu.json]

Model: ``acb generate``'s default Llama (hidden 256, 4 layers, random weights, float32, CPU).
Adapters: random PEFT adapters of rank ``--rank`` on every linear of the decoder (q, k, v, o, gate,
up, down), saved with ``save_pretrained`` and added with ``engine.add_lora``; request i uses
adapter ``i % k`` (k = 1, 4, 16), "0 adapters" is an engine with ``max_loras=16`` and no request
naming one (the interception's cost alone). Workload: prompts of 16 to 128 random tokens, ``--new``
tokens each, EOS ignored. Engine start and the adapters' loading are outside the timed region;
one warm-up batch runs first on each engine; prefix caching is off (each side runs the same
prompts). Sides alternate ``--rounds`` times, best of each.
Padded ``generate`` (the base model, and the PeftModel with adapter 0) runs groups of 16 prompts,
left-padded, credited with the requests' own tokens, in each round after the engines' sides (the
engines idle meanwhile), so that both see the same load. The load average at the start and end is in
the result.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

import acb
import acb.runner.lora as runner_lora
from acb.lora import load_adapter, lora_targets
from acb.models import default_model
from acb.runner.lora import reserved_bytes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: torch.nn.Module, n: int, rank: int, folder: Path) -> list[Path]:
    from peft import LoraConfig, get_peft_model

    out = []
    for i in range(n):
        torch.manual_seed(100 + i)
        m = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
        m.save_pretrained(folder / f"a{i}")
        out.append(folder / f"a{i}")
    return out


def peft_model(base: torch.nn.Module, folder: Path) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()


def padded_generate(model: torch.nn.Module, prompts: list[list[int]], new: int, group: int = 16) -> float:
    """Seconds for left-padded ``generate`` over groups of ``group`` prompts."""
    t0 = time.perf_counter()
    for i in range(0, len(prompts), group):
        chunk = prompts[i : i + group]
        width = max(map(len, chunk))
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(chunk):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/results/lora_cpu.json")
    args = ap.parse_args()
    load_start = os.getloadavg()
    base = default_model()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 200, (int(n),), generator=g).tolist()
        for n in torch.randint(16, 129, (args.prompts,), generator=g)
    ]
    tokens = args.prompts * args.new
    tmp = Path(tempfile.mkdtemp(prefix="acb_lora_bench_"))
    folders = make_adapters(base, 16, args.rank, tmp)

    pm = peft_model(base, folders[0])  # (before the engines swap the base model's attention)
    # prefix caching off: every side reruns the same prompts on one engine, and a side after another
    # of the same adapter would reuse its prompts' blocks (it did until 2026-11-29: "1 adapters,
    # auto", the grouped form itself at one adapter, read 1.4-1.6x "1 adapters, grouped" in 3 runs)
    base_cfg = acb.ContinuousBatchingConfig(num_blocks=512, page_size=16, allow_block_sharing=False)
    lora_cfg = acb.ContinuousBatchingConfig(
        num_blocks=512, page_size=16, max_loras=16, max_lora_rank=args.rank, allow_block_sharing=False
    )

    def run(engine: acb.Engine, k: int) -> tuple[float, list[list[int]]]:
        loras = [f"a{i % k}" for i in range(len(prompts))] if k else None
        t0 = time.perf_counter()
        res = engine.generate_batch(prompts, max_new_tokens=args.new, ignore_eos=True, lora=loras, progress_bar=False)
        return time.perf_counter() - t0, [o.generated_tokens for o in res.values()]

    forms = {"grouped": False, "gathered": True, "auto": None}
    sides: dict[str, tuple[bool, int, bool | None]] = {"base engine (max_loras=0)": (False, 0, None)}
    for k in (0, 1, 4, 16):
        for form in forms if k else ("auto",):
            sides[f"{k} adapters, {form}" if k else "0 adapters (max_loras=16)"] = (True, k, forms[form])
    best: dict[str, float] = {}
    toks: dict[str, list[list[int]]] = {}
    gen: dict[str, float] = {}
    for rnd in range(args.rounds + 1):  # round 0: warm-up
        # the engines run while generate does not, and the other way round (a model an engine holds
        # runs its own forward outside the engine's steps, but not at full speed)
        plain, eng = acb.Engine(base, base_cfg), acb.Engine(base, lora_cfg)
        plain.start()
        eng.start()
        for i, f in enumerate(folders):
            eng.add_lora(f"a{i}", str(f))
        for name, (lora, k, gathered) in sides.items():
            runner_lora.GATHERED = gathered
            s, out = run(eng if lora else plain, k)
            if rnd:
                best[name] = min(best.get(name, float("inf")), s)
                toks[name] = out
        runner_lora.GATHERED = None
        plain.stop()
        eng.stop()
        for name, model in (("base model", base), ("PeftModel (1 adapter)", pm)):
            s = padded_generate(model, prompts, args.new)
            if rnd:
                gen[name] = min(gen.get(name, float("inf")), s)
    same_forms = all(
        toks[f"{k} adapters, grouped"] == toks[f"{k} adapters, {f}"] for k in (1, 4, 16) for f in ("gathered", "auto")
    )
    same_base = toks["0 adapters (max_loras=16)"] == toks["base engine (max_loras=0)"]

    ad = load_adapter(folders[0], base, max_rank=args.rank, name="a0")
    targets = lora_targets(base)
    per_slot = reserved_bytes(targets, 16, args.rank) // 17
    result = {
        "benchmark": "lora_offline",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "model": "acb default Llama (hidden 256, 4 layers, vocab 259), float32, CPU",
        "adapter": f"rank {args.rank}, alpha {2 * args.rank}, on {', '.join(TARGETS)} ({len(targets)} linears)",
        "workload": f"{args.prompts} prompts of 16-128 tokens, {args.new} new tokens each, EOS ignored",
        "rounds": args.rounds,
        "tokens_per_s": {name: round(tokens / s, 1) for name, s in best.items()},
        "vs_base_engine": {name: round(best["base engine (max_loras=0)"] / s, 3) for name, s in best.items()},
        "generate_padded_tokens_per_s": {name: round(tokens / s, 1) for name, s in gen.items()},
        "acb_1_adapter_vs_peft_generate": round(gen["PeftModel (1 adapter)"] / best["1 adapters, auto"], 2),
        "forms_give_the_same_tokens": same_forms,
        "no_adapter_rows_equal_base_engine_tokens": same_base,
        "memory_per_adapter_bytes": {
            "adapter tensors (LoraAdapter.nbytes)": ad.nbytes,
            "one slot of the stacked buffers (max_lora_rank)": per_slot,
        },
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
