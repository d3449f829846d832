"""Structured outputs' masks come with the scheduler's output (acb.core.grammar_masks), and the
token bans they read are the sampler's, stated once (SamplingParams.never_sampled); no torch, no
xgrammar: the grammar compiler is a fake over sets of allowed tokens."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from acb.core.block_pool import BlockPool
from acb.core.grammar_masks import GrammarMasks
from acb.core.messages import EngineRequest
from acb.core.request_builder import build_request
from acb.core.scheduler import Scheduler
from acb.outputs import FinishReason
from acb.sampling_params import FALLBACK
from acb.structured_outputs import StructuredOutputs

EOS, B = 2, 9
NEG_INF = -math.inf


class FakeMatcher:
    """Allows ``allowed`` at every step."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def fill_mask(self, bitmask: list, row: int) -> bool:
        bitmask[row] = set(self.allowed)
        return True

    def accept(self, token: int) -> bool:
        return token in self.allowed

    def is_terminated(self) -> bool:
        return False


class FakeCompiler:
    """A GrammarSupport whose bitmask rows are sets of allowed tokens (None: all allowed); every
    grammar allows ``a`` (3), ``B`` and EOS."""

    def __init__(self) -> None:
        self.excluded: list[list] = []  # what each dead_ends call was given

    def compile_now(self, spec):
        return self

    def matcher(self) -> FakeMatcher:
        return FakeMatcher({3, B, EOS})

    def bitmask(self, rows: int) -> list:
        return [None] * rows

    def dead_ends(self, bitmask, rows, excluded):
        self.excluded.append([set(e) for e in excluded])
        dead = [r for r, ex in zip(rows, excluded) if not bitmask[r] - set(ex)]
        for r in dead:
            bitmask[r] = None
        return dead


def engine_request(rid: str, key: int, constrained: bool, **params) -> EngineRequest:
    sp = replace(FALLBACK, structured_outputs=StructuredOutputs(regex="x") if constrained else None, **params)
    return EngineRequest(rid, key, (5, 6, 7), sp, 8, frozenset({EOS}), 0)


def scheduler(masks: GrammarMasks) -> Scheduler:
    return Scheduler(BlockPool(64), block_size=4, max_batch_tokens=64, max_running=8, grammar=masks)


def test_the_compiler_is_built_by_the_first_constrained_request_only():
    built: list[FakeCompiler] = []

    def factory() -> FakeCompiler:
        built.append(FakeCompiler())
        return built[-1]

    masks = GrammarMasks(factory)
    assert masks.compiler_for(engine_request("free", 0, False)) is None and not built
    s = scheduler(masks)
    s.add(build_request(engine_request("free", 0, False), None, None))
    assert s.schedule().grammar is None  # (an engine that never saw structured outputs skips the masks)
    first = masks.compiler_for(engine_request("c1", 1, True))
    assert masks.compiler_for(engine_request("c2", 2, True)) is first and built == [first]
    with pytest.raises(RuntimeError, match="no grammar compiler"):
        GrammarMasks(None).compiler_for(engine_request("c", 0, True))


def test_the_scheduler_output_carries_the_masks_and_the_dead_ends():
    """A grammar allowing only ``a``, ``B`` and EOS: a dead end once min_new_tokens holds EOS back and
    ``B`` has a -inf bias, not with either alone; the free request's row is not constrained."""
    compiler = FakeCompiler()
    masks = GrammarMasks(lambda: compiler)
    cases = {
        "both": dict(min_new_tokens=2, logit_bias={B: NEG_INF, 3: NEG_INF}),
        "min_new": dict(min_new_tokens=2, logit_bias={3: NEG_INF}),
        "bias": dict(logit_bias={B: NEG_INF, 3: NEG_INF}),
        "finite": dict(min_new_tokens=2, logit_bias={B: -100.0, 3: NEG_INF}),
    }
    s = scheduler(masks)
    s.add(build_request(engine_request("free", 0, False), None, None))
    ers = [engine_request(rid, k + 1, True, **p) for k, (rid, p) in enumerate(cases.items())]
    for er in ers:
        s.add(build_request(er, None, masks.compiler_for(er)))
    out = s.schedule()
    assert out.grammar is not None
    bitmask, rows = out.grammar
    assert [out.sample_reqs[i].request_id for i in rows] == list(cases)  # the free request has no row
    assert compiler.excluded == [[{EOS, B, 3}, {EOS, 3}, {B, 3}, {EOS, 3}]]
    dead = {r.request_id for r in out.sample_reqs if r.dead_end}
    assert dead == {"both"} and bitmask[rows[0]] is None  # its row opened: the step samples something
    s.update_from_output(out, [3] * len(out.sample_reqs), None)
    both = s.live.get("both")
    assert both is None or both.finish_reason is FinishReason.GRAMMAR


@pytest.mark.parametrize(
    "min_new, gen_idx, stops, bias, expected",
    [
        (None, 0, {EOS}, None, set()),
        (3, 0, {EOS}, None, {EOS}),
        (3, 2, {EOS, 4}, None, {EOS, 4}),
        (3, 3, {EOS}, None, set()),  # min_new_tokens met
        (3, 0, set(), None, set()),  # no stop token to hold
        (0, 0, {EOS}, {B: NEG_INF}, {B}),
        (2, 1, {EOS}, {B: NEG_INF, 5: -100.0, 6: 100.0}, {EOS, B}),  # only -inf bans
        (2, 1, {EOS}, {EOS: NEG_INF}, {EOS}),
    ],
)
def test_never_sampled_is_the_old_rule(min_new, gen_idx, stops, bias, expected):
    """The stop tokens min_new_tokens holds back while gen_idx < min_new_tokens, and the -inf biases
    (what EngineCore._never_sampled computed before the rule moved to SamplingParams)."""
    sp = replace(FALLBACK, min_new_tokens=min_new, logit_bias=bias)
    assert set(sp.never_sampled(frozenset(stops), gen_idx)) == expected
    assert sp.held_stops(frozenset(stops)) == (frozenset(stops) if min_new else frozenset())
