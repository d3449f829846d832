"""The input processor (acb/api/processor.py) is pure and holds no engine: it checks a submit and
builds its EngineRequest from plain values (the engine's ModelFacts, the tokenizer, the defaults,
the grammar holder, the image token), and nothing else happens until the submit opens it
(acb/api/submissions.py): no id claimed, no sink registered, no trace begun, no seed drawn."""

from __future__ import annotations

import dataclasses
import gc
import types

import pytest

import acb
from acb.api import submissions
from acb.api.base import EngineBase
from acb.api.grammars import Grammars
from acb.api.processor import InputProcessor, ModelFacts
from acb.api.scoring import plan
from acb.api.sinks import ThreadSink
from acb.core.engine_core import EngineCore
from acb.models import build_tokenizer
from acb.runner.model_runner import ModelRunner
from tests.conftest import get_model


@pytest.fixture
def traces(monkeypatch):
    """Every trace the submit path begins (telemetry.begin, counted whether or not it is on)."""
    begun: list[object] = []
    original = submissions.begin

    def counting(prompt, model, params):
        begun.append(prompt)
        return original(prompt, model, params)

    monkeypatch.setattr(submissions, "begin", counting)
    return begun


def _reaches(root: object, kinds: tuple[type, ...], limit: int = 200_000) -> list[object]:
    """Instances of ``kinds`` reachable from ``root`` through its references (not through
    classes, modules or functions, which reach everything)."""
    seen, todo, found = {id(root)}, [root], []
    while todo and len(seen) < limit:
        obj = todo.pop()
        if isinstance(obj, kinds):
            found.append(obj)
        for ref in gc.get_referents(obj):
            if id(ref) in seen or isinstance(ref, (type, types.ModuleType, types.FunctionType)):
                continue
            seen.add(id(ref))
            todo.append(ref)
    return found


def test_processing_a_submit_has_no_side_effects(traces):
    """Processing the same generation and scoring submits twice, then dropping them, leaves the
    engine as it was: no id claimed, no sink registered, no trace begun, no seed drawn (the next
    real submit's seed is the one it would have had); both results are the same request. The
    submit itself (make_request) does all four, and abandon undoes the first two."""
    model = get_model("llama")
    cfg = acb.ContinuousBatchingConfig(num_blocks=32, page_size=8, seed=7)
    sampling = acb.SamplingParams(max_new_tokens=4, n=2, temperature=0.8)
    (group,) = plan([5, 6, 7, 8, 9], [[3], [4, 5, 6]], 1)
    targets = [m.target for m in group]
    with acb.Engine(model, cfg, tokenizer=build_tokenizer()) as eng:
        processor = eng.processor
        made = [processor.process("a prompt", sampling, cache_salt="s") for _ in range(2)]
        scored = [processor.process_score(targets, 2, request_id="mine") for _ in range(2)]
        del processor
        assert made[0] == made[1] and scored[0] == scored[1]
        er = made[0].request
        assert (er.request_id, er.sink_key, er.seed, er.n, er.cache_salt) == ("", -1, 0, 2, "s")
        assert made[0].request_id is None and scored[0].request_id == "mine"
        assert not eng.ids.live and len(eng.sinks) == 0 and traces == []
        # the submit: ids, sink, trace, and the seed the engine's seed gives its first request
        sub = eng.make_request("a prompt", sampling, sink_factory=ThreadSink, cache_salt="s")
        assert sub.request_id == "req_0" and eng.ids.live == {"req_0", "req_0#1"}
        assert len(eng.sinks) == 1 and traces == ["a prompt"]
        assert dataclasses.replace(
            sub.engine_request, request_id="", sink_key=-1, seed=0, created_time=0.0
        ) == dataclasses.replace(er, created_time=0.0)
        eng.abandon(sub)
        assert not eng.ids.live and len(eng.sinks) == 0
    with acb.Engine(model, cfg) as twin:  # the same seed, nothing processed first
        first = twin.make_request([1, 2, 3], sampling, sink_factory=ThreadSink)
        twin.abandon(first)
    assert sub.engine_request.seed == first.engine_request.seed  # (processing drew no seed)


def test_the_processor_is_built_from_its_parts_and_holds_no_engine():
    """An InputProcessor made from plain parts (the facts the engine read at start, a tokenizer,
    defaults, a grammar holder) checks and builds what the engine's own does, and neither reaches
    an engine, its core or its runner."""
    model = get_model("llama")
    tok = build_tokenizer()
    with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=32, page_size=8), tokenizer=tok) as eng:
        facts = eng.processor.facts
        assert isinstance(facts, ModelFacts)
        mine = InputProcessor(ModelFacts(**vars(facts)), tok, eng.defaults, Grammars(tok), None)
        assert any(e is eng for e in _reaches([eng], (EngineBase,)))  # (the walk finds one where there is one)
        for p in (mine, eng.processor):
            assert not _reaches(p, (EngineBase, EngineCore, ModelRunner))
        sampling = acb.SamplingParams(max_new_tokens=3, stop_token_ids=[1])
        assert mine.process("hello there", sampling) == eng.processor.process("hello there", sampling)
        with pytest.raises(acb.InvalidRequestError) as info:
            mine.process([facts.input_vocab_size], sampling)
        assert info.value.field == "prompt"
    unstarted = InputProcessor(None, tok, eng.defaults, Grammars(tok), None)
    with pytest.raises(acb.EngineNotRunningError):
        unstarted.process("hello", sampling)
