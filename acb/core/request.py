"""The state of one request, owned by the engine thread.

:class:`Request` is what the scheduler, the KV manager and the runner read and advance (tokens,
blocks, rows, status, the stop checks); its :class:`RequestOutputState` (``req.out``) is what only
the output side reads (where its results go, and what they carry besides the tokens: logprobs,
timestamps, the text a token completes, scored logprobs), written as tokens are recorded and read
when deliveries and the final output are built (:mod:`acb.core.deliveries`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from acb.outputs import FailureKind, FinishReason, GenerationOutput, RequestStatus, SampleOutput
from acb.text import IncrementalDetokenizer

if TYPE_CHECKING:
    from acb.media import MediaInputs

logger = logging.getLogger(__name__)


class RequestOutputState:
    """What only the output side reads of a request (``Request.out``)."""

    __slots__ = ("key", "new_text", "logprobs", "top_logprobs", "timestamps", "prompt_tops", "next_lps", "next_top")

    def __init__(self, record_timestamps: bool) -> None:
        """Args:
        record_timestamps: keep each token's arrival time.
        """
        self.key = -1  # EngineRequest.sink_key: where its results are delivered (the group's, for n > 1)
        self.new_text = ""  # the text completed by the latest token (stop strings only)
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] | None = None
        self.timestamps: list[float] | None = [] if record_timestamps else None
        # prompt_logprobs: each recorded position's top alternatives (beside Request.prompt_lps)
        self.prompt_tops: list[list[tuple[int, float]]] | None = None
        # scoring: the logprobs of the tokens scored after the whole prompt, and that position's
        # top alternatives
        self.next_lps: list[float] | None = None
        self.next_top: list[tuple[int, float]] | None = None


class Request:
    """Mutable state of a live request. Only the engine thread touches it after admission.

    ``token_ids`` is the prompt followed by the generated tokens; ``num_computed_tokens`` of
    them have their K/V in the cache (advanced by the scheduler when it schedules them).
    """

    __slots__ = (
        "request_id",
        "token_ids",
        "prompt_len",
        "max_new_tokens",
        "stop_token_ids",
        "params",
        "seed",
        "want_logprobs",
        "record_timestamps",
        "status",
        "num_computed_tokens",
        "block_ids",
        "row",
        "created_time",
        "first_scheduled_time",
        "first_token_time",
        "finish_time",
        "finish_reason",
        "error",
        "failure",
        "num_preemptions",
        "num_cached_tokens",
        "events",
        "prompt_lps",
        "detok",
        "matcher",
        "checks",
        "group",
        "dead_end",
        "sample_index",
        "children",
        "block_hashes",
        "num_registered",
        "kv_epoch",
        "snap_plan",
        "cache_salt",
        "swapped",
        "in_flight",
        "last_sample",
        "scoring",
        "lp_start",
        "score_next",
        "media",
        "lora_slot",
        "images_key",
        "versions",
        "out",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        stop_token_ids: frozenset[int] = frozenset(),
        params: Any = None,
        seed: int = 0,
        want_logprobs: bool = False,
        record_timestamps: bool = False,
        created_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = stop_token_ids
        self.params = params  # resolved acb.SamplingParams (read by the runner's sampler)
        self.seed = seed
        self.want_logprobs = want_logprobs
        self.record_timestamps = record_timestamps
        self.status = RequestStatus.PENDING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.row = -1  # row in the runner's persistent block table while running
        self.created_time = time.perf_counter() if created_time is None else created_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.failure: FailureKind | None = None
        self.num_preemptions = 0
        self.events: list[tuple[str, float]] | None = None  # ("preempted" | "resumed", perf_counter time)
        # prompt_logprobs: one entry per prompt position done (a recompute after preemption skips them)
        self.prompt_lps: list[float] | None = None
        # the first prompt position whose next token's logprob is recorded (0: every position;
        # a scoring request's context length - 1: its continuation's tokens only). The prefix
        # cache is read for the positions before it.
        self.lp_start = 0
        # a scoring request samples nothing: it ends once its prompt is computed
        self.scoring = False
        # scoring: tokens scored at the last prompt position (the continuations of one token of a
        # context that is the whole prompt; their logprobs are in out.next_lps)
        self.score_next: list[int] | None = None
        self.num_cached_tokens = 0
        # stop strings: the output text, decoded here (and only here) as tokens come, with the
        # caller's skip_special_tokens; the stream's text pieces and the output's text are its
        self.detok: IncrementalDetokenizer | None = None
        # structured outputs: the grammar's matcher (acb.structured.Matcher), advanced with each
        # token; it fills this request's row of the step's token bitmask
        self.matcher: Any = None
        self.checks = False  # detok or matcher is set: append_token takes the slower path
        # structured outputs: the step being sampled leaves this request no token its grammar allows
        # (found when its mask was filled): that step's token is not recorded and it ends there
        self.dead_end = False
        self.group: RequestGroup | None = None  # n > 1: the samples submitted together
        self.sample_index = 0
        self.children: list[Request] | None = None  # n > 1, on sample 0 until its prompt is prefilled
        self.block_hashes: list[bytes] = []  # prefix-cache digests of this request's full blocks
        self.num_registered = 0  # leading blocks already registered in the prefix cache
        # the prefix cache's epoch (KVManager.epoch: it moves on when the weights change) in which
        # this request's KV was computed: KV from another epoch is never registered
        self.kv_epoch = 0
        # state layers: (position, digest of the block ending there) where this request's prefill
        # takes a snapshot of its state for the prefix cache (acb.core.kv_manager)
        self.snap_plan: list[tuple[int, bytes]] = []
        self.cache_salt = b""  # isolates this request's prefix-cache entries (e.g. per tenant)
        self.media: MediaInputs | None = None  # its images, processed at submit (acb.media)
        self.lora_slot = 0  # its LoRA adapter's slot in the runner's stacked buffers (0: none)
        self.images_key: bytes | None = None  # the runner's key of their embeddings (acb.runner.media)
        # the weight versions its tokens were sampled under: (version, index of its first token)
        self.versions: list[tuple[Any, int]] = [(0, 0)]
        # (host blocks, tokens, host row of its state layers' state or -1) while offloaded
        self.swapped: tuple[list[int], int, int] | None = None
        # tokens scheduled for sampling whose values are not back yet (async batching: up to 2)
        self.in_flight = 0
        self.last_sample = (-1, -1)  # (step id, index among that step's samples) of the latest sample
        self.out = RequestOutputState(record_timestamps)  # what only the output side reads

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def append_token(
        self, token_id: int, logprob: float | None, now: float, top: list[tuple[int, float]] | None = None
    ) -> bool:
        """Record a sampled token; return True if the request is now finished.

        A constrained request's token is checked by its grammar first: at a dead end (nothing was
        left to sample) or a token the grammar rejects, nothing is recorded and the request ends
        with ``FinishReason.GRAMMAR``.
        """
        matcher = self.matcher
        if matcher is not None and (self.dead_end or not matcher.accept(token_id)):
            if not self.dead_end:  # (a mask that allowed tokens was not kept to: NaN logits, or a bug)
                logger.warning(
                    "request %s: a sampled token is outside its grammar's mask; it ends there", self.request_id
                )
            self.finish_reason = FinishReason.GRAMMAR
            self.out.new_text = ""
            return self._text_ends()
        self.token_ids.append(token_id)
        out = self.out
        if logprob is not None:
            out.logprobs.append(logprob)
        if top is not None:
            if out.top_logprobs is None:
                out.top_logprobs = []
            out.top_logprobs.append(top)
        if out.timestamps is not None:
            out.timestamps.append(now)
        if self.first_token_time is None:
            self.first_token_time = now
        if self.checks:  # stop strings or a grammar (most requests have neither: one test)
            return self._checked(token_id)
        if token_id in self.stop_token_ids:
            self.finish_reason = FinishReason.STOP
            return True
        if len(self.token_ids) - self.prompt_len >= self.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False

    def _checked(self, token_id: int) -> bool:
        """``append_token``'s end for a request with stop strings (its text is decoded here) or
        a grammar (its matcher advances)."""
        detok = self.detok
        if detok is not None:  # (if decoding raises, the scheduler fails this request alone)
            self.out.new_text = ""
            self.out.new_text = detok.push((token_id,))
        matcher = self.matcher
        if matcher is not None and matcher.is_terminated():  # complete, and took its stop token
            # (append_token had the matcher accept the token)
            self.finish_reason = FinishReason.STOP
            return self._text_ends()
        if token_id in self.stop_token_ids:
            self.finish_reason = FinishReason.STOP
            return self._text_ends()
        if detok is not None and detok.cut is not None:  # a stop string appeared: the text ends where it starts
            self.finish_reason = FinishReason.STOP
            return self._text_ends()
        if len(self.token_ids) - self.prompt_len >= self.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
            return self._text_ends()
        return False

    def _text_ends(self) -> bool:
        """The request finished: its last text piece takes what the detokenizer held back."""
        if self.detok is not None:
            self.out.new_text += self.detok.flush()
        return True

    def add_prompt_logprobs(self, lo: int, values: list[float], tops: list[list[tuple[int, float]]]) -> None:
        """Record prompt logprobs for positions ``lo``.. (those already recorded are skipped: a
        recompute after preemption computes them again)."""
        lps, top = self.prompt_lps, self.out.prompt_tops
        if lps is None or top is None:
            return
        skip = self.lp_start + len(lps) - lo
        if skip < 0:  # a gap cannot happen: chunks are recorded in order
            return
        lps.extend(values[skip:])
        top.extend(tops[skip:])

    def to_output(self) -> GenerationOutput:
        """A snapshot (copies of the lists) that is safe to hand to another thread."""
        c, out = self.created_time, self.out
        return GenerationOutput(
            request_id=self.request_id,
            prompt_ids=self.token_ids[: self.prompt_len],
            generated_tokens=self.token_ids[self.prompt_len :],
            logprobs=list(out.logprobs),
            top_logprobs=[list(t) for t in out.top_logprobs] if out.top_logprobs is not None else None,
            text=self._text(),
            status=self.status,
            finish_reason=self.finish_reason,
            error=self.error,
            failure=self.failure,
            created_time=c,
            timestamps=list(out.timestamps) if out.timestamps is not None else None,
            queue_time=None if self.first_scheduled_time is None else self.first_scheduled_time - c,
            time_to_first_token=None if self.first_token_time is None else self.first_token_time - c,
            total_time=None if self.finish_time is None else self.finish_time - c,
            num_cached_tokens=self.num_cached_tokens,
            num_preemptions=self.num_preemptions,
            events=list(self.events) if self.events is not None else None,
            prompt_logprobs=list(self.prompt_lps) if self.prompt_lps is not None else None,
            prompt_top_logprobs=[list(t) for t in out.prompt_tops] if out.prompt_tops is not None else None,
            next_token_logprobs=list(out.next_lps) if out.next_lps is not None else None,
            next_token_top_logprobs=list(out.next_top) if out.next_top is not None else None,
            weight_version=self.weight_version(),
        )

    def weight_version(self) -> Any:
        """The weight version its tokens were sampled under, or, when an update landed while it
        ran, ``[(version, first token, end), ...]`` spans over its generated tokens."""
        versions = self.versions
        if len(versions) == 1:
            return versions[0][0]
        ends = [start for _, start in versions[1:]] + [self.num_generated]
        return [(v, start, end) for (v, start), end in zip(versions, ends)]

    def new_weights(self, version: Any) -> None:
        """Weights of ``version`` were swapped in: the tokens it samples from now on are theirs
        (those in flight were sampled before)."""
        at = self.num_generated + self.in_flight
        if at == 0 or self.versions[-1][1] == at:
            self.versions[-1] = (version, self.versions[-1][1])
        else:
            self.versions.append((version, at))

    def _text(self) -> str | None:
        """The output text (stop strings only; None otherwise, or if the tokenizer cannot decode
        it, so that building an output, a failure's included, never raises)."""
        detok = self.detok
        if detok is None:
            return None
        try:
            detok.flush()
        except Exception:  # noqa: BLE001
            logger.warning("request %r: decoding its output text failed", self.request_id, exc_info=True)
            return None
        return detok.text if detok.cut is None else detok.text[: detok.cut]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )


class RequestGroup:
    """The ``n`` samples of one submit. Sample 0 carries the user's request id and is the one
    prefilled; the others fork from it when its prompt is done (sharing its KV blocks)."""

    __slots__ = ("request_id", "members", "delivered")

    def __init__(self, request_id: str, members: list[Request]) -> None:
        self.request_id = request_id
        self.members = members
        self.delivered = False  # the group's final output has been handed out
        for i, m in enumerate(members):
            m.group = self
            m.sample_index = i
        members[0].children = members[1:]

    @property
    def done(self) -> bool:
        return all(m.status.is_terminal for m in self.members)

    def to_output(self) -> GenerationOutput:
        outs = [m.to_output() for m in self.members]
        head = outs[0]
        statuses = {o.status for o in outs}
        for bad in (RequestStatus.FAILED, RequestStatus.CANCELLED):
            if bad in statuses:
                first = next(o for o in outs if o.status == bad)  # (before the head takes the status)
                head.status, head.error, head.failure = bad, first.error, first.failure
                break
        head.samples = [
            SampleOutput(
                i,
                o.generated_tokens,
                o.logprobs,
                o.top_logprobs,
                o.status,
                o.finish_reason,
                o.text,
                o.prompt_logprobs,
                o.prompt_top_logprobs,
                o.next_token_logprobs,
                o.next_token_top_logprobs,
                o.num_cached_tokens,
            )
            for i, o in enumerate(outs)
        ]
        times = [o.time_to_first_token for o in outs if o.time_to_first_token is not None]
        head.time_to_first_token = min(times) if times else None
        totals = [o.total_time for o in outs if o.total_time is not None]
        head.total_time = max(totals) if totals else None
        head.num_preemptions = sum(o.num_preemptions for o in outs)
        head.events = sorted(e for o in outs for e in o.events or ()) or None
        return head
