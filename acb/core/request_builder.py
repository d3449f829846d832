"""A submit's engine-thread state: :func:`build_request` turns the API's
:class:`acb.core.messages.EngineRequest` into the :class:`acb.core.request.Request` (or the group of
them, for ``n`` samples and scoring groups) that the scheduler runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from acb.core.messages import EngineRequest
from acb.core.request import Request, RequestGroup
from acb.text import IncrementalDetokenizer

if TYPE_CHECKING:
    from acb.core.grammar_masks import GrammarSupport
    from acb.text import TokenizerLike

__all__ = ["build_request"]


def build_request(
    er: EngineRequest, tokenizer: TokenizerLike | None, grammars: GrammarSupport | None = None, *, runs: bool = True
) -> Request:
    """The engine-thread state of a submit: one :class:`Request`, or the group's first member
    (``n`` samples, or a scoring group) with the others as its children. ``tokenizer`` decodes
    the text of requests with stop strings; ``grammars`` gives each sample of a constrained
    request its matcher (the grammar was compiled at submit: this is a cache hit). ``runs=False``:
    only to report the outcome of a request that never ran (no matchers)."""
    params = er.params
    compiled = None
    if params.structured_outputs is not None and runs:
        if grammars is None:
            raise RuntimeError(
                f"request {er.request_id!r} has structured outputs, and this engine has no grammar "
                "compiler (a tensor-parallel rank without the tokenizer)"
            )
        compiled = grammars.compile_now(params.structured_outputs)
    targets = (er.score, *er.children) if er.score is not None else ()
    members = []
    for i, mid in enumerate(er.member_ids):
        target = targets[i] if targets else None
        req = Request(
            mid,
            list(er.prompt_ids if target is None else target.prompt_ids),
            max_new_tokens=er.max_new_tokens,
            stop_token_ids=er.stop_token_ids,
            params=params,
            # each sample has its own stream; sample 0 uses the request's seed itself
            seed=er.seed if i == 0 else (er.seed * 1_000_003 + i) & ((1 << 63) - 1),
            want_logprobs=params.logprobs is not None,
            record_timestamps=er.record_timestamps,
            created_time=er.created_time,
        )
        req.out.key = er.sink_key
        if params.stop and tokenizer is not None:
            req.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens is not False, params.stop)
        if compiled is not None:
            req.matcher = compiled.matcher()
        req.checks = req.detok is not None or req.matcher is not None
        if params.prompt_logprobs is not None and i == 0:  # sample 0 prefills the prompt
            req.prompt_lps, req.out.prompt_tops = [], []
        if target is not None:
            req.scoring, req.lp_start = True, target.lp_start
            req.score_next = list(target.next_tokens) if target.next_tokens is not None else None
            req.prompt_lps, req.out.prompt_tops = [], []
        if er.cache_salt:
            req.cache_salt = er.cache_salt.encode()
        req.media = er.media
        req.lora_slot = er.lora_slot
        members.append(req)
    if len(members) > 1:
        RequestGroup(er.request_id, members)
    return members[0]
