"""The tiny random config of any transformers causal-LM model type, and a benchmark-sized one.

One builder for the catalogue sweep (``benchmarks/model_sweep.py``: every model type against
``model.generate``) and for ``acb bench --arch MODEL_TYPE`` (a user reproduces the figures on the
family they care about, from an install, where ``benchmarks/`` is not importable).

:func:`tiny_config` shrinks the config class's defaults (and its sub-configs): hidden 64, one
layer of each per-layer pattern (at least two), 4 heads, 2 KV heads, vocabulary 256, 4 experts
with top-2...; the families in :data:`HAND_CONFIGS` get a hand-written tiny config laid over the
shrunk defaults, so that every layer kind their real checkpoints use is kept (a per-layer list
stays a list, a hybrid keeps each kind of layer). :func:`family_config` scales it to a benchmark
size where the config allows (wider, more layers by repeating the kept pattern, the size's
vocabulary and positions), proving each scaled config by building the model and running a
forward, else the tiny config as is.
"""

from __future__ import annotations

import copy
import difflib
import functools
from typing import Any

# --- the tiny config ---------------------------------------------------------------------------

FIRST_PROMPT_ID = 16  # ids below are reserved for the special tokens tiny_config places there

# Size fields, by exact key, shrunk to at most this value (``min``, so that a default already
# smaller, e.g. one KV head for multi-query attention, or top-1 routing, is kept).
EXACT_TARGETS: dict[str, int] = {
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "n_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "n_kv_heads": 2,
    "multi_query_group_num": 2,
    "num_global_key_value_heads": 2,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "n_ctx": 256,
    "max_seq_len": 256,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "top_k": 2,
    "num_selected_experts": 2,
    "experts_per_token": 2,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "sliding_window": 16,
    "attention_chunk_size": 16,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "state_size": 16,
    "ssm_state_size": 16,
    "mamba_d_state": 16,
    "d_state": 16,
    "time_step_rank": 8,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "mamba_n_heads": 8,
    "hidden_size_per_layer_input": 16,
    "rotary_dim": 8,
    "d_head": 16,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
}
# ... and by suffix (``linear_key_head_dim``, ``moe_intermediate_size``, ``vocab_size_per_layer_input``)
SUFFIX_TARGETS: tuple[tuple[str, int], ...] = (
    ("head_dim", 16),
    ("intermediate_size", 128),
    ("vocab_size", 256),
    ("vocab_size_per_layer_input", 256),
)
# fields some config classes leave None by default although their model needs a value (real
# checkpoints set them): given their target then
FILL_IF_NONE = ("head_dim", "num_key_value_heads", "n_routed_experts", "n_shared_experts", "num_experts_per_tok")
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# the other layer counts (encoder-decoder configs' decoder and encoder stacks), plainly set to 2
OTHER_LAYER_COUNTS = ("encoder_layers", "decoder_layers", "num_decoder_layers", "n_decoder_layers")
MAX_KEPT_LAYERS = 6  # the distinct per-layer patterns kept, at most
# special tokens get fixed low ids (prompts use ids from FIRST_PROMPT_ID on, so a prompt never
# holds an image/audio placeholder token by chance)
FIXED_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}


def _target(key: str) -> int | None:
    if key in EXACT_TARGETS:
        return EXACT_TARGETS[key]
    for suffix, value in SUFFIX_TARGETS:
        if key.endswith(suffix):
            return value
    return None


def _is_config_dict(value: Any) -> bool:
    return isinstance(value, dict) and "model_type" in value


def _layer_count_key(d: dict[str, Any], aliases: dict[str, str]) -> str | None:
    for key in LAYER_COUNT_KEYS:
        real = aliases.get(key, key)
        if isinstance(d.get(real), int) and not isinstance(d.get(real), bool):
            return real
    return None


def _kept_layers(d: dict[str, Any], n: int) -> list[int]:
    """The layers to keep out of ``n``: the first layer of each distinct per-layer pattern (layer
    type first, then the other per-layer lists and layer-index lists), at least two."""
    per_layer = [
        k
        for k, v in d.items()
        if isinstance(v, list)
        and len(v) == n
        and n > 2
        and all(isinstance(x, (str, int, float, bool)) or x is None for x in v)
    ]
    index_lists = [
        k
        for k, v in d.items()
        if isinstance(v, list)
        and ("layer" in k or "idx" in k)
        and v
        and len(v) < n
        and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n for x in v)
    ]
    keep: list[int] = []
    # the layer types matter most (acb's checks and attention depend on them): one of each, always
    if isinstance(d.get("layer_types"), list) and len(d["layer_types"]) == n:
        seen: set[Any] = set()
        for i, t in enumerate(d["layer_types"]):
            if t not in seen:
                seen.add(t)
                keep.append(i)
    signatures: set[tuple[Any, ...]] = set()
    for i in range(n):
        sig = tuple(d[k][i] for k in per_layer) + tuple(i in d[k] for k in index_lists)
        if i in keep:
            signatures.add(sig)
        elif sig not in signatures and len(keep) < MAX_KEPT_LAYERS:
            signatures.add(sig)
            keep.append(i)
    for i in range(n):
        if len(keep) >= min(2, n):
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def _shrink_rope(rope: Any, head_dim: int) -> Any:
    """Multimodal RoPE sections must add up to half the (new) head dim."""
    if not isinstance(rope, dict) or not isinstance(rope.get("mrope_section"), list):
        return rope
    rope = dict(rope)
    old = rope["mrope_section"]
    total, half = sum(old), head_dim // 2
    new = [max(1, x * half // total) for x in old]
    new[0] += half - sum(new)
    rope["mrope_section"] = new
    return rope


def _fit_ssm_heads(d: dict[str, Any]) -> None:
    """Mamba-2 mixers need heads x head dim = expand x hidden size: the head dim follows."""
    hidden = d.get("hidden_size")
    for heads_key, dim_key, expand_key in (
        ("num_heads", "head_dim", "expand"),
        ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
        ("mamba_n_heads", "mamba_head_dim", "mamba_expand"),
    ):
        heads, expand = d.get(heads_key), d.get(expand_key)
        if (
            isinstance(hidden, int)
            and isinstance(heads, int)
            and isinstance(expand, int)
            and dim_key in d
            and ("state_size" in d or "mamba_d_state" in d)
        ):
            d[dim_key] = expand * hidden // heads


def shrink_config_dict(d: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """A copy of one config's ``to_dict()`` with its size fields shrunk (sub-configs included)."""
    d = copy.deepcopy(d)
    for key, value in list(d.items()):
        if _is_config_dict(value):
            d[key] = shrink_config_dict(value, {})
    # the layer count first: per-layer lists are cut to the kept layers before their values shrink
    layer_key = _layer_count_key(d, aliases)
    if layer_key is not None:
        n = d[layer_key]
        keep = _kept_layers(d, n)
        shared = d.get("num_kv_shared_layers")
        if isinstance(shared, int) and shared > 0:
            # KV sharing (Gemma 3n): the last layers reuse the KV of earlier ones of the same type,
            # so keep one of each type among the computing layers and again among the sharing ones
            keep = keep + [n - len(keep) + i for i in range(len(keep))]
            keep = sorted(set(keep))
            d["num_kv_shared_layers"] = len(keep) // 2
        for key, value in list(d.items()):
            if isinstance(value, list) and len(value) == n and n > 2 and key != layer_key:
                d[key] = [value[i] for i in keep]
            elif (
                isinstance(value, list)
                and ("layer" in key or "idx" in key)
                and value
                and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n for x in value)
                and len(value) < n
            ):
                d[key] = [keep.index(x) for x in value if x in keep]
        if isinstance(d.get("per_layer_config"), dict):  # per-layer overrides keyed by layer index
            d["per_layer_config"] = {
                str(keep.index(int(i))): v for i, v in d["per_layer_config"].items() if int(i) in keep
            }
        d[layer_key] = len(keep)
        for key in ("first_k_dense_replace", "num_dense_layers"):  # one dense layer, then MoE ones
            if isinstance(d.get(key), int) and d[key] > 0:
                d[key] = 1
    for key in OTHER_LAYER_COUNTS:
        if isinstance(d.get(key), int) and not isinstance(d.get(key), bool):
            d[key] = min(d[key], 2)
    for key in FILL_IF_NONE:
        if key in d and d[key] is None:
            d[key] = _target(key)
    for key, value in list(d.items()):
        target = _target(key)
        if target is None:
            target = next((_target(alias) for alias, real in aliases.items() if real == key and _target(alias)), None)
        if target is None:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            d[key] = min(value, target)
        elif isinstance(value, list) and value and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            d[key] = [min(x, target) for x in value]
    if "kv_lora_rank" in d:
        # MLA: keys and values are expanded per query head from the latent, so there are as many
        # KV heads as heads, and the RoPE part is what the config calls the head dim
        for kv_key in ("num_key_value_heads", "num_kv_heads"):
            if kv_key in d and isinstance(d.get("num_attention_heads"), int):
                d[kv_key] = d["num_attention_heads"]
        if "qk_rope_head_dim" in d and "head_dim" in d:
            d["head_dim"] = d["qk_rope_head_dim"]
    if isinstance(d.get("qk_nope_head_dim"), int) and isinstance(d.get("qk_rope_head_dim"), int) and "qk_head_dim" in d:
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    _fit_ssm_heads(d)
    given = d.get("head_dim")
    head_dim = given if isinstance(given, int) else 16
    for key in ("rope_parameters", "rope_scaling"):
        if key in d:
            d[key] = _shrink_rope(d[key], head_dim)
    # special tokens inside the tiny vocabulary
    extra = iter(range(3, FIRST_PROMPT_ID))
    for key, value in list(d.items()):
        if not (key.endswith("_token_id") or key.endswith("_token_index") or key.endswith("_token_ids")):
            continue
        fixed = FIXED_TOKEN_IDS.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            d[key] = fixed if fixed is not None else next(extra, FIRST_PROMPT_ID - 1)
        elif isinstance(value, list) and value and all(isinstance(x, int) for x in value):
            d[key] = [fixed] if fixed is not None else [next(extra, FIRST_PROMPT_ID - 1) for _ in value]
    # encoder-style classes used as causal LMs (BertLMHeadModel...) attend causally only as decoders
    if "is_decoder" in d and not d.get("is_encoder_decoder"):
        d["is_decoder"] = True
    # a wider init makes logits peaked, so that greedy parity does not hinge on near-ties
    if "initializer_range" in d:
        d["initializer_range"] = 0.2
    return d


# Families the generic shrinking cannot make into a model that keeps every layer kind its real
# checkpoints use (a default config with no attention layer, per-layer fields derived from
# others): a hand-written tiny config, laid over the shrunk defaults. Each keeps its real layer
# kinds: state (Mamba) layers and attention layers, MoE where the family has it.
MAMBA2_TINY = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4)
HAND_CONFIGS: dict[str, dict[str, Any]] = {
    "jamba": dict(
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=8,
    ),
    "bamba": dict(
        num_hidden_layers=4,
        attn_layer_indices=[1, 3],
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_expand=2,
        mamba_chunk_size=16,
        **MAMBA2_TINY,
    ),
    "granitemoehybrid": dict(
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        hidden_size=64,
        intermediate_size=128,
        shared_intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_expand=2,
        mamba_chunk_size=16,
        **MAMBA2_TINY,
    ),
    "nemotron_h": dict(
        num_hidden_layers=4,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=1,
        ssm_state_size=8,
        conv_kernel=4,
        expand=1,
        chunk_size=16,
    ),
    # a shared attention block applied at its hybrid layers (hybrid_layer_ids must match layer_types)
    "zamba2": dict(
        num_hidden_layers=4,
        layer_types=["linear_attention", "hybrid", "linear_attention", "hybrid"],
        hybrid_layer_ids=[1, 3],
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_head_dim=32,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_ngroups=1,
        n_mamba_heads=4,
        num_mem_blocks=1,
        chunk_size=16,
        # the fields its config derives from the others (the shrunk defaults hold the big model's)
        mamba_headdim=32,
        attention_hidden_size=128,
        kv_channels=16,
        num_query_groups=4,
    ),
    "falcon_h1": dict(
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=16,
    ),
}
# indexed sparse attention (DSA): a top-k small enough that the prompts' later tokens attend to a
# selection (the default 2048 would select every token of a tiny prompt: dense attention), and,
# where the family has them, layers that reuse the previous indexer's selection ("shared")
_DSA_LAYERS = dict(
    num_hidden_layers=3, layer_types=["indexed_attention"] * 3, mlp_layer_types=["dense", "sparse", "sparse"]
)
# short-convolution and lightning-attention hybrids: their real checkpoints' mix of state and
# attention layers (LFM2's default config, and so the generic shrink, has attention layers only;
# LFM2-MoE's has no layer types at all); MiniMax with lightning blocks shorter than a prompt
_LFM = dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"])
HAND_CONFIGS.update(
    {
        "lfm2": dict(full_attn_idxs=[1, 3], **_LFM),  # (layer indices: as long as the attention layers)
        "lfm2_moe": dict(num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **_LFM),
        "minimax": dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            block_size=8,
        ),
        # compressed attention: pooled entries every 4 (CSA) and 8 (HCA) tokens, a sliding window
        # shorter than a prompt, the indexer picking 2 pooled entries, a sliding-only layer too
        "deepseek_v4": dict(
            num_hidden_layers=4,
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            sliding_window=8,
            index_topk=2,
            index_n_heads=8,
            o_lora_rank=16,
        ),
        "deepseek_v32": dict(index_topk=4, **_DSA_LAYERS),
        "axk2": dict(index_topk=4, **_DSA_LAYERS),
        "glm_moe_dsa": dict(index_topk=4, indexer_types=["full", "shared", "full"], **_DSA_LAYERS),
        "hy_v4": dict(index_topk=4, indexer_types=["full", "full", "shared"], **_DSA_LAYERS),
    }
)
# Families whose default config cannot build a model at all (a sub-config missing a field the
# model reads, sizes the shrink cannot keep consistent, an indexer left unset): sizes that fit,
# with the layer kinds of their real checkpoints
HAND_CONFIGS.update(
    {
        # sliding layers with RoPE, full-attention layers without (NoPE: ``None`` rope parameters)
        "cohere_compass_text": dict(
            num_hidden_layers=4,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
                "full_attention": None,
            },
        ),
        # the attention sub-config's rope_theta (read by the model, absent from the default), clipped
        # QKV, grouped KV heads (the top-level count its config derives from them: the shrunk
        # default holds the default's), top-2 of 4 experts
        "dbrx": dict(
            num_key_value_heads=2,
            attn_config=dict(kv_n_heads=2, rope_theta=500000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2),
        ),
        # the drafter: every layer reads the KV of the target model (shared), no per-layer inputs
        "gemma4_assistant": dict(
            backbone_hidden_size=64,
            num_centroids=16,
            centroid_intermediate_top_k=4,
            text_config=dict(
                num_hidden_layers=2,
                layer_types=["sliding_attention", "full_attention"],
                num_kv_shared_layers=2,
                hidden_size_per_layer_input=0,
                vocab_size_per_layer_input=0,
                enable_moe_block=False,
                use_double_wide_mlp=False,
            ),
        ),
        # a shared attention block at its hybrid layers (two, so that it is shared)
        "zamba": dict(
            num_hidden_layers=4,
            layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
            attention_hidden_size=128,
            attention_head_dim=32,
            mamba_dt_rank=4,
        ),
        # widths their configs derive from the hidden size (the shrunk defaults hold the default's)
        "rwkv": dict(attention_hidden_size=64),
        # (xLSTM's cache rounds the query-key width up to a multiple of 64 and its layers do not:
        # a hidden size of 128 keeps its real 0.5 factor and both at 64)
        "xlstm": dict(hidden_size=128, embedding_dim=128, num_blocks=2, chunk_size=8),
        # local and LSH attention layers, chunks shorter than a prompt, axial position embeddings
        # whose widths add up to the hidden size, a fixed hash seed (else LSH draws new rotations)
        "reformer": dict(
            attn_layers=["local", "lsh"],
            attention_head_size=16,
            axial_pos_shape=[16, 16],
            axial_pos_embds_dim=[16, 48],
            feed_forward_size=128,
            local_attn_chunk_length=8,
            lsh_attn_chunk_length=8,
            num_buckets=4,
            hash_seed=0,
        ),
    }
)
# Dots 3 Note: DSA layers and sliding MLA layers with their own head count, latent and head
# widths (the released checkpoint's ``swa_*`` fields; the SWA head dim is its nope + rope parts)
_DOTS3_TEXT = dict(
    num_hidden_layers=3,
    layer_types=["indexed_attention", "sliding_attention", "indexed_attention"],
    mlp_layer_types=["dense", "sparse", "sparse"],
    head_dim=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    kv_lora_rank=16,
    index_topk=4,
    index_n_heads=4,
    index_head_dim=16,
    swa_num_attention_heads=2,
    swa_num_key_value_heads=2,
    swa_q_lora_rank=32,
    swa_kv_lora_rank=32,
    swa_head_dim=32,
    swa_qk_nope_head_dim=24,
    swa_v_head_dim=16,
)
# Qwen4-Exp: linear-attention (gated delta) layers, some with per-layer n-gram embeddings (PLE),
# and QSA indexed-attention layers (the indexer selects compressed blocks within a token budget
# smaller than a prompt), hyper-connections, MoE
_QWEN4_EXP_TEXT = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    ple_layer_ids=[1],
    number_of_conv_states=3,  # derived from PLE by its config: the shrunk default holds the default's 1
    ple_embed_dim=64,
    heads_per_ngram=2,
    ngram_vocab_size_base=64,
    make_ngram_vocab_size_divisible_by=8,
    split_ngram_parts=1,
    hc_lowrank=16,
    eos_token_id=2,  # PLE needs one (the n-gram context restarts after it)
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=8,
    indexer_compress_ratio=4,
)
HAND_CONFIGS.update(
    {
        "dots3_note_text": _DOTS3_TEXT,
        # its adapters' widths: the (shrunk) encoder's in, the text model's out
        "dots3_note": dict(
            text_config=_DOTS3_TEXT,
            vision_config=dict(adapter_in_dim=64, adapter_out_dim=64),
            audio_config=dict(adapter_input_size=64, adapter_out_dim=64),
        ),
        "qwen4_exp_text": _QWEN4_EXP_TEXT,
        "qwen4_exp": dict(text_config=_QWEN4_EXP_TEXT),
    }
)


def tiny_config(model_type: str) -> Any:
    """The tiny random config of ``model_type``, from its config class's defaults (and, for the
    families in :data:`HAND_CONFIGS`, that family's hand-written sizes laid over them)."""
    from transformers import AutoConfig

    try:
        default = AutoConfig.for_model(model_type)
    except Exception:
        if model_type not in HAND_CONFIGS:
            raise
        # a default that fails its own class's checks (Gemma 4's assistant): the hand-written
        # fields make it valid
        default = AutoConfig.for_model(model_type, **HAND_CONFIGS[model_type])
    d = shrink_config_dict(default.to_dict(), dict(getattr(type(default), "attribute_map", {}) or {}))
    # sub-configs are shrunk as dicts; their classes' aliases are known only as objects
    d.pop("transformers_version", None)
    if model_type in HAND_CONFIGS:
        d = lay_over(d, HAND_CONFIGS[model_type])
    return type(default).from_dict(d)


def lay_over(d: dict[str, Any], hand: dict[str, Any]) -> dict[str, Any]:
    """``hand`` laid over the shrunk config dict ``d``; a hand-written dict for a sub-config is
    laid over that sub-config the same way (its other fields stay the shrunk defaults)."""
    d = dict(d)
    # the shrunk per-layer lists (and per-layer overrides) describe the default's layers: a
    # hand-written layer count rules
    for key, value in list(d.items()):
        if (
            any(k in hand for k in LAYER_COUNT_KEYS)
            and key not in hand
            and ((isinstance(value, list) and ("layer" in key or "block_type" in key)) or key == "per_layer_config")
        ):
            d.pop(key)
    for key, value in hand.items():
        d[key] = lay_over(d[key], value) if isinstance(value, dict) and _is_config_dict(d.get(key)) else value
    return d


# --- a benchmark-sized config of any family ---------------------------------------------------

# Widths scaled by one factor (every linear relation between them, such as Mamba-2's heads x head
# dim = expand x hidden, or an MLA head's nope + rope parts, survives): by exact key ...
WIDTH_KEYS = frozenset(
    {
        "hidden_size",
        "n_embd",
        "d_model",
        "embedding_dim",
        "attention_hidden_size",
        "kv_lora_rank",
        "q_lora_rank",
        "o_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "qk_head_dim",
        "v_head_dim",
        "mamba_d_ssm",
        "hidden_size_per_layer_input",
        "rotary_dim",
        "kv_channels",
        "d_head",
        "n_inner",
        "ffn_dim",
        "ffn_hidden_size",
        "backbone_hidden_size",
    }
)
# ... and by suffix (``linear_key_head_dim``, ``mamba_d_head``, ``moe_intermediate_size``)
WIDTH_SUFFIXES = ("head_dim", "_headdim", "_d_head", "intermediate_size")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
VOCAB_KEYS = ("vocab_size",)


def causal_lm_types() -> dict[str, str]:
    """``{model_type: causal-LM class name}`` of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {k: v if isinstance(v, str) else "/".join(v) for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}


def check_model_type(model_type: str, also: tuple[str, ...] = ()) -> None:
    """Refuse a name that is not a causal-LM model type of the installed transformers (nor one of
    ``also``), saying which names are close."""
    types = causal_lm_types()
    if model_type in types or model_type in also:
        return
    import transformers

    close = difflib.get_close_matches(model_type, list(dict.fromkeys([*also, *types])), n=4, cutoff=0.6)
    raise ValueError(
        f"unknown model type {model_type!r}: not a causal-LM model type of transformers {transformers.__version__} "
        f"(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, {len(types)} types)"
        + (f"; did you mean {', '.join(map(repr, close))}?" if close else "")
    )


def _text_dict(d: dict[str, Any]) -> dict[str, Any]:
    """The dict holding the language model's sizes: the ``text_config`` of a composite config."""
    sub = d.get("text_config")
    return sub if isinstance(sub, dict) and "model_type" in sub else d


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _scale_widths(d: dict[str, Any], factor: int) -> None:
    for key, value in list(d.items()):
        if key not in WIDTH_KEYS and not key.endswith(WIDTH_SUFFIXES):
            continue
        if _is_int(value) and value > 0:
            d[key] = value * factor
        elif isinstance(value, list) and value and all(_is_int(x) for x in value):
            d[key] = [x * factor for x in value]
    for key in ("rope_parameters", "rope_scaling"):  # multimodal RoPE sections: half the (new) head dim
        rope = d.get(key)
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
            d[key] = dict(rope, mrope_section=[x * factor for x in rope["mrope_section"]])


# per-layer lists that are a config's layer count where it has no count field (Nemotron-H)
LAYER_LISTS = ("layers_block_type", "layer_types", "block_types")


def _layer_count(d: dict[str, Any]) -> tuple[str | None, int]:
    """The field holding a config dict's layer count and the count: a count field, else the
    length of its per-layer list (``None, 0`` when it has neither)."""
    key = _layer_count_key(d, {})
    if key is not None:
        return key, d[key]
    for name in LAYER_LISTS:
        if isinstance(d.get(name), list) and d[name]:
            return None, len(d[name])
    return None, 0


def _repeat_layers(d: dict[str, Any], times: int) -> bool:
    """The kept layer pattern repeated ``times`` times (per-layer lists tiled, layer-index lists
    and per-layer overrides shifted into each repeat); False where the config's layers cannot be
    repeated so (no layer count, or layers that share another's KV)."""
    layer_key, n = _layer_count(d)
    if n == 0 or d.get("num_kv_shared_layers"):
        return False
    for key, value in list(d.items()):
        if key == layer_key or not isinstance(value, list) or not value:
            continue
        named = any(w in key for w in ("layer", "block", "type", "idx"))
        if len(value) == n and named:
            d[key] = value * times
        elif named and len(value) < n and all(_is_int(x) and 0 <= x < n for x in value):
            d[key] = [x + n * r for r in range(times) for x in value]
    if isinstance(d.get("per_layer_config"), dict):  # overrides keyed by layer index
        d["per_layer_config"] = {str(int(i) + n * r): v for r in range(times) for i, v in d["per_layer_config"].items()}
    if layer_key is not None:
        d[layer_key] = n * times
    return True


def _raise_to(d: dict[str, Any], keys: tuple[str, ...], value: int, only_up: bool) -> None:
    for key in keys:
        if _is_int(d.get(key)):
            d[key] = max(d[key], value) if only_up else value


def _builds(config: Any) -> str | None:
    """None when a random model of ``config`` builds and runs a forward; else why not."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        vocab = int(config.get_text_config().vocab_size)
        with torch.no_grad():
            model(torch.arange(FIRST_PROMPT_ID, FIRST_PROMPT_ID + 6).remainder(vocab)[None])
    except Exception as e:  # noqa: BLE001 - any failure of a scaled config makes it fall back
        return f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
    return None


@functools.lru_cache(maxsize=32)
def _family_dict(
    model_type: str, hidden_size: int, num_hidden_layers: int, vocab_size: int, max_positions: int
) -> tuple[Any, dict[str, Any], str]:
    try:
        tiny = tiny_config(model_type)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"model type {model_type!r}: its tiny config cannot be built ({type(e).__name__}: {e})") from e
    why = _builds(tiny)
    if why is not None:
        raise ValueError(f"model type {model_type!r}: a random model of its tiny config does not run ({why})")
    cls: Any = type(tiny)
    base = tiny.to_dict()
    base.pop("transformers_version", None)
    text = _text_dict(base)
    width = text.get("hidden_size", text.get("n_embd", text.get("d_model")))
    factor = max(1, hidden_size // width) if isinstance(width, int) and width > 0 else 1
    _, layers = _layer_count(text)
    times = max(1, num_hidden_layers // layers) if layers > 0 else 1
    tries = [(factor, times), (factor, 1), (1, times), (1, 1)]
    failures: list[str] = []
    for f, t in dict.fromkeys(tries):  # (in order, each once)
        d = copy.deepcopy(base)
        td = _text_dict(d)
        if f > 1:
            _scale_widths(td, f)
        if t > 1 and not _repeat_layers(td, t):
            continue
        _raise_to(td, POSITION_KEYS, max_positions, only_up=True)
        _raise_to(td, VOCAB_KEYS, vocab_size, only_up=False)
        why = _builds(cls.from_dict(d))
        if why is None:
            parts = [f"widths x{f}"] if f > 1 else []
            parts += [f"layers x{t}"] if t > 1 else []
            note = "the sweep's tiny config" + (", " + ", ".join(parts) if parts else "")
            if failures:
                note += "; larger tries failed: " + "; ".join(failures)
            return cls, d, note
        failures.append(f"widths x{f}, layers x{t}: {why}")
    return cls, base, "the sweep's tiny config as is; scaled tries failed: " + "; ".join(failures)


def family_config(
    model_type: str,
    *,
    hidden_size: int,
    num_hidden_layers: int,
    vocab_size: int,
    max_position_embeddings: int,
    **_: Any,
) -> tuple[Any, str]:
    """A random-weight benchmark config of any causal-LM ``model_type`` sized toward a Llama shape
    (the keyword arguments; other fields of the shape are ignored), and a note of how it was made.

    The start is :func:`tiny_config` (every layer kind of the family kept); its widths are scaled
    by ``hidden_size`` over its hidden size (heads kept, so head widths grow too), its kept layer
    pattern repeated toward ``num_hidden_layers``, its vocabulary set to ``vocab_size`` and its
    positions raised to ``max_position_embeddings``. Each scaled config is proved by building the
    model and running a forward; the first that runs is taken (both scalings, widths only, layers
    only, neither), else the tiny config as is. Raises ``ValueError`` (what and why) for a name
    that is not a causal-LM model type or whose tiny config does not build and run."""
    check_model_type(model_type)
    cls, d, note = _family_dict(model_type, hidden_size, num_hidden_layers, vocab_size, max_position_embeddings)
    return cls.from_dict(copy.deepcopy(d)), note
