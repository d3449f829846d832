"""Scoring requests: the log-probabilities of given continuations of a context, with no sampling.

``Engine.score(context, continuations)`` (and ``AsyncEngine.score``, ``score_batch``) is what an
evaluation harness needs for multiple-choice and perplexity tasks. It is planned here as engine
requests that go through the one submit path (:meth:`acb.api.base.EngineBase.make_request`):

- the continuations of one token are scored together by **one** request whose prompt is the
  context: the logits after its last token give all of them (one context prefill, no extra
  forward per choice: a 4-way one-letter multiple choice costs one request);
- each longer continuation is a request whose prompt is context + continuation, recording the
  logprobs of the continuation's tokens only (rows from the last context token on).

Every such request reads the prefix cache for its context like any request, so a few-shot
preamble shared by a task's documents is computed once per engine, and the tail of a context
past its last cached full block is what each continuation recomputes. The LM head runs on the
rows a request scores and on no others, at most ``Scheduler.max_scored_rows`` rows a step (each
row is vocabulary-sized). Nothing is sampled, and the request keeps no KV once it ends beyond
what the prefix cache keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from acb.outputs import ContinuationScore, GenerationOutput, RequestStatus, ScoreOutput
from acb.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class ScoreSpec:
    """What makes an engine request a scoring request (built by :func:`plan`)."""

    lp_start: int  # the first prompt position whose next token is scored (the context's last)
    next_tokens: tuple[int, ...] | None  # tokens scored after the whole prompt (one-token continuations)
    top_logprobs: int  # alternatives asked per scored position


@dataclass(frozen=True)
class Member:
    """One engine request of a scoring call: its prompt and spec, and which continuations it scores."""

    prompt_ids: list[int]
    spec: ScoreSpec
    continuations: tuple[int, ...]  # indices into the call's continuations


def as_ids(value: Any, what: str, tokenizer: Any, *, context: bool) -> list[int]:
    """Token ids of a context or a continuation given as ids or (with a tokenizer) as text: a
    context is encoded as a prompt is (the tokenizer's special tokens), a continuation without
    special tokens. Text is tokenized on its own: lm-eval-style callers that split a string
    between context and continuation tokenize the whole and pass ids."""
    if isinstance(value, str):
        if tokenizer is None:
            raise TypeError(f"{what} is text, but the engine has no tokenizer: pass token ids, or tokenizer=...")
        ids = tokenizer(value, add_special_tokens=context)["input_ids"]
    else:
        from acb.api.base import as_token_list

        ids = as_token_list(value)
    if not ids:
        raise ValueError(f"{what} is empty: it needs at least one token"
                         + (" (the first continuation token is scored after the context's last)" if context else ""))
    return list(ids)


def plan(context_ids: list[int], continuations: list[list[int]], top_logprobs: int) -> list[Member]:
    """The engine requests that score ``continuations`` of ``context_ids``."""
    if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) or not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"top_logprobs must be an int in [0, {MAX_LOGPROBS}], got {top_logprobs!r}")
    if not continuations:
        raise ValueError("score() needs at least one continuation")
    last = len(context_ids) - 1
    singles = tuple(i for i, c in enumerate(continuations) if len(c) == 1)
    members = []
    if singles:
        members.append(Member(list(context_ids), ScoreSpec(last, tuple(continuations[i][0] for i in singles),
                                                           top_logprobs), singles))
    for i, c in enumerate(continuations):
        if len(c) > 1:
            members.append(Member(context_ids + c, ScoreSpec(last, None, top_logprobs), (i,)))
    return members


def assemble(request_id: str, context_ids: list[int], continuations: list[list[int]], members: list[Member],
             outputs: Sequence[GenerationOutput], top_logprobs: int) -> ScoreOutput:
    """The call's :class:`ScoreOutput` from its members' outputs (in ``members`` order)."""
    scores: list[ContinuationScore | None] = [None] * len(continuations)
    cached = 0
    failed = next((o for o in outputs if o.status != RequestStatus.FINISHED), None)
    for m, out in zip(members, outputs):
        cached += out.num_cached_tokens
        if out.status != RequestStatus.FINISHED:
            continue
        if m.spec.next_tokens is not None:
            values, top = out.next_token_logprobs or [], out.next_token_top_logprobs or []
            greedy_id = top[0][0] if top else None
            for k, i in enumerate(m.continuations):
                tok = continuations[i][0]
                scores[i] = ContinuationScore([tok], [values[k]], tok == greedy_id,
                                              [list(top[:top_logprobs])] if top_logprobs else None)
        else:
            (i,) = m.continuations
            cont = continuations[i]
            lps, tops = out.prompt_logprobs or [], out.prompt_top_logprobs or []
            greedy = all(t and t[0][0] == tok for t, tok in zip(tops, cont)) and len(tops) == len(cont)
            scores[i] = ContinuationScore(list(cont), list(lps), greedy,
                                          [list(t[:top_logprobs]) for t in tops] if top_logprobs else None)
    if failed is not None:
        return ScoreOutput(request_id, list(context_ids), [s for s in scores if s is not None], cached,
                           failed.status, failed.error)
    assert all(s is not None for s in scores)
    return ScoreOutput(request_id, list(context_ids), [s for s in scores if s is not None], cached)


def prefix_order(prompts: Sequence[list[int]]) -> list[int]:
    """Submission order for many requests: sorted by their tokens, so that requests sharing a
    prefix are admitted one after the other and meet in the prefix cache (the first computes
    it, the next ones read it) before it can be evicted."""
    return sorted(range(len(prompts)), key=lambda i: prompts[i])
