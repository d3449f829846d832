"""The batch-invariant mode on indexed sparse attention (DSA: DeepSeek V3.2, GLM-5, ...): see
:mod:`acb.runner.batch_invariant`."""

from __future__ import annotations

import torch


def dsa_refusal(model: torch.nn.Module) -> str | None:
    """Why the mode cannot run ``model``'s indexed sparse attention layers (None: it can)."""
    return (
        "indexed sparse attention (DSA): a query's selected keys are attended by acb's torch backend, not the "
        "fixed-order kernel, and the indexer scores the queries against the cached keys in batched products "
        "(not covered yet)"
    )
