"""The sampler against transformers' logits processors, and its distribution."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import acb
from acb.core.request import Request
from acb.runner.sampler import C_TEMP, SamplingState, process_logits, sample, seeded_uniforms, stage_standalone
from acb.sampling_params import FALLBACK

V = 64
EOS = 2


def make_req(row, params: acb.SamplingParams, prompt, generated=(), seed=0):
    r = Request(f"r{row}", list(prompt), max_new_tokens=100, stop_token_ids=frozenset({EOS}), params=params, seed=seed)
    r.token_ids.extend(generated)
    r.row = row
    return r


def hf_processors(sp: acb.SamplingParams, prompt_len: int) -> LogitsProcessorList:
    procs = LogitsProcessorList()
    if sp.repetition_penalty not in (None, 1.0):
        procs.append(RepetitionPenaltyLogitsProcessor(sp.repetition_penalty))
    if sp.min_new_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, sp.min_new_tokens, EOS))
    if not sp.is_greedy:
        if sp.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(sp.temperature))
        if sp.top_k:
            procs.append(TopKLogitsWarper(sp.top_k))
        if sp.top_p is not None and sp.top_p < 1.0:
            procs.append(TopPLogitsWarper(sp.top_p))
        if sp.min_p:
            procs.append(MinPLogitsWarper(sp.min_p))
    return procs


CASES = [
    acb.SamplingParams(temperature=0.0),
    acb.SamplingParams(temperature=0.7),
    acb.SamplingParams(temperature=1.0, top_k=5),
    acb.SamplingParams(temperature=1.3, top_p=0.8),
    acb.SamplingParams(temperature=0.9, top_k=10, top_p=0.5),
    acb.SamplingParams(temperature=1.0, min_p=0.1),
    acb.SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
    acb.SamplingParams(temperature=0.0, repetition_penalty=1.5),
    acb.SamplingParams(temperature=1.1, repetition_penalty=0.7, top_k=8),
    acb.SamplingParams(temperature=0.0, min_new_tokens=5),
    acb.SamplingParams(temperature=1.0, min_new_tokens=2, top_p=0.95),
    acb.SamplingParams(temperature=1.0, top_k=100),  # k larger than the vocabulary
]


def _run_process(cases, logits, prompts, gens):
    state = SamplingState(len(cases), V, torch.device("cpu"))
    reqs = [
        make_req(i, sp.merged_over(acb.sampling_params.FALLBACK), prompts[i], gens[i]) for i, sp in enumerate(cases)
    ]
    for r in reqs:
        state.init_row(r.row, r)
    step, dev = stage_standalone(state, [r.row for r in reqs], [len(g) for g in gens])
    p = dev["sp_params"]
    pr = process_logits(
        logits,
        p,
        dev["sp_gen"],
        dev["sp_rows"],
        state,
        use_penalty=bool(state.live_penalty.any()),
        use_bias=False,
        use_min_new=bool(state.live_min_new.any()),
        any_sampling=step.any_sampling,
        top_kp_width=step.top_kp_width,
        any_min_p=step.any_min_p,
    )
    return reqs, pr.x, pr.full(p[:, C_TEMP])


def test_processed_logits_equal_transformers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), V, generator=g) * 3
    prompts = [torch.randint(3, V, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in CASES]
    gens = [torch.randint(0, V, (i % 4,), generator=g).tolist() for i in range(len(CASES))]
    reqs, x, y = _run_process(CASES, logits, prompts, gens)
    for i, sp in enumerate(CASES):
        input_ids = torch.tensor([prompts[i] + gens[i]])
        expected = hf_processors(reqs[i].params, len(prompts[i]))(input_ids, logits[i : i + 1].clone())[0]
        ours = x[i] if reqs[i].params.is_greedy else y[i]
        finite = torch.isfinite(expected)
        assert torch.equal(finite, torch.isfinite(ours)), f"case {i}: different tokens kept ({sp})"
        torch.testing.assert_close(ours[finite], expected[finite], rtol=1e-5, atol=1e-5, msg=f"case {i}: {sp}")


def test_presence_frequency_and_bias():
    logits = torch.zeros(1, V)
    sp = acb.SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: 2.0, 9: -1.0})
    state = SamplingState(1, V, torch.device("cpu"))
    r = make_req(0, sp.merged_over(acb.sampling_params.FALLBACK), [3, 4], generated=[5, 5, 6])
    state.init_row(0, r)
    step, dev = stage_standalone(state, [0], [3])
    p = dev["sp_params"]
    x = process_logits(
        logits,
        p,
        torch.tensor([3]),
        torch.tensor([0]),
        state,
        use_penalty=True,
        use_bias=True,
        use_min_new=False,
        any_sampling=False,
    ).x
    expected = torch.zeros(V)
    expected[7] += 2.0
    expected[9] -= 1.0
    expected[5] -= 0.5 + 2 * 0.25  # generated twice
    expected[6] -= 0.5 + 0.25
    # prompt tokens are not penalised by presence/frequency (they are by repetition_penalty)
    torch.testing.assert_close(x[0], expected)


def test_seeded_uniforms_depend_only_on_seed_and_counter():
    a = seeded_uniforms(torch.tensor([5, 7, 5]), torch.tensor([0, 0, 1]))
    b = seeded_uniforms(torch.tensor([7]), torch.tensor([0]))
    assert a[1] == b[0] and a[0] != a[2] and a[0] != a[1]
    u = seeded_uniforms(torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    assert 0 < u.min() and u.max() < 1
    # uniform on (0, 1): every decile holds about a tenth
    hist = torch.histc(u, bins=10, min=0, max=1) / len(u)
    assert (hist - 0.1).abs().max() < 0.01


@pytest.mark.parametrize(
    "sp",
    [
        acb.SamplingParams(temperature=0.8),
        acb.SamplingParams(temperature=1.2, top_k=6),
        acb.SamplingParams(temperature=1.0, top_p=0.7),
        acb.SamplingParams(temperature=1.0, min_p=0.2, repetition_penalty=1.3),
        acb.SamplingParams(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05),
    ],
)
def test_sampling_frequencies_match_processed_softmax(sp):
    n = 20000
    g = torch.Generator().manual_seed(1)
    base = torch.randn(1, V, generator=g) * 1.5
    state = SamplingState(n, V, torch.device("cpu"))
    params = sp.merged_over(acb.sampling_params.FALLBACK)
    for i in range(n):  # n independent draws: same logits, different seeds
        state.init_row(i, make_req(i, params, [3, 4, 5], seed=1000 + i))
    step, dev = stage_standalone(state, list(range(n)), [0] * n)
    ids = sample(base.expand(n, V).contiguous(), step, state, dev)
    counts = torch.bincount(ids, minlength=V).double() / n
    _, x, y = _run_process([params], base, [[3, 4, 5]], [[]])
    probs = torch.softmax(y[0].double(), -1)
    tv = 0.5 * (counts - probs).abs().sum().item()
    assert tv < 0.03, f"total variation {tv:.4f} between sampled frequencies and the processed softmax"
    assert counts[probs == 0].sum() == 0, "sampled a token the processors removed"


def test_plain_greedy_on_half_precision_logits_equals_the_float32_argmax():
    g = torch.Generator().manual_seed(3)
    n = 64
    logits = (torch.randn(n, V, generator=g) * 2).round().to(torch.bfloat16)  # many ties
    state = SamplingState(n, V, torch.device("cpu"))
    for i in range(n):
        state.init_row(i, make_req(i, acb.SamplingParams().merged_over(acb.sampling_params.FALLBACK), [3, 4]))
    step, dev = stage_standalone(state, list(range(n)), [0] * n)
    ids = sample(logits, step, state, dev)
    assert ids.dtype == torch.long and torch.equal(ids, logits.float().argmax(dim=-1))


def test_reused_step_parameters_follow_rows_that_join_leave_and_change(monkeypatch):
    """Issue 54 item 5: a step with the previous step's rows reuses its parameter rows, so a row
    freed and given to a request with other parameters between two steps (the same row list)
    must stage the new parameters, as must rows joining, leaving or reordering."""
    from acb.runner import sampler as sampler_mod

    greedy = acb.SamplingParams(max_new_tokens=8)
    hot = acb.SamplingParams(temperature=0.7, top_k=5, max_new_tokens=8, logprobs=2)
    pen = acb.SamplingParams(temperature=1.3, repetition_penalty=1.2, max_new_tokens=8, logit_bias={3: 1.5})
    # per step: (rows freed, (row, params) initialised, the step's rows, gen_idx)
    plan = [
        ([], [(0, greedy), (1, hot)], [0, 1], [0, 0]),
        ([], [], [0, 1], [1, 1]),
        ([], [], [0, 1], [2, 2]),
        ([], [(1, pen)], [0, 1], [3, 0]),  # row 1 (re)initialised: same rows, new parameters
        ([], [], [0, 1], [4, 1]),
        ([1], [], [0], [5]),  # row 1 left (and with it the penalties and biases)
        ([], [(2, greedy)], [0, 2], [6, 0]),  # row 2 joined
        ([], [], [2, 0], [1, 7]),  # reordered
    ]

    def run(reuse: bool) -> list[tuple]:
        monkeypatch.setattr(sampler_mod, "REUSE", reuse)
        state = SamplingState(4, V, torch.device("cpu"))
        seen = []
        for freed, inits, rows, gen in plan:
            for r in freed:
                state.free_row(r)
            for r, sp in inits:
                state.init_row(r, make_req(r, sp, [5, 6, 7], seed=r + 1))
            step, dev = stage_standalone(state, rows, gen)
            seen.append(
                (
                    {k: v.tolist() for k, v in dev.items()},
                    step.rows.tolist(),
                    step.gen_idx.tolist(),
                    step.params.tolist(),
                    step.any_sampling,
                    step.top_kp_width,
                    step.any_min_p,
                    step.max_logprobs,
                    state.live(),
                )
            )
        return seen

    fast, general = run(True), run(False)
    assert fast == general
    assert fast[2][8] == (False, False, False) and fast[3][8] == (True, True, False)
    assert fast[5][8] == (False, False, False)


BAN_CASES = [
    acb.SamplingParams(min_new_tokens=2),
    acb.SamplingParams(min_new_tokens=2, logit_bias={5: float("-inf"), 6: -100.0}),
    acb.SamplingParams(logit_bias={EOS: float("-inf")}),
    acb.SamplingParams(),
    acb.SamplingParams(min_new_tokens=3, logit_bias={7: float("-inf"), 8: 3.0}, temperature=0.0),
]


def _banned(gen_idx: int, stops: frozenset[int]) -> list[set[int]]:
    """The tokens the sampler's processors set to -inf, per BAN_CASES row, at ``gen_idx``."""
    state = SamplingState(len(BAN_CASES), V, torch.device("cpu"))
    for i, sp in enumerate(BAN_CASES):
        r = Request(f"r{i}", [3, 4], max_new_tokens=10, stop_token_ids=stops, params=sp.merged_over(FALLBACK))
        state.init_row(i, r)
    rows = list(range(len(BAN_CASES)))
    step, dev = stage_standalone(state, rows, [gen_idx] * len(rows))
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(gen_idx))
    use_penalty, use_bias, use_min_new = state.live()
    x = process_logits(
        logits,
        dev["sp_params"],
        dev["sp_gen"],
        dev["sp_rows"],
        state,
        use_penalty=use_penalty,
        use_bias=use_bias,
        use_min_new=use_min_new,
        any_sampling=False,
    ).x
    return [set(torch.isneginf(x[i]).nonzero().flatten().tolist()) for i in rows]


@pytest.mark.parametrize("gen_idx", [0, 1, 2, 3])
def test_what_the_sampler_bans_is_the_one_rule(gen_idx):
    """The tokens the sampler never samples (-inf after the bias and min_new_tokens) are exactly
    SamplingParams.never_sampled, the rule structured outputs' dead-end check reads
    (acb.core.grammar_masks); before, the check kept its own copy of the sampler's rules."""
    stops = frozenset({EOS, 11})
    banned = _banned(gen_idx, stops)
    for sp, got in zip(BAN_CASES, banned):
        assert got == set(sp.merged_over(FALLBACK).never_sampled(stops, gen_idx)), sp


def test_the_sampler_reads_the_rule_it_shares(monkeypatch):
    """The sampler's min_new_tokens table is built from SamplingParams.held_stops itself: a change
    of the rule there changes both what the sampler bans and what never_sampled says."""
    monkeypatch.setattr(acb.SamplingParams, "held_stops", lambda self, stops: frozenset({13}))
    banned = _banned(0, frozenset({EOS}))
    assert banned[0] == {13} and banned[3] == set()  # (min_new_tokens=2; none)
    for sp, got in zip(BAN_CASES, banned):
        assert got == set(sp.merged_over(FALLBACK).never_sampled(frozenset({EOS}), 0)), sp
