"""Paged KV tensors and the memory sizing that decides how many blocks there are.

Layout per cache layer: K and V each ``[num_blocks, block_size, kv_heads, head_dim]``, where a
model whose layers differ in shape (Gemma 4's sliding and full layers, MiMo V2 Flash's KV head
counts) gives each cache layer its own ``(kv_heads, head_dim)``: the layers of one shape form a
group (:meth:`KVSpec.groups`). Every group has the same ``num_blocks`` and one block table per
request serves them all, so one block costs the sum of its layers' pages
(:meth:`KVSpec.bytes_per_block`) and the memory budget splits between the groups in proportion
to what a token costs in each. Block 0 is scratch (padded rows write there; nothing reads it).

Indexed (DSA) attention's indexer keys are paged the same way: one key-only cache layer per
indexer (``[num_blocks, block_size, 1, index_head_dim]``, no values), after the attention
layers, under the same block table (:mod:`acb.runner.indexed`).
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


@dataclass(frozen=True)
class KVSpec:
    num_layers: int  # cache layers (K and V tensors of each); fewer than the model's when layers share
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # the model's layer index -> its cache layer; None: the identity. Layers that share K/V (Gemma
    # 3n's last num_kv_shared_layers) map to their producer's cache layer and allocate none
    layer_map: tuple[int, ...] | None = None
    # (kv_heads, head_dim) per cache layer when the layers differ in shape; None: every layer is
    # (num_kv_heads, head_dim). With shapes, num_kv_heads/head_dim are the largest layer's
    layer_shapes: tuple[tuple[int, int], ...] | None = None
    # the model's layers with an indexer (DSA), in order: the indexer of the n-th of them keeps its
    # keys in key-only cache layer ``num_layers - len(index_layers) + n`` (shape (1, index dim))
    index_layers: tuple[int, ...] = ()
    # what a token costs the model's own cache objects of the layers that run on them
    # (acb.runner.own_cache: no pages; measured at start), counted in a block's cost
    own_bytes_per_token: int = 0
    # cache layers that hold an MLA layer's latent (acb.runner.latent): key-only, shape
    # (1, kv_lora_rank + qk_rope_head_dim); the module's own expand_kv makes K/V of them at attention
    latent_layers: tuple[int, ...] = ()

    @property
    def attention_layers(self) -> int:
        """The cache layers holding attention K/V (the first ones; the indexers' follow)."""
        return self.num_layers - len(self.index_layers)

    def is_key_only(self, layer: int) -> bool:
        """Whether cache layer ``layer`` holds keys only (an indexer's, or an MLA layer's latent)."""
        return layer >= self.attention_layers or layer in self.latent_layers

    def index_layer_of(self, layer_idx: int) -> int:
        """The key-only cache layer of the indexer of the model's layer ``layer_idx``."""
        return self.attention_layers + self.index_layers.index(layer_idx)

    def shape_of(self, layer: int) -> tuple[int, int]:
        """``(kv_heads, head_dim)`` of cache layer ``layer``."""
        return (self.num_kv_heads, self.head_dim) if self.layer_shapes is None else self.layer_shapes[layer]

    def groups(self) -> dict[tuple[int, int], list[int]]:
        """The attention cache layers of each shape, ``(kv_heads, head_dim) -> [cache layer, ...]``
        (K and V pages; the latent layers are not among them)."""
        out: dict[tuple[int, int], list[int]] = {}
        for layer in range(self.attention_layers):
            if layer in self.latent_layers:
                continue
            out.setdefault(self.shape_of(layer), []).append(layer)
        return out

    def bytes_per_token(self) -> dict[tuple[int, int] | str, int]:
        """What one cached token costs in each group (K and V of its layers), and in the indexers'
        key-only layers (``"index keys"``) and in the MLA layers' latent (``"latent"``), in bytes."""
        elem = torch.finfo(self.dtype).bits // 8 if self.dtype.is_floating_point else 1
        out: dict[tuple[int, int] | str, int] = {
            (h, d): 2 * len(layers) * h * d * elem for (h, d), layers in self.groups().items()
        }
        if self.latent_layers:
            out["latent"] = sum(math.prod(self.shape_of(layer)) for layer in self.latent_layers) * elem
        if self.index_layers:
            h, d = self.shape_of(self.attention_layers)
            out["index keys"] = len(self.index_layers) * h * d * elem
        if self.own_bytes_per_token:
            out["own cache"] = self.own_bytes_per_token
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
