"""The CPU backend (``attn_backend="cpu"``, the CPU default for float32 models): decode rows attend
over the paged cache in place through acb's C kernel (``acb/runner/attention/cpu_kernels.c``).

Checked here: the kernel against the torch backend (the reference) with every attention feature
it takes (GQA groups, sliding windows, chunked attention, soft-capping, sinks, head sizes, page
sizes, scattered pages); that a row's output has the same bits alone as inside any batch; that
the engine picks it by default and keeps the torch backend where the kernel cannot be built;
and tokens equal to ``model.generate`` with the kernel running, with async batching, preemption
and offload.
"""

from __future__ import annotations

import pytest
import torch

import acb
from acb.models import tiny_model
from acb.runner.attention import AttentionCall, BatchInputs, StepContext, cpu_backend, cpu_kernels
from acb.runner.attention.cpu_backend import CpuBackend, _to_kernel
from acb.runner.attention.torch_backend import TorchBackend
from acb.runner.kv_cache import KVCache, KVSpec
from tests.conftest import prompts_of_lengths, reference_generate

pytestmark = pytest.mark.skipif(cpu_backend.unavailable_reason() is not None, reason="no C compiler here")


def _step(num_new, start, block_size, heads, hkv, head_dim, seed=0):
    """A step over a cache whose pages are scattered: the batch, q/k/v and a filled cache layer."""
    g = torch.Generator().manual_seed(seed)
    lens = [s + n for s, n in zip(start, num_new)]
    cols = max(-(-n // block_size) for n in lens)
    table = (torch.randperm(len(lens) * cols, generator=g) + 1).view(len(lens), cols).long()
    slots = [int(table[i, p // block_size]) * block_size + p % block_size
             for i, (s, n) in enumerate(zip(start, num_new)) for p in range(s, s + n)]  # fmt: skip
    qsl = [0]
    for n in num_new:
        qsl.append(qsl[-1] + n)
    batch = BatchInputs(
        slot_mapping=torch.tensor(slots),
        block_table=table,
        seq_lens=torch.tensor(lens),
        query_start_loc=torch.tensor(qsl),
        num_new=list(num_new),
        start_pos=list(start),
        max_seq_len=max(lens),
    )
    t = qsl[-1]
    q = torch.randn(1, heads, t, head_dim, generator=g)
    k = torch.randn(1, hkv, t, head_dim, generator=g)
    v = torch.randn(1, hkv, t, head_dim, generator=g)
    pages = torch.randn(1 + len(lens) * cols, block_size, hkv, head_dim, generator=g)
    return batch, q, k, v, pages


def _run(backend, batch, q, k, v, pages, block_size, **features):
    spec = KVSpec.uniform(1, pages.shape[2], pages.shape[3], torch.float32)
    cache = KVCache(spec, pages.shape[0], block_size, torch.device("cpu"))
    cache.k[0].copy_(pages)
    cache.v[0].copy_(pages.flip(0) * 0.5)
    ctx = StepContext(cache, backend, backend.build_metadata(batch, block_size))
    return backend.forward(0, q, k, v, ctx, AttentionCall(**features))[0]  # [T, H, D]


FEATURES = [
    dict(),
    dict(scaling=0.3),
    dict(sliding_window=7),
    dict(chunk=16),
    dict(softcap=5.0),
    dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 0.25, 3.0])),
    dict(sliding_window=20, softcap=30.0, sinks=torch.linspace(-1, 1, 8)),
]


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "+".join(f) or "plain")
@pytest.mark.parametrize(("heads", "hkv", "head_dim", "block_size"), [(8, 2, 64, 16), (8, 8, 32, 8), (8, 1, 80, 4)])
def test_the_kernel_agrees_with_the_torch_backend(features, heads, hkv, head_dim, block_size):
    # decode rows of many lengths (one page, a partial page, many pages) beside three prefill
    # chunks: a fresh prompt and a long chunk after a cached prefix (SDPA), a short chunk after one
    # (the kernel, query by query)
    num_new, start = [1, 1, 6, 1, 1, 9, 1, 60], [0, 37, 0, 15, 3, 20, 64, 10]
    assert _to_kernel(20, 9) and not _to_kernel(10, 60) and not _to_kernel(0, 6)
    batch, q, k, v, pages = _step(num_new, start, block_size, heads, hkv, head_dim)
    want = _run(TorchBackend(), batch, q, k, v, pages, block_size, **dict(features))
    calls = []
    real = cpu_kernels.paged_attention

    def spy(*a, **kw):
        calls.append(a[4].numel())
        return real(*a, **kw)

    cpu_kernels.paged_attention = spy
    try:
        got = _run(CpuBackend(), batch, q, k, v, pages, block_size, **dict(features))
    finally:
        cpu_kernels.paged_attention = real
    assert calls == [5 + 9]  # one kernel call: the five decode rows and the short chunk's nine queries
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_a_rows_output_does_not_depend_on_its_batch():
    """The same decode row, alone and inside batches of other rows (other lengths, other orders):
    the same bits, where SDPA over gathered, padded pages does not promise it."""
    block_size, heads, hkv, d = 8, 8, 2, 64
    batch, q, k, v, pages = _step([1] * 9, [40, 3, 17, 90, 8, 55, 1, 33, 70], block_size, heads, hkv, d, seed=3)

    def alone_and_in(rows):
        sub = BatchInputs(
            slot_mapping=batch.slot_mapping[rows],
            block_table=batch.block_table[rows],
            seq_lens=batch.seq_lens[rows],
            query_start_loc=torch.arange(len(rows) + 1),
            num_new=[1] * len(rows),
            start_pos=[batch.start_pos[i] for i in rows],
            max_seq_len=max(int(batch.seq_lens[i]) for i in rows),
        )
        return _run(CpuBackend(), sub, q[:, :, rows], k[:, :, rows], v[:, :, rows], pages, block_size)

    alone = alone_and_in([3])[0]
    for rows in ([0, 3], [3, 1, 2, 4, 5, 6, 7, 8], [8, 7, 6, 5, 4, 3, 2, 1, 0]):
        torch.testing.assert_close(alone_and_in(rows)[rows.index(3)], alone, atol=0, rtol=0)


def test_the_engine_picks_it_on_cpu_and_keeps_torch_where_it_cannot_be_built(monkeypatch, caplog):
    model = tiny_model("llama", seed=4)
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32)) as eng:
        assert eng.core.runner.cfg.attn_backend == "cpu" and isinstance(eng.core.runner.backend, CpuBackend)
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32, attn_backend="torch")) as eng:
        assert type(eng.core.runner.backend) is TorchBackend  # the reference, when asked
    bf16 = tiny_model("llama", seed=4, dtype=torch.bfloat16)
    with acb.Engine(bf16, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32)) as eng:
        assert eng.core.runner.cfg.attn_backend == "torch"  # the kernel is float32 only
    # a machine without a C compiler: told once (INFO), the torch backend runs
    monkeypatch.setattr(cpu_kernels, "_TRIED", False)
    monkeypatch.setattr(cpu_kernels, "_LIB", None)
    monkeypatch.setattr(cpu_kernels, "_PROBLEM", None)
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    with caplog.at_level("INFO"), acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32)) as eng:
        assert eng.core.runner.cfg.attn_backend == "torch"
    assert "no C compiler" in caplog.text and cpu_backend.unavailable_reason() == cpu_kernels.problem()
    # asked for by name there: refused at start, with the reason and the way out
    with pytest.raises(ValueError, match=r"attn_backend='cpu' cannot run here: no C compiler.*attn_backend='torch'"):
        acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32, attn_backend="cpu")).start()


def test_asked_for_by_name_in_a_fresh_process_it_builds_and_runs(tmp_path):
    """The kernel is loaded by the engine's start when the backend is named (not only by the
    automatic pick's check): a fresh process, an empty cache directory."""
    import os
    import subprocess
    import sys

    code = (
        "import acb; from acb.models import tiny_model; from tests.conftest import reference_generate\n"
        "m = tiny_model('llama', seed=5)\n"
        "with acb.Engine(m, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32, attn_backend='cpu')) as e:\n"
        "    out = e.generate([5, 6, 7, 8], acb.SamplingParams(max_new_tokens=6)).generated_tokens\n"
        "assert out == reference_generate(m, [5, 6, 7, 8], 6), out\n"
        "print('ok')\n"
    )
    env = dict(os.environ, ACB_CACHE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_TRIED", False)
    monkeypatch.setattr(cpu_kernels, "_LIB", None)
    monkeypatch.setattr(cpu_kernels, "_PROBLEM", None)
    monkeypatch.setenv("ACB_CACHE_DIR", str(tmp_path))
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", bad)
    assert cpu_kernels.load() is None
    assert cpu_kernels.problem().startswith("cc failed") or "failed" in cpu_kernels.problem()
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left behind


@pytest.mark.parametrize("offload", [False, True])
def test_generate_parity_with_async_batching_preemption_and_offload(offload, monkeypatch):
    calls = []
    real = cpu_kernels.paged_attention
    monkeypatch.setattr(cpu_kernels, "paged_attention", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    model = tiny_model("qwen2", seed=15)
    prompts = prompts_of_lengths([20, 31, 12, 25, 9, 17, 28, 14], seed=66)
    cfg = acb.ContinuousBatchingConfig(
        page_size=4,
        num_blocks=17,
        safety_margin=0.0,
        use_async_batching=True,
        cpu_offload_space=0.01 if offload else 0.0,
    )
    with acb.Engine(model, cfg) as eng:
        assert eng.core.runner.cfg.attn_backend == "cpu"
        handles = [eng.submit(p, acb.SamplingParams(max_new_tokens=16)) for p in prompts]
        outs = [h.result(timeout=120) for h in handles]
        stats = eng.stats
    assert calls and stats.preemptions > 0 and (stats.swapped_out_blocks > 0) == offload
    assert [o.generated_tokens for o in outs] == [reference_generate(model, p, 16) for p in prompts]


def test_a_library_built_for_another_cpu_is_not_loaded(monkeypatch, tmp_path):
    """The library is built for ``-march=native``: a cache directory shared with a machine whose
    CPU differs (a home directory on NFS) must not hand this one the other's build."""
    monkeypatch.setenv("ACB_CACHE_DIR", str(tmp_path))
    built = []
    for flags in ("flags : sse avx2\n", "flags : sse avx2 avx512f\n", "flags : sse avx2\n"):
        monkeypatch.setattr(cpu_kernels, "_TRIED", False)
        monkeypatch.setattr(cpu_kernels, "_LIB", None)
        monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda f=flags: f)
        assert cpu_kernels.load() is not None
        built.append(sorted(p.name for p in (tmp_path / "kernels").glob("*.so")))
    assert len(built[0]) == 1 and len(built[1]) == 2 and built[2] == built[1]  # the first CPU's build reused


def test_decode_only_metadata_equals_the_general_build(monkeypatch):
    """Issue 54 item 5: a decode-only step's metadata (the kernel's rows from a cached arange, its
    lengths the staged seq_lens, the torch path's decode groups built on first read) equals the
    general build's, for batches of several sizes and lengths, and the attention out of it too."""
    bs = 4
    for num, start in (([1], [6]), ([1, 1, 1], [3, 17, 8]), ([1] * 5, [0, 40, 2, 9, 33]), ([1, 1, 1], [5, 2, 30])):
        batch, q, k, v, pages = _step(num, start, bs, 4, 2, 16)
        mds = {}
        for reuse in (True, False):
            monkeypatch.setattr(cpu_backend, "REUSE", reuse)
            mds[reuse] = CpuBackend().build_metadata(batch, bs)
        fast, general = mds[True], mds[False]
        assert fast.groups is None  # not built until a layer falls back to the torch path
        assert [t.tolist() for t in fast.kernel_rows] == [t.tolist() for t in general.kernel_rows]
        assert (fast.num_tokens, fast.decode_rows, fast.prefills, fast.kernel_prefills) == (
            general.num_tokens,
            general.decode_rows,
            general.prefills,
            general.kernel_prefills,
        )
        assert [(g.rows.tolist(), g.blocks.tolist(), g.seq_lens.tolist(), g.num_blocks) for g in fast.decode] == [
            (g.rows.tolist(), g.blocks.tolist(), g.seq_lens.tolist(), g.num_blocks) for g in general.decode
        ]
        monkeypatch.setattr(cpu_backend, "REUSE", True)
        out = _run(CpuBackend(), batch, q, k, v, pages, bs)
        monkeypatch.setattr(cpu_backend, "REUSE", False)
        assert torch.equal(out, _run(CpuBackend(), batch, q, k, v, pages, bs))
