"""Scoring requests: the log-probabilities of given continuations of a context, with no sampling.

``Engine.score(context, continuations)`` (and ``AsyncEngine.score``, ``score_batch``) is what an
evaluation harness needs for multiple-choice and perplexity tasks. It is planned here as engine
requests that go through the one submit path (:meth:`acb.api.base.EngineBase.make_request`):

- a request's prompt is the context and a continuation without its last token; it records the
  logprobs of that continuation part (rows from the last context token on) and, from the row
  after its whole prompt, those of the last token of every continuation that shares the part:
  the continuations of one token all come from **one** request whose prompt is the context (one
  context prefill, no extra forward per choice: a 4-way one-letter multiple choice is one
  request), and no request feeds a token it only scores (a window of N + 1 tokens takes N
  positions, as the model's own forward over it does).

Every such request reads the prefix cache for its context like any request, so a few-shot
preamble shared by a task's documents is computed once per engine, and the tail of a context
past its last cached full block is what each continuation recomputes. The LM head runs on the
rows a request scores and on no others, at most ``Scheduler.max_scored_rows`` rows a step (each
row is vocabulary-sized: the engine allows 128 MiB of float32 logits a step,
``acb.core.engine_core.SCORED_LOGITS_BYTES``). Nothing is sampled, and the request keeps no KV once it ends beyond
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
    """The engine requests that score ``continuations`` of ``context_ids``: one per distinct
    continuation-but-its-last-token, whose prompt is the context and that part, and which scores
    the last token of each of its continuations after the whole prompt (so the one-token
    continuations of a context share one request, and no request feeds a token it only scores:
    a window of N + 1 tokens needs N positions, as a model's own forward does)."""
    if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) or not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"top_logprobs must be an int in [0, {MAX_LOGPROBS}], got {top_logprobs!r}")
    if not continuations:
        raise ValueError("score() needs at least one continuation")
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, c in enumerate(continuations):
        groups.setdefault(tuple(c[:-1]), []).append(i)
    last = len(context_ids) - 1
    return [Member(context_ids + list(body), ScoreSpec(last, tuple(continuations[i][-1] for i in idx), top_logprobs),
                   tuple(idx))
            for body, idx in groups.items()]


Plan = tuple[list[int], list[list[int]], list[Member]]  # (context ids, continuations' ids, members)


def plan_batch(items: Sequence[tuple[Any, Sequence[Any]]], top_logprobs: int, tokenizer: Any) -> list[Plan]:
    """Every item of a ``score_batch`` call validated and planned (errors name the item)."""
    plans = []
    for i, item in enumerate(items):
        try:
            context, continuations = item
            if isinstance(continuations, (str, bytes)) or not isinstance(continuations, Sequence):
                raise TypeError("continuations must be a list of continuations (token ids or text), got "
                                f"{type(continuations).__name__}")
            ctx = as_ids(context, "context", tokenizer, context=True)
            conts = [as_ids(c, f"continuations[{k}]", tokenizer, context=False) for k, c in enumerate(continuations)]
            plans.append((ctx, conts, plan(ctx, conts, top_logprobs)))
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"items[{i}]: {exc}") from None
    return plans


def batch_ids(request_ids: Sequence[str] | None, n: int) -> list[str]:
    ids = list(request_ids) if request_ids is not None else [f"score_{i}" for i in range(n)]
    if len(ids) != n:
        raise ValueError(f"request_ids has {len(ids)} ids for {n} items")
    return ids


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
        # the member's own continuation part (scored at rows of its prompt), then each last token
        lps, tops = out.prompt_logprobs or [], out.prompt_top_logprobs or []
        body = m.prompt_ids[len(context_ids):]
        body_greedy = len(tops) == len(body) and all(t and t[0][0] == tok for t, tok in zip(tops, body))
        values, top = out.next_token_logprobs or [], out.next_token_top_logprobs or []
        greedy_id = top[0][0] if top else None
        for k, i in enumerate(m.continuations):
            tok = continuations[i][-1]
            scores[i] = ContinuationScore(
                list(continuations[i]), [*lps, values[k]], body_greedy and tok == greedy_id,
                [*(list(t[:top_logprobs]) for t in tops), list(top[:top_logprobs])] if top_logprobs else None)
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
