"""Compile acb's Triton kernels for a GPU architecture on a machine without one, and report their resources.

Triton compiles ahead of time when it is given a target: its NVIDIA backend lowers to PTX and runs
the bundled ``ptxas``, with no driver and no GPU. This script drives the real launch path (the
``TritonBackend`` forward that the engine calls, so the same views, strides and integer
specialisations) with a stand-in driver that reports the target architecture; each kernel's
``_do_compile`` is intercepted, so nothing is launched, and every specialisation it asked for is
then compiled to a cubin for the target. ``cuobjdump -res-usage`` reads registers, spills (local
memory) and shared memory off each cubin.

The LoRA kernels (``acb.runner.lora_kernels``: shrink and expand over a step's runs of equal
slots, and the same kernels per row inside a decode graph) are driven through ``lora_apply`` the
way ``acb.runner.lora``'s interception calls it, for target linears of the benchmarked models'
shapes (:class:`LoraCase`).

The batch-invariant mode's kernels: its fixed-order matmul (``acb.runner.batch_invariant_kernels``,
every linear and the LM head on CUDA) and its row mean (RMSNorm's) for the benchmarked models'
linear shapes at several row counts (:class:`MatmulCase`; one specialisation whatever the row
count), and the Triton backend's
fixed-order attention (``TritonBackend(fixed_order=True)``: step kind ``"fixed"``).

What it catches without a GPU: kernels that do not lower for the real target (the interpreter
accepts things that the compiler rejects: ``tl.dot`` shapes and dtypes, layouts), shared memory
over the architecture's per-block limit, and register spills. It says nothing about speed.

    python benchmarks/kernel_compile.py                     # full matrix, sm_90 and sm_80
    python benchmarks/kernel_compile.py --quick --arch 90   # the CI subset

``--jobs N`` compiles N specialisations at a time, in threads (Triton's compiler releases the GIL
for its passes and runs ``ptxas`` as a subprocess; its own ``AsyncCompileMode`` compiles in a
thread pool too); each record's ``compile_s`` is then its wall time beside the others.

Writes ``benchmarks/results/kernel_compile.json`` (``--json`` to change) and prints a table; exits
1 when a kernel fails to compile or exceeds the shared-memory limit.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("kernel_compile.py compiles real kernels: run it without TRITON_INTERPRET=1")
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

# per-block dynamic shared memory limit (bytes) by compute capability (CUDA programming guide)
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    """One attention layer's step: shapes of a model family, and which kernels the step takes."""

    head_dim: int
    dtype: str
    heads: int
    kv_heads: int
    # "decode" (one split), "decode_split" (split-K + reduction), "mixed" (prefill + decode rows), "prefill",
    # "fixed" (a mixed step in the batch-invariant mode: every query through the decode kernel, one split)
    step: str
    window: int | None = None
    softcap: float | None = None
    # an MLA layer paged as its latent of this rank (acb.runner.latent): head_dim is the latent's width
    # (rank + rope) and kv_heads 1; the query and values are DeepSeek V3's (nope 128 + rope, v 128)
    latent: int = 0


MLA_NOPE = MLA_V = 128


@dataclass(frozen=True)
class LoraCase:
    """One target linear's LoRA update (``acb.runner.lora_kernels.lora_apply``): the linear's
    shape, the dtype, ``max_lora_rank`` and the form: ``runs`` (an eager step's runs of equal
    slots) or ``per_row`` (a decode graph: one run a row, from the static slot row)."""

    in_features: int
    out_features: int
    dtype: str
    max_rank: int
    form: str
    max_loras: int = 4


@dataclass(frozen=True)
class MatmulCase:
    """The batch-invariant mode's linear (``acb.runner.batch_invariant_kernels.matmul``): the
    linear's shape, the dtype and the step's row count."""

    in_features: int
    out_features: int
    dtype: str
    rows: int


def matmul_cases(quick: bool) -> list[MatmulCase]:
    """Llama-3.1-8B's q/o, gate/up and down projections and its LM head (4096 -> 128256) in bf16, at
    1, 17 and 300 rows; Qwen3-0.6B's q (1024 -> 2048) in fp16 and fp32. ``quick``: one row count
    for the large shapes."""
    rows = (1,) if quick else (1, 17, 300)
    shapes = ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 128256))
    out = [MatmulCase(i, o, "bf16", m) for (i, o), m in itertools.product(shapes, rows)]
    out += [MatmulCase(1024, 2048, dt, m) for dt, m in itertools.product(("fp16", "fp32"), (1, 64))]
    return out


def _matmul_step(case: MatmulCase) -> None:
    from acb.runner import batch_invariant_kernels as bk

    dtype = DTYPES[case.dtype]
    x = torch.zeros(case.rows, case.in_features, dtype=dtype)
    bk.matmul(x, torch.zeros(case.out_features, case.in_features, dtype=dtype))
    bk.row_mean(x.float(), keepdim=True)  # the RMSNorm's mean before such a linear


class _TargetDriver:
    """Stands in for Triton's CUDA driver: reports ``target`` and device 0; launches nothing."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def cases(quick: bool) -> list[Case]:
    """The matrix: every head dim the issue names, every dtype, GQA groups 1 and 4, each step kind,
    and the window and softcap variants (constexpr switches). ``quick``: the model shapes acb is
    benchmarked on (Qwen3-0.6B and Llama-3.1-8B: head dim 128 bf16), plus head dim 256 with
    window and softcap (Gemma-2) and one fp32 and one fp16 shape."""
    steps = ("decode", "decode_split", "mixed", "prefill")
    if quick:
        out = [Case(128, "bf16", 16, 8, s) for s in steps]
        out += [Case(128, "bf16", 32, 8, s) for s in steps]
        out += [Case(256, "bf16", 8, 4, s, window=4096, softcap=50.0) for s in steps]
        out += [Case(80, "fp32", 4, 4, s) for s in steps]
        out += [Case(96, "fp16", 32, 32, "mixed")]
        # DeepSeek V3's latent (512 + 64), 16 heads: the latent kernel (B3; "mixed" also runs the
        # prefill kernel over the expanded latent, B1)
        out += [Case(576, "bf16", 16, 1, s, latent=512) for s in ("decode", "decode_split", "mixed")]
        out += [Case(128, "bf16", 32, 8, "fixed"), Case(80, "fp32", 4, 4, "fixed")]  # the batch-invariant mode
        return out
    out = []
    for hd, dt, (h, kv), s in itertools.product((64, 80, 96, 128, 256), DTYPES, ((8, 8), (16, 4)), steps):
        out.append(Case(hd, dt, h, kv, s))
    for hd, s in itertools.product((128, 256), steps):
        out.append(Case(hd, "bf16", 16, 4, s, window=4096))
        out.append(Case(hd, "bf16", 16, 4, s, softcap=50.0))
    for dt, h, s in itertools.product(DTYPES, (16, 128), ("decode", "decode_split", "mixed")):
        out.append(Case(576, dt, h, 1, s, latent=512))
    out += [Case(hd, dt, 16, 4, "fixed") for hd, dt in itertools.product((64, 128, 256), DTYPES)]
    return out


def lora_cases(quick: bool) -> list[LoraCase]:
    """LoRA's matrix: Llama-3.1-8B's q/o (4096 -> 4096), gate/up (4096 -> 14336) and down
    (14336 -> 4096) projections and Qwen3-0.6B's q (1024 -> 2048); ranks 8, 16 and 64; both forms.
    ``quick``: Llama's three shapes at rank 16 in bf16, one rank-64 fp16 and one rank-8 fp32
    shape, each in both forms."""
    forms = ("runs", "per_row")
    if quick:
        shapes = ((4096, 4096), (4096, 14336), (14336, 4096))
        out = [LoraCase(i, o, "bf16", 16, f) for (i, o), f in itertools.product(shapes, forms)]
        out += [LoraCase(4096, 4096, "fp16", 64, f) for f in forms]
        out += [LoraCase(1024, 2048, "fp32", 8, f) for f in forms]
        return out
    shapes = ((4096, 4096), (4096, 14336), (14336, 4096), (1024, 2048))
    return [LoraCase(i, o, dt, r, f) for (i, o), dt, r, f in itertools.product(shapes, DTYPES, (8, 16, 64), forms)]


def _lora_step(case: LoraCase, slots: list[int]) -> None:
    """One target linear's update through ``lora_apply`` as the interception makes it (CPU tensors:
    the kernels never launch): ``slots`` is each token's slot (0: none); the eager form gets the
    adapter rows sorted by slot and their runs, the per-row form every row."""
    from acb.runner import lora_kernels as lk

    dtype = DTYPES[case.dtype]
    t = len(slots)
    x = torch.zeros(1, t, case.in_features, dtype=dtype).reshape(-1, case.in_features).contiguous()
    out = torch.zeros(1, t, case.out_features, dtype=dtype).view(-1, case.out_features)
    a = torch.zeros(case.max_loras + 1, case.max_rank, case.in_features, dtype=dtype)
    b = torch.zeros(case.max_loras + 1, case.out_features, case.max_rank, dtype=dtype)
    scale = torch.zeros(case.max_loras + 1, dtype=torch.float32)
    tok = torch.tensor(slots)
    if case.form == "per_row":
        order = torch.arange(t)
        lk.lora_apply(x, out, a, b, scale, order, lk.per_row_runs(tok, order), 1)
        return
    order = torch.argsort(tok, stable=True)
    order = order[tok[order] > 0]
    runs, start = [], 0
    for s in sorted(set(slots) - {0}):
        runs.append((s, start, slots.count(s)))
        start += slots.count(s)
    lk.lora_apply(x, out, a, b, scale, order, lk.runs_tensor(runs, torch.device("cpu")), max(c for *_, c in runs))


BLOCK_SIZE = 16


def _cache(case: Case, blocks: int):
    """A one-layer KV cache of ``case``'s shape, on CPU (the kernels never launch)."""
    from acb.runner.kv_cache import KVCache, KVSpec

    spec = KVSpec.uniform(1, case.kv_heads, case.head_dim, DTYPES[case.dtype])
    return KVCache(spec, blocks, BLOCK_SIZE, torch.device("cpu"))


def _latent_expand(case: Case):
    """A ``LatentExpand`` of ``case``'s shape (zero weights, on CPU): what an MLA module's layer passes.
    (The backend reads a latent layer's pages as ``k[layer]``, ``[blocks, block_size, 1, rank + rope]``:
    ``_cache``'s layer of one head of ``head_dim``.)"""
    from acb.runner.latent import LatentExpand

    rank, rope, heads = case.latent, case.head_dim - case.latent, case.heads
    kv_b = torch.nn.Linear(rank, heads * (MLA_NOPE + MLA_V), bias=False, dtype=DTYPES[case.dtype])
    torch.nn.init.zeros_(kv_b.weight)

    def expand_kv(c: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, _, n, _ = c.shape
        kv = kv_b(c).view(b, n, heads, MLA_NOPE + MLA_V).transpose(1, 2)
        return torch.cat([kv[..., :MLA_NOPE], k_rot.expand(b, heads, n, rope)], -1), kv[..., MLA_NOPE:]

    return LatentExpand(expand_kv, rank, rope, MLA_V, heads, MLA_NOPE, kv_b)


def _step(
    backend, cache, case: Case, num_new: list[int], start: list[int], table: torch.Tensor, num_splits: int | None = None
) -> None:
    """One layer of one step through ``TritonBackend.forward``, with inputs laid out as the engine
    builds them: the block table gathered to the step's width, the model's projection views."""
    from acb.runner.attention import AttentionCall, BatchInputs, StepContext

    lens = [s + n for s, n in zip(start, num_new)]
    qsl = [0]
    for n in num_new:
        qsl.append(qsl[-1] + n)
    t, b = qsl[-1], len(num_new)
    batch = BatchInputs(
        slot_mapping=torch.zeros(t, dtype=torch.long),
        block_table=table[:, : -(-max(lens) // BLOCK_SIZE)].index_select(0, torch.arange(b) % table.shape[0]),
        seq_lens=torch.tensor(lens),
        query_start_loc=torch.tensor(qsl),
        num_new=num_new,
        start_pos=start,
        max_seq_len=max(lens),
    )
    md = backend.step_metadata(batch)
    md.num_splits = num_splits
    dtype = DTYPES[case.dtype]
    # the model's layout: projections viewed as [1, T, H, D] and transposed to [1, H, T, D]
    q_dim = MLA_NOPE + case.head_dim - case.latent if case.latent else case.head_dim
    q = torch.zeros(1, t, case.heads, q_dim, dtype=dtype).transpose(1, 2)
    k = torch.zeros(1, t, case.kv_heads, case.head_dim, dtype=dtype).transpose(1, 2)
    with torch.no_grad():
        backend.forward(
            0,
            q,
            k,
            k.clone(),
            StepContext(cache, backend, md),
            AttentionCall(
                scaling=q_dim**-0.5,
                sliding_window=case.window,
                softcap=case.softcap,
                latent=_latent_expand(case) if case.latent else None,
            ),
        )


def _drive(case: Case | LoraCase | MatmulCase) -> None:
    """Run one layer of ``case``'s step kind through the backend, or one LoRA update, or one
    batch-invariant matmul (nothing launches)."""
    from acb.runner.attention.triton_backend import TritonBackend

    if isinstance(case, LoraCase):
        _lora_step(case, [0, 1, 2, 1, 0, 3, 3, 3, 2, 0, 1, 4] * 3)
        return
    if isinstance(case, MatmulCase):
        _matmul_step(case)
        return

    num_new, lens = {
        "mixed": ([1, 1, 7, 40], [300, 20, 30, 40]),
        "fixed": ([1, 1, 7, 40], [300, 20, 30, 40]),
        "prefill": ([7, 40], [30, 300]),  # a fresh prompt and a chunk after cached context
    }.get(case.step, ([1, 1, 1], [300, 20, 400]))
    start = [n - q for n, q in zip(lens, num_new)]
    _step(
        TritonBackend(fixed_order=case.step == "fixed"),
        _cache(case, 64),
        case,
        num_new,
        start,
        torch.zeros(4, 32, dtype=torch.long),
        num_splits=4 if case.step == "decode_split" else 1 if case.step != "fixed" else None,
    )


def _resources(cubin: bytes) -> dict[str, int]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    fields = dict(item.split(":", 1) for item in line.split())
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]), "spill_bytes": int(fields["LOCAL"])}


def _ptx_summary(ptx: str) -> dict[str, object]:
    """How the kernel reads memory and multiplies: the matrix instruction family (``wgmma`` is
    Hopper's warpgroup MMA, ``mma.sync`` the Ampere one, ``none`` for FMA-only) and the count of
    asynchronous global-to-shared copies (``cp.async``: Triton's software pipelining)."""
    if "wgmma.mma_async" in ptx:
        mma = "wgmma"
    elif "mma.sync" in ptx:
        mma = "mma.sync"
    else:
        mma = "none"
    return {"mma": mma, "cp_async": len(re.findall(r"\bcp\.async\.c[ag]\.shared\.global", ptx))}


@contextlib.contextmanager
def intercepted(arch: int):
    """Within the block, launches of acb's kernels compile and run nothing: each specialisation
    Triton would compile for ``sm_<arch>`` is recorded instead, in the dict yielded (identity ->
    (kernel, signature, constexprs, attrs, options, tag)); set ``tag[0]`` to label what follows."""
    from acb.runner import batch_invariant_kernels as bk
    from acb.runner import lora_kernels as lk
    from acb.runner.attention import triton_kernels as tk

    if tk.interpreted():
        raise RuntimeError("triton_kernels was imported under TRITON_INTERPRET=1")
    kernels = (
        tk._store_kv_kernel,
        tk._decode_split_kernel,
        tk._decode_reduce_kernel,
        tk._prefill_kernel,
        tk._latent_decode_kernel,
        lk._shrink_kernel,
        lk._expand_kernel,
        bk._matmul_kernel,
        bk._row_mean_kernel,
    )
    asked: dict[tuple, tuple] = {}
    tag: list = [None]

    def interceptor(kernel):
        def _do_compile(key, signature, device, constexprs, options, attrs, warmup):
            ident = (
                kernel.__name__,
                repr(sorted(signature.items())),
                repr(sorted(constexprs.items())),
                repr(sorted(attrs.items())),
                options.num_warps,
                options.num_stages,
            )
            asked.setdefault(ident, (kernel, signature, constexprs, attrs, options, tag[0]))
            return None  # run() returns without launching

        return _do_compile

    saved = {k: k.__dict__.get("_do_compile") for k in kernels}
    driver.set_active(_TargetDriver(GPUTarget("cuda", arch, 32)))
    try:
        for k in kernels:
            k._do_compile = interceptor(k)
            k.device_caches.clear()  # binders are made per target
        yield asked, tag
    finally:
        for k, old in saved.items():
            if old is None:
                del k._do_compile
            else:
                k._do_compile = old
            k.device_caches.clear()
        driver.set_active(None)  # the real driver again, made on first use


def specialisations(arch: int, todo: list[Case | LoraCase | MatmulCase]) -> list[tuple]:
    """Every kernel specialisation that ``todo`` launches for ``sm_<arch>`` (entries of
    :func:`intercepted`'s dict), in the order they were asked for."""
    with intercepted(arch) as (asked, tag):
        for case in todo:
            tag[0] = case
            _drive(case)
    return list(asked.values())


def compile_cases(arch: int, todo: list[Case | LoraCase | MatmulCase], jobs: int = 1) -> list[dict]:
    """Every kernel specialisation that ``todo`` launches, compiled for ``sm_<arch>`` (``jobs`` at a
    time); one record each, in the order they were asked for."""
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(functools.partial(_compile_one, arch), specialisations(arch, todo)))


def _compile_one(arch: int, entry: tuple) -> dict:
    """One specialisation (an entry of :func:`intercepted`'s dict) compiled for ``sm_<arch>``: its record."""
    target = GPUTarget("cuda", arch, 32)
    limit = SHARED_LIMIT.get(arch)
    kernel, signature, constexprs, attrs, options, case = entry
    rec = {
        "arch": f"sm_{arch}",
        "kernel": kernel.__name__.lstrip("_"),
        "case": asdict(case),
        "num_warps": options.num_warps,
        "num_stages": options.num_stages,
        # constexprs are keyed by argument position: name them (integers Triton
        # specialised because they equal 1 show up here too)
        "constexprs": {
            kernel.arg_names[path[0]]: v for path, v in constexprs.items() if isinstance(v, (bool, int, float))
        },
    }
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__
        )
    except Exception as exc:  # noqa: BLE001 - reported per kernel
        rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
    else:
        rec.update(
            ok=True,
            shared_bytes=compiled.metadata.shared,
            **_resources(compiled.asm["cubin"]),
            **_ptx_summary(compiled.asm["ptx"]),
        )
        if limit is not None and rec["shared_bytes"] > limit:
            rec.update(ok=False, error=f"shared memory {rec['shared_bytes']} B over the sm_{arch} limit {limit} B")
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    return rec


def mid_serving_compiles(arch: int, case: Case, steps: int = 150, seed: int = 0) -> list[str]:
    """Specialisations a sweep of ``steps`` engine-like steps would compile after warm-up.

    Warm-up is ``triton_kernels.precompile`` for the layer (what the backend runs on its first
    forward). The sweep then sends random steps through ``TritonBackend.forward`` the way the
    engine builds them: batch sizes 1-48, decode-only, prefill-only and mixed, contexts up to
    4k tokens, the block table gathered to each step's width, split counts chosen per step or
    fixed as in a graph, some in the batch-invariant mode. Returns the kernel names of specialisations first asked for in the
    sweep (each would be a compile stall mid-serving); empty is the goal."""
    import random

    from acb.runner.attention import triton_kernels as tk
    from acb.runner.attention.triton_backend import TritonBackend

    rng = random.Random(seed)
    blocks = 512
    cache = _cache(case, blocks)
    table = torch.randint(1, blocks, (64, 256))
    with intercepted(arch) as (asked, tag):
        tag[0] = "warm-up"
        tk.precompile(
            case.heads, cache.k[0], cache.v[0], DTYPES[case.dtype], case.head_dim**-0.5, case.window, case.softcap
        )
        tag[0] = "sweep"
        backend = TritonBackend()
        invariant = TritonBackend(fixed_order=True)  # the batch-invariant mode's steps
        for _ in range(steps):
            b = rng.randint(1, 48)
            kind = rng.choice(("decode", "prefill", "mixed"))
            num_new = [
                1 if kind == "decode" or (kind == "mixed" and rng.random() < 0.7) else rng.randint(2, 300)
                for _ in range(b)
            ]
            splits = None
            if kind == "decode" and rng.random() < 0.5:  # a graph replay: the split count is fixed
                splits = rng.choice(backend.graph_variants(b, case.kv_heads, 4096, torch.device("cpu")))
            rows = table[torch.randperm(64)[: min(b, 64)]]
            mode = rng.random() < 0.2
            start = [rng.randint(0, 4000) for _ in range(b)]
            _step(invariant if mode else backend, cache, case, num_new, start, rows, None if mode else splits)
    return [entry[0].__name__.lstrip("_") for entry in asked.values() if entry[5] == "sweep"]


def lora_mid_serving_compiles(arch: int, case: LoraCase, steps: int = 60, seed: int = 0) -> list[str]:
    """LoRA's counterpart of :func:`mid_serving_compiles` for one target linear's shape, dtype and
    rank. Warm-up is the per-row form at one batch size (what the decode graphs' capture runs
    first); the sweep sends random eager steps (1-600 tokens, 1-``max_loras`` slots, base rows
    between) and per-row steps of 1-256 rows. Returns the kernel names first asked for in the
    sweep; empty is the goal (the runs, the order and the grid are the only things that vary)."""
    import random

    rng = random.Random(seed)
    with intercepted(arch) as (asked, tag):
        tag[0] = "warm-up"
        _lora_step(LoraCase(case.in_features, case.out_features, case.dtype, case.max_rank, "per_row"), [0, 1] * 4)
        tag[0] = "sweep"
        for _ in range(steps):
            form = rng.choice(("runs", "per_row"))
            t = rng.randint(1, 600 if form == "runs" else 256)
            slots = [rng.randint(0, case.max_loras) for _ in range(t)]
            slots[rng.randrange(t)] = rng.randint(1, case.max_loras)  # (at least one adapter row)
            _lora_step(LoraCase(case.in_features, case.out_features, case.dtype, case.max_rank, form), slots)
    return [entry[0].__name__.lstrip("_") for entry in asked.values() if entry[5] == "sweep"]


def matmul_mid_serving_compiles(arch: int, case: MatmulCase, steps: int = 40, seed: int = 0) -> list[str]:
    """The batch-invariant matmul's counterpart of :func:`mid_serving_compiles` for one linear's
    shape and dtype: warm-up is one row; the sweep sends 1-600 rows, and rows of a wider buffer
    (a strided view). Returns the kernel names first asked for in the sweep; empty is the goal
    (the row count is not specialised: one compiled kernel, one arithmetic, for every batch)."""
    import random

    from acb.runner import batch_invariant_kernels as bk

    rng = random.Random(seed)
    dtype = DTYPES[case.dtype]
    w = torch.zeros(case.out_features, case.in_features, dtype=dtype)
    with intercepted(arch) as (asked, tag):
        tag[0] = "warm-up"
        bk.matmul(torch.zeros(1, case.in_features, dtype=dtype), w)
        tag[0] = "sweep"
        for _ in range(steps):
            m = rng.randint(1, 600)
            x = torch.zeros(m, case.in_features + rng.choice((0, 16)), dtype=dtype)[:, : case.in_features]
            bk.matmul(x, w)
    return [entry[0].__name__.lstrip("_") for entry in asked.values() if entry[5] == "sweep"]


def _table(records: list[dict]) -> str:
    head = "| arch | kernel | dtype | head dim | H/Hkv | step | regs | spill B | shared KiB | mma | ok |"
    rows = [head, "|" + "---|" * 11]
    for r in records:
        c = r["case"]
        if "rows" in c:  # a batch-invariant matmul: the linear's shape in the head-dim column
            c = {
                "dtype": c["dtype"],
                "head_dim": f"{c['in_features']}->{c['out_features']}",
                "heads": "M",
                "kv_heads": c["rows"],
                "step": "invariant matmul",
                "window": None,
                "softcap": None,
            }
        if "form" in c:  # a LoRA case: the linear's shape in the head-dim column, the rank in H/Hkv's
            c = {
                "dtype": c["dtype"],
                "head_dim": f"{c['in_features']}->{c['out_features']}",
                "heads": "r",
                "kv_heads": c["max_rank"],
                "step": f"lora {c['form']}",
                "window": None,
                "softcap": None,
            }
        extra = "+window" if c["window"] else ""
        extra += "+softcap" if c["softcap"] else ""
        extra += f"+latent{c['latent']}" if c.get("latent") else ""
        rows.append(
            f"| {r['arch']} | {r['kernel']} | {c['dtype']} | {c['head_dim']} | {c['heads']}/{c['kv_heads']} | "
            f"{c['step']}{extra} | {r.get('registers', '-')} | {r.get('spill_bytes', '-')} | "
            f"{r['shared_bytes'] / 1024:.1f} | {r['mma']} | yes |"
            if r["ok"]
            else f"| {r['arch']} | {r['kernel']} | {c['dtype']} | {c['head_dim']} | {c['heads']}/{c['kv_heads']} | "
            f"{c['step']}{extra} | - | - | - | - | NO: {r['error'][:120]} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--arch", type=int, action="append", help="compute capability, e.g. 90 (repeatable; default 90 and 80)"
    )
    ap.add_argument("--quick", action="store_true", help="the CI subset of shapes")
    ap.add_argument("--first", type=int, help="only the first N cases of the matrix")
    ap.add_argument("--json", default="benchmarks/results/kernel_compile.json")
    ap.add_argument("--jobs", type=int, default=1, help="specialisations compiled at a time (threads)")
    ap.add_argument(
        "--skip-sweep", action="store_true", help="compile only: no sweep of step shapes for mid-serving compiles"
    )
    args = ap.parse_args(argv)
    archs = args.arch or [90, 80]
    todo: list[Case | LoraCase | MatmulCase] = [
        *cases(args.quick),
        *lora_cases(args.quick),
        *matmul_cases(args.quick),
    ][: args.first]
    t0 = time.perf_counter()
    # after warm-up, no step shape may need a new compile (one family per dtype/head-dim/flags)
    # (the latent cases are not swept: their B1 chunks' prefill kernel compiles at first use)
    families = {
        (c.head_dim, c.dtype, c.heads // c.kv_heads == 1, c.window, c.softcap): c
        for c in todo
        if isinstance(c, Case) and not c.latent
    }
    # (a LoRA family: a linear's shape, dtype and rank; both forms share its kernels)
    lora_families = {(c.in_features, c.out_features, c.dtype, c.max_rank): c for c in todo if isinstance(c, LoraCase)}
    matmul_families = {(c.in_features, c.out_features, c.dtype): c for c in todo if isinstance(c, MatmulCase)}
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        # the compiles run in the pool while this thread sweeps the step shapes (Python work: the
        # compiler's passes and ptxas mostly run without the GIL)
        compiling = [pool.map(functools.partial(_compile_one, arch), specialisations(arch, todo)) for arch in archs]
        mid_serving = {
            f"{c.dtype} hd{c.head_dim} {c.heads}/{c.kv_heads}{' window' if c.window else ''}"
            f"{' softcap' if c.softcap else ''}": mid_serving_compiles(archs[0], c)
            for c in ([] if args.skip_sweep else families.values())
        }
        mid_serving |= {
            f"lora {c.dtype} {c.in_features}->{c.out_features} r{c.max_rank}": lora_mid_serving_compiles(archs[0], c)
            for c in ([] if args.skip_sweep else lora_families.values())
        }
        mid_serving |= {
            f"invariant matmul {c.dtype} {c.in_features}->{c.out_features}": matmul_mid_serving_compiles(archs[0], c)
            for c in ([] if args.skip_sweep else matmul_families.values())
        }
        records = [r for done in compiling for r in done]
    wall = time.perf_counter() - t0
    failed = [r for r in records if not r["ok"]]
    spilled = [r for r in records if r["ok"] and r["spill_bytes"]]
    late = {k: v for k, v in mid_serving.items() if v}
    doc = {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "archs": [f"sm_{a}" for a in archs],
        "quick": args.quick,
        "cases": len(todo),
        "kernels_compiled": len(records),
        "failed": len(failed),
        "spilling": len(spilled),
        "mid_serving_compiles": mid_serving,
        "wall_s": round(wall, 1),
        "records": records,
    }
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    print(_table(records))
    print(
        f"\n{len(records)} kernel specialisations for {', '.join(doc['archs'])} in {wall:.0f} s: "
        f"{len(failed)} failed, {len(spilled)} spill registers"
    )
    if not args.skip_sweep:
        print(
            f"after warm-up, a sweep of step shapes over {len(mid_serving)} layer kinds asks for "
            f"{sum(map(len, late.values()))} new specialisations" + (f": {late}" if late else "")
        )
    return 1 if failed or late else 0


if __name__ == "__main__":
    sys.exit(main())
