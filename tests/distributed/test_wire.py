"""What a tensor-parallel leader sends its followers for a new request rebuilds the same request:
same prompt, seed, stop ids, limits and sampling settings (a follower that resolved any of them
differently would schedule differently and break the ranks' lock step). In-process: no torchrun."""

from __future__ import annotations

import dataclasses

import pytest

import acb
from acb.api.sinks import ThreadSink
from acb.core.messages import Add
from acb.core.request_builder import build_request
from acb.core.wire import from_wire, to_wire
from acb.distributed.tp import decode_commands, encode_commands
from acb.models import build_tokenizer, default_model

CASES = [
    dict(max_new_tokens=5, ignore_eos=True),  # the generation config's EOS dropped: must stay dropped
    dict(max_new_tokens=5),  # the generation config's EOS
    dict(max_new_tokens=7, stop_token_ids=(5, 9), ignore_eos=True),  # explicit ids survive ignore_eos
    dict(
        max_new_tokens=4,
        do_sample=True,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_new_tokens=2,
        logit_bias={3: -1.5, 7: 2.0},
        repetition_penalty=1.2,
        logprobs=2,
        logprobs_mode="processed",
    ),
    dict(max_new_tokens=6, n=3, do_sample=True, stop=("ab", "\n")),  # samples and stop strings
    dict(max_new_tokens=3, prompt_logprobs=1, seed=1234),
    # structured outputs: the spec crosses as its fields; each rank compiles it and has its matchers
    dict(max_new_tokens=9, n=2, structured_outputs={"json": {"type": "object", "properties": {"a": {"enum": [1, 2]}}}}),
    dict(max_new_tokens=9, structured_outputs={"choice": ["x", "y z"]}),
]


def _crossed(core, er):
    """``er`` as a follower's core receives it: through the wire and the frame codec."""
    cmd = from_wire(decode_commands(encode_commands([to_wire(Add(er))]))[0])
    assert isinstance(cmd, Add)
    return cmd.req


@pytest.mark.parametrize("kw", CASES)
def test_a_request_crosses_to_the_followers_unchanged(kw):
    """The EngineRequest arrives equal (but for where the leader delivers it and when it came),
    and the engine-thread state a follower builds from it is the leader's."""
    with acb.Engine(default_model(), acb.ContinuousBatchingConfig(num_blocks=64), tokenizer=build_tokenizer()) as eng:
        core = eng.core
        sub = eng.make_request(
            "some prompt", acb.SamplingParams(**kw), sink_factory=ThreadSink, cache_salt="salt", record_timestamps=True
        )
        er = sub.engine_request
        eng.abandon(sub)
        copy = _crossed(core, er)
        assert copy.sink_key == -1  # a follower delivers nowhere
        assert dataclasses.replace(copy, sink_key=er.sink_key, created_time=er.created_time) == er
        grammars = eng.grammars() if er.params.structured_outputs is not None else None
        a, b = build_request(er, eng.tokenizer, grammars), build_request(copy, eng.tokenizer, grammars)
        members = lambda r: r.group.members if r.group is not None else [r]  # noqa: E731
        for x, y in zip(members(a), members(b), strict=True):
            assert (
                x.request_id,
                x.token_ids,
                x.prompt_len,
                x.max_new_tokens,
                x.stop_token_ids,
                x.seed,
                x.want_logprobs,
                x.record_timestamps,
                x.cache_salt,
                x.detok is None,
                x.prompt_lps is None,
            ) == (
                y.request_id,
                y.token_ids,
                y.prompt_len,
                y.max_new_tokens,
                y.stop_token_ids,
                y.seed,
                y.want_logprobs,
                y.record_timestamps,
                y.cache_salt,
                y.detok is None,
                y.prompt_lps is None,
            )
        assert len(members(a)) == (kw.get("n") or 1)
        assert (a.detok is not None) == bool(kw.get("stop"))
        assert all((m.matcher is not None) == ("structured_outputs" in kw) for m in members(b))


def test_a_scoring_group_crosses_to_the_followers_unchanged():
    """A scoring group (context request and the children that fork from it) is rebuilt on a
    follower with the same prompts, scored positions and tokens."""
    from acb.api.scoring import make_score_request, plan

    with acb.Engine(default_model(), acb.ContinuousBatchingConfig(num_blocks=64)) as eng:
        core = eng.core
        (group,) = plan([5, 6, 7, 8, 9], [[3], [4, 5, 6], [4, 5, 7], [8, 9]], 2)
        sub = make_score_request(eng, [m.target for m in group], 2, sink_factory=ThreadSink)
        eng.abandon(sub)
        er = sub.engine_request
        copy = _crossed(core, er)
        assert dataclasses.replace(copy, sink_key=er.sink_key, created_time=er.created_time) == er
        a, b = build_request(er, None), build_request(copy, None)
        for x, y in zip(a.group.members, b.group.members, strict=True):
            assert (x.request_id, x.token_ids, x.scoring, x.lp_start, x.score_next, x.params.prompt_logprobs) == (
                y.request_id,
                y.token_ids,
                y.scoring,
                y.lp_start,
                y.score_next,
                y.params.prompt_logprobs,
            )
        assert [m.token_ids for m in b.group.members] == [m.prompt_ids for m in group]
