"""The Triton backend over an MLA layer's latent pages (``acb.runner.latent``): the latent kernel
(``triton_kernels.paged_latent_attention``, B3: absorbed queries over the latent as one head) against
a plain torch reference.

Runs under the Triton interpreter on CPU (``TRITON_INTERPRET=1``, set here before triton is
imported), in float32 (the interpreter's bf16 ``tl.dot`` is wrong). On a CUDA machine run with
``TRITON_INTERPRET=0`` to test the compiled kernel on the GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import functools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from acb.runner.attention import AttentionCall, BatchInputs, StepContext  # noqa: E402
from acb.runner.attention import triton_kernels as tk  # noqa: E402
from acb.runner.attention.torch_backend import TorchBackend, absorbs_chunk  # noqa: E402
from acb.runner.attention.triton_backend import TritonBackend  # noqa: E402
from acb.runner.latent import LatentExpand  # noqa: E402
from tests.conftest import triton_test_device  # noqa: E402

DEVICE = triton_test_device()

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.*")] + (
    [pytest.mark.gpu] if DEVICE.type == "cuda" else []
)

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _pages(num_blocks: int, block_size: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, block_size, 1, width, generator=g).to(dtype).to(DEVICE)


def _table(lens: list[int], block_size: int, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """Rows of shuffled, distinct block ids (never the scratch block 0); unused columns are 0."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    assert sum(need) <= len(perm)
    bt = torch.zeros(len(lens), max(need) + 1, dtype=torch.long)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = torch.tensor(perm[i : i + n])
        i += n
    return bt.to(DEVICE)


def _reference(q, pages, table, rows, lens, rank, scale, window=None, softcap=None, sinks=None, chunk=None):
    """fp32: query ``i`` ([H, r + rope]) over the latent at its row's positions ``0..lens[i] - 1`` as
    keys ``[c | k_rot]`` and values ``c``; returns ``[N, H, rank]``."""
    bs = pages.shape[1]
    flat = pages.float().reshape(-1, pages.shape[3])
    out = torch.zeros(q.shape[0], q.shape[1], rank, device=q.device)
    for i, (row, n) in enumerate(zip(rows, lens)):
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        lat = flat[table[row][pos // bs] * bs + pos % bs]  # [L, r + rope]
        s = q[i].float() @ lat.T * scale  # [H, L]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        vis = torch.ones(n, dtype=torch.bool, device=q.device)
        if window:
            vis &= pos > n - 1 - window
        if chunk:
            vis &= pos >= (n - 1) // chunk * chunk
        s = s.masked_fill(~vis, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.float()[:, None]], -1)
        out[i] = s.softmax(-1)[:, :n] @ lat[:, :rank]
    return out


# (heads, rank, rope): the tiny DeepSeek-V3's latent; more heads than a program's block (two blocks,
# the second part-masked) and a rank that is no power of two
SHAPES = [(4, 32, 8), (20, 48, 16)]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"H{s[0]}r{s[1]}p{s[2]}")
def test_decode_rows_of_different_lengths(shape, splits):
    """One absorbed query per sequence (no ``rows``: query ``i`` on block-table row ``i``), contexts
    of 1 to 70 tokens across pages, one split and split-K with the reduction."""
    h, rank, rope = shape
    bs, nb = 8, 32
    lens = [1, 70, 17, 8, 33]
    pages = _pages(nb, bs, rank + rope, torch.float32)
    table = _table(lens, bs, nb)
    q = torch.randn(len(lens), h, rank + rope, device=DEVICE)
    scale = 0.3
    got = tk.paged_latent_attention(q, pages, table, torch.tensor(lens, device=DEVICE), rank, scale, num_splits=splits)
    want = _reference(q, pages, table, range(len(lens)), lens, rank, scale)
    assert got.shape == (len(lens), h, rank)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("splits", [1, 2])
def test_chunk_queries_after_a_cached_prefix_as_rows(splits):
    """A chunk of 5 queries after 21 cached tokens: each query is a row of its own (its position + 1
    keys: the chunk's causal mask), beside a decode row of another sequence, through ``rows``, and
    the result is written into the first ``rank`` columns of a wider ``out``."""
    h, rank, rope = 4, 32, 8
    bs, nb = 4, 32
    pages = _pages(nb, bs, rank + rope, torch.float32, seed=1)
    table = _table([26, 13], bs, nb, seed=1)
    rows = [1, 0, 0, 0, 0, 0]
    lens = [13, 22, 23, 24, 25, 26]
    q = torch.randn(len(rows), h, rank + rope, device=DEVICE)
    out = torch.full((len(rows), h, rank + 8), 7.0, device=DEVICE)
    tk.paged_latent_attention(
        q,
        pages,
        table,
        torch.tensor(lens, device=DEVICE),
        rank,
        0.2,
        num_splits=splits,
        rows=torch.tensor(rows, device=DEVICE),
        out=out,
    )
    want = _reference(q, pages, table, rows, lens, rank, 0.2)
    torch.testing.assert_close(out[..., :rank], want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert torch.equal(out[..., rank:], torch.full_like(out[..., rank:], 7.0))  # untouched


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("feature", ["sinks", "softcap", "window", "chunk"], ids=lambda f: f)
def test_sinks_softcap_window_and_chunk(feature, splits):
    """Attention sinks (one logit per query head, in the first split only), soft-capping, a sliding
    window and chunked attention, each as the other kernels take them."""
    h, rank, rope = 20, 32, 8
    bs, nb = 8, 32
    lens = [3, 61, 40]
    pages = _pages(nb, bs, rank + rope, torch.float32, seed=2)
    table = _table(lens, bs, nb, seed=2)
    q = torch.randn(len(lens), h, rank + rope, device=DEVICE)
    kw: dict = {
        "sinks": {"sinks": torch.randn(h, device=DEVICE) * 2},
        "softcap": {"softcap": 2.0},
        "window": {"sliding_window": 19},
        "chunk": {"chunk": 16},
    }[feature]
    got = tk.paged_latent_attention(
        q, pages, table, torch.tensor(lens, device=DEVICE), rank, 0.3, num_splits=splits, **kw
    )
    ref_kw = {{"sliding_window": "window"}.get(k, k): v for k, v in kw.items()}
    want = _reference(q, pages, table, range(len(lens)), lens, rank, 0.3, **ref_kw)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    plain = tk.paged_latent_attention(q, pages, table, torch.tensor(lens, device=DEVICE), rank, 0.3, num_splits=splits)
    assert not torch.allclose(plain, got, atol=1e-3)  # the feature changed the result


def test_bad_shapes_are_refused():
    pages = _pages(4, 4, 40, torch.float32)
    table = torch.zeros(1, 2, dtype=torch.long, device=DEVICE)
    lens = torch.tensor([3], device=DEVICE)
    with pytest.raises(ValueError, match="latent pages"):
        tk.paged_latent_attention(torch.zeros(1, 4, 40, device=DEVICE), pages.expand(4, 4, 2, 40), table, lens, 32)
    with pytest.raises(ValueError, match="does not fit"):
        tk.paged_latent_attention(torch.zeros(1, 4, 48, device=DEVICE), pages, table, lens, 32)


# --- the backend: the Triton backend over latent pages against the torch backend ------------------

BS = 4  # page size


@functools.cache
def _model():
    from transformers import AutoModelForCausalLM

    from tests.test_model_sweep import ms

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(ms.tiny_config("deepseek_v3"), dtype=torch.float32).eval()


def _expand(absorb: bool) -> LatentExpand:
    """Layer 0's ``LatentExpand`` of the tiny DeepSeek V3 (its own ``expand_kv``; B3 where ``absorb``)."""
    m = _model().model.layers[0].self_attn
    nope, v = m.qk_nope_head_dim, m.v_head_dim
    heads = m.kv_b_proj.out_features // (nope + v)
    return LatentExpand(
        m.expand_kv, m.kv_lora_rank, m.qk_rope_head_dim, v, heads, nope, m.kv_b_proj if absorb else None
    )


def _batch(seqs: list[tuple[int, int]], table: torch.Tensor) -> BatchInputs:
    """A step of ``(start, num_new)`` per sequence, sequence ``i`` on block-table row ``i``."""
    slots = [int(table[i, p // BS]) * BS + p % BS for i, (s, n) in enumerate(seqs) for p in range(s, s + n)]
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    return BatchInputs(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        block_table=table[: len(seqs)],
        seq_lens=torch.tensor([s + n for s, n in seqs], device=DEVICE),
        query_start_loc=torch.tensor(qsl, device=DEVICE),
        num_new=[n for _, n in seqs],
        start_pos=[s for s, _ in seqs],
        max_seq_len=max(s + n for s, n in seqs),
    )


# three sequences over five steps: fresh prompts (B1); decode rows beside a short chunk after a cached
# prefix (B3 for both where the layer absorbs: chunks of up to 12 queries for these sizes); a long chunk
# after a cached prefix (B1: expanded) beside decode rows; decode rows of different lengths, alone (a
# decode-only step); and a short chunk beside a decode row
STEPS = [
    [(0, 9), (0, 21), (0, 3)],
    [(9, 1), (21, 5), (3, 1)],
    [(10, 1), (26, 20), (4, 1)],
    [(11, 1), (46, 1), (5, 1)],
    [(12, 7), (47, 1)],
]


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("absorb", [True, False], ids=["B3", "B1"])
def test_backend_over_latent_pages_matches_the_torch_backend(absorb, sinks, monkeypatch):
    """Each step's output of the Triton backend on latent pages equals the torch backend's (float32,
    1e-5), with and without attention sinks, both storing the same latent; B3 rows go through the
    latent kernel (counted), B1 chunks through the prefill kernel over the expanded latent."""
    from acb.runner.kv_cache import KVCache
    from acb.runner.setup import kv_spec_of

    lat = _expand(absorb)
    assert lat.absorbs is absorb and absorbs_chunk(lat, 5) is absorb and not absorbs_chunk(lat, 20)
    spec = kv_spec_of(_model(), torch.float32, latent=True)
    layer = spec.latent_layers[0]
    table = torch.zeros(3, 13, dtype=torch.long)  # distinct pages per sequence (19, 48 and 6 tokens at most)
    table[0, :5] = torch.arange(1, 6)
    table[1, :12] = torch.arange(6, 18)
    table[2, :2] = torch.arange(18, 20)
    table = table.to(DEVICE)
    caches = {name: KVCache(spec, 24, BS, DEVICE) for name in ("torch", "triton")}
    backends = {"torch": TorchBackend(), "triton": TritonBackend()}
    calls = []
    original = tk.paged_latent_attention
    monkeypatch.setattr(
        tk, "paged_latent_attention", lambda *a, **k: (calls.append(a[0].shape[0]), original(*a, **k))[1]
    )
    g = torch.Generator().manual_seed(3)
    call = AttentionCall(
        scaling=0.21, latent=lat, sinks=torch.randn(lat.heads, generator=g).to(DEVICE) if sinks else None
    )
    for seqs in STEPS:
        batch = _batch(seqs, table)
        t = batch.slot_mapping.numel()
        q = torch.randn(1, lat.heads, t, lat.nope + lat.rope, generator=g).to(DEVICE)
        key = torch.randn(1, 1, t, lat.rank + lat.rope, generator=g).to(DEVICE)
        out = {}
        for name, be in backends.items():
            ctx = StepContext(caches[name], be, be.build_metadata(batch, BS))
            with torch.no_grad():
                out[name] = be.forward(layer, q, key, key, ctx, call)
        assert out["triton"].shape == (1, t, lat.heads, lat.v_dim)
        torch.testing.assert_close(out["triton"], out["torch"], rtol=1e-5, atol=1e-5)
        assert torch.equal(caches["triton"].k[layer], caches["torch"].k[layer])
    # B3: every step has absorbed rows (decode rows; step 2's chunk of 5 and the last step's of 7 are
    # short); B1: none (every query expanded)
    assert calls == ([1 + 5 + 1, 1 + 1, 3, 7 + 1] if absorb else [])


# --- the engine ----------------------------------------------------------------------------------


def test_engine_on_the_triton_backend_pages_the_latent_and_matches_generate(monkeypatch):
    """``attn_backend="triton"`` with ``mla_latent_cache=True``: the MLA layers' cache layers hold the
    latent, the latent kernel attends the decode rows (and short chunks), and the greedy tokens are
    ``model.generate``'s, with prompts chunked (16 tokens a step: steps mix decode rows and chunks)."""
    import copy

    import acb
    from tests.conftest import prompts_of_lengths, reference_generate

    model = _model()
    ps = prompts_of_lengths([5, 19, 11], vocab=model.config.vocab_size, seed=3)
    want = [reference_generate(model, p, 5, ignore_eos=True) for p in ps]
    calls = []
    original = tk.paged_latent_attention
    monkeypatch.setattr(
        tk, "paged_latent_attention", lambda *a, **k: (calls.append(a[0].shape[0]), original(*a, **k))[1]
    )
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=16, page_size=8, max_batch_tokens=16, attn_backend="triton", mla_latent_cache=True
    )
    with acb.Engine(copy.deepcopy(model).to(DEVICE), cfg) as eng:
        assert eng.runner.cfg.attn_backend == "triton"
        assert eng.runner.kv_cache.spec.latent_layers == (0, 1)
        got = [
            o.generated_tokens
            for o in eng.generate_batch(ps, max_new_tokens=5, ignore_eos=True, progress_bar=False).values()
        ]
    assert calls  # the latent kernel ran
    assert got == want
