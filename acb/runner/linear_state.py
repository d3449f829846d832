"""Linear-attention layers (hybrid models: Qwen3-Next, Qwen3.5): per-request recurrent state.

Work in progress (issue 30): :func:`linear_layers` finds the layers acb knows how to drive.
"""

from __future__ import annotations

from typing import Any

import torch

# the linear-attention layer classes acb drives, by class name (transformers' own modules)
LINEAR_LAYER_CLASSES = frozenset({"Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"})


def linear_layers(model: torch.nn.Module) -> list[Any]:
    """The model's linear-attention layers acb drives (empty for a plain attention model)."""
    return [m for m in model.modules() if type(m).__name__ in LINEAR_LAYER_CLASSES]
