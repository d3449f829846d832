"""Scoring requests: the log-probabilities of given continuations of a context, with no sampling.

``Engine.score(context, continuations)`` (and ``AsyncEngine.score``, ``score_batch``) is what an
evaluation harness needs for multiple-choice and perplexity tasks. It is planned here as engine
requests, each made by :func:`make_score_request` (the input processor's
:meth:`~acb.api.processor.InputProcessor.process_score`, then the submit's
:meth:`~acb.api.submissions.Submissions.open`):

- a call is one engine request per group: a **context request** (prompt: the context) and, for
  the continuations of two or more tokens, one **child** per distinct continuation-but-its-last-
  token, forked from the context request when its prompt is done, as the samples of ``n > 1``
  fork: the children share its full KV blocks and get a copy of its partial last block, so the
  context is prefilled **once** and each child computes only its own tokens;
- the context request scores, from the row after the context, the one-token continuations and
  the first token of every child (no extra forward for a one-token choice: a 4-way one-letter
  multiple choice is one forward of its context); a child scores the rest of its tokens, and
  from the row after its whole prompt the last token of each continuation that shares it; no
  token is fed only to be scored (a window of N + 1 tokens takes N positions, as the model's own
  forward does);
- a group has at most ``max_requests_per_batch`` requests (its children hold rows from its
  admission on); more continuations make more groups, each with its own context request;
- with ``max_requests_per_batch=1`` there is no row for a child beside its context request (and a
  model that prefills whole, Mamba1's, cannot go on from its context's state): each
  continuation of two or more tokens (each distinct body) is then a request of its own, whose
  prompt is the context and the body, scored from the context's last position on; they run one
  after another, and share the context's full blocks through the prefix cache.

Every such request reads the prefix cache for its context like any request, so a few-shot
preamble shared by a task's documents is computed once per engine, and the tail of a context
past its last cached full block is what each continuation recomputes. The LM head runs on the
rows a request scores and on no others, at most ``Scheduler.max_scored_rows`` rows a step (each
row is vocabulary-sized: the engine allows 128 MiB of float32 logits a step,
``acb.core.engine_core.SCORED_LOGITS_BYTES``). Nothing is sampled, and the request keeps no KV once it ends beyond
what the prefix cache keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from acb.api.processor import as_token_list
from acb.core.messages import ScoreTarget
from acb.errors import InvalidRequestError, InvalidRequestTypeError, prefixed
from acb.media import MediaInputs, has_media
from acb.outputs import ContinuationScore, GenerationOutput, RequestStatus, ScoreOutput
from acb.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from acb.api.base import EngineBase
    from acb.api.submissions import Submission


@dataclass(frozen=True)
class Member:
    """One engine request of a scoring group: its :class:`ScoreTarget` (the engine request's own
    type: its prompt, the first position scored, the tokens scored after the whole prompt); which
    continuations it ends (their last token is scored after its whole prompt); for a child, the
    continuations it holds (``body``: theirs but the last token, after the context)."""

    target: ScoreTarget
    continuations: tuple[int, ...]  # indices into the call's continuations scored after the prompt
    body: tuple[int, ...] = ()  # a child: the continuation tokens its prompt adds to the context

    @property
    def prompt_ids(self) -> list[int]:
        """The engine request's prompt."""
        return list(self.target.prompt_ids)


def as_ids(value: Any, what: str, tokenizer: Any, *, context: bool) -> list[int]:
    """Token ids of a context or a continuation given as ids or (with a tokenizer) as text: a
    context is encoded as a prompt is (the tokenizer's special tokens), a continuation without
    special tokens. Text is tokenized on its own: lm-eval-style callers that split a string
    between context and continuation tokenize the whole and pass ids.

    Args:
        value: token ids, or text.
        what: how errors name it (``context``, ``continuations[k]``).
        tokenizer: the engine's tokenizer, if any.
        context: whether it is the context (else a continuation).

    Returns:
        Its token ids (normalised here, once: the engine requests take them as they are).

    Raises:
        InvalidRequestTypeError: text without a tokenizer, or no token ids.
        InvalidRequestError: empty.
    """
    field = "context" if context else "continuations"
    if isinstance(value, str):
        if tokenizer is None:
            raise InvalidRequestTypeError(
                f"{what} is text, but the engine has no tokenizer: pass token ids, or tokenizer=...", field
            )
        ids = tokenizer(value, add_special_tokens=context)["input_ids"]
    else:
        ids = as_token_list(value, field)
    if not ids:
        raise InvalidRequestError(
            f"{what} is empty: it needs at least one token"
            + (" (the first continuation token is scored after the context's last)" if context else ""),
            field,
        )
    return list(ids)


def _member(
    prompt: list[int],
    lp_start: int,
    next_tokens: tuple[int, ...],
    continuations: tuple[int, ...],
    body: tuple[int, ...] = (),
) -> Member:
    return Member(ScoreTarget(tuple(prompt), lp_start, next_tokens), continuations, body)


def plan(
    context_ids: list[int], continuations: list[list[int]], top_logprobs: int, max_group: int = 1 << 30
) -> list[list[Member]]:
    """The engine request groups that score ``continuations`` of ``context_ids``: each group is a
    context request followed by its children (at most ``max_group`` requests a group).

    Args:
        context_ids: the context's token ids.
        continuations: each continuation's token ids (none empty).
        top_logprobs: the alternatives asked per scored position (checked here).
        max_group: the most requests a group may have (``max_requests_per_batch``).

    Returns:
        The groups, each its context request first.

    Raises:
        InvalidRequestError: a bad ``top_logprobs``, or no continuation.
    """
    if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) or not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(
            f"top_logprobs must be an int in [0, {MAX_LOGPROBS}], got {top_logprobs!r}", "top_logprobs"
        )
    if not continuations:
        raise InvalidRequestError("score() needs at least one continuation", "continuations")
    bodies: dict[tuple[int, ...], list[int]] = {}
    for i, c in enumerate(continuations):
        bodies.setdefault(tuple(c[:-1]), []).append(i)
    singles = tuple(bodies.pop((), ()))
    children = list(bodies.items())
    n = len(context_ids)
    if max_group < 2:
        # no row for a child beside its context request: each body is a request of its own (the
        # context and the body as its prompt), scored from the context's last position on; the
        # context's full blocks are shared through the prefix cache instead of a fork
        solo = [[_member(context_ids, n - 1, tuple(continuations[i][0] for i in singles), singles)]] if singles else []
        return solo + [
            [_member(context_ids + list(body), n - 1, tuple(continuations[i][-1] for i in idx), tuple(idx), body)]
            for body, idx in children
        ]
    per = max_group - 1
    chunks: list[list[tuple[tuple[int, ...], list[int]]]] = [
        children[k : k + per] for k in range(0, len(children), per)
    ]
    chunks = chunks or [[]]
    groups = []
    for g, chunk in enumerate(chunks):
        mine = singles if g == 0 else ()
        # the context request: the one-token continuations, then each child's first token
        head = _member(
            context_ids, n - 1, tuple(continuations[i][0] for i in mine) + tuple(body[0] for body, _ in chunk), mine
        )
        groups.append(
            [head]
            + [
                _member(context_ids + list(body), n, tuple(continuations[i][-1] for i in idx), tuple(idx), body)
                for body, idx in chunk
            ]
        )
    return groups


Plan = tuple[list[int], list[list[int]], list[list[Member]]]  # (context ids, continuations' ids, groups)


def plan_batch(
    items: Sequence[tuple[Any, Sequence[Any]]], top_logprobs: int, tokenizer: Any, max_group: int = 1 << 30
) -> list[Plan]:
    """Every item of a ``score_batch`` call validated and planned.

    Args:
        items: ``(context, continuations)`` pairs.
        top_logprobs: the alternatives asked per scored position.
        tokenizer: the engine's tokenizer, if any (for text).
        max_group: the most requests a group may have.

    Returns:
        One plan per item.

    Raises:
        ValueError: a bad item, named ``items[i]`` (an :class:`InvalidRequestError` keeps its field).
        TypeError: likewise, for a value of the wrong type.
    """
    plans = []
    for i, item in enumerate(items):
        try:
            context, continuations = item
            if isinstance(continuations, (str, bytes)) or not isinstance(continuations, Sequence):
                raise InvalidRequestTypeError(
                    "continuations must be a list of continuations (token ids or text), "
                    f"got {type(continuations).__name__}",
                    "continuations",
                )
            ctx = as_ids(context, "context", tokenizer, context=True)
            conts = [as_ids(c, f"continuations[{k}]", tokenizer, context=False) for k, c in enumerate(continuations)]
            plans.append((ctx, conts, plan(ctx, conts, top_logprobs, max_group)))
        except (ValueError, TypeError) as exc:
            raise prefixed(exc, f"items[{i}]") from None
    return plans


def batch_ids(request_ids: Sequence[str] | None, n: int) -> list[str | None]:
    """The ids a ``score_batch`` call's items were given (None for each when none were: the
    engine then gives every group a fresh ``score_<n>`` id, unique whatever runs beside it)."""
    ids: list[str | None] = list(request_ids) if request_ids is not None else [None] * n
    if len(ids) != n:
        raise InvalidRequestError(f"request_ids has {len(ids)} ids for {n} items", "request_ids")
    return ids


def assemble(
    request_id: str,
    context_ids: list[int],
    continuations: list[list[int]],
    groups: list[list[Member]],
    outputs: Sequence[GenerationOutput],
    top_logprobs: int,
) -> ScoreOutput:
    """The call's :class:`ScoreOutput` from its groups' outputs (in ``groups`` order; a group of
    several requests has one output with a sample per request)."""
    scores: list[ContinuationScore | None] = [None] * len(continuations)
    cached = 0
    failed = next((o for o in outputs if o.status != RequestStatus.FINISHED), None)

    def tops(t: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
        return list(t[:top_logprobs])

    for group, out in zip(groups, outputs):
        parts: Sequence[Any] = out.samples if out.samples is not None else [out]
        cached += sum(p.num_cached_tokens for p in parts)
        if out.status != RequestStatus.FINISHED:
            continue
        head, head_out = group[0], parts[0]
        if head.body:  # a request of its own (no row for a fork): it scores its body from the context's last row
            _score_body(scores, continuations, head, head_out, None, top_logprobs)
            continue
        values, top = head_out.next_token_logprobs or [], head_out.next_token_top_logprobs or []
        greedy_id = top[0][0] if top else None
        for k, i in enumerate(head.continuations):
            tok = continuations[i][0]
            scores[i] = ContinuationScore([tok], [values[k]], tok == greedy_id, [tops(top)] if top_logprobs else None)
        for j, (m, part) in enumerate(zip(group[1:], parts[1:])):
            # the child's first token, scored by the context request after the context
            _score_body(scores, continuations, m, part, (values[len(head.continuations) + j], top), top_logprobs)
    if failed is not None:
        return ScoreOutput(
            request_id, list(context_ids), [s for s in scores if s is not None], cached, failed.status, failed.error
        )
    assert all(s is not None for s in scores)
    return ScoreOutput(request_id, list(context_ids), [s for s in scores if s is not None], cached)


def _score_body(
    scores: list[ContinuationScore | None],
    continuations: list[list[int]],
    m: Member,
    part: Any,
    first: tuple[float, Sequence[tuple[int, float]]] | None,
    top_logprobs: int,
) -> None:
    """The scores of the continuations a member with a body ends: its body's tokens (the first
    one's ``(logprob, top row)`` given as ``first`` when the context request scored it, else in
    the member's prompt logprobs), then each continuation's last token after its whole prompt."""
    lps, rows = list(part.prompt_logprobs or []), list(part.prompt_top_logprobs or [])
    if first is not None:
        lps, rows = [first[0], *lps], [first[1], *rows]
    body_greedy = len(rows) == len(m.body) and all(r and r[0][0] == tok for r, tok in zip(rows, m.body))
    last_values, last_top = part.next_token_logprobs or [], part.next_token_top_logprobs or []
    last_greedy = last_top[0][0] if last_top else None
    for k, i in enumerate(m.continuations):
        cont = continuations[i]
        scores[i] = ContinuationScore(
            list(cont),
            [*lps, last_values[k]],
            body_greedy and cont[-1] == last_greedy,
            [*(list(r[:top_logprobs]) for r in rows), list(last_top[:top_logprobs])] if top_logprobs else None,
        )


def ordered_groups(plans: Sequence[Plan], ids: Sequence[str | None]) -> list[tuple[int, int, str | None, list[Member]]]:
    """Every group of a batch as ``(item index, group index, engine request id, group)``, in
    submission order: sorted by the groups' context tokens (see :func:`prefix_order`). An item
    given an id names its groups ``<id>#g<j>``; the others' ids are the engine's (None here)."""
    groups = [
        (i, j, None if ids[i] is None else f"{ids[i]}#g{j}", g)
        for i, (_, _, gs) in enumerate(plans)
        for j, g in enumerate(gs)
    ]
    return [groups[k] for k in prefix_order([g[0].prompt_ids for _, _, _, g in groups])]


def make_score_request(
    engine: EngineBase,
    group: Sequence[ScoreTarget],
    top_logprobs: int,
    *,
    sink_factory: Callable[[str], Any],
    request_id: str | None = None,
    cache_salt: str | None = None,
    media: MediaInputs | None = None,
    lora: str | None = None,
) -> Submission:
    """A scoring group's submit, made as :meth:`acb.api.base.EngineBase.make_request` makes a
    generation's: checked and built by the engine's input processor
    (:meth:`~acb.api.processor.InputProcessor.process_score`), then opened
    (:meth:`~acb.api.submissions.Submissions.open`: its ids claimed, its sink registered, its
    trace begun). Post it with ``engine.admit``, or give it back with ``engine.abandon``.

    Args:
        engine: the engine it goes to.
        group: the group's targets (planned by :func:`plan`), its context request first.
        top_logprobs: the alternatives to record at each scored position.
        sink_factory: ``sink_factory(request_id)`` makes the sink its results go to.
        request_id: its id (default: a fresh ``score_<n>``).
        cache_salt: keeps its prefix-cache entries apart from other salts'.
        media: the context's media, processed (:mod:`acb.media`).
        lora: the LoRA adapter it is scored with, by name (None: the base model).

    Returns:
        The :class:`~acb.api.submissions.Submission`.

    Raises:
        InvalidRequestError: bad input (its ``field``: ``continuations``, ``request_id``...);
            nothing is left behind.
        InvalidRequestTypeError: an argument of the wrong type.
        EngineNotRunningError: the engine is not started.
    """
    engine.submit_core()
    made = engine.processor.process_score(
        group, top_logprobs, request_id=request_id, cache_salt=cache_salt, media=media, lora=lora
    )
    return engine.submissions.open(made, sink_factory, engine.tokenizer, engine.model_name)


def make_requests(
    engine: EngineBase,
    items: Sequence[tuple[Any, Sequence[Any]]],
    top_logprobs: int,
    cache_salt: str | None,
    request_ids: Sequence[str] | None,
    sink_factory: Callable[[str], Any],
    lora: str | None = None,
) -> tuple[list[Plan], list[str], list[list[str]], list[Submission]]:
    """Validate and plan a ``score_batch`` call and make its engine requests (one per group, in
    submission order: sorted for prefix reuse) with :func:`make_score_request`: all of them or,
    on an error naming the item, none.

    Args:
        engine: the engine they go to.
        items: ``(context, continuations)`` pairs.
        top_logprobs: the top alternatives to record at each scored position.
        cache_salt: keeps the prefix-cache entries apart from other salts'.
        request_ids: one id per item (its groups are ``<id>#g<j>``); by default each group
            gets a fresh ``score_<n>`` id, and an item's id is its first group's (unique per
            call: concurrent calls never collide).
        sink_factory: makes each engine request's sink.
        lora: the LoRA adapter every item is scored with, by name (None: the base model).

    Returns:
        The plans, the items' ids and each item's engine request ids by group (for
        :func:`assemble_batch`), and the submissions to enqueue.

    Raises:
        ValueError: a bad item, named ``items[i]``.
        TypeError: an item of the wrong type, named likewise.
    """
    engine.submit_core()
    cfg = engine.processor.started().cfg
    processor = engine.processor
    # contexts with images: processed first (acb.media); their groups carry the images
    images: list[MediaInputs | None] = []
    processed = []
    for i, item in enumerate(items):
        context = item[0] if isinstance(item, Sequence) and len(item) == 2 else None
        if context is not None and has_media(context):
            try:
                context = processor.process_media(context)
            except (ValueError, TypeError) as exc:
                raise prefixed(exc, f"items[{i}]") from None
            processed.append((context, item[1]))
            images.append(context.media)
        else:
            processed.append(item)
            images.append(None)
    # a model that prefills whole (its state layers cannot resume a prefill) cannot fork a child
    # from its context's state mid-prompt either: each body is then a request of its own
    plans = plan_batch(
        processed, top_logprobs, engine.tokenizer, 1 if cfg.whole_prefill else cfg.max_requests_per_batch
    )
    given = batch_ids(request_ids, len(plans))
    order = ordered_groups(plans, given)

    def maker(rid: str | None, group: list[Member], pictures: MediaInputs | None) -> Callable[[], Submission]:
        targets = [m.target for m in group]
        return lambda: make_score_request(
            engine,
            targets,
            top_logprobs,
            sink_factory=sink_factory,
            request_id=rid,
            cache_salt=cache_salt,
            media=pictures,
            lora=lora,
        )

    reqs = engine.submissions.make_all("items", ((i, maker(rid, group, images[i])) for i, _, rid, group in order))
    engine_ids: list[list[str]] = [[""] * len(gs) for _, _, gs in plans]
    for (i, j, _, _), req in zip(order, reqs):
        engine_ids[i][j] = req.request_id
    ids = [rid if rid is not None else engine_ids[i][0] for i, rid in enumerate(given)]
    return plans, ids, engine_ids, reqs


def assemble_batch(
    plans: Sequence[Plan],
    ids: Sequence[str],
    engine_ids: Sequence[Sequence[str]],
    results: Mapping[str, GenerationOutput],
    top_logprobs: int,
) -> list[ScoreOutput]:
    """Every item's :class:`ScoreOutput`, in input order, from its groups' outputs by engine request
    id (``engine_ids[i][j]``: item ``i``'s group ``j``; ``ids[i]``: the item's id)."""
    return [
        assemble(ids[i], ctx, conts, groups, [results[rid] for rid in engine_ids[i]], top_logprobs)
        for i, (ctx, conts, groups) in enumerate(plans)
    ]


def prefix_order(prompts: Sequence[list[int]]) -> list[int]:
    """Submission order for many requests: sorted by their tokens, so that requests sharing a
    prefix are admitted one after the other and meet in the prefix cache (the first computes
    it, the next ones read it) before it can be evicted."""
    return sorted(range(len(prompts)), key=lambda i: prompts[i])
