"""The one-command GPU check: tests under the ``gpu`` marker, then the GPU benchmark.

    python benchmarks/gpu_check.py [--quick] [--json benchmarks/results/gpu_check.json]

1. ``pytest -m gpu`` (CUDA parity with the Triton backend and async batching) and the Triton
   kernel tests compiled for the GPU (``TRITON_INTERPRET=0``).
2. Workload A (nano-vllm's shape): 256 requests, prompt and output lengths uniform in
   [100, 1024], random ids, EOS ignored, a Qwen3-0.6B-shaped model with random bf16 weights;
   workload B: the same with a Llama-3.1-8B-shaped model. Output tokens/s of acb and of
   transformers' continuous batching, same process, same prompts.
3. Decode step time at batch 1/64/256 (prompts of 512 tokens) against the memory-bandwidth
   floor: (weight bytes + KV bytes read per step) / measured device copy bandwidth.
4. GPU idle fraction over decode steps, with and without async batching: 1 - (CUDA kernel
   time / wall time), from the torch profiler.

Prints a short table last and writes everything, with the device named, to ``--json``. Each
section records its error instead of stopping the others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

import torch

SHAPES = {
    "A: Qwen3-0.6B": dict(arch="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                          max_position_embeddings=40960),
    "B: Llama-3.1-8B": dict(arch="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                            max_position_embeddings=131072),
}


def build(shape: dict[str, Any]) -> Any:
    from acb.models import tiny_model

    kw = dict(shape)
    arch = kw.pop("arch")
    kw["initializer_range"] = 0.02
    return tiny_model(arch, dtype=torch.bfloat16, **kw).to("cuda")


def run_tests() -> dict[str, Any]:
    env = dict(os.environ, TRITON_INTERPRET="0")
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/gpu", "tests/runner/test_triton_kernels.py"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    tail = (p.stdout + p.stderr).strip().splitlines()[-15:]
    return {"command": " ".join(cmd), "returncode": p.returncode, "seconds": time.perf_counter() - t0, "tail": tail}


def workload(n: int, seed: int = 0, vocab: int = 32000) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(100, 1025, (n,), generator=g).tolist()
    outs = torch.randint(100, 1025, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens], outs


def throughput(name: str, shape: dict[str, Any], n: int) -> dict[str, Any]:
    import acb

    prompts, outs = workload(n, vocab=shape["vocab_size"])
    res: dict[str, Any] = {"workload": name, "requests": n, "output_tokens": sum(outs)}
    model = build(shape)
    with acb.Engine(model) as eng:  # defaults: triton backend, async batching, memory from free GPU memory
        eng.generate(prompts[0][:16], acb.SamplingParams(max_new_tokens=4))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hs = [eng.submit(p, acb.SamplingParams(max_new_tokens=o, ignore_eos=True)) for p, o in zip(prompts, outs)]
        got = sum(len(h.result().generated_tokens) for h in hs)
        dt = time.perf_counter() - t0
        res["acb"] = {"tokens_per_s": got / dt, "seconds": dt, "tokens": got, "config": str(eng.config)}
    del model
    torch.cuda.empty_cache()
    try:
        from transformers import GenerationConfig

        model = build(shape)
        gc = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=-1)
        with model.continuous_batching_context_manager(generation_config=gc, block=True, timeout=60) as m:
            t0 = time.perf_counter()
            for i, (p, o) in enumerate(zip(prompts, outs)):
                m.add_request(input_ids=p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)
            done: dict[str, int] = {}
            while len(done) < n:
                r = m.get_result(timeout=5)
                if r is not None and r.is_finished():
                    done[r.request_id] = len(r.generated_tokens)
                elif r is None and not m.is_running():
                    raise RuntimeError("transformers' generation thread stopped")
            dt = time.perf_counter() - t0
        got = sum(done.values())
        res["transformers_cb"] = {"tokens_per_s": got / dt, "seconds": dt, "tokens": got}
        res["acb_vs_transformers"] = res["acb"]["tokens_per_s"] / res["transformers_cb"]["tokens_per_s"]
        del model
        torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001
        res["transformers_cb"] = {"error": f"{type(exc).__name__}: {exc}"}
    return res


def copy_bandwidth() -> float:
    """Device memory bandwidth (bytes/s) measured with a large copy (read + write counted)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)


def decode_steps(shape: dict[str, Any], batches: list[int], bw: float, async_batching: bool) -> list[dict[str, Any]]:
    import acb

    model = build(shape)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for b in batches:
        cfg = acb.ContinuousBatchingConfig(max_requests_per_batch=max(b, 1), use_async_batching=async_batching)
        with acb.Engine(model, cfg) as eng:
            core = eng._fe.core
            kv_per_token = eng._fe.runner.kv_cache.spec.bytes_per_block(1)
            gate = threading.Event()
            core.call(lambda c: gate.wait())  # start all b requests together
            g = torch.Generator().manual_seed(b)
            hs = [eng.submit(torch.randint(3, 1000, (512,), generator=g).tolist(),
                             acb.SamplingParams(max_new_tokens=64, ignore_eos=True)) for _ in range(b)]
            core.step_log = []
            gate.set()
            # GPU busy fraction over the decode phase, from the profiler
            time.sleep(0)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                for h in hs:
                    h.result()
                wall = time.perf_counter() - t0
            busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
            log = [s for s in core.step_log if s[0] == b and s[2] == b]
        steps = [s[3] + s[4] + s[5] + s[6] for s in log]
        step = statistics.median(steps) if steps else float("nan")
        floor = (weight_bytes + b * (512 + 32) * kv_per_token) / bw
        rows.append({"batch": b, "step_ms": step * 1e3, "floor_ms": floor * 1e3, "ratio_to_floor": step / floor,
                     "gpu_idle_fraction": max(0.0, 1 - busy / wall), "async_batching": async_batching,
                     "steps_measured": len(log)})
    del model
    torch.cuda.empty_cache()
    return rows


def section(results: dict[str, Any], key: str, fn: Any, *args: Any) -> None:
    print(f"== {key}", file=sys.stderr, flush=True)
    try:
        results[key] = fn(*args)
    except Exception as exc:  # noqa: BLE001
        results[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 requests per workload, batches 1/64 only")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-b", action="store_true", help="skip the 8B-shaped workload")
    ap.add_argument("--json", default="benchmarks/results/gpu_check.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check", file=sys.stderr)
        return 2
    from acb.bench.common import machine_info

    results: dict[str, Any] = {"machine": machine_info("cuda")}
    n = 32 if args.quick else 256
    if not args.skip_tests:
        section(results, "tests", run_tests)
    section(results, "bandwidth_bytes_per_s", copy_bandwidth)
    for name, shape in SHAPES.items():
        if args.skip_b and name.startswith("B"):
            continue
        section(results, f"throughput {name}", throughput, name, shape, n)
    bw = results.get("bandwidth_bytes_per_s")
    if isinstance(bw, float):
        batches = [1, 64] if args.quick else [1, 64, 256]
        for mode in (True, False):
            section(results, f"decode A async={mode}", decode_steps, SHAPES["A: Qwen3-0.6B"], batches, bw, mode)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"\ndevice: {results['machine'].get('gpu')}  torch {results['machine']['torch']}  "
          f"transformers {results['machine']['transformers']}  {results['machine']['date']}")
    if "tests" in results:
        t = results["tests"]
        print(f"tests: returncode {t.get('returncode')}  {t.get('tail', [''])[-1] if t.get('tail') else t}")
    for key, r in results.items():
        if key.startswith("throughput") and "acb" in r:
            tf = r.get("transformers_cb", {})
            print(f"{r['workload']:<18} acb {r['acb']['tokens_per_s']:>9.0f} tok/s   transformers CB "
                  f"{tf.get('tokens_per_s', float('nan')):>9.0f} tok/s   ratio {r.get('acb_vs_transformers', float('nan')):.2f}x")
        elif key.startswith("decode") and isinstance(r, list):
            for row in r:
                print(f"decode batch {row['batch']:>4} async={row['async_batching']!s:<5} step {row['step_ms']:.2f} ms  "
                      f"floor {row['floor_ms']:.2f} ms  ({row['ratio_to_floor']:.2f}x)  GPU idle {row['gpu_idle_fraction']:.1%}")
        elif isinstance(r, dict) and "error" in r:
            print(f"{key}: ERROR {r['error']}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
