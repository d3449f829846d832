"""What a tensor-parallel leader sends its followers for a new request rebuilds the same request:
same prompt, seed, stop ids, limits and sampling settings (a follower that resolved any of them
differently would schedule differently and break the ranks' lock step). In-process: no torchrun."""

from __future__ import annotations

import pytest

from acb.core.messages import Add

import acb
from acb.api.sinks import ThreadSink
from acb.distributed.tp import decode_commands, encode_commands
from acb.models import build_tokenizer, default_model

CASES = [
    dict(max_new_tokens=5, ignore_eos=True),  # the generation config's EOS dropped: must stay dropped
    dict(max_new_tokens=5),  # the generation config's EOS
    dict(max_new_tokens=7, stop_token_ids=(5, 9), ignore_eos=True),  # explicit ids survive ignore_eos
    dict(max_new_tokens=4, do_sample=True, temperature=0.7, top_k=5, top_p=0.9, min_new_tokens=2,
         logit_bias={3: -1.5, 7: 2.0}, repetition_penalty=1.2, logprobs=2, logprobs_mode="processed"),
    dict(max_new_tokens=6, n=3, do_sample=True, stop=("ab", "\n")),  # samples and stop strings
    dict(max_new_tokens=3, prompt_logprobs=1, seed=1234),
]


@pytest.mark.parametrize("kw", CASES)
def test_a_request_crosses_to_the_followers_unchanged(kw):
    with acb.Engine(default_model(), acb.ContinuousBatchingConfig(num_blocks=64), tokenizer=build_tokenizer()) as eng:
        core = eng.core
        req = eng.make_request("some prompt", acb.SamplingParams(**kw), sink_factory=ThreadSink,
                               cache_salt="salt", record_timestamps=True)
        wire = decode_commands(encode_commands([core._wire(Add(req))]))[0]  # through the frame codec
        eng.abandon(req)  # its ids are free again for the rebuilt copy
        core.remote_request = eng._remote_request
        cmd = core._unwire(wire)
        try:
            assert isinstance(cmd, Add)
            copy = cmd.req
            members = [req, *(req.children or ())] if req.group is None else req.group.members
            copies = [copy, *(copy.children or ())] if copy.group is None else copy.group.members
            for a, b in zip(members, copies, strict=True):
                assert (a.request_id, a.token_ids, a.prompt_len, a.max_new_tokens, a.stop_token_ids, a.seed,
                        a.want_logprobs, a.record_timestamps, a.cache_salt) == \
                       (b.request_id, b.token_ids, b.prompt_len, b.max_new_tokens, b.stop_token_ids, b.seed,
                        b.want_logprobs, b.record_timestamps, b.cache_salt)
                assert (a.stop_checker is None) == (b.stop_checker is None)
                assert (a.prompt_lps is None) == (b.prompt_lps is None)
            # the sampling settings the sampler reads
            skip = {"seed", "stop_token_ids"}
            assert {k: v for k, v in vars_of(copy.params).items() if k not in skip} == \
                   {k: v for k, v in vars_of(req.params).items() if k not in skip}
        finally:
            eng.abandon(copy)


def vars_of(params: acb.SamplingParams) -> dict:
    import dataclasses

    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def test_a_scoring_group_crosses_to_the_followers_unchanged():
    """A scoring group (context request and the children that fork from it) is rebuilt on a
    follower with the same prompts, scored positions and tokens."""
    from acb.api.scoring import plan

    with acb.Engine(default_model(), acb.ContinuousBatchingConfig(num_blocks=64)) as eng:
        core = eng.core
        (group,) = plan([5, 6, 7, 8, 9], [[3], [4, 5, 6], [4, 5, 7], [8, 9]], 2)
        req = eng.make_request(group[0].prompt_ids, None, sink_factory=ThreadSink, scoring=group[0].spec,
                               score_children=[(m.prompt_ids, m.spec) for m in group[1:]])
        wire = decode_commands(encode_commands([core._wire(Add(req))]))[0]
        eng.abandon(req)
        core.remote_request = eng._remote_request
        cmd = core._unwire(wire)
        try:
            assert isinstance(cmd, Add)
            for a, b in zip(req.group.members, cmd.req.group.members, strict=True):
                assert (a.request_id, a.token_ids, a.scoring, a.lp_start, a.score_next, a.params.prompt_logprobs) == \
                       (b.request_id, b.token_ids, b.scoring, b.lp_start, b.score_next, b.params.prompt_logprobs)
            assert [m.token_ids for m in cmd.req.group.members] == [m.prompt_ids for m in group]
        finally:
            eng.abandon(cmd.req)
