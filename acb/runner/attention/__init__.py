"""Attention backends behind one interface, and acb's hook into transformers' AttentionInterface.

acb registers one attention function (``ATTN_IMPL_NAME``) with transformers'
``AttentionInterface``. An engine step passes a 4-D placeholder ``attention_mask``, which
transformers' mask creation returns as-is, so no dense mask is ever built; acb's mask function
(registered with ``AttentionMaskInterface``) serves forwards outside a step, with the model's own. Per-step metadata reaches the
function as the ``acb_ctx`` forward kwarg, which transformers passes down to attention.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from acb.runner.step import CURRENT, entered

if TYPE_CHECKING:
    from acb.runner.kv_cache import KVCache
    from acb.runner.latent import LatentExpand

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


@dataclass(frozen=True)
class AttentionCall:
    """One layer's attention as the model asked for it: everything a backend needs besides the
    step's query, keys, values and metadata. acb's attention function builds one per call from the
    module and the keywords the model passed; it is the one argument through which a layer kind
    reaches a backend. A new variant is a field here (default: off), a name in :meth:`features`,
    and that name in the ``features`` of the backends that take it (:func:`_forward` refuses the
    others with a clear error instead of each backend checking its keywords)."""

    scaling: float | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [heads] learned sink logits (GPT-OSS, Hunyuan V4), or None
    chunk: int | None = None  # chunked attention (Llama 4): keys of the query's own chunk only
    store: bool = True  # False: the step's K/V are already in this cache layer (a KV-shared layer)
    index: torch.Tensor | None = None  # [1, T, k] indexed attention (DSA): each query's keys, -1 for none
    # an MLA layer paged as its latent (acb.runner.latent): the key is the step's latent
    # [1, 1, T, r + rope], the cache layer holds it, and this expands or absorbs it
    latent: LatentExpand | None = None
    tuning: list[float] | None = None  # Llama 4's attention temperature tuning (applied before the backend)
    # the layer's prefill masks let an image's tokens see their whole image (Gemma 3, Gemma 4's
    # sliding layers): set by the torch backend from the step's image blocks, not by the model
    media_blocks: bool = False

    def features(self) -> frozenset[str]:
        """The optional features this call needs a backend to take (its ``features``)."""
        need = []
        if self.sinks is not None:
            need.append("sinks")
        if self.chunk:
            need.append("chunk")
        if self.index is not None:
            need.append("index")
        if self.latent is not None:
            need.append("latent")
        return frozenset(need)


class AttentionBackend(Protocol):
    name: str
    # the optional AttentionCall features the backend takes (AttentionCall.features)
    features: frozenset[str]

    def build_metadata(self, batch: BatchInputs, block_size: int) -> Any: ...

    def forward(
        self,
        layer: int,  # the cache layer
        query: torch.Tensor,  # [1, heads, T, head_dim]
        key: torch.Tensor,  # [1, kv_heads, T, head_dim]
        value: torch.Tensor,
        ctx: StepContext,
        call: AttentionCall,
    ) -> torch.Tensor: ...  # [1, T, heads, head_dim]


@dataclass
class StepContext:
    """What the attention function needs for one forward: the cache, the backend, its metadata."""

    kv_cache: KVCache
    backend: AttentionBackend
    metadata: Any


class SharedAttention:
    """The attention modules that are told their layer when called (``forward(..., layer_idx)``:
    one module shared by several layers, Zamba2's shared block): each call's ``layer_idx`` is
    what acb's attention function pages by, for the life of an engine."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules: list[torch.nn.Module] = []
        for m in model.modules():
            if not (hasattr(m, "q_proj") and hasattr(m, "o_proj")):
                continue
            sig = inspect.signature(type(m).forward)
            if "layer_idx" not in sig.parameters:
                continue
            original = m.forward
            m.forward = lambda *a, _o=original, _s=sig, _m=m, **k: _called_at(_o, _s, _m, *a, **k)
            self.modules.append(m)

    def remove(self) -> None:
        for m in self.modules:
            if "forward" in vars(m):
                del m.forward
        self.modules = []


def _called_at(original: Any, sig: inspect.Signature, module: Any, *args: Any, **kwargs: Any) -> Any:
    layer = sig.bind_partial(module, *args, **kwargs).arguments.get("layer_idx")
    with entered("called_layer", layer):
        return original(*args, **kwargs)


def layer_chunk(module: torch.nn.Module) -> int | None:
    """The attention chunk of a chunked-attention layer (Llama 4's ``chunked_attention`` layers:
    a query sees only the keys of its own ``attention_chunk_size`` positions), else None."""
    cfg = getattr(module, "config", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    if not chunk:
        return None
    types = getattr(cfg, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if types is None or idx is None or types[idx] != "chunked_attention":
        return None
    return int(chunk)


def layer_sinks(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """Per-head attention-sink logits the model passes its attention function (GPT-OSS: ``s_aux``)."""
    sinks = kwargs.get("s_aux")
    return sinks if sinks is not None else kwargs.get("sinks")


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
    ctx: StepContext | Literal[True] | None = kwargs.get("acb_ctx")
    if ctx is None:  # a decoder layer that drops its kwargs (Nemotron): the thread's step, if any
        ctx = CURRENT.attention
    if CURRENT.own_attention:  # a layer run on the model's own cache (acb.runner.unpaged_layers)
        ctx = None
        kwargs.pop("acb_ctx", None)
    if ctx is None:  # the model called outside an engine step (a training forward between rounds)
        index = kwargs.pop("indices", None)
        if index is not None and _own_name(getattr(module, "config", None)) == "acb_batch_invariant":
            kwargs["indices"] = index  # the batch-invariant mode's attention takes it (runner/batch_invariant_dsa.py)
        elif index is not None:  # indexed attention: what the model's eager/SDPA path does with the selection
            attention_mask = fold_selection(attention_mask, index, key.shape[2], query.dtype)
        return own_attention(module)(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            softcap=softcap,
            **kwargs,
        )
    # a KV-shared layer (Gemma 3n) gets the K/V its producer layer computed in this same forward,
    # which the producer has written into the cache layer both read
    shared = bool(getattr(module, "is_kv_shared_layer", False))
    # an int on HF attention layers; a shared block's module (Zamba2's, one module called at several
    # layers) is told its layer at call time instead (SharedAttention)
    called = CURRENT.called_layer
    layer_idx: int = called if called is not None else module.layer_idx  # type: ignore[assignment]
    call = AttentionCall(
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=layer_sinks(kwargs),
        chunk=layer_chunk(module),
        store=not shared,
        # indexed attention (DSA): the positions the layer's indexer selected for each query
        # (acb.runner.indexed); the eager/SDPA paths of transformers fold them into the mask instead
        index=kwargs.get("indices"),
        tuning=temperature_tuning(module),
    )
    latent: LatentExpand | None = getattr(module, "_acb_latent", None)  # acb.runner.latent.LATENT_ATTR
    if latent is not None and (ctx is True or ctx.kv_cache.layer_of(layer_idx) not in ctx.kv_cache.spec.latent_layers):
        # the latent came through, but this engine's cache holds the expanded heads (another engine
        # on the model pages the latent): expand the step's tokens as the model would
        key, value = latent.original(key, value)
        latent = None
    if latent is not None:
        # an MLA layer paged as its latent: its expand_kv passed the latent through (key = kv_nope
        # [1, 1, T, r], value = k_rot [1, 1, T, rope]); the backend stores [kv_nope | k_rot] and
        # expands the request's latent with the module's own expand_kv
        assert ctx is not True
        lat = torch.cat([key, value.to(key.dtype)], dim=-1)
        return _forward(ctx, layer_idx, query, lat, lat, replace(call, latent=latent)), None
    k_dim, v_dim = key.shape[-1], value.shape[-1]
    if k_dim != v_dim:  # latent attention (MLA): the cache holds keys and values at the wider width,
        # the narrower zero-padded (zeros add nothing to q.k, and padded value columns are dropped)
        width = max(k_dim, v_dim)
        if scaling is None:
            call = replace(call, scaling=k_dim**-0.5)
        query, key = (torch.nn.functional.pad(t, (0, width - k_dim)) for t in (query, key))
        value = torch.nn.functional.pad(value, (0, width - v_dim))
    if ctx is True:  # a compiled step: the context is the thread's, behind an opaque op (no graph break)
        if call.index is not None:
            raise RuntimeError("indexed attention does not run under torch.compile in acb")
        out = torch.ops.acb.paged_attention(
            query,
            key,
            value,
            layer_idx,
            call.scaling,
            call.sliding_window,
            call.softcap,
            call.sinks,
            call.chunk,
            call.store,
            call.tuning,
        )
    else:
        out = _forward(ctx, layer_idx, query, key, value, call)
    return (out if k_dim == v_dim else out[..., :v_dim].contiguous()), None


@contextlib.contextmanager
def own_attention_here() -> Iterator[None]:
    """Within the block, this thread's attention calls go to the model's own attention function
    (with the mask and keys the model gives it), as outside an engine step: for layers that run
    on the model's own cache (:mod:`acb.runner.unpaged_layers`)."""
    with entered("own_attention", True):
        yield


def on_own_attention() -> bool:
    """Whether this thread is inside :func:`own_attention_here`."""
    return CURRENT.own_attention


def fold_selection(
    mask: torch.Tensor | None, index: torch.Tensor, key_len: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """An indexed-attention layer's selection (``index``: ``[B, S, k]`` key positions) folded into
    its ``[B, 1, S, T]`` mask, as the model's own eager/SDPA path folds it when its implementation
    is not acb's: keys not selected are masked out."""
    b, s = index.shape[:2]
    dropped = torch.ones((b, s, key_len), dtype=torch.bool, device=index.device)
    dropped = dropped.scatter(-1, index.long(), False)[:, None]
    if mask is None:  # causal (the queries are the keys' last s)
        causal = torch.ones((s, key_len), dtype=torch.bool, device=index.device).tril(key_len - s)
        return causal & ~dropped
    if mask.dtype == torch.bool:
        return mask & ~dropped
    return mask.masked_fill(dropped, torch.finfo(dtype).min)


def temperature_tuning(module: torch.nn.Module) -> list[float] | None:
    """``[floor_scale, attn_scale]`` of a Llama 4 no-RoPE layer with attention temperature tuning, else None.

    Such a layer scales its queries by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``,
    with positions ``p`` it counts from its cache (``arange(T) + past``). acb's forward has no
    cache and one flattened sequence, so the model took the token's index in the step for ``p``;
    :func:`_fix_temperature` puts the real position's scale in its place."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return None
    return [float(module.floor_scale), float(module.attn_scale)]  # type: ignore[arg-type]


def _temperature(pos: torch.Tensor, tuning: list[float]) -> torch.Tensor:
    floor_scale, attn_scale = tuning
    return torch.log1p(torch.floor((pos.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def _fix_temperature(query: torch.Tensor, md: Any, tuning: list[float]) -> torch.Tensor:
    """``query`` ([1, H, T, D]) scaled by its tokens' real positions' temperature instead of the
    one their index in the flattened step gave (both 1.0, and the query unchanged bit for bit,
    below ``floor_scale - 1``). Positions are computed on the device from the step's metadata."""
    t = query.shape[2]
    qsl = getattr(md, "query_start_loc", None)
    if qsl is None:
        qsl = md.cu_seqlens_q
    seq_lens = md.seq_lens
    idx = torch.arange(t, device=query.device)
    seq = torch.searchsorted(qsl[1:].to(torch.long), idx, right=True).clamp_(max=seq_lens.numel() - 1)
    pos = seq_lens.to(torch.long)[seq] - qsl.to(torch.long)[seq + 1] + idx
    wrong, right = _temperature(idx, tuning), _temperature(pos, tuning)
    # the model's own arithmetic: (query * scale).to(dtype), undone and redone
    return (query.float() / wrong.view(1, 1, t, 1) * right.view(1, 1, t, 1)).to(query.dtype)


def _forward(
    ctx: StepContext, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: AttentionCall
) -> torch.Tensor:
    if call.tuning is not None:
        query = _fix_temperature(query, ctx.metadata, call.tuning)
    cache = ctx.kv_cache
    spec = cache.spec
    layer = cache.layer_of(layer_idx)
    heads, width = spec.shape_of(layer)
    if key.shape[1] != heads or key.shape[3] != width:
        raise RuntimeError(
            f"layer {layer_idx}: keys have {key.shape[1]} heads of {key.shape[3]} but its KV cache layer "
            f"holds {heads} of {width}; the model's config and attention modules do not describe its "
            "attention layers"
        )
    backend = ctx.backend
    missing = call.features() - backend.features
    if missing:  # resolve_config picks a backend that takes what the model's layers need
        raise NotImplementedError(
            f"layer {layer_idx} needs attention with {', '.join(sorted(missing))}, which the "
            f"{backend.name!r} backend does not take"
        )
    return backend.forward(layer, query, key, value, ctx, call)


# ------------------------------------------------------------------ compiled steps
# Under torch.compile the step's context (host-side metadata, the cache) is not a graph input:
# the runner sets it for its thread around the forward, and attention is one opaque custom op
# that reads it, so the rest of the model compiles into one graph around the layers' attention.
def in_step() -> bool:
    """Whether this thread is inside an engine step's forward (:func:`step_context`)."""
    return CURRENT.attention is not None


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[None]:
    """Make ``ctx`` the context of ``acb::paged_attention`` calls on this thread (the runner
    enters it around every engine forward, compiled or not)."""
    with entered("attention", ctx):
        yield


@torch.library.custom_op("acb::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    store: bool = True,
    tuning: list[float] | None = None,
) -> torch.Tensor:
    """Attention of one layer (the model's layer index) over the paged KV cache of the thread's
    current step (it also writes the step's keys and values into the cache: a side effect the
    graph cannot see, and needs not, since nothing else in the graph reads the cache).
    [1, T, heads, head_dim]."""
    ctx: StepContext | None = CURRENT.attention
    if ctx is None:
        raise RuntimeError("acb::paged_attention ran outside an engine step")
    call = AttentionCall(scaling, sliding_window, softcap, sinks, chunk, store, tuning=tuning)
    return _forward(ctx, layer, query, key, value, call)


@paged_attention.register_fake
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    store: bool = True,
    tuning: list[float] | None = None,
) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


# ------------------------------------------------------------------ outside an engine step
# While an engine runs, the model's attention implementation is acb's. A forward the user runs
# themselves meanwhile (training between RL rounds) gets the model's own implementation: its
# masks and its attention function, looked up by the config the model's modules share.
_OWN: dict[int, str] = {}  # id(config) -> the model's own implementation


def set_own_implementation(configs: list[Any], impl: str | None) -> None:
    for c in configs:
        if impl is None:
            _OWN.pop(id(c), None)
        else:
            _OWN[id(c)] = impl


def own_implementation(config: Any) -> str | None:
    """The model's own attention implementation an engine recorded for ``config`` (what its calls
    outside a step run), or None when no engine holds the model."""
    return _OWN.get(id(config))


def _own_name(config: Any) -> str:
    name = _OWN.get(id(config))
    if name is None:
        raise RuntimeError(f"the '{ATTN_IMPL_NAME}' attention implementation runs only on a model an acb engine uses")
    return name


def own_attention(module: torch.nn.Module) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = _own_name(getattr(module, "config", None))
    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    import sys

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"no {name!r} attention function for {type(module).__name__} outside an engine step")
    return eager


def acb_mask(*args: Any, **kwargs: Any) -> Any:
    """The mask function of acb's implementation, for forwards outside an engine step: the model's
    own mask. (An engine step passes a 4-D placeholder mask, which transformers returns as-is
    without calling this.)"""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = _own_name(kwargs.get("config"))
    fn: Any = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name)
    return None if fn is None else fn(*args, **kwargs)


def register_with_transformers(compiled: bool = False) -> None:
    """Register acb's attention function with transformers (idempotent). A compiled step reaches
    the cache through the ``acb::paged_attention`` op (traced, no graph break); ``compiled``
    keeps dynamo out of the mask function (it is only called outside a step), and only then,
    because importing dynamo disturbs Triton's interpreter."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL_NAME, acb_attention_forward)
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(ATTN_IMPL_NAME, torch.compiler.disable(acb_mask) if compiled else acb_mask)


def make_backend(name: str) -> AttentionBackend:
    """The backend called ``name`` ("torch", "cpu", "triton" or "flash_attn")."""
    if name == "torch":
        from acb.runner.attention.torch_backend import TorchBackend

        return TorchBackend()
    if name == "cpu":
        from acb.runner.attention.cpu_backend import CpuBackend

        return CpuBackend()
    if name == "triton":
        from acb.runner.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "flash_attn":
        from acb.runner.attention.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    raise ValueError(f"unknown attention backend {name!r}")


def query_heads(config: Any, kv_heads: int, tp: int = 1) -> int:
    """The query heads per KV head group that :func:`check_backend` runs with for a model: its text
    config's ``num_attention_heads`` on this rank (of ``tp``), or ``kv_heads`` (one query head per
    KV head) when the config names none a page shape of ``kv_heads`` heads can take."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        heads = getattr(text, "num_attention_heads", None)
    except Exception:  # noqa: BLE001 - a per-layer config refusing the global read
        heads = None
    if isinstance(heads, int) and heads >= tp and (heads // tp) % kv_heads == 0:
        return heads // tp
    return kv_heads


def check_backend(
    candidate: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int = 64,
    block_size: int = 16,
    heads: int = 4,
    kv_heads: int = 2,
) -> str | None:
    """Run ``candidate`` against the torch reference on a small mixed step (decode rows, a fresh
    prompt and a chunk after cached context, GQA) on ``device``; None if they agree, else what
    went wrong. Used when a backend is picked automatically, so that a GPU where its kernels fail
    to build or disagree falls back to another backend instead of failing. With the model's
    head sizes, the kernels it compiles are the ones the engine then runs."""
    try:
        # a mixed step (decode rows, a fresh prompt, a chunk after cached context), then decode only
        for num_new, start in (([1, 1, 9, 5], [20, 37, 0, 16]), ([1, 1, 1], [20, 37, 4])):
            problem = _compare_once(candidate, device, dtype, head_dim, block_size, num_new, start, heads, kv_heads)
            if problem is not None:
                return problem
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means "do not use it"
        return f"{type(exc).__name__}: {exc}"


def _compare_once(
    candidate: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    num_new: list[int],
    start: list[int],
    heads: int,
    hkv: int,
) -> str | None:
    from acb.runner.attention.torch_backend import TorchBackend
    from acb.runner.kv_cache import KVCache, KVSpec

    g = torch.Generator().manual_seed(0)
    lens = [s + n for s, n in zip(start, num_new)]
    cols = max(-(-n // block_size) for n in lens)
    perm = torch.randperm(len(lens) * cols, generator=g) + 1  # block 0 is scratch
    table = perm.view(len(lens), cols).long()
    slots = []
    for i, (s, n) in enumerate(zip(start, num_new)):
        for p in range(s, s + n):
            slots.append(int(table[i, p // block_size]) * block_size + p % block_size)
    qsl = [0]
    for n in num_new:
        qsl.append(qsl[-1] + n)
    t = qsl[-1]
    batch = BatchInputs(
        slot_mapping=torch.tensor(slots, device=device),
        block_table=table.to(device),
        seq_lens=torch.tensor(lens, device=device),
        query_start_loc=torch.tensor(qsl, device=device),
        num_new=num_new,
        start_pos=start,
        max_seq_len=max(lens),
    )
    spec = KVSpec.uniform(1, hkv, head_dim, dtype)
    outs = []
    q = torch.randn(1, heads, t, head_dim, generator=g).to(device, dtype)
    k = torch.randn(1, hkv, t, head_dim, generator=g).to(device, dtype)
    v = torch.randn(1, hkv, t, head_dim, generator=g).to(device, dtype)
    context = torch.randn(1 + len(lens) * cols, block_size, hkv, head_dim, generator=g).to(device, dtype)
    for backend in (TorchBackend(), candidate):
        cache = KVCache(spec, 1 + len(lens) * cols, block_size, device)
        cache.k[0].copy_(context)
        cache.v[0].copy_(context.flip(0))
        ctx = StepContext(cache, backend, backend.build_metadata(batch, block_size))
        outs.append(backend.forward(0, q, k, v, ctx, AttentionCall(scaling=head_dim**-0.5)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = (outs[0].float() - outs[1].float()).abs().max().item()
    if not err <= tol:
        return f"max abs difference {err:.3g} from the torch backend (tolerance {tol})"
    return None
