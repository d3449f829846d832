"""Logits processing and sampling for a whole step, batched, on the device.

No Python loop over requests and no host sync: per-row parameters arrive as one small
tensor per step (gathered from host arrays indexed by block-table row), history-dependent
penalties read per-row device buffers that are updated in place after each sample, and
random numbers come from a counter-based hash of ``(seed, token index)``, so a seeded
request draws the same number whatever else is in the batch.

Order, as transformers' ``generate``: logit_bias, repetition penalty, presence/frequency
penalties, min_new_tokens; then greedy argmax, or temperature, top-k, top-p, min-p and a
draw by inverse CDF (one seeded uniform per row; top-k/top-p rows draw among their sorted
candidates, so only a row using top-p without top-k costs a full sort).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from acb.sampling_params import MIN_TEMPERATURE

if TYPE_CHECKING:
    from acb.core.messages import GrammarMask
    from acb.core.request import Request
    from acb.runner.input_batch import StagingSet

# columns of the per-row parameter table
(C_TEMP, C_TOPK, C_TOPP, C_MINP, C_REP, C_PRES, C_FREQ, C_MINNEW, C_SEED_LO, C_SEED_HI, C_NLOGPROBS, C_PROCESSED) = (
    range(12)
)
NUM_COLS = 12

# Host fast path (issue 54, item 5): a step whose sampling rows are the previous step's, with no
# row (re)initialised or freed since, reuses that step's parameter rows and flags. False computes
# them every step (benchmarks' A/B; the same inputs either way).
REUSE = True

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


def seeded_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """``[S]`` float32 uniforms in (0, 1) that depend only on each row's (seed, counter)."""
    x = _mix(_mix(seeds * _M1 + counters) + _M2)
    # 23 bits, so that (k + 0.5) / 2^23 is exact in float32 and strictly inside (0, 1)
    return (((x >> 41) & 0x7FFFFF).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from unnormalised ``probs`` [S, N] with uniforms ``u`` [S]: the first
    index whose cumulative mass exceeds ``u * total``; zero-probability entries are never hit."""
    cum = probs.cumsum(dim=-1)
    target = (u * cum[:, -1])[:, None]
    return torch.searchsorted(cum, target, right=True).clamp_(max=probs.shape[-1] - 1)[:, 0]


@dataclass
class StepSampling:
    """Host-side description of one step's sampling rows (built by the runner)."""

    rows: np.ndarray  # [S] block-table rows of the sampling sequences
    gen_idx: np.ndarray  # [S] index of the token being generated (0 = first)
    params: np.ndarray  # [S, NUM_COLS] float64 rows of the parameter table
    any_sampling: bool
    top_kp_width: int  # candidates kept for top-k/top-p rows (0: no sampled row uses them)
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
        # rows whose bias table row holds a former owner's biases: the bias of every row of a step
        # is added whenever one row has any, so a row is zeroed before its next owner runs
        self.bias_dirty = np.zeros(max_rows, dtype=bool)
        self.live_min_new = np.zeros(max_rows, dtype=bool)
        self.seen: torch.Tensor | None = None  # [rows, V] bool: prompt and generated tokens
        self.counts: torch.Tensor | None = None  # [rows, V] float32: generated-token counts (no cast per step)
        self.bias: torch.Tensor | None = None  # [rows, V] float32
        self.stop_mask: torch.Tensor | None = None  # [rows, V] bool: tokens min_new_tokens suppresses
        self._staged_inits = _no_inits()  # row initialisations not yet staged
        self._inits_dirty = False  # whether _staged_inits may hold any
        # bumped whenever a row's parameters or live flags change (init_row, free_row): what the
        # step-to-step reuse below is keyed on
        self._version = 0
        self._last: tuple[int, list[int], StepSampling, dict[str, np.ndarray]] | None = None
        self._flags: tuple[int, tuple[bool, bool, bool]] | None = None
        # a device-side True for index_put_: assigning a Python scalar through tensor indices
        # copies it from host memory on every call, a blocking copy on CUDA
        self.true = torch.ones((), dtype=torch.bool, device=device)

    def _buf(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        t = getattr(self, name)
        if t is None:
            t = torch.zeros(self.table.shape[0], self.vocab, dtype=dtype, device=self.device)
            setattr(self, name, t)
        return t

    def init_row(self, row: int, req: Request) -> None:
        """(Re)fill a row for a request admitted to it (fresh, or resumed after preemption)."""
        sp = req.params
        self._version += 1
        self._inits_dirty = True
        t = self.table[row]
        # (validated at submit; a temperature below MIN_TEMPERATURE would overflow the logits, and
        # a top_k past the vocabulary keeps it all)
        t[C_TEMP] = 0.0 if sp.is_greedy else max(sp.temperature or 0.0, MIN_TEMPERATURE)
        t[C_TOPK] = min(sp.top_k or 0, self.vocab)
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
        penalty = t[C_REP] != 1.0 or t[C_PRES] != 0.0 or t[C_FREQ] != 0.0
        self.live_penalty[row] = penalty
        ops = self._staged_inits
        if penalty:  # seen: prompt and generated tokens; counts: generated ones
            ops["pen_rows"].append(row)
            ops["seen_r"].append(np.full(len(req.token_ids), row, dtype=np.int64))
            ops["seen_c"].append(np.asarray(req.token_ids, dtype=np.int64))
            gen = req.token_ids[req.prompt_len :]
            ops["cnt_r"].append(np.full(len(gen), row, dtype=np.int64))
            ops["cnt_c"].append(np.asarray(gen, dtype=np.int64))
        self.live_bias[row] = bool(sp.logit_bias)
        if sp.logit_bias or self.bias_dirty[row]:
            ops["bias_rows"].append(row)  # zeroed, then this request's biases (if any) written
            self.bias_dirty[row] = bool(sp.logit_bias)
        if sp.logit_bias:
            ops["bias_r"].append(np.full(len(sp.logit_bias), row, dtype=np.int64))
            ops["bias_c"].append(np.fromiter(sp.logit_bias.keys(), dtype=np.int64))
            ops["bias_v"].append(np.fromiter(sp.logit_bias.values(), dtype=np.float32))
        # the tokens min_new_tokens holds back (the rule's one statement: SamplingParams.held_stops),
        # suppressed on the device while gen_idx < C_MINNEW
        held = sp.held_stops(req.stop_token_ids)
        self.live_min_new[row] = bool(held)
        if held:
            ops["stop_rows"].append(row)
            ops["stop_r"].append(np.full(len(held), row, dtype=np.int64))
            ops["stop_c"].append(np.asarray(sorted(held), dtype=np.int64))

    def free_row(self, row: int) -> None:
        self._version += 1
        self.live_penalty[row] = self.live_bias[row] = self.live_min_new[row] = False

    def stage(self, st: StagingSet, rows: list[int], gen_idx: list[int]) -> StepSampling:
        """This step's sampling inputs, queued on the staging set ``st`` (an
        ``acb.runner.input_batch.StagingSet``) with the row (re)initialisations since the last step."""
        gen = np.asarray(gen_idx, dtype=np.int64)
        last = self._last
        if REUSE and not self._inits_dirty and last is not None and last[0] == self._version and last[1] == rows:
            prev, arrays = last[2], last[3]
            for name, a in arrays.items():
                st.add(name, a if name != "sp_gen" else gen)
            return StepSampling(
                prev.rows, gen, prev.params, prev.any_sampling, prev.top_kp_width, prev.any_min_p, prev.max_logprobs
            )
        r = np.asarray(rows, dtype=np.int64)
        params = self.table[r]
        sampled = params[:, C_TEMP] > 0
        trunc = sampled & ((params[:, C_TOPK] > 0) | (params[:, C_TOPP] < 1))
        # top-p then runs on the top-k survivors, so only top-p without top-k needs every token
        widths = np.where(params[:, C_TOPK] > 0, np.minimum(params[:, C_TOPK], self.vocab), self.vocab)
        arrays = {"sp_rows": r, "sp_params": params.astype(np.float32), "sp_gen": gen}
        any_sampling = bool(sampled.any())
        if any_sampling:
            arrays["sp_seeds"] = (params[:, C_SEED_HI].astype(np.int64) << 32) | params[:, C_SEED_LO].astype(np.int64)
        for name, a in arrays.items():
            st.add(name, a)
        if self._inits_dirty:
            for name, parts in self._staged_inits.items():
                if parts:
                    st.add(name, np.asarray(parts, dtype=np.int64) if name.endswith("_rows") else np.concatenate(parts))
            self._staged_inits = _no_inits()
            self._inits_dirty = False
        step = StepSampling(
            rows=r,
            gen_idx=gen,
            params=params,
            any_sampling=any_sampling,
            top_kp_width=int(widths[trunc].max()) if trunc.any() else 0,
            any_min_p=bool((sampled & (params[:, C_MINP] > 0)).any()),
            max_logprobs=int(params[:, C_NLOGPROBS].max()) if len(r) else -1,
        )
        self._last = (self._version, list(rows), step, arrays)
        return step

    def live(self) -> tuple[bool, bool, bool]:
        """Whether any row has penalties, logit biases, min_new_tokens stops (kept per row version)."""
        flags = self._flags
        if REUSE and flags is not None and flags[0] == self._version:
            return flags[1]
        now = (bool(self.live_penalty.any()), bool(self.live_bias.any()), bool(self.live_min_new.any()))
        self._flags = (self._version, now)
        return now

    def apply_inits(self, dev: dict[str, torch.Tensor]) -> None:
        """On the device: write the staged row initialisations into the history tables."""
        if "pen_rows" in dev:
            seen, counts = self._buf("seen", torch.bool), self._buf("counts", torch.float32)
            seen.index_fill_(0, dev["pen_rows"], False)
            counts.index_fill_(0, dev["pen_rows"], 0.0)
            seen.index_put_((dev["seen_r"], dev["seen_c"]), self.true)
            if "cnt_r" in dev:
                counts.index_put_(
                    (dev["cnt_r"], dev["cnt_c"]), torch.ones_like(dev["cnt_r"], dtype=torch.float32), accumulate=True
                )
        if "bias_rows" in dev:
            bias = self._buf("bias", torch.float32)
            bias.index_fill_(0, dev["bias_rows"], 0.0)
            if "bias_r" in dev:  # (rows only zeroed for an owner without biases have no entries)
                bias[dev["bias_r"], dev["bias_c"]] = dev["bias_v"]
        if "stop_rows" in dev:
            mask = self._buf("stop_mask", torch.bool)
            mask.index_fill_(0, dev["stop_rows"], False)
            mask.index_put_((dev["stop_r"], dev["stop_c"]), self.true)


def _no_inits() -> dict[str, list]:
    names = (
        "pen_rows",
        "seen_r",
        "seen_c",
        "cnt_r",
        "cnt_c",
        "bias_rows",
        "bias_r",
        "bias_c",
        "bias_v",
        "stop_rows",
        "stop_r",
        "stop_c",
    )
    return {n: [] for n in names}


@dataclass
class Processed:
    """One step's processed logits.

    ``x``: after bias, penalties and min_new_tokens (greedy rows take its argmax).
    Sampled rows draw from ``plain`` (temperature, min-p) or, for rows using top-k/top-p, from
    the candidates ``cand_vals`` / ``cand_ids`` (the ``width`` best tokens, sorted, with
    top-k, top-p and min-p applied as ``-inf``).
    """

    x: torch.Tensor  # [S, V]
    plain: torch.Tensor | None  # [S, V]
    cand_vals: torch.Tensor | None  # [S, width]
    cand_ids: torch.Tensor | None  # [S, width]
    trunc_rows: torch.Tensor | None  # [S] bool: rows that sample from the candidates

    def full(self, temp: torch.Tensor) -> torch.Tensor:
        """``[S, V]`` logits each row's token is drawn from (``x`` for greedy rows)."""
        if self.plain is None:
            return self.x
        y = self.plain
        if self.cand_vals is not None:
            cand_ids, trunc_rows = self.cand_ids, self.trunc_rows
            assert cand_ids is not None and trunc_rows is not None  # set together with cand_vals
            scattered = torch.full_like(y, float("-inf")).scatter_(1, cand_ids, self.cand_vals)
            y = torch.where(trunc_rows[:, None], scattered, y)
        return torch.where((temp > 0)[:, None], y, self.x)


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
    top_kp_width: int = 0,
    any_min_p: bool = False,
) -> Processed:
    """The processors, in transformers' order, batched over rows with different parameters."""
    neg_inf = float("-inf")
    x = logits
    # the history buffers a flag asks for were allocated when a row first needed them (apply_inits)
    if use_bias:
        bias = state.bias
        assert bias is not None
        x = x + bias[rows]
    if use_penalty:
        seen, counts = state.seen, state.counts
        assert seen is not None and counts is not None
        rep = p[:, C_REP, None]
        x = torch.where(seen[rows], torch.where(x < 0, x * rep, x / rep), x)
        cnt = counts[rows]
        x = x - p[:, C_FREQ, None] * cnt - p[:, C_PRES, None] * (cnt > 0).to(x.dtype)
    if use_min_new:
        stop_mask = state.stop_mask
        assert stop_mask is not None
        suppress = stop_mask[rows] & (gen_idx < p[:, C_MINNEW].long())[:, None]
        x = x.masked_fill(suppress, neg_inf)
    if not any_sampling:
        return Processed(x, None, None, None, None)
    temp = p[:, C_TEMP]
    y = x / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None]
    plain = _min_p(y, p[:, C_MINP]) if any_min_p else y
    if not top_kp_width:
        return Processed(x, plain, None, None, None)
    # top-k / top-p on the best `width` tokens, sorted descending (a full sort only when some
    # row uses top-p without top-k); equal to transformers' ascending-sort formulation
    top_k, top_p = p[:, C_TOPK].long(), p[:, C_TOPP]
    vals, ids = y.topk(top_kp_width, dim=-1)
    pos = torch.arange(top_kp_width, device=y.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, y.shape[-1]))
    kth = vals.gather(1, (k.clamp(max=top_kp_width) - 1)[:, None])
    vals = vals.masked_fill((pos >= k[:, None]) & (vals < kth), neg_inf)  # ties with the k-th stay
    probs = vals.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely candidates
    vals = vals.masked_fill((mass_before >= top_p[:, None]) & (pos > 0), neg_inf)
    if any_min_p:
        vals = _min_p(vals, p[:, C_MINP])
    trunc = (temp > 0) & ((top_k > 0) | (top_p < 1))
    return Processed(x, plain, vals, ids, trunc)


def _min_p(y: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = y.softmax(dim=-1)
    return y.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))


def sample(
    logits: torch.Tensor,  # [S, V] any float dtype
    step: StepSampling,
    state: SamplingState,
    dev: dict[str, torch.Tensor],
    grammar: GrammarMask | None = None,
) -> torch.Tensor:
    """Sampled ids, packed with logprobs when asked: ``[S]`` long, or ``[S, 2 + 2k]`` float64
    rows of (id, chosen logprob, k alternative ids, k alternative logprobs).

    ``grammar`` (structured outputs): the constrained rows' token bitmask, applied to the logits
    before every other processor; ``"raw"`` logprobs stay the model's (before the mask)."""
    rows, p, gen_idx = dev["sp_rows"], dev["sp_params"], dev["sp_gen"]  # staged by SamplingState.stage
    unmasked = None
    if grammar is not None:
        from acb.structured import apply_bitmask  # (xgrammar's kernels; imported once a request asks)

        if step.max_logprobs >= 0:  # logprobs: "raw" ones are read from the logits before the mask
            unmasked = logits.float()
            logits = unmasked.clone()
        elif logits.dtype != torch.float32:
            logits = logits.float()
        # (else masked in place: nothing reads this step's sampled rows' logits after the sampler)
        apply_bitmask(logits, grammar.bitmask, grammar.rows)
    use_penalty, use_bias, use_min_new = state.live()
    if not (use_penalty or use_bias or use_min_new or step.any_sampling) and step.max_logprobs < 0:
        # plain greedy: argmax of the model's logits as they are (the float32 upcast would pick
        # the same first maximum), without materialising a float32 copy of [S, V]
        return logits.argmax(dim=-1)
    raw = logits.float()
    pr = process_logits(
        raw,
        p,
        gen_idx,
        rows,
        state,
        use_penalty=use_penalty,
        use_bias=use_bias,
        use_min_new=use_min_new,
        any_sampling=step.any_sampling,
        top_kp_width=step.top_kp_width,
        any_min_p=step.any_min_p,
    )
    ids = pr.x.argmax(dim=-1)
    temp = p[:, C_TEMP]
    if step.any_sampling:
        u = seeded_uniforms(dev["sp_seeds"], gen_idx)
        plain = pr.plain
        assert plain is not None  # set whenever any row samples
        sampled = _inverse_cdf((plain - plain.amax(dim=-1, keepdim=True)).exp(), u)
        cv, cand_ids, trunc_rows = pr.cand_vals, pr.cand_ids, pr.trunc_rows
        if cv is not None:
            assert cand_ids is not None and trunc_rows is not None  # set together with cand_vals
            pick = _inverse_cdf((cv - cv[:, :1]).exp(), u)  # candidates are sorted: column 0 is the max
            sampled = torch.where(trunc_rows, cand_ids.gather(1, pick[:, None])[:, 0], sampled)
        ids = torch.where(temp > 0, sampled, ids)
    if use_penalty:  # history for the next step, updated on the device
        seen, counts = state.seen, state.counts
        assert seen is not None and counts is not None  # allocated by apply_inits
        seen.index_put_((rows, ids), state.true)
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    if step.max_logprobs < 0:
        return ids
    src = raw if unmasked is None else unmasked
    if bool((step.params[:, C_PROCESSED] > 0).any()):
        src = torch.where((p[:, C_PROCESSED] > 0)[:, None], pr.full(temp), raw)
    lp = torch.log_softmax(src, dim=-1)
    chosen = lp.gather(1, ids[:, None])
    cols = [ids[:, None].double(), chosen.double()]
    if step.max_logprobs > 0:
        top_lp, top_ids = lp.topk(step.max_logprobs, dim=-1)
        cols += [top_ids.double(), top_lp.double()]
    return torch.cat(cols, dim=1)


def stage_standalone(
    state: SamplingState, rows: list[int], gen_idx: list[int]
) -> tuple[StepSampling, dict[str, torch.Tensor]]:
    """Stage and apply one step's sampling inputs outside an engine (tests, benchmarks):
    returns what :func:`sample` and :func:`process_logits` take."""
    from acb.runner.input_batch import DeviceStreams, StagingSet

    st = StagingSet(0, 1 << 12, state.device, DeviceStreams(state.device))
    step = state.stage(st, rows, gen_idx)
    dev = st.send()
    state.apply_inits(dev)
    return step, dev
