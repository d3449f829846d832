"""Prefix caching on the model's own cache (issue 53 item 3): a shared prefix sent once, then
extended, with and without prefix caching, in one run.

    python benchmarks/own_cache_prefix.py [--out benchmarks/results/own_cache_prefix_cpu.json]

Models (random weights, float32, CPU; attention outside transformers' attention interface, so they
run on their own ``DynamicCache`` per request, ``acb.runner.own_cache_runner``): the tests' tiny GPT-J
(``tests/test_model_sweep.py``'s catalogue config: hidden 64, 2 layers, where a forward's fixed
cost dominates) and ``own_cache_offline.py``'s GPT-J shape (hidden 256, 8 layers). Workload: a 160-token prefix as one
request (8 new tokens), then 8 prompts extending it by 8 to 64 tokens, sent as one batch
(8 new tokens each, EOS ignored). With prefix caching, the 8 start from a copy of the first
request's cache cut at the prefix's last block boundary. Each side has its engine; they run a
warm-up pass and five timed passes, interleaved, the prefix cache reset before each (so each pass
starts cold).
Reported: prompt tokens the engine computed (its ``prefill_tokens``), the tokens read from the
cache, the wall time of each timed pass and their minimum; the outputs of both sides are checked
equal. One torch thread by default: on the shared 2-core machine it was measured on, two threads'
OpenMP workers made a one-token forward take 10-60x longer and the passes vary 5x.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

import acb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.own_cache_offline import build  # noqa: E402
from tests.conftest import prompts_of_lengths  # noqa: E402
from tests.test_model_sweep import ms  # noqa: E402

PASSES = 5
PREFIX = 160
TAILS = [8, 16, 24, 32, 40, 48, 56, 64]
NEW = 8


def one_pass(eng: acb.Engine, prefix: list[int], prompts: list[list[int]]) -> tuple[float, int, list]:
    """The prefix, then its extensions as one batch, from a cold prefix cache: wall time, prompt
    tokens computed, outputs."""
    eng.reset_prefix_cache()
    before = eng.stats.prefill_tokens
    t0 = time.perf_counter()
    eng.generate(prefix, max_new_tokens=NEW, ignore_eos=True)
    res = list(eng.generate_batch(prompts, max_new_tokens=NEW, ignore_eos=True, progress_bar=False).values())
    return time.perf_counter() - t0, eng.stats.prefill_tokens - before, res


def compare(model: torch.nn.Module, name: str) -> dict:
    """Both sides on one model, their passes interleaved (the machine's load drifts alike on both)."""
    vocab = int(model.config.vocab_size)
    prefix = prompts_of_lengths([PREFIX], vocab=vocab, seed=7)[0]
    prompts = [prefix + t for t in prompts_of_lengths(TAILS, vocab=vocab, seed=8)]
    sides: dict[str, dict] = {}
    engines = {
        caching: acb.Engine(
            model, acb.ContinuousBatchingConfig(num_blocks=512, page_size=16, allow_block_sharing=caching)
        )
        for caching in (True, False)
    }
    try:
        for eng in engines.values():
            eng.start()
        walls: dict[bool, list[float]] = {True: [], False: []}
        outs = {}
        for i in range(PASSES + 1):  # (the first pass of each warms up)
            for caching, eng in engines.items():
                wall, prefill, res = one_pass(eng, prefix, prompts)
                if i:
                    walls[caching].append(wall)
                outs[caching] = [o.generated_tokens for o in res]
                cfg = eng.runner.cfg
                sides["with_prefix_caching" if caching else "without_prefix_caching"] = {
                    "prefix_caching": cfg.prefix_caching,
                    "snapshot_slots": cfg.state_snapshots,
                    "prompt_tokens": len(prefix) + sum(len(p) for p in prompts),
                    "prefill_tokens_computed": prefill,
                    "cached_tokens": sum(o.num_cached_tokens for o in res),
                    "wall_s_min": round(min(walls[caching], default=wall), 4),
                    "wall_s_passes": [round(w, 4) for w in walls[caching]],
                }
    finally:
        for eng in engines.values():
            eng.shutdown()
    on, off = sides["with_prefix_caching"], sides["without_prefix_caching"]
    assert outs[True] == outs[False], "prefix caching changed the outputs"
    assert on["prefix_caching"] and not off["prefix_caching"]
    return {
        "model": name,
        **sides,
        "prefill_tokens_ratio": round(off["prefill_tokens_computed"] / max(on["prefill_tokens_computed"], 1), 2),
        "wall_speedup": round(off["wall_s_min"] / on["wall_s_min"], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/own_cache_prefix_cpu.json")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tiny = AutoModelForCausalLM.from_config(ms.tiny_config("gptj"), dtype=torch.float32).eval()
    result = {
        "benchmark": "own_cache_prefix",
        "workload": f"a {PREFIX}-token prefix, then {len(TAILS)} extensions by {TAILS} tokens, {NEW} new tokens each",
        "timing": f"min of {PASSES} passes per side, interleaved, after a warm-up pass; the prefix cache reset before each",
        "load_average_1m": round(os.getloadavg()[0], 2),
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "runs": [
            compare(tiny, "tests' tiny GPT-J (catalogue config: hidden 64, 2 layers), float32, own-cache path"),
            compare(build("gptj"), "GPT-J-shaped (hidden 256, 8 layers: own_cache_offline's), float32, own-cache path"),
        ],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
