"""The batch-invariant mode's reading of a transformers attention mask (a leaf: the mode's
attention in :mod:`acb.runner.batch_invariant` and the families' own attention forms use it)."""

from __future__ import annotations

import torch


def mask_ranges(
    mask: torch.Tensor | None, b: int, q: int, s: int, window: int | None, chunk: int | None
) -> tuple[list[int], torch.Tensor | None]:
    """Each row's left padding, and each query's key end (``[B, Q]``, exclusive; None: every
    query's own position plus one, causal), read from the boolean ``[B, 1, Q, S]`` mask
    transformers built (None: no padding, causal). The mask is checked to be what acb's kernel
    computes: per query the keys ``[lo, end)`` in position order, ``lo`` the row's first token or
    where the window or chunk of the query's position starts, ``end`` past the query's own
    position only where the model lets a token see later ones (an image whose tokens attend to
    each other both ways: Gemma 3, Gemma 4's sliding layers, Molmo2). Queries on padding, left or
    right, are not checked (their outputs are not used); any other mask is refused."""
    if mask is None:
        return [0] * b, None
    if mask.dtype != torch.bool or mask.dim() != 4:
        raise ValueError(
            f"acb's batch-invariant attention takes a boolean 4-D mask, not {mask.dtype} {tuple(mask.shape)}"
        )
    m = mask[:, 0].expand(b, q, s)
    seen = m.any(dim=1)  # [B, S]: keys some query attends (padding keys: none)
    pads = [int(p) for p in (~seen).long().cumprod(-1).sum(-1).tolist()]
    last = [s - int(e) for e in (~seen.flip(-1)).long().cumprod(-1).sum(-1).tolist()]
    qpos = torch.arange(s - q, s, device=m.device)[:, None]
    kpos = torch.arange(s, device=m.device)[None, :]
    # each query's last key plus one (a query that sees none: its own position plus one)
    sees = m.any(-1)  # [B, Q]
    top = torch.where(m, kpos, -1).amax(-1) + 1
    ends = torch.where(sees, top, qpos[:, 0] + 1).clamp(min=qpos[:, 0] + 1)
    ahead = False
    for i, (pad, end) in enumerate(zip(pads, last)):
        rows = slice(max(0, pad - (s - q)), max(0, end - (s - q)))  # the row's own tokens' queries
        want = (kpos < ends[i][:, None]) & (kpos >= pad)
        if window:
            want &= qpos - kpos < window
        if chunk:
            want &= (kpos - pad) // chunk == (qpos - pad) // chunk
        if not torch.equal(m[i, rows], want[rows]):
            raise ValueError(
                "acb's batch-invariant attention computes causal attention with left or right padding, and an "
                "image's tokens seeing their image's later ones; this forward's mask is another (packed "
                "sequences, or a custom mask)"
            )
        ahead = ahead or bool((ends[i, rows] > qpos[rows, 0] + 1).any())
    return pads, (ends.to(torch.long) if ahead else None)


def masked_attention(
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, KVH, S, D]
    value: torch.Tensor,
    allow: torch.Tensor,  # [B, Q, S] bool: the keys each query attends
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention over each query's allowed keys in ordinary torch ops (what the mode's attention
    functions' backward recomputes, autograd through it): ``[B, Q, H, D]``; a query with no key
    (padding) gives zeros."""
    b, h, q, _ = query.shape
    g = h // key.shape[1]
    k = key.repeat_interleave(g, dim=1)
    v = value.repeat_interleave(g, dim=1)
    w = (query @ k.transpose(-1, -2)) * scale
    if softcap:
        w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~allow[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.reshape(1, h, 1, 1).expand(b, h, q, 1).to(w.dtype)
        p = torch.softmax(torch.cat([w, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(w, dim=-1)
    return (torch.nan_to_num(p) @ v).transpose(1, 2)
