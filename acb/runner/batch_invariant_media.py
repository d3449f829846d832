"""The batch-invariant mode's image inputs (:mod:`acb.runner.batch_invariant`): what it runs of a
vision-language model's images, and why not the rest."""

from __future__ import annotations

import torch


def media_refusal(model: torch.nn.Module) -> str | None:
    """Why the mode cannot run the model's images (None: it can, or the model takes none). In the
    mode each image goes through the model's ``get_image_features`` alone (its features never depend
    on the step's other images), in the engine and under ``enabled(model)`` alike; image tokens
    must attend causally (acb's fixed-order kernel has no two-way image blocks)."""
    from acb.runner.media import ImageFeatures, media_attention, takes_media

    if not takes_media(model):
        return None
    attention = media_attention(model)
    if attention.refused:
        return f"image inputs: {attention.refused}"
    if attention.layers or attention.one_block:
        return (
            "image tokens that attend to each other both ways in prefill (Gemma 3/4, Molmo2): acb's "
            "fixed-order kernel computes causal attention only"
        )
    if not ImageFeatures(model).modules:
        return "image inputs: the model has no get_image_features method, so its images cannot run one a call"
    return None
