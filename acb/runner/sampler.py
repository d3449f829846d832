"""Turn the logits of the sampling rows into token ids, on the device, without a host sync.

Greedy rows take the argmax; rows with a temperature sample from ``softmax(logits / T)`` by
the exponential-race trick (``argmax(p / E)`` with ``E ~ Exp(1)``), which needs no
``multinomial`` and no sync. Logprobs are the log-softmax of the raw logits (before temperature).
"""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,  # [S, V] any float dtype
    temperatures: list[float],
    generator: torch.Generator | None,
    want_logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([S] long, [S] float32 | None)
    logits = logits.float()
    ids = logits.argmax(dim=-1)
    if any(t > 0 for t in temperatures):
        temps = torch.tensor(temperatures, dtype=torch.float32, device=logits.device)
        scaled = logits / temps.clamp_min(1e-5)[:, None]
        probs = torch.softmax(scaled, dim=-1)
        race = torch.empty_like(probs).exponential_(generator=generator)
        sampled = (probs / race).argmax(dim=-1)
        ids = torch.where(temps > 0, sampled, ids)
    logprobs = None
    if want_logprobs:
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[:, None])[:, 0]
    return ids, logprobs
