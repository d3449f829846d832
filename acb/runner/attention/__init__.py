"""Attention backends behind one interface, and acb's hook into transformers' AttentionInterface.

acb registers one attention function (``ATTN_IMPL_NAME``) with transformers'
``AttentionInterface``. It is not registered with ``AttentionMaskInterface``, so the model's
mask creation returns ``None`` (no dense mask is ever built). Per-step metadata reaches the
function as the ``acb_ctx`` forward kwarg, which transformers passes down to attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from acb.errors import UnsupportedModelError

ATTN_IMPL_NAME = "acb_paged"


@dataclass
class BatchInputs:
    """Device tensors (and their host twins) describing one flattened batch; shared by backends."""

    slot_mapping: torch.Tensor  # [T] long: flat cache slot of each new token
    block_table: torch.Tensor  # [B, max_blocks] long: the scheduled rows of the block table
    seq_lens: torch.Tensor  # [B] long: context length after this step
    query_start_loc: torch.Tensor  # [B + 1] long
    num_new: list[int]  # host: query tokens per sequence
    start_pos: list[int]  # host: tokens already in the cache per sequence
    max_seq_len: int  # host: max(seq_lens)


class AttentionBackend(Protocol):
    name: str

    def build_metadata(self, batch: BatchInputs, block_size: int) -> Any: ...

    def forward(
        self,
        layer: int,
        query: torch.Tensor,  # [1, heads, T, head_dim]
        key: torch.Tensor,  # [1, kv_heads, T, head_dim]
        value: torch.Tensor,
        ctx: "StepContext",
        *,
        scaling: float | None,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor: ...  # [1, T, heads, head_dim]


@dataclass
class StepContext:
    """What the attention function needs for one forward: the cache, the backend, its metadata."""

    kv_cache: Any  # acb.runner.kv_cache.KVCache
    backend: AttentionBackend
    metadata: Any


_UNSUPPORTED_KWARGS = {
    "s_aux": "attention sinks",
}


def acb_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    ctx: StepContext | None = kwargs.get("acb_ctx")
    if ctx is None:
        raise RuntimeError(
            f"the '{ATTN_IMPL_NAME}' attention implementation only runs inside an acb engine step; "
            "stop the engine (which restores the model's own implementation) before calling the model directly"
        )
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"{type(module).__name__} uses {what} ({name}), which acb does not support")
    spec = ctx.kv_cache.spec
    if key.shape[1] != spec.num_kv_heads or key.shape[3] != spec.head_dim:
        raise RuntimeError(
            f"layer {module.layer_idx}: keys have {key.shape[1]} heads of {key.shape[3]} but the KV cache "
            f"holds {spec.num_kv_heads} of {spec.head_dim}; the model's config does not describe its "
            "attention layers"
        )
    out = ctx.backend.forward(
        module.layer_idx, query, key, value, ctx,
        scaling=scaling, sliding_window=sliding_window, softcap=softcap,
    )
    return out, None


def register_with_transformers(compiled: bool = False) -> None:
    """Register acb's attention function with transformers (idempotent). ``compiled``: wrap it in
    ``torch.compiler.disable`` so that a compiled model graph-breaks there (its metadata is
    host-side); only then, because importing dynamo disturbs Triton's interpreter."""
    from transformers import AttentionInterface

    fn = torch.compiler.disable(acb_attention_forward) if compiled else acb_attention_forward
    AttentionInterface.register(ATTN_IMPL_NAME, fn)


def make_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from acb.runner.attention.torch_backend import TorchBackend

        return TorchBackend()
    if name == "triton":
        from acb.runner.attention.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}")
