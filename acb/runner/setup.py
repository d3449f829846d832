"""What the runner needs settled before its first step: whether acb can run the model, the
engine's resolved configuration and memory sizing, the device, and acb's attention swapped in
(counted per model). Apart from stepping (:mod:`acb.runner.model_runner`): everything here runs
once, at start.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from acb.config import ContinuousBatchingConfig, ResolvedConfig
from acb.errors import UnsupportedModelError
from acb.runner.attention import ATTN_IMPL_NAME, set_own_implementation
from acb.runner.kv_cache import (
    INDEX_KEYS,
    KV,
    LATENT,
    NO_KV_MAX_LEN,
    UNPAGED,
    KVSpec,
    available_host_memory,
    size_kv_cache,
)
from acb.runner.model_support import decoder_of
from acb.runner.tp_sync import agree_min, tp_group, tp_size_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
DEFAULT_BLOCK_SIZE = 32


def check_decoder(model: PreTrainedModel) -> None:
    """Refuse, with the reason, what is not a decoder-only causal LM (on either runner path)."""
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; acb runs decoder-only causal LMs")
    if not hasattr(model, "get_decoder") and not hasattr(model, "model"):
        raise UnsupportedModelError(f"{name} is not a transformers causal LM")


def check_model(model: PreTrainedModel) -> None:
    """Refuse, with the reason, models acb cannot page (they run on the model's own cache
    instead, :mod:`acb.runner.own_cache_runner`, unless the paged path was asked for)."""
    cfg = model.config
    name = type(model).__name__
    check_decoder(model)
    from acb.runner.model_support import refusal

    why = refusal(model)
    if why is not None:
        raise UnsupportedModelError(why)
    from acb.runner.indexed import indexer_modules
    from acb.runner.linear_state import linear_layers
    from acb.runner.unpaged_layers import find_unpaged_layers

    # attention layers run on the model's own cache, per request (DeepSeek V4's compressed attention)
    own = {m.layer_idx for m in find_unpaged_layers(model)}
    states = linear_layers(model)
    hybrid = bool(states)  # linear-attention layers acb drives with per-request states
    idx = [m.layer_idx for m in states]
    if len(set(idx)) != len(idx):  # (Inkling's several short convolutions per layer, told apart by state_idx)
        raise UnsupportedModelError(
            f"{name} keeps several per-request states in one layer (several state modules with the same "
            "layer_idx); acb keeps one per layer"
        )
    # indexed sparse attention (DSA): its indexers' keys paged, their selection applied (acb.runner.indexed)
    indexed = bool(indexer_modules(model))
    if not getattr(model, "_supports_attention_backend", False) and not hybrid:
        raise UnsupportedModelError(
            f"{name} does not route its attention through transformers' AttentionInterface "
            "(_supports_attention_backend is False), so acb cannot page its KV cache"
        )
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        # a hybrid's layers without attention (state layers, MLP or MoE blocks) may be of any type;
        # a layer with attention must be of a kind acb's attention knows ("hybrid": Falcon-H1's
        # attention beside a state layer, full attention)
        attention = _attention_modules(model) if hybrid else {}
        known = (
            SUPPORTED_LAYER_TYPES | ({"hybrid"} if hybrid else set()) | ({"indexed_attention"} if indexed else set())
        )
        other = sorted(
            {t for i, t in enumerate(layer_types) if t not in known and (not hybrid or i in attention) and i not in own}
            - ({"linear_attention"} if hybrid else set())
        )
        if other:
            raise UnsupportedModelError(
                f"{name} has layers of type {other}; acb supports only {sorted(SUPPORTED_LAYER_TYPES)}"
            )
    if getattr(text, "attention_chunk_size", None) and "chunked_attention" not in (layer_types or ()):
        # acb's attention applies the chunk to the layers named "chunked_attention" (Llama 4)
        raise UnsupportedModelError(
            f"{name} sets attention_chunk_size but names no 'chunked_attention' layer in layer_types, so acb "
            "cannot tell which layers attend in chunks (chunked attention is supported through layer_types)"
        )
    if getattr(text, "num_kv_shared_layers", 0):
        kv_layer_map(model)  # raises when the sharing is not the form acb knows
    bidirectional = getattr(text, "use_bidirectional_attention", False)
    # "vision": bidirectional within an image's tokens only (Gemma 4 unified); a prompt of text
    # alone, which is what acb runs, is causal throughout
    if bidirectional and bidirectional != "vision":
        raise UnsupportedModelError(f"{name} uses bidirectional attention; acb runs causal attention only")
    held = _module_state(model)
    if held:
        # one flattened forward runs every request of a step: module attributes cannot be per request
        raise UnsupportedModelError(
            f"{name} keeps per-request state in module attributes outside its cache object ({held}); "
            "acb's paged forward runs a step's requests together"
        )


def _module_state(model: PreTrainedModel) -> str | None:
    """The module attributes a short forward of the model's language model with its own cache sets
    (the model's values are put back after), by name; None when there are none, or when the try
    cannot tell (a forward that fails here, or a model split over ranks). The head is left out: it
    keeps no state, and costs a vocabulary's worth of work."""
    from acb.runner.module_state import ModuleState, describe

    if tp_size_of(model) > 1:
        return None
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        return None
    ids = torch.arange(4, device=model_device(model))[None] % vocab
    try:
        with torch.no_grad():
            decoder = decoder_of(model)
            found = ModuleState.of(model, lambda: decoder(input_ids=ids, use_cache=True))
    except Exception:  # noqa: BLE001 - a model whose bare forward needs more: the other checks decide
        return None
    return None if found is None else describe(found.slots, model)


def _attention_modules(model: PreTrainedModel) -> dict[int, torch.nn.Module]:
    """The language model's attention modules by layer index (modules with a ``layer_idx`` and q/o
    projections). Only the decoder's: a vision or audio tower's layers are numbered from 0 too
    (Gemma 4's are found first), and their shapes are not the KV cache's."""
    out: dict[int, torch.nn.Module] = {}
    for m in decoder_of(model).modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and hasattr(m, "q_proj") and hasattr(m, "o_proj"):
            out.setdefault(idx, m)
    return out


def hybrid_attention_layers(model: PreTrainedModel) -> list[int]:
    """A hybrid model's layers with attention: those with an attention module of their own, and
    those whose type says attention (a shared attention block called at several layers, Zamba2's,
    is one module for all of them). A state layer with q/o projections of its own (Kimi's delta
    attention) is no attention module."""
    from acb.runner.linear_state import linear_layers

    text = model.config.get_text_config()
    types = list(getattr(text, "layer_types", None) or ())
    stateless = {"linear_attention", "mamba", "mlp", "moe", "conv"}
    state = {id(m) for m in linear_layers(model)}
    # (a shared block's own layer_idx, -1 for Zamba2's, is no layer: it pages by the calling layer's)
    modules = {
        i for i, m in _attention_modules(model).items() if id(m) not in state and 0 <= i < text.num_hidden_layers
    }
    return sorted(modules | {i for i, t in enumerate(types) if t not in stateless})


def kv_layer_map(model: PreTrainedModel) -> tuple[int, ...] | None:
    """Which cache layer each model layer reads and writes; None when every layer has its own.

    KV sharing across layers (Gemma 3n's ``num_kv_shared_layers``): the last layers reuse the K/V
    of the last earlier layer of their type (``config.kv_sharing_modes``: "store" for that
    producer, "reuse" for the consumers); a consumer gets its producer's cache layer and no cache
    of its own. Raises :class:`UnsupportedModelError` for a form of sharing acb does not know.
    """
    from acb.runner.linear_state import linear_layers

    text = model.config.get_text_config()
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    types = list(getattr(text, "layer_types", None) or ())
    if not shared and linear_layers(model):
        # a hybrid model: only its attention layers have a KV cache (the state layers keep a
        # per-request state instead: acb.runner.linear_state, and MLP-only layers keep nothing);
        # the others never read the slot mapped here
        attention = hybrid_attention_layers(model)
        layers = text.num_hidden_layers
        if not attention or len(attention) == layers:
            return None if attention else tuple([0] * layers)
        index = {layer: n for n, layer in enumerate(attention)}
        return tuple(index.get(i, 0) for i in range(layers))
    if not shared:
        return None
    name = type(model).__name__
    layers = text.num_hidden_layers
    try:
        modes = list(text.kv_sharing_modes)
    except (AttributeError, ValueError) as exc:
        raise UnsupportedModelError(
            f"{name} shares KV caches across layers (num_kv_shared_layers={shared}) in a way acb does not know "
            f"({type(exc).__name__}: {exc}); acb follows Gemma 3n's config.kv_sharing_modes"
        ) from None
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * layers)
    mods = _attention_modules(model)
    producer: dict[str, int] = {}  # layer type -> the cache layer of its latest non-shared layer
    out: list[int] = []
    n = 0
    for i in range(layers):
        m = mods.get(i)
        reuse = modes[i] == "reuse"
        if m is None or bool(getattr(m, "is_kv_shared_layer", False)) != reuse:
            raise UnsupportedModelError(
                f"{name}: layer {i}'s attention module does not say whether it reuses another layer's K/V "
                "as its config's kv_sharing_modes does; acb cannot map its KV cache"
            )
        if reuse:
            if types[i] not in producer:
                raise UnsupportedModelError(f"{name}: layer {i} reuses K/V of a {types[i]} layer, but none precedes it")
            out.append(producer[types[i]])
        else:
            producer[types[i]] = n
            out.append(n)
            n += 1
    return tuple(out)


def kv_spec_of(model: PreTrainedModel, dtype: torch.dtype, latent: bool = False) -> KVSpec:
    """The KV cache's page shapes: one for every layer from the config, or one per cache layer
    when the attention modules differ in shape (Gemma 4's full layers are wider than its sliding
    ones; MiMo V2 Flash's sliding layers have more KV heads), then a key-only layer per indexer
    of an indexed-attention model (DSA: ``(1, index key width)``). With ``latent``, an MLA
    layer's cache layer holds its latent, key-only ``(1, kv_lora_rank + qk_rope_head_dim)``
    (:mod:`acb.runner.latent`), instead of its expanded heads."""
    from acb.runner.indexed import index_key_dim, indexer_modules

    spec = _attention_spec(model, dtype)
    if latent:
        spec = _latent_spec(model, spec)
    indexers = indexer_modules(model)
    if not indexers:
        return spec
    layers = [(spec.group_of(c).kind, *spec.shape_of(c)) for c in range(spec.num_layers)]
    owners = {len(layers) + n: m.layer_idx for n, m in enumerate(indexers)}
    layers += [(INDEX_KEYS, 1, index_key_dim(indexers))] * len(indexers)
    return KVSpec.from_layers(dtype, layers, spec.layer_map, owners, spec.unpaged)


def _latent_spec(model: PreTrainedModel, spec: KVSpec) -> KVSpec:
    """``spec`` with the cache layers of the model's MLA modules holding their latent."""
    from acb.runner.latent import latent_modules, latent_width

    mods = latent_modules(model)
    if not mods or spec.num_layers == 0:
        return spec
    layers = [(spec.group_of(c).kind, *spec.shape_of(c)) for c in range(spec.num_layers)]
    for idx, m in mods.items():
        layers[idx if spec.layer_map is None else spec.layer_map[idx]] = (LATENT, 1, latent_width(m))
    return KVSpec.from_layers(spec.dtype, layers, spec.layer_map, unpaged=spec.unpaged)


def latent_backend(backend: str) -> bool:
    """Whether attention backend ``backend`` attends over an MLA latent (the torch backend, the CPU
    backend, which hands those layers to it, and the Triton backend's latent kernel)."""
    return backend in ("torch", "cpu", "triton")


def _attention_spec(model: PreTrainedModel, dtype: torch.dtype) -> KVSpec:
    text = model.config.get_text_config()
    from acb.runner.unpaged_layers import find_unpaged_layers, unpaged_bytes_per_token

    own = find_unpaged_layers(model)
    if own:  # layers on the model's own cache (acb.runner.unpaged_layers) use no pages: the blocks only measure lengths
        if len(own) != text.num_hidden_layers:
            raise UnsupportedModelError(
                f"{type(model).__name__} has attention layers acb runs on the model's own cache beside layers it "
                "pages; acb runs a model with one kind or the other"
            )
        own_bytes = unpaged_bytes_per_token(model, model_max_len(model))
        return KVSpec(dtype, layer_map=(0,) * text.num_hidden_layers, unpaged=((UNPAGED, own_bytes),))
    layer_map = kv_layer_map(model)  # KV-shared layers read their producer's cache layer
    if layer_map is not None and not _attention_modules(model) and getattr(text, "num_attention_heads", None) is None:
        # state layers only (Mamba, Mamba2, Falcon-Mamba): no KV cache at all; the blocks are
        # still the scheduler's measure of each request's length
        return KVSpec(dtype, layer_map=layer_map)
    num_layers = text.num_hidden_layers if layer_map is None else max(layer_map) + 1
    shapes = _module_shapes(model, layer_map, num_layers)
    if shapes and (len(set(shapes)) > 1 or getattr(text, "is_heterogeneous", False)):
        # layers of different shapes, or per-layer fields (all layers alike)
        return KVSpec.from_layers(dtype, [(KV, h, d) for h, d in shapes], layer_map)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    nope, rope = getattr(text, "qk_nope_head_dim", None), getattr(text, "qk_rope_head_dim", None)
    if nope and rope:  # multi-head latent attention: keys are nope + rope wide, values v_head_dim
        # (the cache holds both at the wider one: acb's attention pads the narrower with zeros)
        head_dim = max(nope + rope, getattr(text, "v_head_dim", None) or nope + rope)
    # tensor parallel (from_pretrained(tp_plan=...)): the config holds the global head counts, but
    # each rank's k_proj is column-sharded, so its attention sees (and its cache holds) a slice
    kv_heads = local_kv_heads(model, kv_heads)
    return KVSpec.uniform(num_layers, kv_heads, head_dim, dtype, layer_map)


def _module_shapes(
    model: PreTrainedModel, layer_map: tuple[int, ...] | None, num_layers: int
) -> list[tuple[int, int]] | None:
    """``(kv_heads, head_dim)`` of each cache layer, read off the attention modules (their
    ``head_dim``, ``v_head_dim`` where values are narrower or wider, and ``num_key_value_groups``);
    None when a module does not say (the config's one shape is used then)."""
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    if not isinstance(heads, int):
        return None
    mods = _attention_modules(model)
    out: list[tuple[int, int] | None] = [None] * num_layers
    for i in range(text.num_hidden_layers):
        m = mods.get(i)
        if m is None:  # a layer without attention (a hybrid's linear layers)
            continue
        if getattr(m, "is_kv_shared_layer", False):  # reads its producer's cache layer
            continue
        groups, width = getattr(m, "num_key_value_groups", None), getattr(m, "head_dim", None)
        if not isinstance(groups, int) or not isinstance(width, int) or groups <= 0 or heads % groups:
            return None
        v_width = getattr(m, "v_head_dim", None)
        if isinstance(v_width, int):  # keys and values of different widths: cached at the wider
            width = max(width, v_width)
        out[i if layer_map is None else layer_map[i]] = (local_kv_heads(model, heads // groups), width)
    if any(shape is None for shape in out):
        return None
    return [shape for shape in out if shape is not None]


def local_kv_heads(model: PreTrainedModel, kv_heads: int) -> int:
    """The KV heads this rank's attention layers hold."""
    tp = tp_size_of(model)
    if tp == 1:
        return kv_heads
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    local = get_kv_heads_per_rank(getattr(model, "tp_plan", None) or {}, kv_heads, tp)
    if not isinstance(local, int):
        raise UnsupportedModelError(f"{kv_heads} KV heads cannot be split evenly over {tp} tensor-parallel ranks")
    return int(local)


UNBOUNDED_LEN = 1 << 20  # a model's max positions when its config names none


def model_max_len(model: PreTrainedModel) -> int:
    """The most positions the model takes: its config's ``max_position_embeddings`` (or the older
    names of it: MPT's ``max_seq_len``, ...), unbounded (2^20) when it names none."""
    text = model.config.get_text_config()
    names = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length", "max_sequence_length")
    for name in (*names, "max_target_positions"):  # (Whisper's decoder: max_target_positions)
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return UNBOUNDED_LEN


def default_backend(device: torch.device, dtype: torch.dtype, block_size: int | None) -> str:
    """flash-attn on CUDA when it is installed and fits (fp16/bf16, blocks of 256k tokens), else
    Triton on CUDA when it imports; on CPU, acb's own kernel for float32 where it builds; else the
    torch reference."""
    if device.type == "cuda":
        import importlib.util

        from acb.runner.attention import flash_attn_backend

        if flash_attn_backend.unavailable_reason(device, dtype, block_size) is None:
            return "flash_attn"
        if importlib.util.find_spec("triton") is not None:
            return "triton"
        logger.warning("triton is not installed; using the torch attention backend on CUDA")
    elif device.type == "cpu" and dtype == torch.float32:
        from acb.runner.attention import cpu_backend

        if cpu_backend.unavailable_reason() is None:
            return "cpu"
    return "torch"


def block_size_for(backend: str, block_size: int | None) -> int:
    from acb.runner.attention.flash_attn_backend import PAGE_MULTIPLE

    return block_size or (PAGE_MULTIPLE if backend == "flash_attn" else DEFAULT_BLOCK_SIZE)


def staging_bytes(cfg: ResolvedConfig) -> int:
    """Initial size of a staging set: a full step's token arrays and per-row arrays, with room
    for sampling parameters and block-table updates (it grows if a step ever needs more)."""
    tokens, rows = cfg.max_batch_tokens, cfg.max_requests_per_batch
    return 8 * (4 * tokens + 8 * rows + 16) + 4 * 16 * rows + 8 * 2 * 4 * rows


def own_path_spec(model: PreTrainedModel, dtype: torch.dtype) -> KVSpec:
    """The model on its own cache objects, whole (:mod:`acb.runner.own_cache_runner`): no pages; the
    blocks measure lengths, sized by what a token costs the model's own cache (measured)."""
    from acb.runner.unpaged_layers import unpaged_bytes_per_token

    return KVSpec(dtype, unpaged=((UNPAGED, unpaged_bytes_per_token(model, model_max_len(model))),))


def resolve_config(
    model: PreTrainedModel, config: ContinuousBatchingConfig, own_path: bool = False
) -> tuple[ResolvedConfig, KVSpec]:
    """Concrete sizes for this model on its device (the only place memory is measured).

    With ``num_blocks`` unset, the KV cache gets ``max_memory_percent`` of the device's free
    memory (CUDA; measured now, after the model is loaded) or a conservative share of the
    available RAM (CPU), minus the step's transient memory (:func:`acb.runner.kv_cache.size_kv_cache`). If
    that cannot hold one request of ``max_model_len`` tokens, start fails with the figures.
    With ``num_blocks`` set, ``max_model_len`` is lowered to what the cache holds.
    """
    device = model_device(model)
    dtype = next(model.parameters()).dtype
    backend = "torch" if own_path else config.attn_backend or default_backend(device, dtype, config.page_size)
    if config.batch_invariant:  # the fixed-order kernels, or a refusal that says why (acb.runner.batch_invariant)
        from acb.runner.batch_invariant import attention_backend
        from acb.runner.batch_invariant_scope import refusal

        problem = refusal(model, config, own_path)
        if problem is not None:
            raise ValueError(f"batch_invariant=True cannot run {type(model).__name__}: {problem}")
        backend = attention_backend(device)
    from acb.runner.indexed import indexer_modules
    from acb.runner.latent import latent_modules

    # the batch-invariant mode pages MLA's expanded heads (the latent's absorbed products are
    # batched over the step's tokens; the expanded heads go through the fixed-order kernel)
    want = False if config.batch_invariant else config.mla_latent_cache
    if want is None:  # the latent where the torch backend runs the model anyway (CPU; DSA models); on
        # CUDA otherwise the expanded heads, whose decode steps run in CUDA graphs (a latent model's do not)
        want = backend in ("torch", "cpu") or (config.attn_backend is None and bool(indexer_modules(model)))
    latent = want and not own_path and bool(latent_modules(model))
    if latent and not latent_backend(backend) and config.attn_backend is None:
        # the MLA latent is attended by the Triton and torch backends (flash-attn has no kernel for it);
        # a backend asked for by name keeps the expanded heads instead
        import importlib.util

        backend = "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"
        logger.info("%s's MLA latent is paged: the %s attention backend runs it", type(model).__name__, backend)
    latent = latent and latent_backend(backend)

    if not own_path and indexer_modules(model) and backend not in ("torch", "cpu"):
        # indexed attention's selection is applied by the torch reference backend only (the CPU
        # backend hands its indexed layers to it)
        if config.attn_backend is not None:
            raise ValueError(
                f"attn_backend={config.attn_backend!r} cannot run {type(model).__name__}'s indexed sparse attention "
                "(DSA); use attn_backend='torch'"
            )
        logger.info("%s has indexed sparse attention (DSA): the torch attention backend runs it", type(model).__name__)
        backend = "torch"
    spec = own_path_spec(model, dtype) if own_path else kv_spec_of(model, dtype, latent=latent)
    from acb.runner.media import bidirectional_media, takes_media

    if not own_path and takes_media(model) and bidirectional_media(model) and backend not in ("torch", "cpu"):
        # image tokens that attend to their whole image: a mask the torch reference backend applies
        # (the CPU backend's prefill chunks are the torch backend's)
        if config.attn_backend is not None:
            raise ValueError(
                f"attn_backend={config.attn_backend!r} cannot run {type(model).__name__}'s image attention (an "
                "image's tokens see each other both ways); use attn_backend='torch'"
            )
        logger.info("%s's image tokens attend both ways: the torch attention backend runs it", type(model).__name__)
        backend = "torch"
    if config.attn_backend == "cpu":
        from acb.runner.attention import cpu_backend

        problem = cpu_backend.unavailable_reason()
        if problem is not None:
            raise ValueError(f"attn_backend='cpu' cannot run here: {problem}; use attn_backend='torch'")
        if device.type != "cpu":
            raise ValueError(f"attn_backend='cpu' runs on CPU; the model is on {device}")
    if config.attn_backend == "flash_attn":  # an automatic pick has passed this check already
        from acb.runner.attention import flash_attn_backend

        problem = flash_attn_backend.unavailable_reason(device, dtype, config.page_size)
        if problem is not None:
            raise ValueError(f"attn_backend='flash_attn' cannot run here: {problem}")
    block_size = block_size_for(backend, config.page_size)
    max_len = model_max_len(model)
    if config.max_model_len is not None:
        max_len = min(max_len, config.max_model_len)
    cuda = device.type == "cuda"
    max_reqs = config.max_requests_per_batch or (256 if cuda else 128)
    max_batch_tokens = config.max_batch_tokens or (8192 if cuda else 2048)
    per_block = spec.bytes_per_block(block_size)
    if per_block == 0:  # no KV cache (state layers only): the blocks only measure lengths
        max_len = min(max_len, NO_KV_MAX_LEN)
    elif max_len == UNBOUNDED_LEN and config.num_blocks is None:
        # a model that names no maximum position (ALiBi: BLOOM) and no max_model_len asked for:
        # as long as one request the memory budget holds can be (at most NO_KV_MAX_LEN tokens)
        from acb.runner.kv_cache import kv_memory_budget, step_workspace_bytes

        room = kv_memory_budget(device, config.max_memory_percent) - step_workspace_bytes(
            model, max_batch_tokens, max_reqs, dtype
        )
        max_len = max(block_size, min(NO_KV_MAX_LEN, (room // per_block - 1) * block_size))
    # a vision-language model's image embeddings: set aside before the KV cache is sized from
    # the memory budget (a sixteenth of it by default, at least 64 MiB)
    images = not own_path and takes_media(model)
    image_bytes = config.image_cache_bytes
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    else:
        if images and image_bytes is None:
            from acb.runner.kv_cache import kv_memory_budget

            image_bytes = max(64 << 20, kv_memory_budget(device, config.max_memory_percent) // 16)
        num_blocks = size_kv_cache(
            model,
            spec,
            device,
            config.max_memory_percent,
            block_size=block_size,
            max_len=max_len,
            max_reqs=max_reqs,
            max_batch_tokens=max_batch_tokens,
            reserved=image_bytes or 0 if images else 0,
        )
    # as transformers: the offload space is capped at the threshold's share of the RAM available
    # now (0 turns offload off), and None sizes it to that cap
    swap_cap = int(config.cpu_offload_space_safety_threshold * available_host_memory())
    space = config.cpu_offload_space
    swap_bytes = swap_cap if space is None else min(int(space * 2**30), swap_cap)
    group = tp_group(model)
    if group is not None:  # tensor parallel: every rank runs the same schedule, so the smallest sizes
        num_blocks, swap_bytes = agree_min(group, [num_blocks, swap_bytes])
    # a single request may hold at most what the cache holds and what the model can position
    max_model_len = min(max_len, (num_blocks - 1) * block_size)
    resolved = ResolvedConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_reqs,
        max_model_len=max_model_len,
        scheduler_type=config.scheduler_type,
        safety_margin=0.01 if config.safety_margin is None else config.safety_margin,
        max_queue_size=config.max_queue_size,
        return_logprobs=config.return_logprobs,
        seed=config.seed,
        attn_backend=backend,
        device=str(device),
        kv_cache_bytes=num_blocks * per_block,
        num_swap_blocks=swap_bytes // per_block if per_block else 0,
        offload_bytes=swap_bytes,
        prefix_caching=config.allow_block_sharing,
        async_batching=config.use_async_batching if config.use_async_batching is not None else cuda,
        image_cache_bytes=image_bytes or max(64 << 20, num_blocks * per_block // 8),
        batch_invariant=config.batch_invariant,
    )
    return resolved, spec


def decode_graph_flag(use_cuda_graph: bool | tuple[bool, bool] | None) -> bool | None:
    """transformers' ``use_cuda_graph`` (a bool for both paths, or (varlen, decode)) -> the decode flag."""
    if isinstance(use_cuda_graph, tuple):
        if use_cuda_graph[0]:
            logger.warning(
                "CUDA graphs for mixed (varlen) steps are not used: acb runs them eagerly "
                "and replays graphs for decode-only steps"
            )
        return use_cuda_graph[1]
    return use_cuda_graph


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def device_scope(device: torch.device, stream: torch.cuda.Stream | None = None) -> contextlib.AbstractContextManager:
    """On CUDA: ``device`` (and ``stream``) made current for the block. Triton launches, new
    streams, graph capture and pools all follow the current device, and the engine thread's
    current device is 0 whatever the model's; a caller's stream context must not leak in either."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    if stream is not None:
        stack.enter_context(torch.cuda.stream(stream))
    return stack


def _set_attn(model: PreTrainedModel, impl: str) -> None:
    try:
        model.set_attn_implementation(impl)
    except (AttributeError, ValueError, KeyError, ImportError):
        model.config._attn_implementation = impl


class _AttentionSwap:
    """acb's attention on a model for as long as any runner uses it, then the model's own back.

    Counted per model object, so that two engines on one model both run acb's attention and
    the model gets its own implementation back when the last of them stops, in any order.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: dict[int, tuple[int, str | None]] = {}  # id(model) -> (runners, its own implementation)

    def acquire(self, model: PreTrainedModel) -> None:
        with self._lock:
            users, own = self._users.get(id(model), (0, None))
            if users == 0:
                own = model.config._attn_implementation
                set_own_implementation(_configs(model), own)
                _set_attn(model, ATTN_IMPL_NAME)
            self._users[id(model)] = (users + 1, own)

    def release(self, model: PreTrainedModel) -> None:
        with self._lock:
            users, own = self._users.pop(id(model))
            if users > 1:
                self._users[id(model)] = (users - 1, own)
            elif own is not None:
                _set_attn(model, own)
                set_own_implementation(_configs(model), None)


def _configs(model: PreTrainedModel) -> list[Any]:
    """The config objects the model's modules may hold: the model's, its text config, and its other
    sub-configs (a vision tower's, which runs outside engine steps on its own attention)."""
    out = [model.config]
    text = model.config.get_text_config()
    if text is not model.config:
        out.append(text)
    for name in getattr(model.config, "sub_configs", None) or {}:
        sub = getattr(model.config, name, None)
        if sub is not None and all(sub is not c for c in out):
            out.append(sub)
    return out


ATTN_SWAP = _AttentionSwap()
