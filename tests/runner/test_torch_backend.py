"""The torch attention backend against attention computed per sequence from its own keys.

Decode rows are split into groups of similar context length and their pages gathered into a
reused workspace; these tests check that the grouping covers every row once and that the
output of a mixed step (decode rows of very different lengths, a fresh prompt, a chunk after
cached context, GQA, sliding window) equals plain per-sequence attention, on two steps in a
row (the workspace reused, then grown), with a group attended whole or a row at a time.
"""

from __future__ import annotations

import pytest
import torch

from acb.runner.attention import AttentionCall, BatchInputs, StepContext, torch_backend
from acb.runner.attention.torch_backend import GROUP_RATIO, MAX_GROUPS, TorchBackend, decode_groups
from acb.runner.kv_cache import KVCache, KVSpec

BS, H, HKV, D = 8, 4, 2, 16


def test_decode_groups_cover_every_row_once_and_bound_padding():
    lengths = [1, 3, 9, 17, 40, 41, 64, 65, 100, 200, 7, 8, 33]
    groups = decode_groups(lengths, BS)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert len(groups) <= MAX_GROUPS
    for g in groups:
        pages = [-(-lengths[i] // BS) for i in g]
        assert pages[0] == max(pages)  # the first row sets the group's padded length
        if g is not groups[-1]:  # only the last group may take what the cap left over
            assert min(pages) >= GROUP_RATIO * pages[0]
    assert decode_groups([], BS) == []


def _step(num_new: list[int], start: list[int], num_blocks: int, g: torch.Generator):
    lens = [s + n for s, n in zip(start, num_new)]
    cols = max(-(-n // BS) for n in lens)
    perm = torch.randperm(num_blocks - 1, generator=g)[: len(lens) * cols] + 1  # block 0 is scratch
    table = perm.view(len(lens), cols).long()
    slots = [
        int(table[i, p // BS]) * BS + p % BS for i, (s, n) in enumerate(zip(start, num_new)) for p in range(s, s + n)
    ]
    qsl = [0]
    for n in num_new:
        qsl.append(qsl[-1] + n)
    return BatchInputs(
        slot_mapping=torch.tensor(slots),
        block_table=table,
        seq_lens=torch.tensor(lens),
        query_start_loc=torch.tensor(qsl),
        num_new=num_new,
        start_pos=start,
        max_seq_len=max(lens),
    )


def _reference(cache: KVCache, batch: BatchInputs, q: torch.Tensor, window: int | None) -> torch.Tensor:
    """Per sequence: its keys read slot by slot from the cache, dense attention with a causal
    (and window) mask; [1, T, H, D]."""
    kf, vf = cache.flat_k(0), cache.flat_v(0)
    out = torch.empty(q.shape[2], H, D)
    for i, (s, n) in enumerate(zip(batch.start_pos, batch.num_new)):
        pos = torch.arange(s + n)
        slots = batch.block_table[i, pos // BS] * BS + pos % BS
        k = kf[slots].transpose(0, 1).repeat_interleave(H // HKV, 0)  # [H, L, D]
        v = vf[slots].transpose(0, 1).repeat_interleave(H // HKV, 0)
        a = int(batch.query_start_loc[i])
        qi = q[0, :, a : a + n]  # [H, n, D]
        qpos = torch.arange(s, s + n)[:, None]
        mask = pos[None, :] <= qpos
        if window is not None:
            mask &= pos[None, :] > qpos - window
        w = (qi @ k.transpose(1, 2)) * D**-0.5
        w = w.masked_fill(~mask, float("-inf")).softmax(-1)
        out[a : a + n] = (w @ v).transpose(0, 1)
    return out[None]


@pytest.mark.parametrize("chunk_bytes", [None, 1])
@pytest.mark.parametrize("window", [None, 20])
def test_mixed_steps_equal_per_sequence_attention(window, chunk_bytes, monkeypatch):
    if chunk_bytes is not None:  # every decode row gathered and attended on its own
        monkeypatch.setattr(torch_backend, "CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(0)
    spec = KVSpec.uniform(1, HKV, D, torch.float32)
    cache = KVCache(spec, 512, BS, torch.device("cpu"))
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    backend = TorchBackend()
    steps = [  # decode rows of 1..~200 tokens of context (several groups), a prompt, a chunk after context
        ([1, 1, 1, 1, 1, 9, 5, 1], [0, 3, 40, 130, 199, 0, 16, 64]),
        ([1] * 12 + [30], [i * 23 for i in range(12)] + [150]),  # more decode rows: the workspace grows
    ]
    for num_new, start in steps:
        batch = _step(num_new, start, cache.num_blocks, g)
        t = batch.slot_mapping.numel()
        q = torch.randn(1, H, t, D, generator=g)
        k = torch.randn(1, HKV, t, D, generator=g)
        v = torch.randn(1, HKV, t, D, generator=g)
        ctx = StepContext(cache, backend, backend.build_metadata(batch, BS))
        got = backend.forward(0, q, k, v, ctx, AttentionCall(scaling=D**-0.5, sliding_window=window))
        assert len(ctx.metadata.decode) > 1  # the rows were split
        torch.testing.assert_close(got, _reference(cache, batch, q, window), atol=1e-5, rtol=1e-5)


def test_softcap_path_matches_dense_attention():
    """Gemma 2's soft-capped logits take the explicit path; one decode group and a prompt."""
    g = torch.Generator().manual_seed(1)
    spec = KVSpec.uniform(1, HKV, D, torch.float32)
    cache = KVCache(spec, 64, BS, torch.device("cpu"))
    backend = TorchBackend()
    batch = _step([1, 1, 6], [10, 12, 0], cache.num_blocks, g)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    q = torch.randn(1, H, 8, D, generator=g)
    k = torch.randn(1, HKV, 8, D, generator=g)
    v = torch.randn(1, HKV, 8, D, generator=g)
    ctx = StepContext(cache, backend, backend.build_metadata(batch, BS))
    got = backend.forward(0, q, k, v, ctx, AttentionCall(scaling=D**-0.5, softcap=1e9))
    # a cap this large changes nothing: the result is plain attention
    torch.testing.assert_close(got, _reference(cache, batch, q, None), atol=1e-5, rtol=1e-5)


def test_a_call_a_backend_does_not_take_is_refused_by_name():
    """A layer's AttentionCall names the optional features it needs; the attention function
    refuses a backend without one of them, naming it, before the backend runs."""
    from acb.runner.attention import _forward

    assert AttentionCall(scaling=0.5).features() == frozenset()
    index = torch.zeros(1, 3, 2, dtype=torch.long)
    assert AttentionCall(sinks=torch.zeros(H), chunk=8, index=index).features() == {"sinks", "chunk", "index"}

    class Plain(TorchBackend):  # a backend that takes none of the optional features
        name = "plain"
        features = frozenset()

    g = torch.Generator().manual_seed(2)
    spec = KVSpec.uniform(1, HKV, D, torch.float32)
    cache = KVCache(spec, 16, BS, torch.device("cpu"))
    batch = _step([3], [0], cache.num_blocks, g)
    q, k, v = torch.randn(1, H, 3, D), torch.randn(1, HKV, 3, D), torch.randn(1, HKV, 3, D)
    for backend in (Plain(), TorchBackend()):
        ctx = StepContext(cache, backend, backend.build_metadata(batch, BS))
        call = AttentionCall(scaling=D**-0.5, index=index)
        if backend.features:
            assert _forward(ctx, 0, q, k, v, call).shape == (1, 3, H, D)
        else:
            with pytest.raises(NotImplementedError, match="index.*'plain' backend"):
                _forward(ctx, 0, q, k, v, call)
