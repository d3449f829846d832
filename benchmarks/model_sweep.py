"""Catalogue sweep: every transformers causal-LM model type through acb, against ``model.generate``.

For each model type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny random model is built
generically from the config class's defaults (:func:`tiny_config` shrinks the size fields of the
config and of its sub-configs), then greedy tokens from plain ``model.generate`` are compared
with acb's, once with the default step budget and once with ``max_batch_tokens=8`` (chunked
prefill). Each model type gets one status:

- ``exact``: acb's tokens equal ``model.generate``'s in both runs;
- ``differs``: they do not (the first differing run, prompt and position are recorded, with the
  reference's top-2 logit margin there: a margin near 0 is a near-tie, not a bug);
- ``refused``: acb's start checks refused the model (``UnsupportedModelError``), with the reason;
- ``failed``: acb raised anything else, failed a request, hung or crashed: an acb bug to report;
- ``cannot build``: the generic tiny config, the model or the reference failed (not about acb).

Each model runs in its own process (forked from a server that imported torch, transformers and acb
once) with a timeout, at most ``--jobs`` at a time, so a hang
or a crash only costs that model. A full sweep writes ``benchmarks/results/model_sweep.json``
and ``docs/MODELS.md``; regenerate both with::

    nice -n 10 python benchmarks/model_sweep.py

``--only llama,qwen3`` or ``--sample 10 --seed 0`` sweep a part (printed, not written unless
``--merge``); ``--check`` compares the statuses with the committed table and exits 1 when one
changed (CI staleness).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import datetime
import json
import os
import random
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_PATH = ROOT / "benchmarks" / "results" / "model_sweep.json"
DOCS_PATH = ROOT / "docs" / "MODELS.md"

STATUSES = ("exact", "differs", "refused", "failed", "cannot build")
PROMPT_LENGTHS = (5, 11, 17)
MAX_NEW_TOKENS = 8
SEED = 0
FIRST_PROMPT_ID = 16  # ids below are reserved for the special tokens tiny_config places there
DEFAULT_TIMEOUT_S = 240.0

# --- the tiny config ---------------------------------------------------------------------------

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
    head_dim = d.get("head_dim") if isinstance(d.get("head_dim"), int) else 16
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
        d = _lay_over(d, HAND_CONFIGS[model_type])
    return type(default).from_dict(d)


def _lay_over(d: dict[str, Any], hand: dict[str, Any]) -> dict[str, Any]:
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
        d[key] = _lay_over(d[key], value) if isinstance(value, dict) and _is_config_dict(d.get(key)) else value
    return d


# --- one model (in the worker subprocess) ------------------------------------------------------


def _stage(name: str) -> None:
    # the parent reports the last stage reached when a model hangs or crashes
    if _stage_conn is not None:
        _stage_conn.send(("stage", name))


def _prompts(vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(FIRST_PROMPT_ID, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _reference(model: Any, prompts: list[list[int]]) -> tuple[list[list[int]], list[Any]]:
    """Greedy tokens from plain ``model.generate``, one unpadded prompt at a time, EOS not
    stopping (the generation config has none), and each step's raw logits."""
    import torch

    tokens, logits = [], []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new = out.sequences[0, len(prompt) :].tolist()
        if len(new) != MAX_NEW_TOKENS:
            raise RuntimeError(f"model.generate gave {len(new)} tokens, not {MAX_NEW_TOKENS}")
        tokens.append(new)
        logits.append([step[0].float() for step in out.logits])
    return tokens, logits


def _margin(step_logits: Any) -> float:
    top = step_logits.topk(2).values
    return float(top[0] - top[1])


# the runs of each model: name -> config fields and samples per prompt (on the path acb picks;
# a model it pages runs "own cache" too): whole prompts; chunked prefill; memory for about one
# request (preemptions, recomputes) with async batching; two samples per prompt (forked caches)
RUNS: dict[str, tuple[dict[str, Any], int]] = {
    "default": ({}, 1),
    "chunked": ({"max_batch_tokens": 8}, 1),
    "preempt+async": ({"num_blocks": 8, "page_size": 4, "max_batch_tokens": 16, "use_async_batching": True}, 1),
    "n=2": ({}, 2),
}


def _run_acb(
    model: Any, prompts: list[list[int]], run: str = "default", runner: str | None = None
) -> tuple[list[list[int]] | str, str]:
    """acb's greedy tokens (or the error of a failed request) and the path that ran them
    ("paged", or "own cache": the model on its own cache objects); with ``n=2`` each prompt's two
    samples, one after the other."""
    from transformers import GenerationConfig

    import acb

    fields, n = RUNS[run]
    cfg = acb.ContinuousBatchingConfig(**{"num_blocks": 64, "page_size": 8, **fields, "runner": runner})
    gen = GenerationConfig(do_sample=False, eos_token_id=FIXED_TOKEN_IDS["eos_token_id"], pad_token_id=0)
    engine = acb.Engine(model, cfg, gen)
    engine.start()
    try:
        path = "own cache" if engine.runner.own_forward is not None else "paged"
        outs = engine.generate_batch(
            prompts, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, progress_bar=False, do_sample=False, n=n
        )
    finally:
        engine.shutdown()
    result = []
    for out in outs.values():
        if out.status != acb.RequestStatus.FINISHED:
            return f"request {out.request_id} ended {out.status.name}: {out.error}", path
        result.extend([list(x.generated_tokens) for x in out.samples] if out.samples else [list(out.generated_tokens)])
    return result, path


def _exc(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text[:400]


def _where(e: BaseException) -> str:
    """The innermost frame of the traceback (file:line in function), for the report."""
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return ""
    f = tb[-1]
    path = f.filename
    for marker in ("site-packages/", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{f.lineno} in {f.name}"


def run_model(model_type: str) -> dict[str, Any]:
    """Build ``model_type``'s tiny model and classify acb on it (runs in the worker)."""
    import logging

    import torch

    torch.set_num_threads(1)  # two processes share two cores
    logging.getLogger("acb").setLevel(logging.CRITICAL)  # a failed request is in the result already
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rec: dict[str, Any] = {
        "model_type": model_type,
        "class": _class_name(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]),
    }
    _stage("build")
    try:
        cfg = tiny_config(model_type)
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        rec["class"] = type(model).__name__
        rec["params"] = sum(p.numel() for p in model.parameters())
        # greedy, no EOS: the reference runs all MAX_NEW_TOKENS (acb ignores EOS on its side)
        model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=1)
        vocab = int(model.config.get_text_config().vocab_size)
        prompts = _prompts(vocab)
    except Exception as e:  # noqa: BLE001 - any failure of the generic config is a result
        return {**rec, "status": "cannot build", "reason": f"tiny config/model: {_exc(e)}", "where": _where(e)}
    _stage("reference")
    try:
        ref, ref_logits = _reference(model, prompts)
    except Exception as e:  # noqa: BLE001
        return {**rec, "status": "cannot build", "reason": f"model.generate: {_exc(e)}", "where": _where(e)}
    import acb

    diffs = []
    # the path acb picks, in each of RUNS; a model it pages also runs on its own cache objects
    # (the second path), which must give the same tokens
    # (ACB_SWEEP_RUNS: a comma-separated subset of RUNS, for CI's sample)
    wanted = os.environ.get("ACB_SWEEP_RUNS")
    runs: list[tuple[str, str, str | None]] = [
        (run, run, None) for run in RUNS if wanted is None or run in wanted.split(",")
    ]
    for label, run, runner in runs:
        _stage(f"acb {label}")
        try:
            got, path = _run_acb(model, prompts, run, runner)
        except acb.UnsupportedModelError as e:
            return {**rec, "status": "refused", "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - any other acb exception is a bug to report
            return {**rec, "status": "failed", "reason": f"{label} run: {_exc(e)}", "where": _where(e)}
        if isinstance(got, str):
            return {**rec, "status": "failed", "reason": f"{label} run: {got}"}
        if label == "default":
            rec["path"] = path
            if path == "paged":
                runs.append(("own cache", "default", "own_cache"))
        samples = RUNS[run][1]
        for i, (want, have) in enumerate(zip([r for r in ref for _ in range(samples)], got)):
            p = i // samples
            if want != have:
                pos = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
                margin = _margin(ref_logits[p][pos]) if pos < len(ref_logits[p]) else None
                diffs.append(
                    {
                        "run": label,
                        "prompt": p,
                        "prompt_len": len(prompts[p]),
                        "position": pos,
                        "expected": want,
                        "got": have,
                        "ref_top2_margin": margin,
                    }
                )
                break
    if diffs:
        d = diffs[0]
        margin = "" if d["ref_top2_margin"] is None else f", reference top-2 logit margin {d['ref_top2_margin']:.3g}"
        runs = "+".join(sorted({x["run"] for x in diffs}))
        return {
            **rec,
            "status": "differs",
            "diffs": diffs,
            "reason": f"{runs}: first at new token {d['position']} of prompt {d['prompt']} "
            f"(len {d['prompt_len']}, {d['run']} run){margin}",
        }
    return {**rec, "status": "exact", "reason": ""}


def _class_name(value: Any) -> str:
    return value if isinstance(value, str) else "/".join(value)


# --- the sweep (parent) ------------------------------------------------------------------------


def catalogue() -> dict[str, str]:
    """``{model_type: causal-LM class name}`` of this transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {k: _class_name(v) for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}


def sample_types(types: list[str], n: int, seed: int) -> list[str]:
    """A deterministic sample of ``n`` model types (sorted)."""
    return sorted(random.Random(seed).sample(sorted(types), min(n, len(types))))


# The modules every model needs, imported once by the fork server: each model then runs in a
# fresh fork of it (its own process, so a crash or a hang costs only that model) without paying
# the ~4 s of importing torch and transformers again.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.activations",
    "transformers.modeling_utils",
    "transformers.generation",
    "transformers.integrations.flash_attention",
    "transformers.core_model_loading",
    "acb",
    "acb.runner.model_runner",
)


def _child(model_type: str, conn: Any) -> None:
    """The forked process of one model: send its stages, then its result."""
    global _stage_conn
    _stage_conn = conn
    try:
        rec = run_model(model_type)
    except Exception as e:  # noqa: BLE001 - the sweep's own bug: reported as the model's result
        rec = {"model_type": model_type, "class": "?", "status": "cannot build", "reason": f"sweep: {_exc(e)}"}
    conn.send(("result", rec))
    conn.close()


_stage_conn: Any = None


def _sweep_one(ctx: Any, model_type: str, class_name: str, timeout_s: float) -> dict[str, Any]:
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(model_type, child), daemon=True)
    t0 = time.monotonic()
    proc.start()
    child.close()
    stage, rec = "start", None
    deadline = t0 + timeout_s
    while rec is None:
        left = deadline - time.monotonic()
        if left <= 0 or not parent.poll(left):
            break
        try:
            kind, value = parent.recv()
        except EOFError:  # the process died without a result
            break
        if kind == "stage":
            stage = value
        else:
            rec = value
    if rec is None:
        proc.join(0.5)
        if proc.is_alive():
            why = f"timed out after {timeout_s:.0f} s"
            proc.kill()
        else:
            why = f"the process died (exit code {proc.exitcode})"
        proc.join()
        # a hang or a crash: where it happened decides whose it is
        status = "failed" if stage.startswith("acb") else "cannot build"
        rec = {"model_type": model_type, "class": class_name, "status": status, "reason": f"{stage}: {why}"}
    else:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    parent.close()
    rec["seconds"] = round(time.monotonic() - t0, 1)
    return rec


def sweep(
    types: list[str], *, jobs: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S, verbose: bool = True
) -> dict[str, dict[str, Any]]:
    """Run each model type in its own process (forked from a preloaded server), ``jobs`` at a time."""
    import multiprocessing

    # before the fork server starts: it and every model's process inherit these (two processes
    # share two cores, one thread each)
    os.environ.update(
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error"
    )
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # the fork server imports this module by name to find _child
        sys.path.insert(0, here)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    classes = catalogue()
    results: dict[str, dict[str, Any]] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(_sweep_one, ctx, t, classes.get(t, "?"), timeout_s): t for t in types}
        for fut in concurrent.futures.as_completed(futures):
            rec = fut.result()
            results[rec["model_type"]] = rec
            if verbose:
                print(
                    f"[{len(results)}/{len(types)}] {rec['model_type']:28s} {rec['status']:12s} "
                    f"{rec['seconds']:6.1f}s {rec['reason'][:110]}",
                    flush=True,
                )
    return {t: results[t] for t in sorted(results)}


def _acb_commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.CalledProcessError):
        return None


def make_table(results: dict[str, dict[str, Any]], acb_commit: str | None = None) -> dict[str, Any]:
    import transformers

    counts = Counter(r["status"] for r in results.values())
    return {
        "transformers_version": transformers.__version__,
        "date": datetime.date.today().isoformat(),
        "acb_commit": acb_commit or _acb_commit(),
        "prompt_lengths": list(PROMPT_LENGTHS),
        "max_new_tokens": MAX_NEW_TOKENS,
        "counts": {s: counts.get(s, 0) for s in STATUSES},
        "models": results,
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(table: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {s}" for s, n in table["counts"].items())
    lines = [
        "# Model catalogue",
        "",
        "<!-- generated by benchmarks/model_sweep.py; do not edit by hand -->",
        "",
        "Every causal-LM model type of transformers "
        f"{table['transformers_version']} (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, {len(table['models'])} types), "
        "built as a tiny random float32 model from its config class's defaults (hidden size 64, 2 layers "
        "keeping one of each layer type, 4 heads, 2 KV heads, vocabulary 256, 4 experts with top-2...), "
        f"and run through acb (commit {table.get('acb_commit') or '?'}, {table['date']}) against greedy "
        f"`model.generate`: prompts of {', '.join(map(str, table['prompt_lengths']))} tokens, "
        f"{table['max_new_tokens']} new tokens, in four runs: the default step budget; `max_batch_tokens=8` "
        "(chunked prefill); memory for about one request at a time (preemptions and recomputes) with async "
        "batching; `n=2` (two samples per prompt, forked caches). **path** is the runner acb picks: `paged` (acb's paged KV cache) or `own cache` "
        "(the model on its own cache objects, as `model.generate` runs it: for models acb cannot page); a "
        "model on the paged path also runs on its own cache, and must give the same tokens there.",
        "",
        f"Counts: {counts}.",
        "",
        "- **exact**: acb's tokens equal `model.generate`'s in every run.",
        "- **differs**: they do not; the first divergence is given (a reference top-2 logit margin near 0 "
        "would be a near-tie rather than a bug).",
        "- **refused**: acb refuses the model at start (`UnsupportedModelError`), for the reason given.",
        "- **failed**: acb raised another exception, failed a request, hung or crashed: a bug.",
        "- **cannot build**: the generic tiny config, the model or `model.generate` failed (not about acb).",
        "",
        "Regenerate (about 75 s on 2 cores): `nice -n 10 python benchmarks/model_sweep.py`. "
        "`python benchmarks/model_sweep.py --check` reruns the sweep and fails when a status changed; "
        "`tests/test_model_sweep.py` checks a sample of it in CI.",
        "",
        "| model type | class | status | path | reason |",
        "|---|---|---|---|---|",
    ]
    for t, r in table["models"].items():
        lines.append(
            f"| `{t}` | {_cell(r['class'])} | {r['status']} | {r.get('path', '')} | {_cell(r.get('reason', ''))} |"
        )
    return "\n".join(lines) + "\n"


def load_table(path: Path = RESULTS_PATH) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def write_table(table: dict[str, Any]) -> None:
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
    DOCS_PATH.parent.mkdir(parents=True, exist_ok=True)
    DOCS_PATH.write_text(render_markdown(table))


def status_changes(results: dict[str, dict[str, Any]], committed: dict[str, Any] | None) -> list[str]:
    """The model types whose status is not the committed table's (or that it lacks)."""
    old = (committed or {}).get("models", {})
    return [
        f"{t}: {old[t]['status'] if t in old else 'absent'} -> {r['status']} ({r['reason'][:160]})"
        for t, r in results.items()
        if t not in old or old[t]["status"] != r["status"]
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--sample", type=int, help="a random sample of this many model types")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    ap.add_argument("--jobs", type=int, default=2, help="models run in parallel")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per model")
    ap.add_argument("--check", action="store_true", help="fail if a status differs from the committed table")
    ap.add_argument("--merge", action="store_true", help="merge a partial sweep into the committed table")
    args = ap.parse_args(argv)
    cat = catalogue()
    types = sorted(cat)
    if args.only:
        wanted = [t.strip() for t in args.only.split(",") if t.strip()]
        unknown = [t for t in wanted if t not in cat]
        if unknown:
            ap.error(f"not causal-LM model types of this transformers: {unknown}")
        types = sorted(wanted)
    if args.sample:
        types = sample_types(types, args.sample, args.seed)
    partial = types != sorted(cat)
    commit = _acb_commit()  # now: the acb the workers import is the checkout's at start
    t0 = time.monotonic()
    results = sweep(types, jobs=args.jobs, timeout_s=args.timeout)
    counts = Counter(r["status"] for r in results.values())
    print(
        f"{len(results)} model types in {time.monotonic() - t0:.0f} s: "
        + ", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES)
    )
    committed = load_table()
    if args.check:
        changes = status_changes(results, committed)
        if not partial and committed:
            changes += [f"{t}: in the table, no longer in the catalogue" for t in committed["models"] if t not in cat]
        if changes:
            print(
                "the committed table is stale (regenerate: python benchmarks/model_sweep.py):\n  "
                + "\n  ".join(changes)
            )
            return 1
        print("the committed table is up to date")
        return 0
    if partial and not args.merge:
        return 0
    if partial and committed:
        results = {**committed["models"], **results}
        results = {t: results[t] for t in sorted(results) if t in cat}
    write_table(make_table(results, commit))
    print(f"wrote {RESULTS_PATH.relative_to(ROOT)} and {DOCS_PATH.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
