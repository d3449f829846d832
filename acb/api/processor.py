"""The input processor: a submit, checked and turned into an :class:`EngineRequest` (as vLLM's
``Processor`` is, in its own room).

:class:`InputProcessor` is what every facade (``AsyncEngine``, ``Engine``, ``generate_batch``,
the manager, the scoring calls) goes through before the engine sees a request:

- :func:`as_token_list` is the one prompt normaliser, called once per prompt on its way in (a
  scoring group's prompts are normalised when they are planned, and reach the processor as
  :class:`ScoreTarget` s of plain ints);
- the named validators (``check_*``) each refuse one thing, with an
  :class:`~acb.errors.InvalidRequestError` (or :class:`~acb.errors.InvalidRequestTypeError`)
  whose ``field`` is the public name of what it is about;
- :meth:`InputProcessor.make_request` (a generation) and
  :meth:`InputProcessor.make_score_request` (a scoring group) check everything, then claim the
  request ids (all or none), register the sink and build the frozen :class:`EngineRequest`;
  :meth:`InputProcessor.make_all` does several at once (all or none).

The engine (:class:`acb.api.base.EngineBase`) keeps the lifecycle: it owns the core, the sinks,
the defaults and the grammar compiler, which the processor reads through it.
"""

from __future__ import annotations

import itertools
import operator
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from acb import telemetry
from acb.core.messages import EngineRequest, ScoreTarget
from acb.errors import EngineNotRunningError, InvalidRequestError, InvalidRequestTypeError, prefixed
from acb.images import ImagePrompt, has_images, image_token_id, process_prompt
from acb.outputs import FailureKind, FinishReason, GenerationOutput, RequestStatus
from acb.sampling_params import FALLBACK, SamplingParams
from acb.text import IncrementalDetokenizer, encode_prompt

if TYPE_CHECKING:
    from acb.api.base import EngineBase
    from acb.config import ResolvedConfig
    from acb.core.engine_core import EngineCore
    from acb.images import ImageInputs
    from acb.structured import CompiledGrammar, GrammarCompiler
    from acb.structured_outputs import StructuredOutputs
    from acb.text import Prompt

__all__ = [
    "InputProcessor",
    "Submission",
    "as_token_list",
    "check_logprobs",
    "check_min_tokens",
    "check_prompt_vocab",
    "check_vocab",
    "compile_grammar",
    "fork_blocks",
]


def as_token_list(prompt_ids: Any, field: str = "prompt") -> list[int]:
    """One prompt as a list of ints: a sequence of ints, a 1-D tensor/array, or a ``[1, T]`` one.

    Args:
        prompt_ids: the prompt's token ids.
        field: what the refusals name as their ``field`` (``prompt``; ``context``,
            ``continuations`` for a scoring call).

    Returns:
        The ids, as Python ints.

    Raises:
        InvalidRequestTypeError: text, a mapping or set, or something that holds no ints.
        InvalidRequestError: an array of more than one row.
    """
    if isinstance(prompt_ids, (str, bytes)):
        raise InvalidRequestTypeError("prompt_ids must be a sequence of token ids, not text (tokenize it first)", field)
    if isinstance(prompt_ids, (Mapping, Set)):
        raise InvalidRequestTypeError(
            f"prompt_ids must be an ordered sequence of token ids, got a {type(prompt_ids).__name__} "
            "(for a tokenizer's output, pass its 'input_ids')",
            field,
        )
    if hasattr(prompt_ids, "tolist") and not isinstance(prompt_ids, list):
        ndim = getattr(prompt_ids, "ndim", 1)
        if ndim == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        elif ndim != 1:
            raise InvalidRequestError(
                f"prompt_ids must be 1-D (or [1, T]), got shape {tuple(prompt_ids.shape)}; submit the rows of a "
                "batch one by one, or pass them all to generate_batch",
                field,
            )
        prompt_ids = prompt_ids.tolist()
    try:
        ids = list(prompt_ids)
    except TypeError:
        raise InvalidRequestTypeError(
            f"prompt_ids must be a sequence of ints, got {type(prompt_ids).__name__}", field
        ) from None
    try:
        return [operator.index(t) if not isinstance(t, bool) else _bool_token(t) for t in ids]
    except TypeError as e:
        bad = next(t for t in ids if isinstance(t, bool) or not hasattr(t, "__index__"))
        raise InvalidRequestTypeError(f"prompt_ids must hold ints, found {bad!r} ({type(bad).__name__})", field) from e


def _bool_token(t: bool) -> int:
    raise TypeError(f"prompt_ids must hold ints, found {t!r} (bool)")


def check_vocab(field: str, ids: Iterable[int], vocab: int, what: str | None = None) -> None:
    """Refuse a token id the model cannot produce.

    Args:
        field: the argument the ids come from (the refusal's ``field``).
        ids: the token ids (non-negative: checked where they were made).
        vocab: the model's vocabulary size.
        what: how the message names them (default: ``field``).

    Raises:
        InvalidRequestError: an id ``>= vocab``.
    """
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise InvalidRequestError(
            f"{what or field} token id {bad} is outside the model's vocabulary [0, {vocab})", field
        )


def check_prompt_vocab(ids: Sequence[int], vocab: int, field: str) -> None:
    """Refuse a prompt token the model has no embedding for.

    Args:
        ids: the prompt's token ids.
        vocab: the model's vocabulary size.
        field: the argument the prompt is (``prompt``; ``context`` for a scoring call).

    Raises:
        InvalidRequestError: an id below 0 or at least ``vocab``; the message names its position.
    """
    for pos, tok in enumerate(ids):
        if tok < 0 or tok >= vocab:
            raise InvalidRequestError(
                f"prompt_ids[{pos}] = {tok} is outside the model's vocabulary [0, {vocab})", field
            )


def compile_grammar(compiler: GrammarCompiler, spec: StructuredOutputs) -> CompiledGrammar:
    """The compiled grammar of a request's structured outputs.

    Args:
        compiler: the engine's grammar compiler.
        spec: the request's constraint.

    Returns:
        The compiled grammar (cached by spec).

    Raises:
        InvalidRequestError: it cannot compile (xgrammar's message; field ``structured_outputs``).
    """
    try:
        return compiler.compile_now(spec)
    except ValueError as exc:
        raise InvalidRequestError(f"structured_outputs: {exc}", "structured_outputs") from None


def check_min_tokens(grammar: CompiledGrammar, min_new: int, stop_ids: frozenset[int]) -> None:
    """Refuse a ``min_new_tokens`` that no output of the grammar can reach while it holds back every
    token the grammar can end with (the request's stop tokens are the ones it holds back).

    Args:
        grammar: the request's compiled grammar.
        min_new: its ``min_new_tokens`` (after the clamp to ``max_new_tokens``).
        stop_ids: its stop token ids.

    Raises:
        InvalidRequestError: the grammar's outputs are all shorter; the message names both numbers
            (field ``structured_outputs``: the constraint is what cannot be met).
    """
    bound = grammar.max_tokens
    if bound is not None and min_new > bound and set(grammar.stop_token_ids) <= stop_ids:
        raise InvalidRequestError(
            f"structured_outputs: min_new_tokens={min_new} (min_tokens) can never be met: every output of the "
            f"{grammar.spec.kind} constraint has at most {bound} tokens before its end, which min_new_tokens "
            "holds back",
            "structured_outputs",
        )


def check_logprobs(params: SamplingParams, vocab: int) -> None:
    """Refuse more logprob alternatives than the vocabulary has.

    Args:
        params: the resolved sampling params.
        vocab: the model's vocabulary size.

    Raises:
        InvalidRequestError: ``logprobs`` or ``prompt_logprobs`` exceeds ``vocab``.
    """
    if params.logprobs is not None and params.logprobs > vocab:
        raise InvalidRequestError(
            f"logprobs={params.logprobs} asks for more alternatives than the vocabulary's {vocab} tokens", "logprobs"
        )
    if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
        raise InvalidRequestError(
            f"prompt_logprobs={params.prompt_logprobs} asks for more alternatives than the vocabulary's {vocab} tokens",
            "prompt_logprobs",
        )


def fork_blocks(prompt_len: int, n: int, cfg: ResolvedConfig) -> tuple[int, int]:
    """The KV blocks ``n`` requests forked from one prompt need when it is done: its full blocks
    are shared, and each needs its own copy of the partial last block.

    Args:
        prompt_len: the shared prompt's tokens.
        n: how many requests fork from it.
        cfg: the engine's resolved sizes.

    Returns:
        ``(needed, usable)``: the blocks needed, and the cache's usable blocks.
    """
    bs = cfg.block_size
    return prompt_len // bs + (n if prompt_len % bs else 0), cfg.num_blocks - 1


def _member_ids(request_id: str, n: int) -> list[str]:
    """The ids a request of ``n`` samples (or scoring members) claims: its own, then its samples'
    (as :attr:`acb.core.messages.EngineRequest.member_ids` names them)."""
    return [request_id] + [f"{request_id}#{i}" for i in range(1, n)]


class Submission:
    """A validated submit on the caller's side (what :meth:`InputProcessor.make_request` returns):
    the :class:`EngineRequest` to post, and the sink its results go to. Its request ids are
    claimed until it is posted (:meth:`acb.api.base.EngineBase.admit`) or given back
    (:meth:`acb.api.base.EngineBase.abandon`)."""

    __slots__ = ("engine_request", "sink")

    def __init__(self, engine_request: EngineRequest, sink: Any) -> None:
        self.engine_request = engine_request
        self.sink = sink

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id

    def failed_output(self, error: str, failure: FailureKind) -> GenerationOutput:
        """The outcome of a submit that never reached the engine (it died first).

        Args:
            error: the error's text.
            failure: its kind.

        Returns:
            A FAILED output with the request's id and prompt.
        """
        er = self.engine_request
        return GenerationOutput(
            request_id=er.request_id,
            prompt_ids=list(er.prompt_ids),
            status=RequestStatus.FAILED,
            finish_reason=FinishReason.ERROR,
            error=error,
            failure=failure,
        )


class InputProcessor:
    """Checks submits against the engine's model and sizes and builds their engine requests.

    Args:
        engine: the engine whose core, sinks, tokenizer, defaults and grammar compiler it uses.
        seed: seeds the draws of the requests without a seed (the engine's ``seed``), so that
            runs repeat.
    """

    def __init__(self, engine: EngineBase, seed: int | None) -> None:
        self._engine = engine
        # requests without a seed draw one here, so that the engine's seed makes runs repeatable
        self._seeds = random.Random(seed)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (None without one)."""
        return self._engine.tokenizer

    # ------------------------------------------------------------ validators
    def live_core(self) -> EngineCore:
        """The core a submit goes to.

        Returns:
            The running core.

        Raises:
            EngineNotRunningError: the engine is not started.
            EngineDeadError: the engine died.
            RuntimeError: this is a tensor-parallel follower (its leader takes the submits).
        """
        core = self._engine.core
        if core is None:
            raise EngineNotRunningError("the engine is not running (start it, or use it as a context manager)")
        core.check_alive()
        if core.sync is not None and not core.sync.is_leader and threading.current_thread() is not core.thread:
            raise RuntimeError(
                f"this is a tensor-parallel follower (rank {core.sync.rank}): submit requests on the leader, rank "
                f"{core.sync.leader_rank}, whose engine runs them on every rank (generate_batch returns {{}} here)"
            )
        return core

    def prompt_ids(
        self, prompt: Prompt, vocab: int, chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """A prompt normalised (text and chats encoded with the tokenizer) and checked.

        Args:
            prompt: token ids, text or a chat.
            vocab: the model's vocabulary size.
            chat_template_kwargs: the chat template's variables.

        Returns:
            Its token ids.

        Raises:
            InvalidRequestError: empty, or an id outside the vocabulary (field ``prompt``).
            InvalidRequestTypeError: not token ids (nor, with a tokenizer, text or a chat).
        """
        ids, images = self.prompt_and_images(prompt, vocab, chat_template_kwargs)
        if images is not None:
            raise InvalidRequestError("this call takes no images", "prompt")
        return ids

    def prompt_and_images(
        self, prompt: Prompt, vocab: int, chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> tuple[list[int], ImageInputs | None]:
        """:meth:`prompt_ids` for a prompt that may have images (:mod:`acb.images`): a chat with
        image parts is processed by the engine's processor, a processor's output taken as it is.

        Returns:
            Its token ids and its images (None: none).

        Raises:
            InvalidRequestError: as :meth:`prompt_ids`; an image that does not load or is too
                large, or images for an engine that cannot run them (field ``prompt``).
            InvalidRequestTypeError: as :meth:`prompt_ids`.
        """
        images = None
        try:
            if has_images(prompt):
                processed = self.process_images(prompt, chat_template_kwargs)
                ids, images = list(processed), processed.images
            else:
                ids = as_token_list(encode_prompt(self._engine.tokenizer, prompt, chat_template_kwargs))
        except (InvalidRequestError, InvalidRequestTypeError):
            raise
        except ValueError as exc:  # the tokenizer's side (an empty text, a template that refuses)
            raise InvalidRequestError(str(exc), "prompt") from exc
        except TypeError as exc:
            raise InvalidRequestTypeError(str(exc), "prompt") from exc
        if not ids:
            raise InvalidRequestError("prompt_ids is empty: a request needs at least one prompt token", "prompt")
        if images is not None:
            images = self.check_images(images)
        check_prompt_vocab(ids, vocab, "prompt")
        return ids, images

    def process_images(self, prompt: Prompt, chat_template_kwargs: Mapping[str, Any] | None = None) -> ImagePrompt:
        """A prompt with images processed (:func:`acb.images.process_prompt`): the CPU work of a
        submit with images, which an async submit runs in a worker thread.

        Raises:
            InvalidRequestError: an image that does not load, a chat the processor refuses, no
                processor (field ``prompt``).
            InvalidRequestTypeError: a processed prompt without ``input_ids``.
        """
        try:
            return process_prompt(
                self._engine.tokenizer,
                prompt,
                image_token_id=image_token_id(self._engine.model.config),
                chat_template_kwargs=chat_template_kwargs,
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "prompt") from exc
        except TypeError as exc:
            raise InvalidRequestTypeError(str(exc), "prompt") from exc

    def check_images(self, images: ImageInputs) -> ImageInputs:
        """Refuse images the engine cannot run, or whose embeddings can never fit its budget;
        return them as the engine runs them (with the blocks a prefill chunk must not cut)."""
        runner = self.live_core().runner
        why = runner.images_refused()
        if why:
            raise InvalidRequestError(f"this engine cannot run images: {why}", "prompt")
        need = runner.image_bytes(images)
        budget = runner.cfg.image_cache_bytes
        if need > budget:
            raise InvalidRequestError(
                f"the request's images ({images.num_image_tokens} image tokens, {len(images.hashes)} image(s)) "
                f"need about {need / 2**20:.1f} MiB of embeddings, more than the engine's image_cache_bytes "
                f"({budget / 2**20:.1f} MiB): send smaller images, or raise image_cache_bytes",
                "prompt",
            )
        return runner.with_image_spans(images)

    @staticmethod
    def check_args(sampling: SamplingParams | None, request_id: str | None, cache_salt: str | None) -> SamplingParams:
        """Check the types of a submit's arguments.

        Args:
            sampling: how to decode (None: the defaults).
            request_id: the caller's id, if any.
            cache_salt: the prefix-cache salt, if any.

        Returns:
            ``sampling`` (an empty :class:`SamplingParams` for None).

        Raises:
            InvalidRequestTypeError: one of the wrong type (its field: ``sampling``, ``request_id``,
                ``cache_salt``).
        """
        if sampling is None:
            sampling = SamplingParams()
        elif not isinstance(sampling, SamplingParams):
            raise InvalidRequestTypeError(
                f"sampling must be an acb.SamplingParams or None, got {type(sampling).__name__}", "sampling"
            )
        if request_id is not None and not isinstance(request_id, str):
            raise InvalidRequestTypeError(f"request_id must be a str, got {type(request_id).__name__}", "request_id")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestTypeError(
                f"cache_salt must be a str or None, got {type(cache_salt).__name__}", "cache_salt"
            )
        return sampling

    def stop_ids(self, sampling: SamplingParams, params: SamplingParams, vocab: int) -> frozenset[int]:
        """A request's stop token ids (checking the caller's).

        Args:
            sampling: as the caller gave it.
            params: resolved over the defaults.
            vocab: the model's vocabulary size.

        Returns:
            The ids that end it: the caller's; none with ``ignore_eos``; else the generation
            config's that the model can produce.

        Raises:
            InvalidRequestError: a caller's id outside the vocabulary (field ``stop_token_ids``).
        """
        if sampling.stop_token_ids is not None:
            check_vocab("stop_token_ids", sampling.stop_token_ids, vocab)
            return frozenset(sampling.stop_token_ids)
        if params.ignore_eos:  # as vLLM: the model's EOS is ignored; stops the caller gives still apply
            return frozenset()
        # the generation config's: an id the model cannot produce can never stop anything
        return frozenset(t for t in params.stop_token_ids or () if t < vocab)

    @staticmethod
    def check_fits(prompt_len: int, n: int, cfg: ResolvedConfig) -> None:
        """Refuse a generation that can never fit the engine.

        Args:
            prompt_len: its prompt's tokens.
            n: its samples.
            cfg: the engine's resolved sizes.

        Raises:
            InvalidRequestError: the prompt leaves no room for a token (field ``prompt``); more
                samples than rows, or than the cache can fork (field ``n``).
        """
        limit = cfg.max_model_len
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"prompt of {prompt_len} tokens can never fit: a request may hold at most {limit} tokens "
                f"(prompt + at least one generated token), the smaller of the model's max positions and "
                f"the KV cache's {cfg.capacity_tokens} tokens",
                "prompt",
            )
        if n > cfg.max_requests_per_batch:
            raise InvalidRequestError(
                f"n={n} samples run side by side and need {n} of the engine's rows, but "
                f"max_requests_per_batch is {cfg.max_requests_per_batch}",
                "n",
            )
        if n > 1:
            need, usable = fork_blocks(prompt_len, n, cfg)
            if need > usable:
                raise InvalidRequestError(
                    f"n={n} samples of a {prompt_len}-token prompt can never fit: forking them needs "
                    f"{need} KV blocks of {cfg.block_size} tokens (the shared full blocks once, the partial "
                    f"last block once per sample), and the cache has {usable}; lower n or raise num_blocks",
                    "n",
                )

    @staticmethod
    def check_score_group(
        group: Sequence[ScoreTarget], vocab: int, cfg: ResolvedConfig, prompt_vocab: int | None = None
    ) -> None:
        """Refuse a scoring group (a context request, then its children) that is malformed or can
        never fit.

        Args:
            group: the group's targets, its context request first.
            vocab: the model's vocabulary size (what a continuation token may be).
            cfg: the engine's resolved sizes.
            prompt_vocab: the ids the context may hold (the input embeddings'; ``vocab`` if None).

        Raises:
            InvalidRequestError: a token outside the vocabulary, a child that does not extend the
                context, or a group that can never fit (field ``continuations``).
        """
        head = group[0].prompt_ids
        check_prompt_vocab(head, prompt_vocab or vocab, "context")
        check_vocab("continuations", group[0].next_tokens or (), vocab, "continuation")
        for child in group[1:]:
            check_vocab("continuations", child.prompt_ids, vocab, "continuation")
            check_vocab("continuations", child.next_tokens or (), vocab, "continuation")
            if child.prompt_ids[: len(head)] != head or len(child.prompt_ids) <= len(head):
                raise InvalidRequestError("a scoring child's prompt must extend its parent's", "continuations")
        limit = cfg.max_model_len
        longest = max(len(t.prompt_ids) for t in group)
        if longest > limit:
            raise InvalidRequestError(
                f"context and continuation ({longest} tokens) can never fit: a request may hold at most {limit} "
                f"tokens (the model's max positions, and the KV cache's {cfg.capacity_tokens} tokens)",
                "continuations",
            )
        n = len(group)
        if n > cfg.max_requests_per_batch:  # (plan() makes groups that fit)
            raise InvalidRequestError(
                f"a scoring request with {n - 1} forked continuation(s) runs {n} requests side by side, but "
                f"max_requests_per_batch is {cfg.max_requests_per_batch}: give it at most "
                f"{cfg.max_requests_per_batch - 1} score_children (Engine.score plans groups that fit)",
                "continuations",
            )
        if n > 1:
            need, usable = fork_blocks(len(head), n, cfg)
            if need > usable:
                raise InvalidRequestError(
                    f"scoring {n - 1} continuation(s) of more than one token after a {len(head)}-token context can "
                    f"never fit: they fork from the context's KV, which needs {need} KV blocks of "
                    f"{cfg.block_size} tokens (the shared full blocks once, the partial last block once per "
                    f"request), and the cache has {usable}; score them one call at a time or raise num_blocks",
                    "continuations",
                )

    # ------------------------------------------------------------- requests
    def make_request(
        self,
        prompt_ids: Prompt,
        sampling: SamplingParams | None = None,
        *,
        sink_factory: Callable[[str], Any],
        request_id: str | None = None,
        record_timestamps: bool = False,
        cache_salt: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Submission:
        """Validate one submit and build its :class:`EngineRequest`, whose results go to
        ``sink_factory(request_id)`` (a ``ThreadSink`` or an ``AsyncSink``). Everything is checked
        before the request id is claimed, so a refused submit leaves nothing behind. Hand it to the
        engine with :meth:`acb.api.base.EngineBase.admit` (or ``enqueue`` when holding a queue
        slot), or give its id back with ``abandon``.

        Args:
            prompt_ids: token ids, text or a chat (with a tokenizer).
            sampling: how to decode (merged over the engine's defaults).
            sink_factory: ``sink_factory(request_id)`` makes the sink its results go to.
            request_id: its id (default ``req_<n>``, an id no live request has, nor its samples:
                unique per call, whoever else submits at the same time).
            record_timestamps: record each token's arrival time.
            cache_salt: keeps its prefix-cache entries apart from other salts'.
            chat_template_kwargs: the chat template's variables (a chat prompt).

        Returns:
            The :class:`Submission` (its :class:`EngineRequest` and its sink).

        Raises:
            InvalidRequestError: bad input (the message names it, ``field`` too); nothing is left
                behind.
            InvalidRequestTypeError: an argument of the wrong type.
            EngineNotRunningError: the engine is not started.
        """
        engine = self._engine
        core = self.live_core()
        vocab = core.runner.vocab_size
        ids, images = self.prompt_and_images(prompt_ids, core.runner.input_vocab_size, chat_template_kwargs)
        sampling = self.check_args(sampling, request_id, cache_salt)
        params = sampling.merged_over(engine.defaults)
        check_vocab("logit_bias", params.logit_bias or (), vocab)
        stop_ids = self.stop_ids(sampling, params, vocab)
        check_logprobs(params, vocab)
        if params.stop and engine.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer: pass tokenizer=... to the engine", "stop")
        grammar = None
        if params.structured_outputs is not None:
            # (a cache hit after an async submit: AsyncEngine compiles it off the loop first)
            grammar = compile_grammar(engine.grammars(), params.structured_outputs)
        cfg = core.runner.cfg
        n, max_new_tokens = params.n, params.max_new_tokens
        assert n is not None and max_new_tokens is not None  # the defaults (over FALLBACK) set them
        self.check_fits(len(ids), n, cfg)
        max_new = min(max_new_tokens, cfg.max_model_len - len(ids))
        min_new = min(params.min_new_tokens or 0, max_new)
        if grammar is not None:
            check_min_tokens(grammar, min_new, stop_ids)
        if min_new != (params.min_new_tokens or 0):
            params = replace(params, min_new_tokens=min_new)
        return self._build(
            core,
            prompt_ids,
            ids,
            params,
            max_new,
            stop_ids,
            n,
            request_id,
            "req",
            sink_factory,
            record_timestamps,
            cache_salt,
            None,
            images,
        )

    def make_score_request(
        self,
        group: Sequence[ScoreTarget],
        top_logprobs: int,
        *,
        sink_factory: Callable[[str], Any],
        request_id: str | None = None,
        cache_salt: str | None = None,
        images: ImageInputs | None = None,
    ) -> Submission:
        """Validate one scoring group (planned by :func:`acb.api.scoring.plan`) and build its
        :class:`EngineRequest`, as :meth:`make_request` does for a generation: the context request
        records the prompt logprobs of its target and samples nothing; its children fork from it
        once its prompt is done, as the samples of ``n > 1`` do.

        Args:
            group: the group's targets (prompts of plain ints), its context request first.
            top_logprobs: the alternatives to record at each scored position.
            sink_factory: ``sink_factory(request_id)`` makes the sink its results go to.
            request_id: its id (default ``score_<n>``, as :meth:`make_request` makes them).
            cache_salt: keeps its prefix-cache entries apart from other salts'.
            images: the context's images, processed (:mod:`acb.images`).

        Returns:
            The :class:`Submission`.

        Raises:
            InvalidRequestError: bad input (its ``field``: ``continuations``, ``request_id``...).
            InvalidRequestTypeError: an argument of the wrong type.
            EngineNotRunningError: the engine is not started.
        """
        core = self.live_core()
        vocab = core.runner.vocab_size
        head = group[0]
        self.check_args(None, request_id, cache_salt)
        self.check_score_group(group, vocab, core.runner.cfg, core.runner.input_vocab_size)
        # nothing is sampled: the raw logprobs of the scored positions only
        params = replace(FALLBACK, prompt_logprobs=max(top_logprobs, 1), logprobs_mode="raw")
        check_logprobs(params, vocab)
        if images is not None:
            images = self.check_images(images)
        return self._build(
            core,
            list(head.prompt_ids),
            list(head.prompt_ids),
            params,
            0,
            frozenset(),
            len(group),
            request_id,
            "score",
            sink_factory,
            False,
            cache_salt,
            group,
            images,
        )

    def _build(
        self,
        core: EngineCore,
        prompt: Any,
        ids: list[int],
        params: SamplingParams,
        max_new: int,
        stop_ids: frozenset[int],
        n: int,
        request_id: str | None,
        id_prefix: str,
        sink_factory: Callable[[str], Any],
        record_timestamps: bool,
        cache_salt: str | None,
        score: Sequence[ScoreTarget] | None,
        images: ImageInputs | None = None,
    ) -> Submission:
        """Every check passed: claim the ids (all of them, or none), make and register the sink,
        and build the :class:`EngineRequest`."""
        engine = self._engine
        base_seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        if request_id is None:  # a fresh id whose samples' ids are free too (a caller may hold "req_3#1")
            request_id = f"{id_prefix}_{next(self._ids)}"
            while engine.ids.claim(_member_ids(request_id, n)) is not None:
                request_id = f"{id_prefix}_{next(self._ids)}"
        else:
            taken = engine.ids.claim(_member_ids(request_id, n))
            if taken == request_id:
                raise InvalidRequestError(f"request_id {request_id!r} is already used by a live request", "request_id")
            if taken is not None:  # the samples' internal ids must not collide either
                raise InvalidRequestError(
                    f"request id {taken!r} (sample of {request_id!r}) is already live", "request_id"
                )
        member_ids = _member_ids(request_id, n)
        try:
            sink = sink_factory(request_id)
            source = prompt.source if isinstance(prompt, ImagePrompt) else prompt
            sink.state.trace = telemetry.begin(source, engine.model_name, params)
            tokenizer = engine.tokenizer
            if tokenizer is not None and score is None and not params.stop:
                # text for the stream and the output, decoded on the consumer's side (with stop
                # strings, the engine thread decodes it as it matches them)
                skip = params.skip_special_tokens is not False
                sink.state.detokenizers = [IncrementalDetokenizer(tokenizer, skip) for _ in range(n)]
            er = EngineRequest(
                request_id,
                engine.sinks.register(sink),
                tuple(ids),
                params,
                max_new,
                stop_ids,
                base_seed,
                n,
                time.perf_counter(),
                record_timestamps,
                cache_salt or None,
                score[0] if score else None,
                tuple(score[1:]) if score else (),
                images,
            )
        except BaseException:
            engine.ids.release_all(member_ids)
            raise
        return Submission(er, sink)

    def make_all(self, field: str, makers: Iterable[tuple[int, Callable[[], Submission]]]) -> list[Submission]:
        """Several submits validated together (a batch call): all of them, or none.

        Args:
            field: the argument's name in errors (``inputs[i]: ...``).
            makers: ``(i, maker)`` pairs, each ``maker()`` a :meth:`make_request` call.

        Returns:
            The submissions, in order.

        Raises:
            ValueError: the first bad one, named ``field[i]`` (the others are given back; an
                :class:`InvalidRequestError` keeps its field).
            TypeError: likewise, for an argument of the wrong type.
        """
        made: list[Submission] = []
        try:
            for i, make in makers:
                try:
                    made.append(make())
                except (ValueError, TypeError) as exc:
                    raise prefixed(exc, f"{field}[{i}]") from None
        except BaseException:
            for r in made:
                self._engine.abandon(r)
            raise
        return made
