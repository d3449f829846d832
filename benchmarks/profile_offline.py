"""Where an offline step's time goes: torch.profiler inside acb's engine thread.

Runs the ``acb bench offline`` workload (default size: the 40M Llama, 128 prompts of 16-256
tokens, outputs 16-128, greedy, EOS ignored) through one ``acb.Engine``, with the profiler
started and stopped on the engine thread (``EngineCore.call``), and attributes every op's own
(self) CPU time to

- a **phase**: the range it ran under: ``attention`` (acb's attention backend: KV write, gather,
  SDPA), ``lm_head``, ``sampler``, ``metadata`` (the backend's per-step metadata), ``stage``
  (input staging), or ``body`` (the rest of the model's forward: linear layers, norms, rotary,
  activation, embedding) and ``engine`` (anything else on the thread: scheduling, outputs);
- a **kind**: ``matmul`` (mm/addmm/bmm/linear), ``sdpa``, ``gather/scatter`` (index, index_copy,
  index_select, gather), ``copy`` (copy_, to, contiguous, cat), ``elementwise`` (the rest of
  aten), ``python`` (time in no op).

The same run without the profiler gives the wall time the breakdown is scaled against.
Writes ``benchmarks/results/profile_offline_cpu.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import acb  # noqa: E402
from acb.bench.common import (  # noqa: E402
    MODEL_SHAPES,
    ModelSpec,
    machine_info,
    matmul_peak_gflops,
    op_kind,
    random_prompts,
    workload_flops,
)
from acb.bench.offline import MAX_BATCH_TOKENS, MAX_REQUESTS, SIZES  # noqa: E402

PHASES = ("acb::attention", "acb::lm_head", "acb::sampler", "acb::metadata", "acb::stage")


def _wrap(obj: Any, attr: str, label: str) -> None:
    fn = getattr(obj, attr)

    @functools.wraps(fn)
    def wrapped(*a: Any, **kw: Any) -> Any:
        with torch.profiler.record_function(label):
            return fn(*a, **kw)

    setattr(obj, attr, wrapped)


def instrument(engine: acb.Engine) -> None:
    """record_function ranges around the phases (this engine's objects only)."""
    import acb.runner.model_runner as mr

    runner = engine.core.runner  # type: ignore[union-attr]
    _wrap(runner.backend, "forward", "acb::attention")
    _wrap(runner.backend, "build_metadata", "acb::metadata")
    head = runner.model.get_output_embeddings()
    _wrap(head, "forward", "acb::lm_head")
    _wrap(runner.inputs, "stage", "acb::stage")
    original = mr.sample

    def sample(*a: Any, **kw: Any) -> Any:
        with torch.profiler.record_function("acb::sampler"):
            return original(*a, **kw)

    mr.sample = sample


def breakdown(prof: torch.profiler.profile) -> dict[str, Any]:
    """Self CPU time (µs) per (phase, kind) over the engine thread's ops."""
    events = prof.events()
    table: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for ev in events:
        if ev.name in PHASES or ev.name.startswith("ProfilerStep"):
            continue
        phase, in_forward, parent = None, False, ev.cpu_parent
        while parent is not None:
            if parent.name in PHASES:
                phase = parent.name.split("::")[1]
            in_forward |= parent.name == "acb::forward"
            parent = parent.cpu_parent
        if phase is None:
            phase = "body" if in_forward else "engine"
        table[phase][op_kind(ev.name)] += ev.self_cpu_time_total
    return {p: dict(k) for p, k in table.items()}


def run(size: str, profile: bool, packed: bool | None = None) -> dict[str, Any]:
    p = SIZES[size]
    spec = ModelSpec(size)
    prompts = random_prompts(p["num_prompts"], p["min_prompt_len"], p["max_prompt_len"], spec.vocab, seed=1)
    g = torch.Generator().manual_seed(2)
    outs = torch.randint(p["min_new"], p["max_new"] + 1, (len(prompts),), generator=g).tolist()
    model = spec.build()
    cfg = acb.ContinuousBatchingConfig(
        page_size=32,
        num_blocks=2048,
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_requests_per_batch=MAX_REQUESTS,
        seed=0,
        cpu_packed_linears=packed,
    )
    engine = acb.Engine(model, cfg)
    engine.start()
    try:
        engine.generate_batch(prompts[:2], acb.SamplingParams(max_new_tokens=4, ignore_eos=True), progress_bar=False)
        prof = None
        if profile:
            instrument(engine)
            _wrap(engine.core.runner, "forward", "acb::forward")  # type: ignore[union-attr]
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            engine.core.call(lambda _c: prof.__enter__()).result()  # type: ignore[union-attr]
        t0 = time.perf_counter()
        hs = [engine.submit(q, acb.SamplingParams(max_new_tokens=o, ignore_eos=True)) for q, o in zip(prompts, outs)]
        for h in hs:
            h.result()
        wall = time.perf_counter() - t0
        if prof is not None:
            engine.core.call(lambda _c: prof.__exit__(None, None, None)).result()  # type: ignore[union-attr]
        stats = engine.stats
    finally:
        engine.shutdown()
    out: dict[str, Any] = dict(wall_s=wall, steps=stats.steps, output_tokens=sum(outs), tokens_per_s=sum(outs) / wall)
    flops = workload_flops(MODEL_SHAPES[size], [len(q) for q in prompts], outs)
    out["flops"] = flops
    out["achieved_gflops"] = flops["total"] / wall / 1e9
    if prof is not None:
        out["breakdown_us"] = breakdown(prof)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="default", choices=sorted(SIZES))
    ap.add_argument(
        "--packed-linears",
        choices=("on", "off"),
        default=None,
        help="cpu_packed_linears (default: the engine's default, which is on for this model)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "profile_offline_cpu.json"))
    args = ap.parse_args()
    peak = matmul_peak_gflops()
    packed = None if args.packed_linears is None else args.packed_linears == "on"
    plain = run(args.size, profile=False, packed=packed)
    prof = run(args.size, profile=True, packed=packed)
    total = sum(v for kinds in prof["breakdown_us"].values() for v in kinds.values())
    doc = dict(
        machine=machine_info(),
        size=args.size,
        cpu_packed_linears=args.packed_linears or "default",
        matmul_peak=peak,
        plain=plain,
        profiled=prof,
        roofline_pct=100 * plain["achieved_gflops"] / peak["gflops"],
    )
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str))
    print(
        f"matmul peak {peak['gflops']:.1f} GFLOP/s; workload {plain['flops']['total'] / 1e12:.3f} TFLOP; "
        f"wall {plain['wall_s']:.2f} s ({plain['tokens_per_s']:.1f} tok/s), {plain['achieved_gflops']:.1f} GFLOP/s "
        f"= {doc['roofline_pct']:.1f}% of peak; profiled wall {prof['wall_s']:.2f} s"
    )
    rows = sorted(
        ((ph, k, us) for ph, kinds in prof["breakdown_us"].items() for k, us in kinds.items()), key=lambda r: -r[2]
    )
    for ph, k, us in rows:
        print(f"{ph:>10} {k:>15} {us / 1e6:8.3f} s {100 * us / total:5.1f}%")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
