"""``shared-prefix``: every prompt is one shared prefix plus its own suffix; acb with prefix
caching on vs off (same process, same model and prompts).

On every benchmark architecture (``--arch``): the Llama, a Qwen3.5-shaped hybrid (whose linear-
attention layers resume from snapshots of their state kept at block boundaries: each row reports
the snapshots restored) and a DeepSeek-V3-shaped MLA model (also run with its latent paged,
``mla_latent_cache=True``)."""

from __future__ import annotations

import time
from typing import Any

import torch

from acb.api.engine import Engine
from acb.bench.common import ModelSpec, peak_memory_bytes, reset_peak_memory
from acb.config import ContinuousBatchingConfig
from acb.sampling_params import SamplingParams

SIZES = {
    "tiny": dict(num_prompts=16, prefix_len=64, suffix_len=8, max_new=8),
    "small": dict(num_prompts=32, prefix_len=128, suffix_len=16, max_new=16),
    "default": dict(num_prompts=256, prefix_len=512, suffix_len=32, max_new=32),
}


def run(size: str, spec: ModelSpec, baselines: bool = True) -> dict[str, Any]:
    p = SIZES[size]
    model = spec.build()
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, spec.vocab, (p["prefix_len"],), generator=g).tolist()
    prompts = [
        prefix + torch.randint(3, spec.vocab, (p["suffix_len"],), generator=g).tolist() for _ in range(p["num_prompts"])
    ]
    sp = SamplingParams(max_new_tokens=p["max_new"], ignore_eos=True)
    rows: list[dict[str, Any]] = []
    outputs: dict[str, list[list[int]]] = {}
    sides: list[tuple[str, bool, dict[str, Any]]] = [
        ("acb, prefix cache on", True, {}),
        ("acb, prefix cache off", False, {}),
    ]
    if getattr(model.config, "kv_lora_rank", None):  # MLA: its latent paged as well
        sides.insert(1, ("acb, prefix cache on, MLA latent paged", True, dict(mla_latent_cache=True)))
    for name, caching, extra in sides:
        cfg = ContinuousBatchingConfig(page_size=32, allow_block_sharing=caching, **extra)
        with Engine(model, cfg) as eng:
            eng.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=2))  # warm-up, another prefix
            base = eng.stats
            reset_peak_memory(spec.device)
            t0 = time.perf_counter()
            outs = [h.result() for h in [eng.submit(x, sp) for x in prompts]]
            dt = time.perf_counter() - t0
            st = eng.stats
        tokens = sum(len(o.generated_tokens) for o in outs)
        queries = st.prefix_queries - base.prefix_queries
        rows.append(
            dict(
                engine=name,
                seconds=dt,
                output_tokens=tokens,
                tokens_per_s=tokens / dt,
                requests_per_s=len(prompts) / dt,
                prefill_tokens=st.prefill_tokens - base.prefill_tokens,
                prefix_hit_rate=(st.prefix_hits - base.prefix_hits) / queries if queries else 0.0,
                # state layers: prefix hits that resumed from a snapshot of their state
                state_snapshot_restores=st.state_snapshot_restores - base.state_snapshot_restores,
                state_snapshots_cached=st.state_snapshots_cached,
                peak_memory=peak_memory_bytes(spec.device),
                settings=f"page_size=32 allow_block_sharing={caching}" + "".join(f" {k}={v}" for k, v in extra.items()),
            )
        )
        outputs[name] = [o.generated_tokens for o in outs]
    for r in rows:
        r["acb_speedup"] = rows[0]["tokens_per_s"] / r["tokens_per_s"]
    return dict(
        workload="shared-prefix",
        settings=dict(p, greedy=True, ignore_eos=True),
        rows=rows,
        outputs_identical=len({tuple(map(tuple, v)) for v in outputs.values()}) == 1,
        notes=[],
    )
