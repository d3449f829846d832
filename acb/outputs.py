"""What requests give back: :class:`GenerationOutput`, :class:`StreamDelta`, statuses."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Values up to DECODING are live; the rest are terminal.

    The first five names and values match transformers' ``RequestStatus``.
    """

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5

    @property
    def is_terminal(self) -> bool:
        return self >= RequestStatus.FINISHED

    def __str__(self) -> str:
        """The name (``CANCELLED``), as a person reads it; ``int(status)`` is the number.

        Returns:
            The member's name.
        """
        return self.name

    def __format__(self, spec: str) -> str:
        """f-strings and ``format`` give the name too (``f"{status}"`` is ``CANCELLED``).

        Args:
            spec: the format spec, applied to the name.

        Returns:
            The formatted name.
        """
        return format(self.name, spec)


class _Word(str, enum.Enum):
    """A str enum that prints as its value (``length``), as a person (and JSON) reads it."""

    def __str__(self) -> str:
        """The value (``length``); ``repr`` keeps the member's full name.

        Returns:
            The member's value.
        """
        return str(self.value)

    def __format__(self, spec: str) -> str:
        """f-strings and ``format`` give the value too.

        Args:
            spec: the format spec, applied to the value.

        Returns:
            The formatted value.
        """
        return format(str(self.value), spec)


class FailureKind(_Word):
    """Why a ``FAILED`` request failed; decides what its handle raises."""

    REQUEST = "request"  # a step it was in, or a check of its own, raised: RequestFailedError
    ENGINE_DEAD = "engine_dead"  # the engine thread died (or stopped) before it finished: EngineDeadError


class FinishReason(_Word):
    """Why a request ended."""

    STOP = "stop"  # an end-of-sequence / stop token was generated
    LENGTH = "length"  # max_new_tokens, the model's max positions, or the cache capacity was reached
    CANCELLED = "cancelled"
    ERROR = "error"
    # structured outputs: no token could continue the output's grammar (its vocabulary has none for
    # what comes next, or min_new_tokens holds back the end and the grammar allows nothing more, or
    # -inf logit biases ban every token it allows); the text is a prefix of a match, never a match
    GRAMMAR = "grammar"


@dataclass
class SampleOutput:
    """One of the ``n`` samples of a request submitted with ``n > 1``."""

    index: int
    generated_tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    status: RequestStatus
    finish_reason: FinishReason | None
    text: str | None = None
    # a scoring group's requests (see acb.api.scoring): what each one scored
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    next_token_logprobs: list[float] | None = None
    next_token_top_logprobs: list[tuple[int, float]] | None = None
    num_cached_tokens: int = 0


@dataclass
class GenerationOutput:
    """The final (or partial) output of one request.

    Times are ``time.perf_counter()`` values (``created_time``, ``timestamps``) or
    durations in seconds (``queue_time``, ``time_to_first_token``, ``total_time``).
    """

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    # log-probability of each generated token (filled when logprobs were asked for)
    logprobs: list[float] = field(default_factory=list)
    # per generated token, the top-k alternatives as (token id, logprob), most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # decoded generated text, when the engine has a tokenizer and the request used stop strings
    text: str | None = None
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: FinishReason | None = None
    error: str | None = None
    failure: FailureKind | None = None  # set with status FAILED
    created_time: float = 0.0
    # perf_counter() of each generated token, when record_timestamps was asked for
    timestamps: list[float] | None = None
    queue_time: float | None = None  # submit -> first scheduled
    time_to_first_token: float | None = None  # submit -> first token sampled
    total_time: float | None = None  # submit -> final outcome
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    # ("preempted" | "resumed", perf_counter time) of each time it left the device and came back
    events: list[tuple[str, float]] | None = None
    # prompt_logprobs=k: the logprob of each prompt token after the first given those before it
    # (len(prompt_ids) - 1 values), and its top-k alternatives as (token id, logprob)
    # (a scoring request: the continuation's tokens only, see ``Engine.score``)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # a scoring request whose continuations are single tokens: their logprobs after the whole
    # prompt, and that position's top alternatives (the greedy token first)
    next_token_logprobs: list[float] | None = None
    next_token_top_logprobs: list[tuple[int, float]] | None = None
    # n > 1: every sample (the top-level token fields then repeat sample 0); None when n == 1
    samples: list[SampleOutput] | None = None
    # the version of the weights its tokens were sampled under (Engine.update_weights; 0: the
    # weights the engine started with), or [(version, first token, end), ...] when an update
    # landed while it ran (pause(mode="keep"))
    weight_version: Any = 0

    def is_finished(self) -> bool:
        """Whether the request reached a terminal state (finished, failed or cancelled)."""
        return self.status.is_terminal

    @property
    def lifespan(self) -> tuple[float, float]:
        """transformers-compatible (first scheduled, finished) perf_counter pair; -1 when unknown."""
        start = self.created_time + self.queue_time if self.queue_time is not None else -1.0
        end = self.created_time + self.total_time if self.total_time is not None else -1.0
        return (start, end)


@dataclass(frozen=True)
class StreamDelta:
    """One item of a request's stream: the tokens new since the previous item.

    The last item of a stream has ``finished`` true and carries the final ``output``.
    Several engine steps may be coalesced into one delta when the consumer is slow.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    output: GenerationOutput | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    sample_index: int = 0  # which sample the tokens belong to (n > 1)
    text: str | None = None  # the text these tokens complete (the engine needs a tokenizer)


@dataclass
class ContinuationScore:
    """How likely the model finds one continuation of a context (see ``Engine.score``).

    ``logprobs``: each continuation token's log-probability given everything before it (the
    raw log-softmax of the model's logits: no temperature, bias or penalty); ``greedy``: whether
    every token is the model's most likely one there (greedy decoding would produce it);
    ``top_logprobs``: per token, the ``top_logprobs`` most likely tokens at that position as
    ``(token id, logprob)``, most likely first (None unless asked for).
    """

    token_ids: list[int]
    logprobs: list[float]
    greedy: bool
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def logprob(self) -> float:
        """The continuation's log-probability: the sum of its tokens'."""
        return float(sum(self.logprobs))


@dataclass
class ScoreOutput:
    """The scores of a context's continuations, in the order they were given.

    ``num_cached_tokens``: the context tokens that were read from the prefix cache rather than
    computed, summed over the engine requests the scoring took (one per continuation of two or
    more tokens, plus one for all single-token continuations together).
    """

    request_id: str
    context_ids: list[int]
    continuations: list[ContinuationScore]
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.FINISHED
    error: str | None = None
