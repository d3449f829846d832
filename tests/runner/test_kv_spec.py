"""KVSpec as page groups: each kind's cache layers grouped by kind and shape, sized and allocated
from the groups, with no field per kind."""

from __future__ import annotations

import pytest
import torch

from acb.runner.kv_cache import INDEX_KEYS, KV, LATENT, UNPAGED, KVCache, KVSpec, PageGroup


def test_page_groups_price_and_allocate_every_kind():
    # two K/V shapes (a sliding and a full layer), an MLA layer's latent in its place, then an
    # indexer's keys owned by model layer 2
    layers = [(KV, 2, 8), (KV, 1, 16), (LATENT, 1, 12), (KV, 2, 8), (INDEX_KEYS, 1, 4)]
    spec = KVSpec.from_layers(torch.float32, layers, owners={4: 2}, unpaged=((UNPAGED, 0),))
    assert spec.num_layers == 5
    assert spec.kv_shapes() == {(2, 8): [0, 3], (1, 16): [1]}
    assert spec.latent_layers == (2,) and spec.layers_of(INDEX_KEYS) == (4,)
    assert spec.index_layers == (2,) and spec.index_layer_of(2) == 4
    assert [spec.is_key_only(c) for c in range(5)] == [False, False, True, False, True]
    assert (spec.num_kv_heads, spec.head_dim) == (2, 8)  # the largest page shape (1 x 16 ties 2 x 8 by size)
    want = {(2, 8): 2 * 2 * 2 * 8 * 4, (1, 16): 2 * 16 * 4, LATENT: 12 * 4, INDEX_KEYS: 4 * 4}
    assert spec.bytes_per_token() == want  # an unpaged kind that costs nothing is not listed
    cache = KVCache(spec, 3, 4, torch.device("cpu"))
    assert [tuple(t.shape) for t in cache.k] == [(3, 4, *spec.shape_of(c)) for c in range(5)]
    assert [cache.v[c].numel() == 0 for c in range(5)] == [spec.is_key_only(c) for c in range(5)]
    assert sum(t.nbytes for t in cache.k + cache.v) == spec.bytes_per_block(4) * 3


def test_layers_without_pages_are_priced_by_kind():
    spec = KVSpec(torch.float16, layer_map=(0, 0, 0), unpaged=((UNPAGED, 96),))
    assert spec.num_layers == 0 and spec.kv_shapes() == {} and spec.bytes_per_token() == {UNPAGED: 96}
    assert spec.bytes_per_block(16) == 16 * 96 and (spec.num_kv_heads, spec.head_dim) == (1, 1)


def test_malformed_groups_are_refused():
    with pytest.raises(ValueError, match="two page groups"):
        KVSpec(torch.float32, (PageGroup(KV, 1, 8, (0,)), PageGroup(LATENT, 1, 8, (0,), values=False)))
    with pytest.raises(ValueError, match="not 0..1"):
        KVSpec(torch.float32, (PageGroup(KV, 1, 8, (0, 2)),))
    with pytest.raises(ValueError, match="owner for some layers only"):
        KVSpec.from_layers(torch.float32, [(INDEX_KEYS, 1, 4), (INDEX_KEYS, 1, 4)], owners={0: 3})
