"""``offline``: N prompts of random lengths, per-request output lengths, EOS ignored.

acb, transformers' continuous batching and padded ``model.generate`` run in one process on
the same model (rebuilt from the same seed for each side) and the same prompts, and must
generate the same number of tokens per request (checked). transformers'
``model.generate_batch`` takes one ``max_new_tokens`` for all requests, so its side drives
the manager ``generate_batch`` wraps, with ``add_request(max_new_tokens=n)`` per request;
acb's side uses ``acb.Engine`` with a ``SamplingParams`` per request. Engine set-up (cache
allocation, warm-up) is outside the timed region on both sides. The padded baseline runs
``model.generate`` on consecutive groups of 32 prompts (left-padded,
``min_new_tokens = max_new_tokens =`` the group's largest target); only each request's own
tokens are credited.

``offline-uniform`` is padded ``generate``'s best case: every prompt the same length and every
output the same length, so its padding wastes nothing.

Both report a roofline: the workload's least FLOP count (``workload_flops``: every prompt
token and every generated token but the last through the body, causal attention, the LM head
on sampled rows) over each side's wall time, against this machine's matmul peak measured in
the same run (``matmul_peak_gflops``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from acb.api.engine import Engine, generate_batch
from acb.bench.common import (
    MODEL_SHAPES,
    ModelSpec,
    blocks_for_all,
    matmul_peak_gflops,
    peak_memory_bytes,
    random_prompts,
    reset_peak_memory,
    tf_page,
    workload_flops,
)
from acb.config import ContinuousBatchingConfig
from acb.runner.kv_cache import meminfo_bytes
from acb.sampling_params import SamplingParams

SIZES = {
    "tiny": dict(num_prompts=8, min_prompt_len=4, max_prompt_len=32, min_new=4, max_new=8, batch_size=4),
    "small": dict(num_prompts=32, min_prompt_len=16, max_prompt_len=128, min_new=16, max_new=48, batch_size=16),
    "default": dict(num_prompts=128, min_prompt_len=16, max_prompt_len=256, min_new=16, max_new=128, batch_size=32),
}
UNIFORM_SIZES = {
    "tiny": dict(num_prompts=8, min_prompt_len=16, max_prompt_len=16, min_new=8, max_new=8, batch_size=4),
    "small": dict(num_prompts=32, min_prompt_len=64, max_prompt_len=64, min_new=32, max_new=32, batch_size=16),
    "default": dict(num_prompts=96, min_prompt_len=128, max_prompt_len=128, min_new=64, max_new=64, batch_size=32),
}
MAX_BATCH_TOKENS = 2048
MAX_REQUESTS = 128


def patch_transformers_cpu_memory() -> str | None:
    """transformers sizes its paged cache with psutil on CPU and sees 0 bytes free without it:
    give its cache module the figures psutil would (total RAM, this process's RSS) from /proc."""
    try:
        import psutil  # noqa: F401

        return None
    except ImportError:
        pass
    from transformers.generation.continuous_batching import cache as tf_cache

    def breakdown() -> tuple[torch.device, int, int, int]:
        total = meminfo_bytes("MemTotal") or 0
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return torch.device("cpu"), total, rss, rss

    tf_cache.get_device_and_memory_breakdown = breakdown
    return "psutil missing: transformers' CPU memory probe reads /proc (MemTotal, RSS) instead"


def run_acb(spec: ModelSpec, prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    model = spec.build()
    bs = 32
    cfg = ContinuousBatchingConfig(
        page_size=bs,
        num_blocks=blocks_for_all([len(p) + o for p, o in zip(prompts, outs)], bs) + 1,
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_requests_per_batch=MAX_REQUESTS,
        seed=0,
    )
    generate_batch(
        model,
        prompts[:2],
        sampling=SamplingParams(max_new_tokens=4, ignore_eos=True),
        progress_bar=False,
        continuous_batching_config=cfg,
    )  # warm-up
    reset_peak_memory(spec.device)
    t_setup = time.perf_counter()
    engine = Engine(model, cfg)
    engine.start()
    setup = time.perf_counter() - t_setup
    try:
        t0 = time.perf_counter()
        hs = [engine.submit(p, SamplingParams(max_new_tokens=o, ignore_eos=True)) for p, o in zip(prompts, outs)]
        results = [h.result() for h in hs]
        dt = time.perf_counter() - t0
        stats = engine.stats
    finally:
        engine.shutdown()
    return dict(
        engine="acb",
        seconds=dt,
        setup_s=setup,
        tokens=[r.generated_tokens for r in results],
        settings=f"page_size={bs} num_blocks={cfg.num_blocks} max_batch_tokens={MAX_BATCH_TOKENS} "
        f"max_requests_per_batch={MAX_REQUESTS}",
        steps=stats.steps,
        peak_memory=peak_memory_bytes(spec.device),
    )


def run_transformers_cb(spec: ModelSpec, prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig as TfConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = spec.build()
    bs = 256  # transformers' default page size

    def cfg_for(ps: list[list[int]], os_: list[int]) -> TfConfig:
        return TfConfig(
            **tf_page(bs),
            num_blocks=blocks_for_all([len(p) + o for p, o in zip(ps, os_)], bs),
            max_batch_tokens=MAX_BATCH_TOKENS,
            max_requests_per_batch=MAX_REQUESTS,
            seed=0,
        )

    def gen(n: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1)  # -1: never stop early

    model.generate_batch(
        inputs=prompts[:2],
        generation_config=gen(4),
        continuous_batching_config=cfg_for(prompts[:2], [4, 4]),
        progress_bar=False,
    )  # warm-up
    cfg = cfg_for(prompts, outs)
    hints = WorkloadHints(
        max_prompt_length=max(map(len, prompts)), max_generated_length=max(outs), num_requests=len(prompts)
    )
    reset_peak_memory(spec.device)
    t_setup = time.perf_counter()
    cm = model.continuous_batching_context_manager(
        generation_config=gen(max(outs)),
        continuous_batching_config=cfg,
        block=True,
        timeout=30,
        warmup=True,
        workload_hints=hints,
    )
    manager = cm.__enter__()
    setup = time.perf_counter() - t_setup
    try:
        t0 = time.perf_counter()
        ids = [
            manager.add_request(input_ids=p, request_id=f"req_{i}", max_new_tokens=o, eos_token_id=-1)
            for i, (p, o) in enumerate(zip(prompts, outs))
        ]
        got: dict[str, Any] = {}
        while len(got) < len(ids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                got[r.request_id] = r
            elif r is None and not manager.is_running():
                raise RuntimeError("transformers' generation thread died")
        dt = time.perf_counter() - t0
    finally:
        cm.__exit__(None, None, None)
    return dict(
        engine="transformers CB",
        seconds=dt,
        setup_s=setup,
        tokens=[list(got[f"req_{i}"].generated_tokens) for i in range(len(prompts))],
        settings=f"paged|sdpa page_size={bs} num_blocks={cfg.num_blocks} max_batch_tokens={MAX_BATCH_TOKENS} "
        f"max_requests_per_batch={MAX_REQUESTS}",
        peak_memory=peak_memory_bytes(spec.device),
    )


@torch.inference_mode()
def run_generate(spec: ModelSpec, prompts: list[list[int]], outs: list[int], batch_size: int) -> dict[str, Any]:
    model = spec.build()

    def padded(group: list[list[int]], n: int) -> torch.Tensor:
        L = max(map(len, group))
        ids = torch.zeros((len(group), L), dtype=torch.long)
        mask = torch.zeros((len(group), L), dtype=torch.long)
        for r, p in enumerate(group):
            ids[r, L - len(p) :] = torch.tensor(p)
            mask[r, L - len(p) :] = 1
        out = model.generate(
            ids.to(spec.device),
            attention_mask=mask.to(spec.device),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        return out[:, L:].cpu()

    padded(prompts[:2], 4)  # warm-up
    reset_peak_memory(spec.device)
    tokens: list[list[int]] = []
    wasted = 0
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch_size):
        group, targets = prompts[s : s + batch_size], outs[s : s + batch_size]
        gen = padded(group, max(targets))
        for r, o in enumerate(targets):
            tokens.append(gen[r, :o].tolist())
            wasted += max(targets) - o
    dt = time.perf_counter() - t0
    return dict(
        engine="padded generate",
        seconds=dt,
        setup_s=None,
        tokens=tokens,
        wasted_tokens=wasted,
        settings=f"sdpa batch_size={batch_size}, left-padded, min_new_tokens=max_new_tokens=group max",
        peak_memory=peak_memory_bytes(spec.device),
    )


def run(size: str, spec: ModelSpec, baselines: bool = True, uniform: bool = False) -> dict[str, Any]:
    p = (UNIFORM_SIZES if uniform else SIZES)[size]
    # (tiny: a smoke run, one timed call per shape)
    secs, reps = (2.0, 3) if size == "default" else (0.2, 1)
    peak = matmul_peak_gflops(spec.device, spec.dtype, seconds=secs, min_reps=reps)
    prompts = random_prompts(p["num_prompts"], p["min_prompt_len"], p["max_prompt_len"], spec.vocab, seed=1)
    g = torch.Generator().manual_seed(2)
    outs = torch.randint(p["min_new"], p["max_new"] + 1, (len(prompts),), generator=g).tolist()
    notes = []
    sides = [run_acb(spec, prompts, outs)]
    if baselines:
        note = patch_transformers_cpu_memory()
        if note:
            notes.append(note)
        try:
            sides.append(run_transformers_cb(spec, prompts, outs))
        except Exception as e:  # noqa: BLE001 - a family transformers' paged cache cannot run: said, not fatal
            if spec.arch == "llama":  # (the Llama's baseline must run; a hybrid's cannot, in transformers 5.23)
                raise
            notes.append(f"transformers CB cannot run this family: {type(e).__name__}: {str(e)[:200]}")
        sides.append(run_generate(spec, prompts, outs, p["batch_size"]))
    after = matmul_peak_gflops(spec.device, spec.dtype, seconds=secs, min_reps=reps)  # before and after: the better one
    peak = after if after["gflops"] > peak["gflops"] else peak
    expected = sum(outs)
    flops = workload_flops(MODEL_SHAPES[size], [len(q) for q in prompts], outs)
    if spec.arch != "llama":
        notes.append("roofline: the least FLOPs of a Llama of this size, not of this family")
    acb_tps = None
    rows = []
    for side in sides:
        counts_ok = [len(t) for t in side["tokens"]] == outs
        tps = expected / side["seconds"]
        acb_tps = acb_tps or tps
        rows.append(
            {k: v for k, v in side.items() if k != "tokens"}
            | dict(
                output_tokens=expected,
                tokens_per_s=tps,
                requests_per_s=len(prompts) / side["seconds"],
                counts_ok=counts_ok,
                acb_speedup=acb_tps / tps,
                gflops=flops["total"] / side["seconds"] / 1e9,
                roofline_pct=100 * flops["total"] / side["seconds"] / 1e9 / peak["gflops"],
            )
        )
    match = None
    if baselines and sides[1]["engine"] == "transformers CB":
        match = sides[0]["tokens"][:4] == sides[1]["tokens"][:4]
    generate = next((side for side in sides if side["engine"] == "padded generate"), None)
    return dict(
        workload="offline-uniform" if uniform else "offline",
        settings=dict(p, greedy=True, ignore_eos=True, prompt_tokens=sum(map(len, prompts))),
        rows=rows,
        greedy_tokens_match_transformers=match,
        # padded generate's seconds over acb's, in this run (the families table of docs/performance.md)
        vs_generate=generate["seconds"] / sides[0]["seconds"] if generate else None,
        notes=notes,
        roofline=dict(
            flops,
            matmul_peak_gflops=peak["gflops"],
            peak_shape=peak["shape"],
            threads=peak["threads"],
            floor_s=flops["total"] / peak["gflops"] / 1e9,
        ),
    )
