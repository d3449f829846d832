"""Logits processing and sampling for a whole step, batched, on the device.

No Python loop over requests and no host sync: per-row parameters arrive as one small
tensor per step (gathered from host arrays indexed by block-table row), history-dependent
penalties read per-row device buffers that are updated in place after each sample, and
random numbers come from a counter-based hash of ``(seed, token index, vocab id)``, so a
seeded request draws the same numbers whatever else is in the batch.

Order, as transformers' ``generate``: logit_bias, repetition penalty, presence/frequency
penalties, min_new_tokens; then greedy argmax, or temperature, top-k, top-p, min-p and a
sample from the softmax (exponential race: ``argmax(p / E)``, ``E ~ Exp(1)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# columns of the per-row parameter table
(C_TEMP, C_TOPK, C_TOPP, C_MINP, C_REP, C_PRES, C_FREQ, C_MINNEW, C_SEED_LO, C_SEED_HI, C_NLOGPROBS,
 C_PROCESSED) = range(12)
NUM_COLS = 12

_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685  # 0x94D049BB133111EB


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic; logical shifts emulated by masking)."""
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * _M2
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * _M3
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    return x


def seeded_exponentials(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[S, V]`` Exp(1) draws that depend only on each row's (seed, counter) and the vocab id."""
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    key = _mix(seeds * _M1 + counters)  # [S]
    x = _mix(key[:, None] + (v[None, :] + 1) * _M1)
    # 23 bits, so that u = (k + 0.5) / 2^23 is exact in float32 and strictly inside (0, 1):
    # with 24 bits the largest u rounds to 1.0, E = 0 and p / E turns a removed token into NaN
    u = (((x >> 41) & 0x7FFFFF).to(torch.float32) + 0.5) * (1.0 / 8388608.0)
    return -torch.log(u)


@dataclass
class StepSampling:
    """Host-side description of one step's sampling rows (built by the runner)."""

    rows: np.ndarray  # [S] block-table rows of the sampling sequences
    gen_idx: np.ndarray  # [S] index of the token being generated (0 = first)
    params: np.ndarray  # [S, NUM_COLS] float64 rows of the parameter table
    any_sampling: bool
    any_top_kp: bool  # some sampled row uses top-k or top-p
    any_min_p: bool
    max_logprobs: int  # -1: nobody wants logprobs


class SamplingState:
    """Per-row sampling parameters and history buffers, indexed by block-table row."""

    def __init__(self, max_rows: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self.table = np.zeros((max_rows, NUM_COLS), dtype=np.float64)
        self.live_penalty = np.zeros(max_rows, dtype=bool)
        self.live_bias = np.zeros(max_rows, dtype=bool)
        self.live_min_new = np.zeros(max_rows, dtype=bool)
        self.seen: torch.Tensor | None = None  # [rows, V] bool: prompt and generated tokens
        self.counts: torch.Tensor | None = None  # [rows, V] int32: generated-token counts
        self.bias: torch.Tensor | None = None  # [rows, V] float32
        self.stop_mask: torch.Tensor | None = None  # [rows, V] bool: tokens min_new_tokens suppresses

    def _buf(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        t = getattr(self, name)
        if t is None:
            t = torch.zeros(self.table.shape[0], self.vocab, dtype=dtype, device=self.device)
            setattr(self, name, t)
        return t

    def init_row(self, row: int, req) -> None:  # req: acb.core.request.Request
        """(Re)fill a row for a request admitted to it (fresh, or resumed after preemption)."""
        sp = req.params
        t = self.table[row]
        t[C_TEMP] = 0.0 if sp.is_greedy else sp.temperature
        t[C_TOPK] = sp.top_k or 0
        t[C_TOPP] = sp.top_p if sp.top_p is not None else 1.0
        t[C_MINP] = sp.min_p or 0.0
        t[C_REP] = sp.repetition_penalty or 1.0
        t[C_PRES] = sp.presence_penalty or 0.0
        t[C_FREQ] = sp.frequency_penalty or 0.0
        t[C_MINNEW] = sp.min_new_tokens or 0
        t[C_SEED_LO] = req.seed & 0xFFFFFFFF
        t[C_SEED_HI] = (req.seed >> 32) & 0x7FFFFFFF
        t[C_NLOGPROBS] = -1 if sp.logprobs is None else sp.logprobs
        t[C_PROCESSED] = 1.0 if sp.logprobs_mode == "processed" else 0.0
        dev = self.device
        penalty = t[C_REP] != 1.0 or t[C_PRES] != 0.0 or t[C_FREQ] != 0.0
        self.live_penalty[row] = penalty
        if penalty:
            seen, counts = self._buf("seen", torch.bool), self._buf("counts", torch.int32)
            seen[row].zero_()
            counts[row].zero_()
            seen[row, torch.tensor(req.token_ids, dtype=torch.long, device=dev)] = True
            gen = req.token_ids[req.prompt_len:]
            if gen:
                g = torch.tensor(gen, dtype=torch.long, device=dev)
                counts[row].index_put_((g,), torch.ones_like(g, dtype=torch.int32), accumulate=True)
        self.live_bias[row] = bool(sp.logit_bias)
        if sp.logit_bias:
            bias = self._buf("bias", torch.float32)
            bias[row].zero_()
            ids = torch.tensor(list(sp.logit_bias.keys()), dtype=torch.long, device=dev)
            bias[row, ids] = torch.tensor(list(sp.logit_bias.values()), dtype=torch.float32, device=dev)
        self.live_min_new[row] = bool(sp.min_new_tokens) and bool(req.stop_token_ids) and not sp.ignore_eos
        if self.live_min_new[row]:
            mask = self._buf("stop_mask", torch.bool)
            mask[row].zero_()
            mask[row, torch.tensor(sorted(req.stop_token_ids), dtype=torch.long, device=dev)] = True

    def free_row(self, row: int) -> None:
        self.live_penalty[row] = self.live_bias[row] = self.live_min_new[row] = False

    def step(self, rows: list[int], gen_idx: list[int]) -> StepSampling:
        r = np.asarray(rows, dtype=np.int64)
        params = self.table[r]
        sampled = params[:, C_TEMP] > 0
        return StepSampling(
            rows=r,
            gen_idx=np.asarray(gen_idx, dtype=np.int64),
            params=params,
            any_sampling=bool(sampled.any()),
            any_top_kp=bool((sampled & ((params[:, C_TOPK] > 0) | (params[:, C_TOPP] < 1))).any()),
            any_min_p=bool((sampled & (params[:, C_MINP] > 0)).any()),
            max_logprobs=int(params[:, C_NLOGPROBS].max()) if len(r) else -1,
        )


def process_logits(
    logits: torch.Tensor,  # [S, V] float32 raw logits
    p: torch.Tensor,  # [S, NUM_COLS] float32 parameters
    gen_idx: torch.Tensor,  # [S] long
    rows: torch.Tensor,  # [S] long
    state: SamplingState,
    *,
    use_penalty: bool,
    use_bias: bool,
    use_min_new: bool,
    any_sampling: bool,
    any_top_kp: bool = True,
    any_min_p: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (x, y): x after bias/penalties/min_new_tokens (what greedy rows take the argmax
    of), y additionally after temperature, top-k, top-p, min-p (what sampled rows draw from)."""
    x = logits
    if use_bias:
        x = x + state.bias[rows]
    if use_penalty:
        rep = p[:, C_REP, None]
        x = torch.where(state.seen[rows], torch.where(x < 0, x * rep, x / rep), x)
        cnt = state.counts[rows].to(x.dtype)
        x = x - p[:, C_FREQ, None] * cnt - p[:, C_PRES, None] * (cnt > 0).to(x.dtype)
    if use_min_new:
        suppress = state.stop_mask[rows] & (gen_idx < p[:, C_MINNEW].long())[:, None]
        x = x.masked_fill(suppress, float("-inf"))
    if not any_sampling:
        return x, x
    temp = p[:, C_TEMP]
    y = x / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None]
    neg_inf = float("-inf")
    if any_top_kp:
        vocab = y.shape[-1]
        top_k = p[:, C_TOPK].long()
        sorted_y, order = y.sort(dim=-1)  # ascending, as transformers' top-p
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = sorted_y.gather(1, (vocab - k)[:, None])  # the k-th largest value; ties are kept
        y = y.masked_fill(y < kth, neg_inf)
        sorted_y = sorted_y.masked_fill(sorted_y < kth, neg_inf)
        cum = sorted_y.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - p[:, C_TOPP])[:, None]
        remove_sorted[:, -1] = False  # the most likely token always stays
        y = y.masked_fill(remove_sorted.scatter(1, order, remove_sorted), neg_inf)
    if any_min_p:
        probs = y.softmax(dim=-1)
        y = y.masked_fill(probs < p[:, C_MINP, None] * probs.amax(dim=-1, keepdim=True), neg_inf)
    return x, y


def sample(
    logits: torch.Tensor,  # [S, V] any float dtype
    step: StepSampling,
    state: SamplingState,
) -> torch.Tensor:
    """Sampled ids, packed with logprobs when asked: ``[S]`` long, or ``[S, 2 + 2k]`` float64
    rows of (id, chosen logprob, k alternative ids, k alternative logprobs)."""
    dev = logits.device
    raw = logits.float()
    rows = torch.from_numpy(step.rows).to(dev, non_blocking=True)
    p = torch.from_numpy(step.params.astype(np.float32)).to(dev, non_blocking=True)
    gen_idx = torch.from_numpy(step.gen_idx).to(dev, non_blocking=True)
    use_penalty = bool(state.live_penalty.any())
    x, y = process_logits(
        raw, p, gen_idx, rows, state,
        use_penalty=use_penalty, use_bias=bool(state.live_bias.any()),
        use_min_new=bool(state.live_min_new.any()), any_sampling=step.any_sampling,
        any_top_kp=step.any_top_kp, any_min_p=step.any_min_p,
    )
    ids = x.argmax(dim=-1)
    if step.any_sampling:
        seeds = torch.from_numpy(
            (step.params[:, C_SEED_HI].astype(np.int64) << 32) | step.params[:, C_SEED_LO].astype(np.int64)
        ).to(dev, non_blocking=True)
        race = y.softmax(dim=-1) / seeded_exponentials(seeds, gen_idx, y.shape[-1])
        sampled = race.argmax(dim=-1)
        is_sampled = p[:, C_TEMP] > 0
        ids = torch.where(is_sampled, sampled, ids)
    if use_penalty:  # history for the next step, updated on the device
        state.seen[rows, ids] = True
        state.counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
    if step.max_logprobs < 0:
        return ids
    processed = torch.where((p[:, C_TEMP] > 0)[:, None], y, x) if step.any_sampling else x
    src = torch.where((p[:, C_PROCESSED] > 0)[:, None], processed, raw)
    lp = torch.log_softmax(src, dim=-1)
    chosen = lp.gather(1, ids[:, None])
    cols = [ids[:, None].double(), chosen.double()]
    if step.max_logprobs > 0:
        top_lp, top_ids = lp.topk(step.max_logprobs, dim=-1)
        cols += [top_ids.double(), top_lp.double()]
    return torch.cat(cols, dim=1)
