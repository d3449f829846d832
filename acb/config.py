"""``ContinuousBatchingConfig``: transformers' field names, acb's validation and resolved defaults.

Every field of transformers' ``ContinuousBatchingConfig`` is accepted so that moving over is
a one-line change. Fields that acb does not implement yet are listed in ``NOT_YET_SUPPORTED``:
setting one to a non-default value warns once, naming it (never silently ignored).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

SCHEDULER_TYPES = ("fifo", "prefill_first")
ATTN_BACKENDS = ("torch", "triton", "flash_attn")

# field -> why it has no effect yet
NOT_YET_SUPPORTED: dict[str, str] = {
    "max_blocks_per_request": "acb's block tables always span max_model_len",
    "kv_padding_interval_size": "acb's decode graphs read context lengths from the device, so KV lengths need no padding",
    "disable_nccl_graph_mixing": "tensor parallelism is not supported",
    "cpu_group_timeout": "tensor parallelism is not supported",
    "use_default_compile_configs": "deprecated in transformers: use default_compile_level",
    "max_cached_graphs": "deprecated in transformers",
}


@dataclass
class ContinuousBatchingConfig:
    """Settings of the engine. Field names and meanings follow transformers'.

    ``None`` means "resolve a sensible default at engine start" (see :class:`ResolvedConfig`).
    acb's own additions: ``attn_backend``, ``max_model_len``.
    """

    block_size: int | None = None  # tokens per KV block; default 32 (transformers: 256)
    num_blocks: int | None = None  # default: from available memory
    max_batch_tokens: int | None = None  # token budget per step
    max_memory_percent: float | None = None  # of free device memory for the KV cache (CUDA)
    max_requests_per_batch: int | None = None  # most sequences in one step (and running at once)
    max_blocks_per_request: int | None = None
    allow_block_sharing: bool = True
    use_async_batching: bool | None = None
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    varlen_compile_config: Any = None
    decode_compile_config: Any = None
    default_compile_level: int = 0
    scheduler_type: str = "fifo"
    # fraction of blocks kept free when admitting new requests (fewer preemptions)
    safety_margin: float | None = None
    return_logprobs: bool = False
    seed: int | None = None
    cpu_offload_space: float | None = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    max_queue_size: int = 0  # most requests waiting to be scheduled; 0 = unlimited
    per_request_processors: bool = False
    drop_unsupported_processors: bool = True
    disable_nccl_graph_mixing: bool = True
    cpu_group_timeout: float | None = 300.0
    use_default_compile_configs: bool | None = None
    max_cached_graphs: int | None = None
    # acb only
    attn_backend: str | None = None  # "torch", "triton", "flash_attn"; None = the best available
    max_model_len: int | None = None  # most tokens per request; default: the model's max positions
    _warned: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def pos_int(name: str, allow_none: bool = True) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ContinuousBatchingConfig.{name} must be a positive int, got {v!r}")

        for name in ("block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "max_model_len"):
            pos_int(name)
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("ContinuousBatchingConfig.num_blocks must be >= 2 (block 0 is scratch)")
        if self.max_memory_percent is not None and not 0 < self.max_memory_percent <= 1:
            raise ValueError(
                f"ContinuousBatchingConfig.max_memory_percent must be in (0, 1], got {self.max_memory_percent}"
            )
        if self.scheduler_type not in SCHEDULER_TYPES:
            raise ValueError(
                f"ContinuousBatchingConfig.scheduler_type must be one of {SCHEDULER_TYPES}, "
                f"got {self.scheduler_type!r}"
            )
        if self.safety_margin is not None and not 0 <= self.safety_margin < 1:
            raise ValueError(f"ContinuousBatchingConfig.safety_margin must be in [0, 1), got {self.safety_margin}")
        if isinstance(self.max_queue_size, bool) or not isinstance(self.max_queue_size, int) or self.max_queue_size < 0:
            raise ValueError(f"ContinuousBatchingConfig.max_queue_size must be an int >= 0, got {self.max_queue_size!r}")
        g = self.use_cuda_graph
        if not (g is None or isinstance(g, bool) or (isinstance(g, tuple) and len(g) == 2
                                                      and all(isinstance(x, bool) for x in g))):
            raise ValueError(
                "ContinuousBatchingConfig.use_cuda_graph must be None, a bool, or a (varlen, decode) tuple of "
                f"bools, got {g!r}"
            )
        if isinstance(self.q_padding_interval_size, bool) or not isinstance(self.q_padding_interval_size, int) \
                or self.q_padding_interval_size < 0:
            raise ValueError("ContinuousBatchingConfig.q_padding_interval_size must be an int >= 0, "
                             f"got {self.q_padding_interval_size!r}")
        if self.attn_backend is not None and self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(
                f"ContinuousBatchingConfig.attn_backend must be one of {ATTN_BACKENDS} or None, "
                f"got {self.attn_backend!r}"
            )

    def warn_unsupported(self) -> list[str]:
        """Warn once about fields set to values acb does not act on yet; return their names."""
        defaults = ContinuousBatchingConfig.__dataclass_fields__
        names = []
        for name, why in NOT_YET_SUPPORTED.items():
            default = defaults[name].default
            if getattr(self, name) != default:
                names.append(name)
                if not self._warned:
                    warnings.warn(f"ContinuousBatchingConfig.{name} is accepted but has no effect yet: {why}", stacklevel=3)
        self._warned = True
        return names


@dataclass(frozen=True)
class ResolvedConfig:
    """The concrete settings an engine runs with, resolved once at start."""

    block_size: int
    num_blocks: int  # including the scratch block 0
    max_batch_tokens: int
    max_requests_per_batch: int
    max_model_len: int  # most tokens (prompt + generated) one request may hold
    scheduler_type: str
    safety_margin: float
    max_queue_size: int
    return_logprobs: bool
    seed: int | None
    attn_backend: str
    device: str
    kv_cache_bytes: int
    num_swap_blocks: int = 0  # host-memory KV offload space, in blocks
    prefix_caching: bool = True  # allow_block_sharing
    async_batching: bool = False  # schedule step N+1 while step N runs
    cuda_graphs: bool = False  # decode-only steps replay CUDA graphs (the eager twin on CPU)
    graph_step: int | None = None  # batch-size granularity of the decode graphs (q_padding_interval_size)

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the cache holds, scratch block excluded."""
        return (self.num_blocks - 1) * self.block_size
