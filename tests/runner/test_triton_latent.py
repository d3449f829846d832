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

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from acb.runner.attention import triton_kernels as tk  # noqa: E402
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
