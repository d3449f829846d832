"""Architectures acb knows it cannot run exactly, and why: refused when the engine starts (the
catalogue sweep, ``benchmarks/model_sweep.py``, found each of them failing or differing from
``model.generate`` when let through). Rules by class, for what a config does not say, and by
config, for what it does."""

from __future__ import annotations

from typing import Any

import torch

# what these models do that acb's paged attention cannot reproduce
REFUSED_CLASSES: dict[str, str] = {
    "DogeForCausalLM": "builds a content-dependent attention bias from the attention mask before calling the "
    "attention function (dynamic mask attention); acb's paged attention takes no mask",
    "DiffLlamaForCausalLM": "calls the attention function twice per layer on the same keys (differential "
    "attention); acb's paged cache takes one call per layer and step",
    "MoshiForCausalLM": "applies its sliding window through the attention mask only (its attention layers do not "
    "pass it to the attention function), and acb's paged attention takes no mask",
    "JetMoeForCausalLM": "routes its attention heads per token (mixture of attention heads: keys and values of "
    "num_key_value_heads x num_experts_per_tok heads)",
}


# the attention sizes acb reads from a config to shape the KV cache's pages
ATTENTION_SHAPE_FIELDS = (
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "hidden_size",
)


# the attention sizes that may differ by layer: each layer's cache pages take its own
PER_LAYER_PAGE_FIELDS = frozenset({"num_key_value_heads", "head_dim"})


def refusal(model: Any) -> str | None:
    """Why acb cannot run ``model`` exactly, or None (the other start checks still apply)."""
    name = type(model).__name__
    if name in REFUSED_CLASSES:
        return f"{name} {REFUSED_CLASSES[name]}"
    cfg = model.config
    if getattr(cfg, "is_decoder", None) is False:  # the BERT family: bidirectional unless configured as a decoder
        return (
            f"{name} has bidirectional attention (config.is_decoder is False); acb runs causal decoders "
            "(set is_decoder=True if the model was trained as one)"
        )
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    # per-layer page shapes (KV heads, head size) are cache groups of their own (acb.runner.kv_cache);
    # the other sizes acb reads must be one value each
    per_layer = set(getattr(text, "per_layer_attributes", None) or ()) & PER_LAYER_PAGE_FIELDS
    for field in ATTENTION_SHAPE_FIELDS:
        if field in per_layer:
            continue
        try:
            value = getattr(text, field, None)
        except Exception as exc:  # noqa: BLE001 - transformers' per-layer configs refuse the global read
            return f"{name} has per-layer attention shapes ({type(exc).__name__}: its {field} differs by layer)"
        if isinstance(value, (list, tuple)):
            return f"{name} has per-layer attention shapes (its {field} is a list, one per layer)"
    return None


def decoder_of(model: Any) -> Any:
    """The model's language model (``get_decoder()``: the text model of a vision-language model),
    or the model itself when it does not say."""
    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - a model whose get_decoder does not apply to it
        decoder = None
    return decoder if isinstance(decoder, torch.nn.Module) else model
