"""The batch-invariant mode's image inputs (:mod:`acb.runner.batch_invariant`): what it runs of a
vision-language model's images, and why not the rest.

Each image goes through the model's ``get_image_features`` alone (its features never depend on the
step's other images), in the engine and under ``enabled(model)`` alike. Image tokens that attend to
each other both ways in prefill (Gemma 3 on every layer, Gemma 4 on its sliding layers with
``use_bidirectional_attention="vision"``, Molmo2's one block of a prompt's images) go through acb's
fixed-order kernel like every other query: an image token's keys run from where its window starts
(measured from its own position) to its image's end, in position order, whatever the step holds
(the engine: :func:`acb.runner.attention.cpu_backend._media_lens`; a prefill chunk never ends
inside such an image); a trainer's forward reads the same key range per query from the mask the
model's own code builds and computes it with the same kernel
(:func:`acb.runner.batch_invariant_masks.mask_ranges`). CPU only: on CUDA images stay refused."""

from __future__ import annotations

import torch


def media_refusal(model: torch.nn.Module) -> str | None:
    """Why the mode cannot run the model's images (None: it can, or the model takes none): the
    masks its own code builds are ones acb cannot follow (:func:`acb.runner.media.media_attention`
    says why), or it has no per-image feature method."""
    from acb.runner.media import ImageFeatures, media_attention, takes_media

    if not takes_media(model):
        return None
    attention = media_attention(model)
    if attention.refused:
        return f"image inputs: {attention.refused}"
    if not ImageFeatures(model).modules:
        return "image inputs: the model has no get_image_features method, so its images cannot run one a call"
    return None
