"""``ContinuousBatchingConfig``: transformers' field names, acb's validation and resolved defaults.

Every field of transformers' ``ContinuousBatchingConfig`` (5.23) is accepted under its name, and
so are its deprecated aliases, with transformers' deprecation behaviour, so that moving over is a
one-line change; a transformers instance itself is converted by :func:`as_config`. Fields that
acb does not act on are listed in ``NOT_YET_SUPPORTED``: setting one to a non-default value warns
once, naming it (never silently ignored).
"""

from __future__ import annotations

import inspect
import logging
import math
import warnings
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, Union

from acb.grammar_budget import (
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_REPETITION,
)

if TYPE_CHECKING:
    from transformers import ContinuousBatchingConfig as TransformersConfig

logger = logging.getLogger(__name__)

SCHEDULER_TYPES = ("fifo", "prefill_first")
ATTN_BACKENDS = ("torch", "cpu", "triton", "flash_attn")

# field -> why it has no effect
NOT_YET_SUPPORTED: dict[str, str] = {
    "max_blocks_per_request": "acb's block tables always span max_model_len",
    "kv_padding_interval_size": "acb's decode graphs read context lengths from the device, so KV lengths need no padding",
    "auto_switch_to_flash": "acb always runs its own paged attention, whatever the model's attn_implementation; "
    "attn_backend=None picks flash_attn when it is installed and fits, else triton, else "
    "torch; set attn_backend='triton' or 'torch' to keep flash-attn out",
    # (acb runs tensor parallel under torchrun with its own step sync: acb.distributed.tp)
    "disable_nccl_graph_mixing": "acb's tensor-parallel ranks keep their collectives and their decode graphs "
    "in lock step themselves (acb.distributed.tp)",
    "cpu_group_timeout": "acb's tensor-parallel step sync has its own timeout: the ACB_TP_TIMEOUT_S environment "
    "variable (default 300 s)",
}

# transformers' deprecated fields: their effect lands on another field in ``__post_init__``
DEPRECATED = ("use_default_compile_configs", "max_cached_graphs", "block_size")


@dataclass
class ContinuousBatchingConfig:
    """Settings of the engine. Field names, order and meanings follow transformers' 5.23
    ``ContinuousBatchingConfig``; a transformers instance is accepted wherever this one is.

    ``None`` means "resolve a sensible default at engine start" (see :class:`ResolvedConfig`).

    Differences from transformers:

    - ``page_size`` (tokens per KV block) defaults to ``None``: 32 tokens, or 256 with the
      flash_attn backend (flash-attn's paged cache needs multiples of 256); transformers' default
      is 256. A transformers instance left at its default page size gets acb's default.
    - ``auto_switch_to_flash``: acb never uses the model's attention implementation, so the default
      (``True``) is what ``attn_backend=None`` already does; ``False`` has no effect and warns.
    - ``max_blocks_per_request``, ``kv_padding_interval_size``, ``disable_nccl_graph_mixing`` and
      ``cpu_group_timeout`` have no effect (``NOT_YET_SUPPORTED``; non-default values warn).
    - ``use_cuda_graph`` applies to decode-only steps; mixed steps always run eagerly.
    - acb's own additions: ``attn_backend``, ``max_model_len``, ``cpu_packed_linears``, ``cpu_threads``,
      ``mla_latent_cache``, ``state_snapshots``, ``max_loras``, ``max_lora_rank``, and the
      structured-outputs compile budget ``grammar_compile_timeout_s``, ``grammar_max_bytes``,
      ``grammar_max_repetition`` (:mod:`acb.grammar_budget`).

    Deprecated aliases behave as in transformers (a logged warning, the same message):
    ``block_size`` is copied to ``page_size`` (it wins if both are given),
    ``use_default_compile_configs`` sets ``default_compile_level`` to 3 (``True``) or 0, and
    ``max_cached_graphs`` has no effect.
    """

    page_size: int | None = None  # tokens per KV block; default 32 (flash_attn: 256; transformers: 256)
    num_blocks: int | None = None  # default: from available memory
    max_batch_tokens: int | None = None  # token budget per step
    max_memory_percent: float | None = None  # of free device memory for the KV cache (CUDA)
    max_requests_per_batch: int | None = None  # most sequences in one step (and running at once)
    max_blocks_per_request: int | None = None  # transformers' knob; no effect in acb (max_model_len bounds a request)
    allow_block_sharing: bool = True  # prefix caching: requests share the KV blocks of a common prompt prefix
    use_async_batching: bool | None = None  # schedule step N+1 while step N runs; default: on for CUDA, off on CPU
    # decode CUDA graphs (a tuple: (mixed, decode)); default: on for CUDA
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    q_padding_interval_size: int = 0  # decode graphs' batch sizes past 8 step by this (0: 8 to 64, then 16)
    kv_padding_interval_size: int = 0  # transformers' knob; no effect in acb
    varlen_compile_config: Any = None  # torch.compile options of mixed (prefill) steps
    decode_compile_config: Any = None  # torch.compile options of decode-only steps
    default_compile_level: int = 0  # 0: no compile; 1-3: torch.compile of both paths, more tuning each
    scheduler_type: str = "fifo"  # "fifo", or "prefill_first"
    # fraction of blocks kept free when admitting new requests (fewer preemptions)
    safety_margin: float | None = None
    return_logprobs: bool = False  # every request returns its tokens' processed logprobs (transformers' meaning)
    seed: int | None = None  # seeds the engine's draws of per-request seeds: a run is repeatable
    auto_switch_to_flash: bool = True  # transformers' knob; acb picks its backend itself (attn_backend)
    cpu_offload_space: float | None = 0.0  # GiB of host memory for offloaded KV blocks; 0: none; None: the cap
    cpu_offload_space_safety_threshold: float = 0.8  # the most of available host memory offload may take
    max_queue_size: int = 0  # most requests waiting to be scheduled; 0 = unlimited
    per_request_processors: bool = False  # the manager's add_request(temperature=...) kwargs apply per request
    # a generation config's unsupported processors: dropped with a warning (else refused)
    drop_unsupported_processors: bool = True
    disable_nccl_graph_mixing: bool = True  # transformers' knob; no effect in acb
    cpu_group_timeout: float | None = 300.0  # transformers' knob; no effect in acb
    # deprecated in transformers (5.11, 5.13, 5.17)
    use_default_compile_configs: bool | None = None
    max_cached_graphs: int | None = None  # deprecated in transformers; no effect
    block_size: int | None = None  # use page_size
    # acb only
    attn_backend: str | None = None  # "torch", "cpu", "triton", "flash_attn"; None = the best available
    # "paged": acb's paged KV cache (refused, with the reason, for a model it cannot page);
    # "own_cache": the model on its own cache objects, as model.generate runs it (acb.runner.own_cache_runner);
    # None: paged when the model passes its checks, else its own cache, said in one log line
    runner: str | None = None
    max_model_len: int | None = None  # most tokens per request; default: the model's max positions
    # vision-language models: bytes of image embeddings kept on the device (the running requests'
    # images, then recent ones for reuse), set aside before the KV cache is sized from the memory
    # budget; a request whose images need more is refused at submit. None: a sixteenth of the
    # memory budget (with num_blocks given: an eighth of the KV cache's bytes), at least 64 MiB
    image_cache_bytes: int | None = None
    # CPU: the forward's float32 linears run on oneDNN-packed copies of their weights in steps of
    # 2 to 128 tokens (None: on when the model is on CPU, not compiled, not tensor parallel and
    # has at least 250k linear parameters per layer; the copies take the linear weights' size in
    # host memory once more)
    cpu_packed_linears: bool | None = None
    # CPU: the engine thread's intra-op threads. "auto" (None, unless the ACB_CPU_THREADS environment
    # variable pins it): torch's count to start with, then chosen by measuring the engine's own
    # steps (a probe of half as many, or twice as many, now and then; kept where faster), so that
    # an engine beside another busy process stops waiting on descheduled threads
    # (acb.runner.host_threads.ThreadTuner); an int pins the count (bitwise repeatable runs: MKL
    # rounds some small float32 GEMMs differently at another count); "fixed" keeps the count torch
    # gives the engine thread (OMP_NUM_THREADS, torch.set_num_threads). The caller's threads keep theirs
    cpu_threads: int | str | None = None
    # multi-head latent attention (DeepSeek V2/V3/V3.2, GLM-5, Kimi, MiniCPM3, ...): page each MLA
    # layer's latent (kv_lora_rank + qk_rope_head_dim values per token) instead of its expanded
    # heads, 5-85x less KV memory, attended by the torch and Triton attention backends (decode rows
    # with the query absorbed, prefill expanded as model.generate expands it; greedy tokens equal
    # generate's); CPU decode measured 0.6-0.8x the expanded pages' time (benchmarks/mla_latent.py).
    # None: the latent wherever the torch backend runs the model anyway (CPU; an indexed-attention
    # model, DSA, on CUDA), the expanded heads on CUDA otherwise (with decode graphs); True: the
    # latent everywhere (on CUDA the Triton backend's latent kernel, without decode graphs; a
    # flash-attn pick becomes Triton); False: the expanded heads
    mla_latent_cache: bool | None = None
    # state layers (linear attention, Mamba, short convolutions): slots of state snapshots kept with
    # cached blocks, so that a prefix hit resumes the layers' state too (one slot: one request's
    # state over every state layer, priced in the memory budget). None: twice
    # max_requests_per_batch, within a quarter of the budget; 0: no prefix caching for such models
    state_snapshots: int | None = None
    # structured outputs: wall-clock seconds one request's grammar may take to compile; past it the
    # compile's worker process is killed and the submit refused with a ValueError naming this field
    grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    # structured outputs: the largest spec in bytes (a JSON schema as compact text, a regex, an EBNF
    # grammar, the choices as a JSON list); a larger one is refused at submit
    grammar_max_bytes: int = DEFAULT_MAX_BYTES
    # structured outputs: the most characters the {m,n} counts of a spec's regexes, JSON-schema
    # patterns and EBNF may expand to (summed; nested counts multiply); more is refused at submit
    # before any compile
    grammar_max_repetition: int = DEFAULT_MAX_REPETITION
    # LoRA adapters (acb.lora, acb.runner.lora): how many may be loaded at once, each request choosing
    # one or none; 0 turns LoRA off. Their stacked buffers, (max_loras + 1) x max_lora_rank x (in + out)
    # per target linear of the decoder, and the fused experts' factors (max_loras x max_lora_rank per
    # 3-D expert parameter) with one transient folded copy, are set aside before the KV cache is sized
    max_loras: int = 0
    # the largest adapter rank taken; a higher-rank adapter is refused when added
    max_lora_rank: int = 16
    # a request's tokens and logprobs the same bits whatever else is in its batch (batch size,
    # chunked prefill, prefix hits, thread count), and equal to a trainer's own forward under
    # acb.runner.batch_invariant.enabled(model): fixed-order linears and attention
    # (acb.runner.batch_invariant; float32 on CPU; MLA pages its expanded heads; refused, with the
    # reason, where not covered)
    batch_invariant: bool = False
    _warned: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # transformers' deprecations, mirrored: same messages, logged (not ``warnings``), same precedence
        if self.use_default_compile_configs is not None:
            if self.use_default_compile_configs:
                level_msg = "setting default_compile_level to 3. Consider using a lower level for faster warmup time."
                self.default_compile_level = 3
            else:
                level_msg = "setting default_compile_level to 0."
                self.default_compile_level = 0
            logger.warning(
                "use_default_compile_configs is deprecated: please use default_compile_level instead. For backwards "
                f"compatibility, {level_msg}"
            )
        if self.max_cached_graphs is not None:
            logger.warning(
                "max_cached_graphs is deprecated: maximum number of graph is no longer an issue. Deprecated in 5.13."
            )
        if self.block_size is not None:
            logger.warning(
                "block_size is deprecated: please use page_size instead. For backwards compatibility, block_size will "
                "be used as the full attention page size."
            )
            self.page_size = self.block_size
        self.validate()

    @classmethod
    def from_transformers(cls, config: TransformersConfig) -> ContinuousBatchingConfig:
        """acb's config from a ``transformers.ContinuousBatchingConfig``, field by field.

        Fields left at transformers' defaults get acb's (so ``page_size=256``, transformers'
        default, becomes acb's automatic page size). Deprecated fields are skipped: transformers
        has already applied them to ``page_size``/``default_compile_level`` and warned (before
        5.23, which has no ``page_size``, ``block_size`` is the page size and is taken as such). Fields acb
        does not know (a newer transformers) warn by name and are dropped; fields acb knows but
        does not act on warn when the engine starts (``NOT_YET_SUPPORTED``)."""
        if not is_transformers_config(config):
            raise TypeError(f"expected a transformers.ContinuousBatchingConfig, got {type(config).__name__}")
        ours = {f.name for f in fields(cls) if f.init}
        kwargs: dict[str, Any] = {}
        unknown: list[str] = []
        theirs = transformers_fields(type(config))
        for name, default in theirs.items():
            value = getattr(config, name, default)
            if default is not MISSING and _same(value, default):
                continue
            if name == "block_size" and "page_size" not in theirs:
                kwargs["page_size"] = value  # transformers before 5.23: block_size is the page size itself
                continue
            if name in DEPRECATED:
                continue
            if name in ours:
                kwargs[name] = value
            else:
                unknown.append(name)
        if unknown:
            warnings.warn(
                f"transformers ContinuousBatchingConfig fields {unknown} are not known to acb and have no effect",
                stacklevel=2,
            )
        return cls(**kwargs)

    def validate(self) -> None:
        def check(name: str, ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"ContinuousBatchingConfig.{name} must be {what}, got {getattr(self, name)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for name in (
            "page_size",
            "num_blocks",
            "max_batch_tokens",
            "max_requests_per_batch",
            "max_model_len",
            "block_size",
            "image_cache_bytes",
        ):
            v = getattr(self, name)
            check(name, v is None or (is_int(v) and v > 0), "a positive int")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("ContinuousBatchingConfig.num_blocks must be >= 2 (block 0 is scratch)")
        for name in (
            "allow_block_sharing",
            "return_logprobs",
            "auto_switch_to_flash",
            "per_request_processors",
            "drop_unsupported_processors",
            "disable_nccl_graph_mixing",
            "batch_invariant",
        ):
            check(name, isinstance(getattr(self, name), bool), "a bool")
        for name in ("use_async_batching", "use_default_compile_configs", "cpu_packed_linears", "mla_latent_cache"):
            check(name, getattr(self, name) is None or isinstance(getattr(self, name), bool), "None or a bool")
        v = self.max_memory_percent
        check("max_memory_percent", v is None or (is_num(v) and 0 < v <= 1), "in (0, 1]")
        check("scheduler_type", self.scheduler_type in SCHEDULER_TYPES, f"one of {SCHEDULER_TYPES}")
        v = self.safety_margin
        check("safety_margin", v is None or (is_num(v) and 0 <= v < 1), "in [0, 1)")
        for name in ("max_queue_size", "q_padding_interval_size", "kv_padding_interval_size", "default_compile_level"):
            check(name, is_int(getattr(self, name)) and getattr(self, name) >= 0, "an int >= 0")
        check("max_loras", is_int(self.max_loras) and self.max_loras >= 0, "an int >= 0 (0: LoRA off)")
        check("max_lora_rank", is_int(self.max_lora_rank) and self.max_lora_rank >= 1, "a positive int")
        for name in ("max_blocks_per_request", "max_cached_graphs", "state_snapshots"):
            v = getattr(self, name)
            check(name, v is None or (is_int(v) and v >= 0), "None or an int >= 0")
        check("seed", self.seed is None or is_int(self.seed), "None or an int")
        t = self.cpu_threads
        check(
            "cpu_threads",
            t is None or t in ("auto", "fixed") or (isinstance(t, int) and is_int(t) and t > 0),
            "None, 'auto', 'fixed' or a positive int",
        )
        v = self.cpu_offload_space
        check("cpu_offload_space", v is None or (is_num(v) and v >= 0), "None or a number of GiB >= 0")
        v = self.cpu_offload_space_safety_threshold
        check("cpu_offload_space_safety_threshold", is_num(v) and v >= 0, "a fraction >= 0")
        v = self.cpu_group_timeout
        check("cpu_group_timeout", v is None or (is_num(v) and v > 0), "None or a number of seconds > 0")
        g = self.use_cuda_graph
        check(
            "use_cuda_graph",
            g is None
            or isinstance(g, bool)
            or (isinstance(g, tuple) and len(g) == 2 and all(isinstance(x, bool) for x in g)),
            "None, a bool, or a (varlen, decode) tuple of bools",
        )
        for name in ("grammar_max_bytes", "grammar_max_repetition"):
            check(name, is_int(getattr(self, name)) and getattr(self, name) >= 1, "an int >= 1")
        v = self.grammar_compile_timeout_s
        check("grammar_compile_timeout_s", is_num(v) and 0 < v < math.inf, "a number of seconds > 0")
        check(
            "attn_backend",
            self.attn_backend is None or self.attn_backend in ATTN_BACKENDS,
            f"one of {ATTN_BACKENDS} or None",
        )
        check("runner", self.runner in (None, "paged", "own_cache"), "'paged', 'own_cache' or None")

    def warn_unsupported(self) -> list[str]:
        """Warn once about fields set to values acb does not act on; return their names."""
        defaults = ContinuousBatchingConfig.__dataclass_fields__
        names = []
        for name, why in NOT_YET_SUPPORTED.items():
            value = getattr(self, name)
            if value != defaults[name].default:
                names.append(name)
                if not self._warned:
                    warnings.warn(
                        f"ContinuousBatchingConfig.{name}={value!r} is accepted but has no effect in acb: {why}",
                        stacklevel=3,
                    )
        self._warned = True
        return names


def is_transformers_config(config: Any) -> bool:
    """Whether ``config`` is a ``transformers.ContinuousBatchingConfig`` (or a subclass), told
    by its class, so that ``import acb`` need not import transformers."""
    return any(
        c.__name__ == "ContinuousBatchingConfig" and c.__module__.split(".")[0] == "transformers"
        for c in type(config).__mro__
    )


def transformers_fields(cls: type) -> dict[str, Any]:
    """The fields of transformers' ``ContinuousBatchingConfig`` class and their defaults
    (``MISSING`` when required): its dataclass fields, or its ``__init__`` parameters if a later
    version stops being a dataclass."""
    if is_dataclass(cls):
        return {
            f.name: f.default_factory() if f.default_factory is not MISSING else f.default
            for f in fields(cls)
            if f.init
        }
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = inspect.signature(cls).parameters.values()  # the constructor's, without self
    return {p.name: MISSING if p.default is inspect.Parameter.empty else p.default for p in params if p.kind in kinds}


# What the engines, generate_batch and the manager take as their config.
ConfigLike = Union[ContinuousBatchingConfig, "TransformersConfig"]


def as_config(config: ConfigLike | None) -> ContinuousBatchingConfig:
    """The config an engine runs with: acb's as given, a transformers one converted
    (:meth:`ContinuousBatchingConfig.from_transformers`), ``None`` for the defaults."""
    if config is None:
        return ContinuousBatchingConfig()
    if isinstance(config, ContinuousBatchingConfig):
        return config
    if is_transformers_config(config):
        return ContinuousBatchingConfig.from_transformers(config)
    hint = " (for a dict, pass acb.ContinuousBatchingConfig(**d))" if isinstance(config, dict) else ""
    raise TypeError(
        "config must be an acb.ContinuousBatchingConfig or a transformers.ContinuousBatchingConfig, "
        f"got {type(config).__name__}{hint}"
    )


def _same(value: Any, default: Any) -> bool:
    """``value == default`` that never raises (tensors, odd objects compare as different)."""
    try:
        return bool(value == default) and type(value) is type(default)
    except Exception:  # noqa: BLE001 - an uncomparable value is not the default
        return False


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
    # each prompt prefilled in one step, never in chunks: the model's state layers cannot resume a
    # prefill from a state (Mamba1's scan); a prompt longer than max_batch_tokens runs alone
    whole_prefill: bool = False
    # state layers (linear attention, Mamba, short convolutions): slots of state snapshots kept
    # with cached blocks, so that a prefix hit resumes their state too (0: prefix caching cannot
    # reuse state layers, or is off)
    state_snapshots: int = 0
    # the tokens the snapshots may hold together, where a snapshot's size grows with its length (the
    # model's own caches cut at a block boundary); 0: no such bound (a state snapshot is one row)
    snapshot_tokens: int = 0
    # state layers: host rows a preempted request's state is offloaded to, with its KV blocks
    state_host_rows: int = 0
    # state layers that resume a prefix hit a token at a time (Mamba1): the longest rest of a prompt
    # a hit is taken for (past it, recomputing the whole prompt is faster); 0: any
    state_resume_max_tail: int = 0
    offload_bytes: int = 0  # the host-memory offload space (cpu_offload_space), in bytes
    async_batching: bool = False  # schedule step N+1 while step N runs
    cuda_graphs: bool = False  # decode-only steps replay CUDA graphs (the eager twin on CPU)
    graph_step: int | None = None  # batch-size granularity of the decode graphs (q_padding_interval_size)
    packed_linears: int = 0  # CPU: float32 linears whose forward runs on oneDNN-packed weights
    image_cache_bytes: int = 64 << 20  # vision-language models: image embeddings kept on the device
    max_loras: int = 0  # LoRA adapters loaded at once (0: LoRA off)
    max_lora_rank: int = 16  # the largest adapter rank taken
    lora_bytes: int = 0  # the adapters' stacked buffers, set aside before the KV cache was sized
    batch_invariant: bool = False  # fixed-order linears and attention (acb.runner.batch_invariant)

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the cache holds, scratch block excluded."""
        return (self.num_blocks - 1) * self.block_size
