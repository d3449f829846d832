"""Paged KV tensors and the memory sizing that decides how many blocks there are.

Layout per cache layer: K and V each ``[num_blocks, block_size, kv_heads, head_dim]``, where a
model whose layers differ in shape (Gemma 4's sliding and full layers, MiMo V2 Flash's KV head
counts) gives each cache layer its own ``(kv_heads, head_dim)``: the layers of one shape form a
page group (:class:`PageGroup`: a kind and a shape). Every group has the same ``num_blocks`` and one
block table per request serves them all, so one block costs the sum of its layers' pages
(:meth:`KVSpec.bytes_per_block`) and the memory budget splits between the groups in proportion
to what a token costs in each. Block 0 is scratch (padded rows write there; nothing reads it).

Other kinds page the same way, in groups of their own kind: indexed (DSA) attention's indexer keys,
one key-only cache layer per indexer (``[num_blocks, block_size, 1, index_head_dim]``, no values),
after the attention layers (:mod:`acb.runner.indexed`), and an MLA layer's latent, key-only in its
layer's place (:mod:`acb.runner.latent`). A new kind adds groups of its kind; ``KVSpec`` has no field
per kind.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


# the kinds of pages (PageGroup.kind): a layer's K and V; an MLA layer's latent (key-only,
# acb.runner.latent); a DSA indexer's keys (key-only, acb.runner.indexed)
KV, LATENT, INDEX_KEYS = "kv", "latent", "index keys"
# what a token costs the model's own cache objects (acb.runner.unpaged_layers): priced, not paged
UNPAGED = "unpaged"


@dataclass(frozen=True)
class PageGroup:
    """Cache layers of one kind and one page shape, under the block table every group shares."""

    kind: str  # KV, LATENT, INDEX_KEYS, or a new kind's name
    heads: int
    width: int
    layers: tuple[int, ...]  # its cache layers (indices into KVCache.k and .v)
    values: bool = True  # False: key-only pages (the V tensors of its layers are empty)
    # the model layer whose module writes each cache layer, where the kind does not go through
    # KVSpec.layer_map (an indexer's keys: the layer it belongs to)
    owners: tuple[int, ...] = ()

    def bytes_per_token(self, elem: int) -> int:
        return (2 if self.values else 1) * len(self.layers) * self.heads * self.width * elem


@dataclass(frozen=True)
class KVSpec:
    """What the paged cache holds: its page groups (each kind of layer and shape), how the model's
    layers map to cache layers, and what a token costs the layers that keep it off the pages.
    A layer kind adds its pages as groups of its own kind (no field of its own here); the cache
    allocates a K (and, unless key-only, a V) tensor per cache layer of every group."""

    dtype: torch.dtype
    groups: tuple[PageGroup, ...] = ()
    # the model's layer index -> the cache layer its attention (K/V or latent) reads; None: the
    # identity. Layers that share K/V (Gemma 3n's last num_kv_shared_layers) map to their producer's
    # cache layer and allocate none; a hybrid's state layers map to a layer they never touch
    layer_map: tuple[int, ...] | None = None
    # (kind, bytes) per token of layers that keep it outside the pages (UNPAGED), counted in a
    # block's cost
    unpaged: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        of: dict[int, PageGroup] = {}
        for g in self.groups:
            for layer in g.layers:
                if layer in of:
                    raise ValueError(f"cache layer {layer} is in two page groups")
                of[layer] = g
        if sorted(of) != list(range(len(of))):
            raise ValueError(f"the page groups' cache layers {sorted(of)} are not 0..{len(of) - 1}")
        object.__setattr__(self, "_of", tuple(of[i] for i in range(len(of))))

    @classmethod
    def from_layers(
        cls,
        dtype: torch.dtype,
        layers: list[tuple[str, int, int]],
        layer_map: tuple[int, ...] | None = None,
        owners: dict[int, int] | None = None,
        unpaged: tuple[tuple[str, int], ...] = (),
    ) -> KVSpec:
        """A spec from each cache layer's ``(kind, heads, width)``, in cache-layer order, grouped by
        kind and shape (``owners``: cache layer -> the model layer that writes it, where the kind
        says). Kinds other than :data:`KV` are key-only."""
        by: dict[tuple[str, int, int], list[int]] = {}
        for i, key in enumerate(layers):
            by.setdefault(key, []).append(i)
        own = owners or {}
        groups = []
        for (kind, h, w), ls in by.items():
            named = tuple(own[i] for i in ls if i in own)
            if named and len(named) != len(ls):
                raise ValueError(f"the {kind!r} cache layers {ls} name an owner for some layers only")
            groups.append(PageGroup(kind, h, w, tuple(ls), kind == KV, named))
        return cls(dtype, tuple(groups), layer_map, unpaged)

    @classmethod
    def uniform(
        cls, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, layer_map: tuple[int, ...] | None = None
    ) -> KVSpec:
        """``num_layers`` cache layers of K/V pages, all ``(kv_heads, head_dim)``."""
        return cls.from_layers(dtype, [(KV, kv_heads, head_dim)] * num_layers, layer_map)

    @property
    def num_layers(self) -> int:
        """The cache layers (K and V tensors of each); fewer than the model's when layers share."""
        return len(self._of)  # type: ignore[attr-defined]

    def group_of(self, layer: int) -> PageGroup:
        return self._of[layer]  # type: ignore[attr-defined]

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """The cache layers of ``kind``'s groups, in order."""
        return tuple(sorted(c for g in self.groups if g.kind == kind for c in g.layers))

    def owned(self, kind: str) -> dict[int, int]:
        """The model layer -> its cache layer of ``kind`` (a kind whose groups name their owners)."""
        return {o: c for g in self.groups if g.kind == kind for o, c in zip(g.owners, g.layers)}

    @property
    def latent_layers(self) -> tuple[int, ...]:
        """The cache layers that hold an MLA layer's latent."""
        return self.layers_of(LATENT)

    @property
    def index_layers(self) -> tuple[int, ...]:
        """The model's layers with an indexer (DSA), in the order of their key-only cache layers."""
        owned = self.owned(INDEX_KEYS)
        return tuple(sorted(owned, key=owned.__getitem__))

    def index_layer_of(self, layer_idx: int) -> int:
        """The key-only cache layer of the indexer of the model's layer ``layer_idx``."""
        return self.owned(INDEX_KEYS)[layer_idx]

    def is_key_only(self, layer: int) -> bool:
        """Whether cache layer ``layer`` holds keys only (an indexer's, or an MLA layer's latent)."""
        return not self.group_of(layer).values

    def shape_of(self, layer: int) -> tuple[int, int]:
        """``(heads, width)`` of cache layer ``layer``."""
        g = self.group_of(layer)
        return g.heads, g.width

    @property
    def num_kv_heads(self) -> int:
        """The heads of the largest page shape (1 with no pages)."""
        return self._largest()[0]

    @property
    def head_dim(self) -> int:
        return self._largest()[1]

    def _largest(self) -> tuple[int, int]:
        return max(((g.heads, g.width) for g in self.groups), key=lambda s: s[0] * s[1], default=(1, 1))

    def kv_shapes(self) -> dict[tuple[int, int], list[int]]:
        """The K/V cache layers of each shape, ``(kv_heads, head_dim) -> [cache layer, ...]``
        (the key-only kinds are not among them)."""
        out: dict[tuple[int, int], list[int]] = {}
        for g in self.groups:
            if g.kind == KV:
                out.setdefault((g.heads, g.width), []).extend(g.layers)
        return {k: sorted(v) for k, v in out.items()}

    def bytes_per_token(self) -> dict[tuple[int, int] | str, int]:
        """What one cached token costs in bytes: per K/V shape (K and V of its layers), and per
        other kind (``"latent"``, ``"index keys"``, and the unpaged ``"unpaged"``)."""
        elem = torch.finfo(self.dtype).bits // 8 if self.dtype.is_floating_point else 1
        out: dict[tuple[int, int] | str, int] = {}
        for g in self.groups:
            key: tuple[int, int] | str = (g.heads, g.width) if g.kind == KV else g.kind
            out[key] = out.get(key, 0) + g.bytes_per_token(elem)
        for kind, n in self.unpaged:
            if n:
                out[kind] = out.get(kind, 0) + n
        return out

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * sum(self.bytes_per_token().values())


class KVCache:
    """Per-layer K/V block tensors. ``flat_k(layer)`` views them as ``[slots, kv_heads, head_dim]``."""

    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self._flat_shapes = [(num_blocks * block_size, *spec.shape_of(layer)) for layer in range(spec.num_layers)]
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.restore()

    def restore(self) -> None:
        """(Re)allocate the device blocks (after :meth:`release`); their content starts as zeros."""
        spec = self.spec
        shapes = [(self.num_blocks, self.block_size, *spec.shape_of(layer)) for layer in range(spec.num_layers)]
        # zeros, not empty: padded gathers read slots that were never written, and masked-out
        # garbage that happens to be NaN/inf would still poison SDPA's weighted sum (0 * NaN)
        self.k = [torch.zeros(shape, dtype=spec.dtype, device=self.device) for shape in shapes]
        # an indexer's layer holds keys only: its values are empty (every per-layer copy still works)
        self.v = [
            torch.zeros(shape if not spec.is_key_only(i) else (*shape[:2], 0, 0), dtype=spec.dtype, device=self.device)
            for i, shape in enumerate(shapes)
        ]

    def layer_of(self, layer_idx: int) -> int:
        """The cache layer (index into ``k``/``v``) of the model's layer ``layer_idx``."""
        m = self.spec.layer_map
        return layer_idx if m is None else m[layer_idx]

    def release(self) -> int:
        """Drop the device blocks (the host offload space stays); returns their bytes."""
        freed = sum(t.nbytes for t in self.k + self.v)
        self.k, self.v = [], []
        return freed

    def flat_k(self, layer: int) -> torch.Tensor:  # [num_blocks * block_size, kv_heads, head_dim]
        return self.k[layer].view(self._flat_shapes[layer])

    def flat_v(self, layer: int) -> torch.Tensor:
        return self.v[layer].view(self._flat_shapes[layer])

    def allocate_swap(self, num_blocks: int) -> None:
        """Host-memory offload space of ``num_blocks`` blocks (pinned when the cache is on CUDA)."""
        self.num_swap_blocks = num_blocks
        if not num_blocks:
            self.swap_k = self.swap_v = []
            return
        pin = self.device.type == "cuda"
        self.swap_k = [torch.zeros((num_blocks, *t.shape[1:]), dtype=self.spec.dtype, pin_memory=pin) for t in self.k]
        self.swap_v = [torch.zeros((num_blocks, *t.shape[1:]), dtype=self.spec.dtype, pin_memory=pin) for t in self.v]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, ``(device, host)`` pairs.

        Synchronous on CUDA (a second host sync in the rare steps that offload): the device
        blocks may be reused by the very next kernels."""
        self._copy_blocks(pairs, (self.k, self.v), (self.swap_k, self.swap_v), non_blocking=False)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks, ``(host, device)`` pairs."""
        self._copy_blocks(pairs, (self.swap_k, self.swap_v), (self.k, self.v), non_blocking=True)

    @staticmethod
    def _copy_blocks(
        pairs: list[tuple[int, int]], src: tuple[list, list], dst: tuple[list, list], non_blocking: bool
    ) -> None:
        """Per layer, for K and V: ``dst[b] = src[a]`` for each ``(a, b)`` pair, across devices."""
        if not src[0]:  # no paged layers (state layers only): the blocks hold nothing
            return
        src_idx = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=src[0][0].device)
        dst_idx = torch.tensor([b for _, b in pairs], dtype=torch.long, device=dst[0][0].device)
        for src_layers, dst_layers in zip(src, dst):
            for s, d in zip(src_layers, dst_layers):
                d.index_copy_(0, dst_idx, s.index_select(0, src_idx).to(d.device, non_blocking=non_blocking))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (copy-on-write of a shared partial block)."""
        for t in self.k:
            t[dst].copy_(t[src])
        for t in self.v:
            t[dst].copy_(t[src])


def meminfo_bytes(key: str) -> int | None:
    """A ``/proc/meminfo`` figure (e.g. ``MemTotal``) in bytes; None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _sysconf_bytes(pages: str, default: int) -> int:
    try:
        return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return default


def available_host_memory() -> int:
    """Bytes of RAM available to this process now (Linux ``MemAvailable``; a sysconf fallback)."""
    found = meminfo_bytes("MemAvailable")
    return found if found is not None else _sysconf_bytes("SC_AVPHYS_PAGES", 2 << 30)


# On CPU the cache shares RAM with everything else: take a modest share, capped
# (set num_blocks or max_memory_percent for more).
CPU_MEMORY_FRACTION = 0.25
CPU_MAX_KV_BYTES = 512 << 20  # zeroing it is part of engine start-up
# a model with no KV cache at all (state layers only) has no memory bound on a request's length:
# its blocks, which then only measure lengths, are sized for this many tokens per request
NO_KV_MAX_LEN = 1 << 16


def kv_memory_budget(device: torch.device, max_memory_percent: float | None) -> int:
    """Bytes the KV cache may use on ``device``."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * (max_memory_percent if max_memory_percent is not None else 0.9))
    frac = max_memory_percent if max_memory_percent is not None else CPU_MEMORY_FRACTION
    return int(min(available_host_memory() * frac, CPU_MAX_KV_BYTES))


def widest(value: Any) -> int:
    """A size field of a config as one int: itself, or the largest of a per-layer list (0 for None).

    Args:
        value: an int, a list or tuple of ints (one per layer), or None.

    Returns:
        The int, the list's largest, or 0.

    Raises:
        TypeError: a value of another type (a config acb does not know how to size).
    """
    if value is None:
        return 0
    if isinstance(value, (list, tuple)):
        return max((widest(v) for v in value), default=0)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"a size field of the model's config is {value!r}; acb expects an int or a list of ints")


def step_workspace_bytes(model: PreTrainedModel, max_batch_tokens: int, max_rows: int, dtype: torch.dtype) -> int:
    """A generous estimate of one step's transient memory: activations of ``max_batch_tokens``
    tokens through one layer (hidden states, q/k/v/o, the MLP's widest tensors) and the
    float32 logits of ``max_rows`` sampling rows with the sampler's working copies."""
    text = model.config.get_text_config()
    hidden = widest(text.hidden_size)
    # the MLP's width may be per layer (Gemma 3n: a list, one per layer): the widest layer's counts
    inter = widest(getattr(text, "intermediate_size", None)) or 4 * hidden
    vocab = text.vocab_size
    elem = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    activations = max_batch_tokens * (6 * hidden + 3 * inter) * elem
    logits = max_rows * vocab * 4 * 6  # logits, processed, probabilities, cumsum, sort keys/indices
    return activations + logits


def size_kv_cache(
    model: PreTrainedModel,
    spec: KVSpec,
    device: torch.device,
    max_memory_percent: float | None,
    *,
    block_size: int,
    max_len: int,
    max_reqs: int,
    max_batch_tokens: int,
    reserved: int = 0,
) -> int:
    """How many KV blocks (scratch block included) fit in the memory budget once one step's
    transient memory (and ``reserved`` bytes: a vision-language model's image embeddings) is set
    aside, and no more than every running request at full length can use. Raises
    ``ValueError`` with the figures when not even one ``max_len`` request fits."""
    dtype = spec.dtype
    per_block = spec.bytes_per_block(block_size)
    budget = kv_memory_budget(device, max_memory_percent)
    workspace = step_workspace_bytes(model, max_batch_tokens, max_reqs, dtype) + reserved
    useful = max_reqs * math.ceil(max_len / block_size) + 1
    if per_block == 0:  # state layers only (Mamba): blocks cost nothing, they only measure lengths
        return min(useful, max_reqs * math.ceil(NO_KV_MAX_LEN / block_size) + 1)
    num_blocks = max(0, min((budget - workspace) // per_block, useful))
    needed = math.ceil(max_len / block_size) + 1
    if num_blocks < needed:
        cuda = device.type == "cuda"
        raise ValueError(
            f"not enough memory for one request of max_model_len={max_len} tokens: it needs "
            f"{needed * per_block / 2**20:.1f} MiB of KV cache, but the budget is "
            f"{budget / 2**20:.1f} MiB ({'max_memory_percent of free CUDA memory' if cuda else 'share of available RAM'}) "
            f"minus {workspace / 2**20:.1f} MiB for a step of max_batch_tokens={max_batch_tokens} and "
            f"max_requests_per_batch={max_reqs} (and image embeddings: image_cache_bytes). Lower max_model_len, max_batch_tokens or "
            "max_requests_per_batch, raise max_memory_percent, or set num_blocks."
        )
    return num_blocks
