"""The one-command GPU check: tests under the ``gpu`` marker, then the GPU benchmark.

    python benchmarks/gpu_check.py [--quick] [--skip-tests] [--skip-b] [--json benchmarks/results/gpu_check.json]
    python benchmarks/gpu_check.py --cpu-smoke    # the same code paths on CPU with tiny shapes (CI)

1. ``tests/gpu`` (CUDA parity with the Triton backend, async batching and decode graphs) and the
   Triton kernel and CUDA-graph tests compiled for the GPU (``TRITON_INTERPRET=0``).
2. Workload A (nano-vllm's shape): 256 requests, prompt and output lengths uniform in
   [100, 1024], random ids, EOS ignored, a Qwen3-0.6B-shaped model with random bf16 weights;
   workload B: the same with a Llama-3.1-8B-shaped model. Output tokens/s of acb and of
   transformers' continuous batching, same process, same prompts.
   Workload A also runs with ``default_compile_level=1`` (torch.compile) to decide whether
   compiling is worth turning on by default.
3. Decode step time at batch 1/64/256 (prompts of 512 tokens, 64 new tokens): the median
   period between consecutive all-decode steps, against the memory-bandwidth floor
   (weight bytes + KV bytes read per step) / measured device copy bandwidth; in three modes:
   async + graphs (the default), async without graphs, neither.
4. GPU idle fraction over those runs: 1 - (CUDA kernel time / wall time), from the torch
   profiler.
5. The same decode steps for an MLA model (DeepSeek V3's attention sizes: 16 heads, latent 512 + 64)
   with its latent paged (``mla_latent_cache=True``: the Triton backend's latent kernel, no graphs)
   and with its expanded heads (decode graphs); each row names its backend and KV bytes per token.
6. The batch-invariant mode (``batch_invariant=True``, :func:`batch_invariance`): on CUDA, kernel by
   kernel (a row of the fixed-order Triton matmul alone and among 3-300 rows, cuBLAS's ``F.linear``
   beside it; torch's row reductions of RMSNorm and the log-softmax alone and among 64 rows; a
   query's attention bits in a prefill chunk and as a decode row, with the Triton backend's
   fixed-order form and without it); a sequence's logits under
   ``acb.runner.batch_invariant.enabled(model)`` alone and in padded batches; then, where the
   engine accepts the mode, a request alone
   against the same request in a batch of 64 (logprobs, bit for bit) and the trainer's forward
   under ``acb.runner.batch_invariant.enabled(model)`` against the engine's logprobs. Where the
   engine refuses the mode, the reason is recorded.

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

SMOKE_SHAPES = {  # --cpu-smoke: the same code paths with a tiny model on CPU
    "A: Qwen3-0.6B": dict(
        arch="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=4096,
    ),
}
SHAPES = {
    "A: Qwen3-0.6B": dict(
        arch="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
    ),
    "B: Llama-3.1-8B": dict(
        arch="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
    ),
}

# section 5: decode of an MLA model with its latent paged (the Triton backend's latent kernel, no
# graphs) against its expanded heads (graphs): DeepSeek V3's attention sizes, fewer and dense layers
MLA_SHAPE = dict(
    arch="deepseek_v3",
    hidden_size=2048,
    intermediate_size=4096,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=768,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    first_k_dense_replace=8,
    vocab_size=32000,
    max_position_embeddings=8192,
)
MLA_SMOKE_SHAPE = dict(
    arch="deepseek_v3",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    vocab_size=512,
    max_position_embeddings=4096,
)

DEVICE = "cuda"
LENGTHS = (100, 1024)  # prompt and output lengths, uniform


def build(shape: dict[str, Any]) -> Any:
    from acb.models import tiny_model

    kw = dict(shape)
    arch = kw.pop("arch")
    kw["initializer_range"] = 0.02
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    if arch == "deepseek_v3":  # not one of acb.models' tiny architectures: its config as given
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        config = AutoConfig.for_model(arch, **kw)
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval().to(DEVICE)
    return tiny_model(arch, dtype=dtype, **kw).to(DEVICE)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    import gc

    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def run_tests() -> dict[str, Any]:
    env = dict(os.environ, TRITON_INTERPRET="0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"]  # CUDA parity, kernels and graphs compiled
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    tail = (p.stdout + p.stderr).strip().splitlines()[-15:]
    return {"command": " ".join(cmd), "returncode": p.returncode, "seconds": time.perf_counter() - t0, "tail": tail}


def workload(n: int, seed: int = 0, vocab: int = 32000) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    lo, hi = LENGTHS
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    outs = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens], outs


def _acb_run(model: Any, prompts: list[list[int]], outs: list[int], cfg: Any = None) -> dict[str, Any]:
    import acb

    t_start = time.perf_counter()
    with acb.Engine(model, cfg) as eng:  # defaults: best backend, async batching, decode graphs on CUDA
        start_s = time.perf_counter() - t_start
        eng.generate(prompts[0][:16], acb.SamplingParams(max_new_tokens=4))
        sync()
        t0 = time.perf_counter()
        hs = [eng.submit(p, acb.SamplingParams(max_new_tokens=o, ignore_eos=True)) for p, o in zip(prompts, outs)]
        got = sum(len(h.result().generated_tokens) for h in hs)
        dt = time.perf_counter() - t0
        graphs = eng.runner.graphs
        return {
            "tokens_per_s": got / dt,
            "seconds": dt,
            "tokens": got,
            "engine_start_s": start_s,
            "backend": eng.config.attn_backend,
            "cuda_graphs": eng.config.cuda_graphs,
            "graph_capture_s": graphs.capture_s if graphs else None,
            "graph_capture_mib": graphs.capture_bytes / 2**20 if graphs else None,
            "config": str(eng.config),
        }


def throughput(name: str, shape: dict[str, Any], n: int, compile_too: bool) -> dict[str, Any]:
    import acb

    prompts, outs = workload(n, vocab=shape["vocab_size"])
    res: dict[str, Any] = {"workload": name, "requests": n, "output_tokens": sum(outs)}
    model = build(shape)
    res["acb"] = _acb_run(model, prompts, outs)
    if compile_too:
        try:
            res["acb_compiled"] = _acb_run(model, prompts, outs, acb.ContinuousBatchingConfig(default_compile_level=1))
            res["compiled_vs_eager"] = res["acb_compiled"]["tokens_per_s"] / res["acb"]["tokens_per_s"]
        except Exception as exc:  # noqa: BLE001
            res["acb_compiled"] = {"error": f"{type(exc).__name__}: {exc}"}
    del model
    free_memory()
    if DEVICE != "cuda":
        res["transformers_cb"] = {"skipped": "CPU smoke run"}
        return res
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
    x = torch.empty(1 << (30 if DEVICE == "cuda" else 26), dtype=torch.uint8, device=DEVICE)
    y = torch.empty_like(x)
    y.copy_(x)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)


def decode_steps(
    shape: dict[str, Any],
    batches: list[int],
    bw: float,
    async_batching: bool,
    graphs: bool | None,
    extra: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Decode step period at each batch size against the bandwidth floor, and GPU idle fraction
    (``extra``: more engine config fields)."""
    from torch.profiler import ProfilerActivity, profile

    import acb

    prompt_len, new = (512, 64) if DEVICE == "cuda" else (24, 8)
    model = build(shape)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for b in batches:
        cfg = acb.ContinuousBatchingConfig(
            max_requests_per_batch=max(b, 1), use_async_batching=async_batching, use_cuda_graph=graphs, **(extra or {})
        )
        with acb.Engine(model, cfg) as eng:
            core = eng.core
            kv_per_token = eng.runner.kv_cache.spec.bytes_per_block(1)
            gate = threading.Event()
            core.call(lambda c: gate.wait())  # start all b requests together
            g = torch.Generator().manual_seed(b)
            hs = [
                eng.submit(
                    torch.randint(3, shape["vocab_size"], (prompt_len,), generator=g).tolist(),
                    acb.SamplingParams(max_new_tokens=new, ignore_eos=True),
                )
                for _ in range(b)
            ]
            core.step_log = []
            activities = [ProfilerActivity.CUDA] if DEVICE == "cuda" else [ProfilerActivity.CPU]
            with profile(activities=activities) as prof:
                gate.set()
                t0 = time.perf_counter()
                for h in hs:
                    h.result()
                wall = time.perf_counter() - t0
            busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 if DEVICE == "cuda" else None
            # all-decode steps with every request running: consecutive, so their completion times
            # give the step period (what async batching and graphs shorten)
            log = [s for s in core.step_log if s[0] == b and s[2] == b]
            used_graphs = eng.config.cuda_graphs
            backend = eng.config.attn_backend
        ends = [s[7] for s in log]
        periods = [y - x for x, y in zip(ends, ends[1:])]
        step = statistics.median(periods) if periods else float("nan")
        mid_ctx = prompt_len + new // 2
        floor = (weight_bytes + b * mid_ctx * kv_per_token) / bw
        rows.append(
            {
                "batch": b,
                "step_ms": step * 1e3,
                "floor_ms": floor * 1e3,
                "ratio_to_floor": step / floor,
                "gpu_idle_fraction": None if busy is None else max(0.0, 1 - busy / wall),
                "async_batching": async_batching,
                "cuda_graphs": used_graphs,
                "attn_backend": backend,
                "kv_bytes_per_token": kv_per_token,
                "steps_measured": len(periods),
            }
        )
        free_memory()
    del model
    free_memory()
    return rows


def _same_row(fn: Any, x0: torch.Tensor, rows: tuple[int, ...], seed: int = 0) -> dict[str, Any]:
    """``fn`` of row ``x0`` alone against the same row among ``m`` random rows (at ``m // 2``), each
    ``m`` in ``rows``: all bits equal, and the largest difference."""
    g = torch.Generator(device=x0.device).manual_seed(seed)
    alone = fn(x0[None])[0]
    worst = 0.0
    equal = True
    for m in rows:
        x = torch.randn(m, x0.shape[0], generator=g, device=x0.device).to(x0.dtype)
        x[m // 2] = x0
        row = fn(x)[m // 2]
        equal &= bool(torch.equal(row, alone))
        worst = max(worst, float((row.float() - alone.float()).abs().max()))
    return {"bits_equal": equal, "max_abs_diff": worst}


def _attention_bits(fixed_order: bool) -> bool:
    """A query's attention output (bf16, one layer: 32/8 heads of 128, 16-token pages) in a mixed step
    (its chunk of 4 after 1000 cached tokens, among a decode row and another chunk) against the same
    query as a decode row alone: equal bits?"""
    from acb.runner.attention import AttentionCall, BatchInputs, StepContext
    from acb.runner.attention.triton_backend import TritonBackend
    from acb.runner.kv_cache import KVCache, KVSpec

    bs, hkv, heads, d, nb, dev = 16, 8, 32, 128, 256, torch.device(DEVICE)
    g = torch.Generator(device=dev).manual_seed(0)
    cache = KVCache(KVSpec.uniform(1, hkv, d, torch.bfloat16), nb, bs, dev)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g, device=dev))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g, device=dev))
    rows = torch.randperm(nb - 1, device=dev)[:192].view(3, 64) + 1
    backend = TritonBackend(fixed_order=fixed_order)
    call = AttentionCall(scaling=d**-0.5)

    def step(seqs: list[int], num_new: list[int], start: list[int], q: torch.Tensor) -> torch.Tensor:
        bt = rows[seqs]
        pos = torch.cat([torch.arange(a, a + n) for a, n in zip(start, num_new)]).to(dev)
        seq_of = torch.repeat_interleave(torch.arange(len(seqs), device=dev), torch.tensor(num_new, device=dev))
        slots = bt[seq_of, pos // bs] * bs + pos % bs
        lens = [a + n for a, n in zip(start, num_new)]
        qsl = [0]
        for n in num_new:
            qsl.append(qsl[-1] + n)
        batch = BatchInputs(
            slots, bt, torch.tensor(lens, device=dev), torch.tensor(qsl, device=dev), num_new, start, max(lens)
        )
        k = cache.k[0].flatten(0, 1)[slots][None].transpose(1, 2)
        v = cache.v[0].flatten(0, 1)[slots][None].transpose(1, 2)
        ctx = StepContext(cache, backend, backend.build_metadata(batch, bs))
        return backend.forward(0, q[None].transpose(1, 2), k, v, ctx, call)[0]

    q = torch.randn(8, heads, d, generator=g, device=dev).to(torch.bfloat16)
    mixed = step([1, 0, 2], [1, 4, 3], [500, 1000, 7], q)[1:5]
    alone = step([0], [1], [1003], q[4:5])[0]
    return bool(torch.equal(alone, mixed[3]))


def _trainer_rows(model: Any, seq: list[int], vocab: int) -> bool:
    """``seq``'s logits under ``enabled(model)`` alone, then among 7 other rows right-padded and
    left-padded (positions from each row's first token): the same bits?"""
    from acb.runner import batch_invariant as bi

    g = torch.Generator().manual_seed(3)
    others = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(5, 80, (7,), generator=g)]

    def logits(rows: list[list[int]], left: bool) -> torch.Tensor:
        w = max(map(len, rows))
        pads = [[0] * (w - len(r)) for r in rows]
        ids = torch.tensor([p + r if left else r + p for r, p in zip(rows, pads)], device=DEVICE)
        mask = torch.tensor(
            [[0] * len(p) + [1] * len(r) if left else [1] * len(r) + [0] * len(p) for r, p in zip(rows, pads)],
            device=DEVICE,
        )
        with torch.no_grad(), bi.enabled(model):
            lg = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        return lg[0, w - len(rows[0]) :] if left else lg[0, : len(rows[0])]

    alone = logits([seq], False)
    return bool(torch.equal(logits([seq, *others], False), alone) and torch.equal(logits([seq, *others], True), alone))


def batch_invariance(shape: dict[str, Any]) -> dict[str, Any]:
    """Section 6 (see the module's docstring)."""
    import acb
    from acb.runner import batch_invariant as bi

    out: dict[str, Any] = {}
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    if DEVICE == "cuda":
        import torch.nn.functional as F

        from acb.runner import batch_invariant_kernels as bk

        g = torch.Generator(device=DEVICE).manual_seed(1)
        rows = (3, 17, 64, 300)
        for name, (k, n) in {"mlp up": (hidden, inter), "lm head": (hidden, vocab)}.items():
            w = (torch.randn(n, k, generator=g, device=DEVICE) * k**-0.5).to(torch.bfloat16)
            x0 = torch.randn(k, generator=g, device=DEVICE).to(torch.bfloat16)
            out[f"matmul {name} {k}->{n}"] = {
                "invariant": _same_row(lambda x, w=w: bk.matmul(x, w), x0, rows),
                "cublas F.linear": _same_row(lambda x, w=w: F.linear(x, w), x0, rows),
                "max_abs_diff_vs_cublas": float((bk.matmul(x0[None], w) - F.linear(x0[None], w)).abs().max()),
            }
            times = {}
            for m in (1, 64, 1024):
                x = torch.randn(m, k, generator=g, device=DEVICE).to(torch.bfloat16)
                for label, fn in (("invariant", bk.matmul), ("cublas", F.linear)):
                    fn(x, w)
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(20):
                        fn(x, w)
                    sync()
                    times[f"{label} M={m} ms"] = (time.perf_counter() - t0) / 20 * 1e3
            out[f"matmul {name} {k}->{n}"]["time"] = times
        x0 = torch.randn(hidden, generator=g, device=DEVICE).to(torch.bfloat16)
        out["torch rmsnorm mean (fp32) over hidden"] = _same_row(
            lambda x: x.float().pow(2).mean(-1, keepdim=True), x0, (2, 3, 64, 300)
        )
        out["invariant row_mean (fp32) over hidden"] = _same_row(
            lambda x: bk.row_mean(x.float().pow(2), keepdim=True), x0, (2, 3, 64, 300)
        )
        l0 = torch.randn(vocab, generator=g, device=DEVICE)
        out["torch log_softmax (fp32) over vocab"] = _same_row(lambda x: torch.log_softmax(x, -1), l0, (2, 3, 64))
        out["attention: prefill == decode bits, fixed order"] = _attention_bits(True)
        out["attention: prefill == decode bits, default"] = _attention_bits(False)
        free_memory()
    # the trainer's forward under enabled(model): a sequence alone, and in padded batches
    model = build(shape)
    vocab_ids = min(vocab, 32000)
    g = torch.Generator().manual_seed(2)
    target = torch.randint(3, vocab_ids, (37,), generator=g).tolist()
    try:
        out["trainer under enabled(model): alone == in padded batches"] = _trainer_rows(model, target, vocab_ids)
    except ValueError as exc:
        out["trainer rows"] = f"refused: {exc}"
    # the engine in the mode: a request alone against it in a batch of 64, and the trainer's forward
    others = [
        torch.randint(3, vocab_ids, (int(n),), generator=g).tolist() for n in torch.randint(5, 200, (63,), generator=g)
    ]
    new = 8 if DEVICE == "cpu" else 32

    def sp(seed: int) -> Any:
        return acb.SamplingParams(
            max_new_tokens=new, ignore_eos=True, temperature=0.9, top_k=0, top_p=1.0, seed=seed,
            logprobs=0, logprobs_mode="processed",
        )  # fmt: skip

    def run(m: Any, prompts: list[list[int]]) -> list[Any]:
        with acb.Engine(m, acb.ContinuousBatchingConfig(page_size=16, batch_invariant=True)) as eng:
            eng.pause()
            hs = [eng.submit(p, sp(7 if i == 0 else 100 + i)) for i, p in enumerate(prompts)]
            eng.resume()
            return [h.result() for h in hs]

    try:
        alone = run(model, [target])[0]
    except ValueError as exc:  # the engine refuses the mode here: say why
        out["engine"] = f"refused: {exc}"
        return out
    t0 = time.perf_counter()
    batch = run(model, [target, *others])[0]
    out["engine: batch of 64 in the mode, generated tok/s (start included)"] = 64 * new / (time.perf_counter() - t0)
    out["engine: alone == in a batch of 64"] = bool(
        alone.generated_tokens == batch.generated_tokens and alone.logprobs == batch.logprobs
    )
    ids = torch.tensor([target + alone.generated_tokens], device=DEVICE)
    try:
        with torch.no_grad(), bi.enabled(model):
            logits = model(input_ids=ids).logits[0, len(target) - 1 : -1]
        trainer = bi.token_logprobs(logits, alone.generated_tokens, 0.9).cpu()
        engine = torch.tensor(alone.logprobs, dtype=trainer.dtype)
        out["trainer under enabled(model) == engine"] = bool(torch.equal(trainer, engine))
        out["trainer max_abs_diff"] = float((trainer - engine).abs().max())
    except ValueError as exc:
        out["trainer"] = f"refused: {exc}"
    del model
    free_memory()
    return out


JSON_PATH = ""  # set by main(); every section is written as soon as it ends


def section(results: dict[str, Any], key: str, fn: Any, *args: Any) -> None:
    """Run one section, record its result (or its error), then write the JSON and print the
    section's result at once: a run cut short by a time limit (a lent GPU's lease) keeps what it
    measured so far."""
    print(f"== {key}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        results[key] = fn(*args)
    except Exception as exc:  # noqa: BLE001
        results[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    save(results)
    brief = (
        {k: v for k, v in results[key].items() if k != "traceback"} if isinstance(results[key], dict) else results[key]
    )
    print(
        f"== {key} done in {time.perf_counter() - t0:.0f} s: {json.dumps(brief, default=str)[:3000]}",
        file=sys.stderr,
        flush=True,
    )


def save(results: dict[str, Any]) -> None:
    """Write ``results`` to ``JSON_PATH`` (the folder made if needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(JSON_PATH)), exist_ok=True)
    with open(JSON_PATH, "w") as f:
        json.dump(results, f, indent=2, default=str)


def tensor_parallel(args: Any, shape: dict[str, Any]) -> int:
    """``--tp N``: relaunch under ``torchrun --nproc-per-node N``; every rank loads workload A's
    model tensor-parallel, rank 0 compares greedy outputs with the same model on one device and
    times the TP engine (tokens/s, and the per-iteration command broadcast)."""
    if "LOCAL_RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.tp), __file__, *sys.argv[1:]]
        return subprocess.call(cmd)
    import tempfile
    from datetime import timedelta

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import acb
    from acb.bench.common import machine_info

    rank = int(os.environ["RANK"])
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    n = 4 if args.cpu_smoke else 32 if args.quick else 256
    prompts, outs = workload(n, vocab=shape["vocab_size"])
    sp = [acb.SamplingParams(max_new_tokens=o, ignore_eos=True) for o in outs]
    with tempfile.TemporaryDirectory() as tmp:
        single = build(shape)  # the same seeded weights on every rank
        single.save_pretrained(tmp)  # before the process group exists: save_pretrained then writes on every rank
        dist.init_process_group("gloo" if DEVICE == "cpu" else "nccl", timeout=timedelta(seconds=600))
        result: dict[str, Any] = {"machine": machine_info(DEVICE), "tp": dist.get_world_size(), "requests": n}
        if rank == 0:  # the reference: the same model on one device
            with acb.Engine(single) as eng:
                hs = [eng.submit(p, s) for p, s in zip(prompts, sp)]
                ref = [h.result().generated_tokens for h in hs]
        del single
        free_memory()
        model = AutoModelForCausalLM.from_pretrained(
            tmp,
            dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32,
            distributed_config=DistributedConfig(tp_plan="auto"),
        ).eval()
    with acb.Engine(model) as eng:
        sync_ = eng.core.sync  # type: ignore[union-attr]
        spent = [0.0, 0]
        real = sync_.exchange

        def timed(cmds: Any) -> Any:
            t0 = time.perf_counter()
            out = real(cmds)
            spent[0] += time.perf_counter() - t0
            spent[1] += 1
            return out

        sync_.exchange = timed
        t0 = time.perf_counter()
        got = []
        if rank == 0:
            hs = [eng.submit(p, s) for p, s in zip(prompts, sp)]
            got = [h.result().generated_tokens for h in hs]
        wall = time.perf_counter() - t0
        steps = eng.stats.steps
    if rank == 0:
        same = sum(a == b for a, b in zip(got, ref))
        result.update(
            identical_to_one_device=f"{same}/{n}",
            tokens_per_s=round(sum(outs) / wall, 1),
            steps=steps,
            broadcast_us=round(1e6 * spent[0] / max(spent[1], 1), 1),
            broadcast_share=round(spent[0] / wall, 4),
        )
        path = args.json or f"benchmarks/results/{'cpu_smoke_tp' if args.cpu_smoke else 'gpu_check_tp'}.json"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)
        print(
            f"tp={result['tp']}: {result['identical_to_one_device']} outputs identical to one device (bf16 on GPU "
            f"may differ by reduction order), {result['tokens_per_s']} tok/s, broadcast {result['broadcast_us']} µs "
            f"({100 * result['broadcast_share']:.2f}% of the wall time); wrote {path}"
        )
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 requests per workload, batches 1/64 only")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-b", action="store_true", help="skip the 8B-shaped workload")
    ap.add_argument("--skip-compile", action="store_true", help="skip the torch.compile run of workload A")
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run every section on CPU with a tiny model and short lengths (checks the script, not speed)",
    )
    ap.add_argument(
        "--json", default=None, help="default: benchmarks/results/gpu_check.json (cpu_smoke.json with --cpu-smoke)"
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=0,
        metavar="N",
        help="instead: workload A tensor-parallel over N GPUs under torchrun (greedy parity with one "
        "GPU, tokens/s, the lock-step broadcast's cost); writes results/gpu_check_tp.json",
    )
    args = ap.parse_args()
    global DEVICE, LENGTHS, JSON_PATH
    shapes = SHAPES
    if args.cpu_smoke:
        DEVICE, LENGTHS, shapes = "cpu", (8, 24), SMOKE_SHAPES
        args.skip_tests = True
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (--cpu-smoke runs the script on CPU)", file=sys.stderr)
        return 2
    if args.tp:
        return tensor_parallel(args, shapes["A: Qwen3-0.6B"])
    JSON_PATH = json_path = args.json or f"benchmarks/results/{'cpu_smoke' if args.cpu_smoke else 'gpu_check'}.json"
    from acb.bench.common import machine_info

    results: dict[str, Any] = {"machine": machine_info(DEVICE)}
    n = 4 if args.cpu_smoke else 32 if args.quick else 256
    if not args.skip_tests:
        section(results, "tests", run_tests)
    section(results, "bandwidth_bytes_per_s", copy_bandwidth)
    for name, shape in shapes.items():
        if args.skip_b and name.startswith("B"):
            continue
        section(
            results, f"throughput {name}", throughput, name, shape, n, name.startswith("A") and not args.skip_compile
        )
    bw = results.get("bandwidth_bytes_per_s")
    if isinstance(bw, float):
        batches = [1, 4] if args.cpu_smoke else [1, 64] if args.quick else [1, 64, 256]
        shape_a = shapes["A: Qwen3-0.6B"]
        for async_mode, graphs in ((True, None), (True, False), (False, False)):
            section(
                results,
                f"decode A async={async_mode} graphs={graphs}",
                decode_steps,
                shape_a,
                batches,
                bw,
                async_mode,
                graphs,
            )
        # an MLA model: its latent paged (mla_latent_cache=True: the Triton backend's latent kernel on
        # CUDA, no graphs) against its expanded heads (decode graphs)
        mla = MLA_SMOKE_SHAPE if args.cpu_smoke else MLA_SHAPE
        for latent in (False, True):
            section(
                results,
                f"decode MLA latent={latent}",
                decode_steps,
                mla,
                batches,
                bw,
                True,
                None,
                {"mla_latent_cache": latent},
            )
    section(results, "batch invariance A", batch_invariance, shapes["A: Qwen3-0.6B"])
    save(results)
    print(
        f"\ndevice: {results['machine'].get('gpu') or DEVICE}  torch {results['machine']['torch']}  "
        f"transformers {results['machine']['transformers']}  {results['machine']['date']}"
    )
    if "tests" in results:
        t = results["tests"]
        print(f"tests: returncode {t.get('returncode')}  {t.get('tail', [''])[-1] if t.get('tail') else t}")
    for key, r in results.items():
        if key.startswith("throughput") and "acb" in r:
            tf = r.get("transformers_cb", {})
            print(
                f"{r['workload']:<18} acb {r['acb']['tokens_per_s']:>9.0f} tok/s   transformers CB "
                f"{tf.get('tokens_per_s', float('nan')):>9.0f} tok/s   ratio {r.get('acb_vs_transformers', float('nan')):.2f}x"
                f"   (backend {r['acb']['backend']}, graphs {r['acb']['cuda_graphs']})"
            )
            if "compiled_vs_eager" in r:
                print(
                    f"{'':<18} with torch.compile (level 1): {r['acb_compiled']['tokens_per_s']:.0f} tok/s "
                    f"({r['compiled_vs_eager']:.2f}x)"
                )
        elif key.startswith("decode") and isinstance(r, list):
            for row in r:
                idle = row["gpu_idle_fraction"]
                print(
                    f"decode batch {row['batch']:>4} async={row['async_batching']!s:<5} graphs={row['cuda_graphs']!s:<5} "
                    f"step {row['step_ms']:.2f} ms  floor {row['floor_ms']:.2f} ms  ({row['ratio_to_floor']:.2f}x)  "
                    f"GPU idle {'n/a' if idle is None else format(idle, '.1%')}"
                )
        elif isinstance(r, dict) and "error" in r:
            print(f"{key}: ERROR {r['error']}")
        elif key.startswith("batch invariance"):
            print(f"{key}: {json.dumps(r, default=str)[:1500]}")
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
