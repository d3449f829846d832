"""What each layer kind costs, as the engine lays out its cache (``engine.runner.layout``).

    python benchmarks/kind_bytes.py [--archs llama,qwen3_next,...]

For one family per layer kind, on the catalogue sweep's tiny configs (every layer kind of the real
checkpoints kept; float32), the kinds the registry finds (``acb.runner.kinds``), each kind's page
bytes per token, bytes per request row and per snapshot, the model's own caches' bytes per token,
and the prefix and offload rules it gets; MLA both as expanded heads and as its latent. Prints
a markdown table (the one in ``docs/memory.md``) and writes
``benchmarks/results/kind_bytes_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import acb  # noqa: E402
from tests.test_model_sweep import ms  # noqa: E402

ARCHS = (
    "llama",
    "gemma4_text",
    "deepseek_v3",
    "deepseek_v3:latent",
    "deepseek_v32:latent",
    "qwen3_next",
    "nemotron_h",
    "mamba2",
    "mamba",
    "kimi_linear:latent",
    "deepseek_v4",
    "gptj",
)


def layout_of(name: str) -> tuple[list[dict[str, object]], str]:
    from transformers import AutoModelForCausalLM

    arch, _, variant = name.partition(":")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ms.tiny_config(arch), dtype=torch.float32).eval()
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=32, page_size=8, cpu_offload_space=0.01, mla_latent_cache=variant == "latent"
    )
    with acb.Engine(model, cfg) as eng:
        layout = eng.runner.layout
        return layout.table(), f"{layout.prefix_rule.value} / {layout.offload.value}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default=",".join(ARCHS))
    args = ap.parse_args()
    out = {}
    lines = [
        "| model (tiny config) | kind | layers | page B/token | row B | snapshot B | own B/token | prefix / offload |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in args.archs.split(","):
        rows, rules = layout_of(name)
        out[name] = {"kinds": rows, "rules": rules}
        for i, r in enumerate(rows):
            lines.append(
                f"| {name if i == 0 else ''} | {r['kind']} | {r['layers']} | {r['page bytes/token']:,} | "
                f"{r['row bytes']:,} | {r['snapshot bytes']:,} | {r['own bytes/token']:,} | "
                f"{rules if i == 0 else ''} |"
            )
    print("\n".join(lines))
    with open(os.path.join(ROOT, "benchmarks", "results", "kind_bytes_cpu.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
