"""What the batch-invariant mode covers (:mod:`acb.runner.batch_invariant`): :func:`refusal`,
the one place that asks each covered area's module (the families' state layers, DSA, DeepSeek
V4's unpaged layers, the own-cache path, images, LoRA) whether it can run a model in the mode.
It sits above them all, so that the mode's ops (:mod:`acb.runner.batch_invariant`) never import
the areas' checks (the areas import the ops)."""

from __future__ import annotations

from typing import Any

import torch

from acb.runner import batch_invariant
from acb.runner.batch_invariant import attention_backend


def refusal(model: torch.nn.Module, config: Any, own_path: bool = False) -> str | None:
    """None when an engine can run ``model`` in the batch-invariant mode, else why not (the
    engine's start refuses it with this reason)."""
    from acb.runner.indexed import indexer_modules
    from acb.runner.latent import latent_modules
    from acb.runner.tp_sync import tp_size_of
    from acb.runner.unpaged_layers import find_unpaged_layers

    p = next(model.parameters(), None)
    if p is None or p.device.type not in ("cpu", "cuda"):
        return f"the mode runs on CPU or CUDA, not {None if p is None else p.device.type}"
    kernels = attention_backend(p.device) == "triton"  # CUDA (or KERNEL): acb.runner.batch_invariant_kernels
    if kernels:
        if p.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"the mode's Triton kernels take bf16, fp16 or fp32, not {p.dtype}"
        if config.attn_backend not in (None, "triton"):
            return (
                "on CUDA the mode attends with the Triton backend's fixed-order form, "
                f"not attn_backend={config.attn_backend!r}"
            )
    elif p.dtype != torch.float32:
        return f"the mode is float32 only (the model is {p.dtype}): its linear path is oneDNN's float32 inner product"
    elif config.attn_backend not in (None, "cpu"):
        return f"the mode attends with acb's CPU kernel, not attn_backend={config.attn_backend!r}"
    if own_path:
        from acb.runner.batch_invariant_own import own_cache_refusal

        problem = own_cache_refusal(model)
        if problem is not None:
            return problem
    if (
        config.default_compile_level
        or config.decode_compile_config is not None
        or config.varlen_compile_config is not None
    ):
        return "the forward is compiled (inductor chooses its own kernels and reduction orders)"
    if tp_size_of(model) > 1:
        return "the model is tensor parallel (the all-reduce sums the ranks' partial products)"
    if getattr(config, "max_loras", 0):
        from acb.runner.batch_invariant_families import lora_refusal

        problem = lora_refusal(model)
        if problem is not None:
            return problem
    from acb.runner.attention import cpu_backend

    problem = None if kernels else cpu_backend.unavailable_reason()
    if problem is not None:
        return f"acb's CPU attention kernel is not available here ({problem})"
    if latent_modules(model) and config.mla_latent_cache:
        return (
            "mla_latent_cache=True: the latent's absorbed products are batched matrix products over the step's "
            "tokens; the mode pages MLA's expanded heads (leave mla_latent_cache unset)"
        )
    # (element-wise sigmoid gates over a few values per token, which torch computes on its scalar path
    # at a call's tail: batch_invariant_families.the whole forward takes them by one fixed path)
    if indexer_modules(model):
        from acb.runner.batch_invariant_dsa import dsa_refusal

        if batch_invariant.KERNEL:
            return (
                "indexed sparse attention (DSA) with the Triton kernels (batch_invariant.KERNEL): they take no "
                "selection; the mode's fixed forms for it are float32 CPU only"
            )

        problem = dsa_refusal(model, indexer_modules(model))
        if problem is not None:
            return problem
    from acb.runner.batch_invariant_families import uncovered_state_layer
    from acb.runner.batch_invariant_media import media_refusal

    if find_unpaged_layers(model):
        from acb.runner.batch_invariant_unpaged import unpaged_refusal

        problem = unpaged_refusal(model)
        if problem is not None:
            return problem
    if kernels:  # what the CUDA path has not been built or checked for
        from acb.runner.linear_state import linear_layers
        from acb.runner.media import takes_media

        if latent_modules(model):
            return "on CUDA, multi-head latent attention (MLA): its expanded heads' widths are not covered yet"
        if linear_layers(model):
            return "on CUDA, state layers: their fixed forms (batch_invariant_families) are CPU-checked only"
        if takes_media(model):
            return "on CUDA, image inputs: the vision encoder's fixed form is CPU-checked only"
    state = uncovered_state_layer(model)  # (the gated delta rule's have fixed forms: batch_invariant_families)
    if state is not None:
        return (
            f"state layers ({state}): the mode has no fixed form for this class (a chunked scan sums in an order "
            "the chunking sets); it has them for the gated delta rule's (Qwen3.5, Qwen3-Next), Kimi's delta "
            "attention (Kimi Linear, Ling), the Mamba scans' (Mamba, Mamba2, Nemotron-H, Jamba, Falcon-Mamba), "
            "MiniMax's lightning attention, Zaya's CCA projection and a short convolution's (LFM2)"
        )
    return media_refusal(model)
