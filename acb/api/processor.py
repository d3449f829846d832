"""The input processor: a submit, checked and turned into an :class:`EngineRequest` (as vLLM's
``Processor`` is, in its own room).

:class:`InputProcessor` is what every facade (``AsyncEngine``, ``Engine``, ``generate_batch``,
the manager, the scoring calls) goes through before the engine sees a request. It is built from
what it checks against, plain values all: the engine's :class:`ModelFacts` (its resolved sizes,
the vocabularies, the model's :class:`~acb.runner.media.MediaFacts`: read from the runner once,
when the engine starts), the tokenizer (or the model's processor), the requests' defaults, the
grammar compiler's holder and the model's image token. It holds no engine, and has no side
effects: processing a submit twice, or processing one and dropping it, leaves nothing behind.

- :func:`as_token_list` is the one prompt normaliser, called once per prompt on its way in (a
  scoring group's prompts are normalised when they are planned, and reach the processor as
  :class:`ScoreTarget` s of plain ints);
- the named validators (``check_*``) each refuse one thing, with an
  :class:`~acb.errors.InvalidRequestError` (or :class:`~acb.errors.InvalidRequestTypeError`)
  whose ``field`` is the public name of what it is about;
- :meth:`InputProcessor.process` (a generation) and :meth:`InputProcessor.process_score` (a
  scoring group) check everything and return the frozen :class:`EngineRequest`, built by
  keyword, in a :class:`Processed`. What only the submit decides (the request id it claims, the
  sink key it registers, the seed it draws for a request without one, when it was submitted) is
  filled in there: :class:`acb.api.submissions.Submissions`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from acb.api.loras import lora_salt
from acb.core.messages import EngineRequest, ScoreTarget
from acb.errors import EngineNotRunningError, InvalidRequestError, InvalidRequestTypeError
from acb.media import MediaPrompt, has_media, process_prompt
from acb.sampling_params import FALLBACK, SamplingParams
from acb.text import encode_prompt

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig

    from acb.api.grammars import Grammars
    from acb.api.loras import LoraInfo, Loras
    from acb.config import ContinuousBatchingConfig, ResolvedConfig
    from acb.media import MediaInputs
    from acb.runner.media import MediaFacts
    from acb.structured import CompiledGrammar, GrammarCompiler
    from acb.structured_outputs import StructuredOutputs
    from acb.text import Prompt, TokenizerLike

__all__ = [
    "InputProcessor",
    "ModelFacts",
    "Processed",
    "as_token_list",
    "check_logprobs",
    "check_min_tokens",
    "check_prompt_vocab",
    "check_vocab",
    "compile_grammar",
    "fork_blocks",
    "request_defaults",
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


def request_defaults(
    generation_config: GenerationConfig | None, model_config: PretrainedConfig, config: ContinuousBatchingConfig
) -> SamplingParams:
    """The defaults a request's sampling params are merged over.

    Args:
        generation_config: a transformers ``GenerationConfig`` (None: acb's defaults).
        model_config: the model's config (what the generation config's fields are read against).
        config: the engine's config (``drop_unsupported_processors``, ``return_logprobs``).

    Returns:
        The resolved defaults (over :data:`acb.sampling_params.FALLBACK`).
    """
    defaults = FALLBACK
    if generation_config is not None:
        defaults = SamplingParams.from_generation_config(
            generation_config, model_config, drop_unsupported=config.drop_unsupported_processors
        ).merged_over(FALLBACK)
    if config.return_logprobs:  # transformers' meaning: logprobs of the processed logits
        defaults = replace(defaults, logprobs=defaults.logprobs or 0, logprobs_mode="processed")
    return replace(defaults, logprobs_mode=defaults.logprobs_mode or "raw")


@dataclass(frozen=True)
class ModelFacts:
    """What submits are checked against, fixed when the engine starts: read from the runner once,
    on the starting thread, before the engine thread drives it."""

    cfg: ResolvedConfig  # the resolved sizes (block size, rows, max_model_len, image_cache_bytes...)
    vocab_size: int  # the output vocabulary: what can be sampled, scored and biased
    input_vocab_size: int  # the ids a prompt may hold (Molmo2's image tokens lie past the output vocabulary)
    media: MediaFacts  # the model's images: whether it runs them, their blocks, their price


class Processed(NamedTuple):
    """A submit checked and built (:meth:`InputProcessor.process`): its :class:`EngineRequest`, and
    what the submit needs besides (:meth:`acb.api.submissions.Submissions.open`). The request's
    ``request_id`` is the caller's (``""`` when it gave none), its ``sink_key`` is -1 (no sink yet),
    its ``seed`` the caller's (0 when it gave none: the submit draws one) and ``created_time`` 0:
    the submit fills them in."""

    request: EngineRequest
    request_id: str | None  # the caller's id (None: the submit claims a fresh one)
    prompt: Any  # what the caller gave as the prompt (its trace reads it)
    lora: LoraInfo | None = None  # its LoRA adapter (the submit records that its ids use it)


class InputProcessor:
    """Checks submits against the model and the engine's sizes and builds their engine requests.

    Args:
        facts: what the engine runs with (None before it first starts: only
            :meth:`process_media` works then).
        renderer: what renders and tokenizes prompts: the model's processor where the engine has
            one, else its tokenizer (None: token ids only).
        defaults: what a request's sampling params are merged over.
        grammars: the holder of the grammar compiler (structured outputs).
        placeholder_ids: the model's media placeholder token ids (:func:`acb.media.placeholder_token_ids`).
        loras: the engine's LoRA adapters by name (None: none can be named).
    """

    def __init__(
        self,
        facts: ModelFacts | None,
        renderer: TokenizerLike | None,
        defaults: SamplingParams,
        grammars: Grammars,
        placeholder_ids: frozenset[int],
        loras: Loras | None = None,
    ) -> None:
        self.facts = facts
        self.renderer = renderer
        self.defaults = defaults
        self.grammars = grammars
        self.placeholder_ids = placeholder_ids
        self.loras = loras

    def started(self) -> ModelFacts:
        """The facts submits are checked against (``EngineNotRunningError`` before the engine's
        first start)."""
        if self.facts is None:
            raise EngineNotRunningError("the engine is not running (start it, or use it as a context manager)")
        return self.facts

    # ------------------------------------------------------------ prompts
    def prompt_and_media(
        self, prompt: Prompt, vocab: int, chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> tuple[list[int], MediaInputs | None]:
        """A prompt normalised (text and chats encoded with the tokenizer; a chat with image parts
        processed by the model's processor, a processor's output taken as it is) and checked.

        Args:
            prompt: token ids, text, a chat, or a processor's output.
            vocab: the ids a prompt may hold (the input embeddings').
            chat_template_kwargs: the chat template's variables.

        Returns:
            Its token ids and its images (None: none).

        Raises:
            InvalidRequestError: empty, or an id outside the vocabulary; an image that does not
                load or is too large, or images for an engine that cannot run them (field
                ``prompt``).
            InvalidRequestTypeError: not token ids (nor, with a tokenizer, text or a chat).
        """
        media = None
        try:
            if has_media(prompt):
                processed = self.process_media(prompt, chat_template_kwargs)
                ids, media = list(processed), processed.media
            else:
                ids = as_token_list(encode_prompt(self.renderer, prompt, chat_template_kwargs))
        except (InvalidRequestError, InvalidRequestTypeError):
            raise
        except ValueError as exc:  # the tokenizer's side (an empty text, a template that refuses)
            raise InvalidRequestError(str(exc), "prompt") from exc
        except TypeError as exc:
            raise InvalidRequestTypeError(str(exc), "prompt") from exc
        if not ids:
            raise InvalidRequestError("prompt_ids is empty: a request needs at least one prompt token", "prompt")
        if media is not None:
            media = self.check_media(media)
        check_prompt_vocab(ids, vocab, "prompt")
        return ids, media

    def process_media(self, prompt: Prompt, chat_template_kwargs: Mapping[str, Any] | None = None) -> MediaPrompt:
        """A prompt with images processed (:func:`acb.media.process_prompt`): the CPU work of a
        submit with images, which an async submit runs in a worker thread.

        Raises:
            InvalidRequestError: an image that does not load, a chat the processor refuses, no
                processor (field ``prompt``).
            InvalidRequestTypeError: a processed prompt without ``input_ids``.
        """
        try:
            return process_prompt(
                self.renderer, prompt, placeholder_ids=self.placeholder_ids, chat_template_kwargs=chat_template_kwargs
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "prompt") from exc
        except TypeError as exc:
            raise InvalidRequestTypeError(str(exc), "prompt") from exc

    def media_refused(self) -> str:
        """Why this engine cannot run a request's images ("" when it can)."""
        return self.facts.media.refused if self.facts is not None else "the engine is not started"

    def check_media(self, inputs: MediaInputs) -> MediaInputs:
        """Refuse images the engine cannot run, or whose embeddings can never fit its budget;
        return them as the engine runs them (with the blocks a prefill chunk must not cut)."""
        facts = self.started()
        media = facts.media
        if media.refused:
            raise InvalidRequestError(f"this engine cannot run images: {media.refused}", "prompt")
        need = media.nbytes(inputs)
        budget = facts.cfg.image_cache_bytes
        if need > budget:
            raise InvalidRequestError(
                f"the request's images ({inputs.num_placeholders} image tokens, {len(inputs.hashes)} image(s)) "
                f"need about {need / 2**20:.1f} MiB of embeddings, more than the engine's image_cache_bytes "
                f"({budget / 2**20:.1f} MiB): send smaller images, or raise image_cache_bytes",
                "prompt",
            )
        return media.with_spans(inputs)

    # ------------------------------------------------------------ validators
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

    def lora(self, name: str | None) -> LoraInfo | None:
        """The adapter a submit names (None: the base model).

        Raises:
            InvalidRequestError: no adapter of that name is loaded (field ``lora``).
            InvalidRequestTypeError: not a str.
        """
        if name is None:
            return None
        if self.loras is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded (this engine holds none)", "lora")
        return self.loras.resolve(name)

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
    def process(
        self,
        prompt_ids: Prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        record_timestamps: bool = False,
        cache_salt: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora: str | None = None,
    ) -> Processed:
        """Check one generation's submit and build its :class:`EngineRequest`.

        Args:
            prompt_ids: token ids, text or a chat (with a tokenizer), or a prompt with images.
            sampling: how to decode (merged over the defaults).
            request_id: its id (None: the submit claims a fresh ``req_<n>``).
            record_timestamps: record each token's arrival time.
            cache_salt: keeps its prefix-cache entries apart from other salts'.
            chat_template_kwargs: the chat template's variables (a chat prompt).
            lora: the name of the LoRA adapter it runs with (None: the base model).

        Returns:
            The :class:`Processed` request.

        Raises:
            InvalidRequestError: bad input (the message names it, ``field`` too).
            InvalidRequestTypeError: an argument of the wrong type.
            EngineNotRunningError: the engine has never started.
        """
        facts = self.started()
        vocab, cfg = facts.vocab_size, facts.cfg
        ids, media = self.prompt_and_media(prompt_ids, facts.input_vocab_size, chat_template_kwargs)
        sampling = self.check_args(sampling, request_id, cache_salt)
        adapter = self.lora(lora)
        params = sampling.merged_over(self.defaults)
        check_vocab("logit_bias", params.logit_bias or (), vocab)
        stop_ids = self.stop_ids(sampling, params, vocab)
        check_logprobs(params, vocab)
        if params.stop and self.renderer is None:
            raise InvalidRequestError("stop strings need a tokenizer: pass tokenizer=... to the engine", "stop")
        grammar = None
        if params.structured_outputs is not None:
            # (a cache hit after an async submit: AsyncEngine compiles it off the loop first)
            grammar = compile_grammar(self.grammars.get(self.defaults.stop_token_ids), params.structured_outputs)
        n, max_new_tokens = params.n, params.max_new_tokens
        assert n is not None and max_new_tokens is not None  # the defaults (over FALLBACK) set them
        self.check_fits(len(ids), n, cfg)
        max_new = min(max_new_tokens, cfg.max_model_len - len(ids))
        min_new = min(params.min_new_tokens or 0, max_new)
        if grammar is not None:
            check_min_tokens(grammar, min_new, stop_ids)
        if min_new != (params.min_new_tokens or 0):
            params = replace(params, min_new_tokens=min_new)
        request = EngineRequest(
            request_id=request_id or "",
            sink_key=-1,
            prompt_ids=tuple(ids),
            params=params,
            max_new_tokens=max_new,
            stop_token_ids=stop_ids,
            seed=params.seed or 0,
            n=n,
            record_timestamps=record_timestamps,
            cache_salt=lora_salt(cache_salt, adapter),
            media=media,
            lora_slot=adapter.slot if adapter is not None else 0,
        )
        source = prompt_ids.source if isinstance(prompt_ids, MediaPrompt) else prompt_ids
        return Processed(request, request_id, source, adapter)

    def process_score(
        self,
        group: Sequence[ScoreTarget],
        top_logprobs: int,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        media: MediaInputs | None = None,
        lora: str | None = None,
    ) -> Processed:
        """Check one scoring group (planned by :func:`acb.api.scoring.plan`) and build its
        :class:`EngineRequest`, as :meth:`process` does for a generation: the context request
        records the prompt logprobs of its target and samples nothing; its children fork from it
        once its prompt is done, as the samples of ``n > 1`` do.

        Args:
            group: the group's targets (prompts of plain ints), its context request first.
            top_logprobs: the alternatives to record at each scored position.
            request_id: its id (None: the submit claims a fresh ``score_<n>``).
            cache_salt: keeps its prefix-cache entries apart from other salts'.
            media: the context's media, processed (:mod:`acb.media`).
            lora: the name of the LoRA adapter it is scored with (None: the base model).

        Returns:
            The :class:`Processed` request.

        Raises:
            InvalidRequestError: bad input (its ``field``: ``continuations``, ``request_id``...).
            InvalidRequestTypeError: an argument of the wrong type.
            EngineNotRunningError: the engine has never started.
        """
        facts = self.started()
        vocab = facts.vocab_size
        head = list(group[0].prompt_ids)
        self.check_args(None, request_id, cache_salt)
        adapter = self.lora(lora)
        self.check_score_group(group, vocab, facts.cfg, facts.input_vocab_size)
        # nothing is sampled: the raw logprobs of the scored positions only
        params = replace(FALLBACK, prompt_logprobs=max(top_logprobs, 1), logprobs_mode="raw")
        check_logprobs(params, vocab)
        if media is not None:
            media = self.check_media(media)
        request = EngineRequest(
            request_id=request_id or "",
            sink_key=-1,
            prompt_ids=tuple(head),
            params=params,
            max_new_tokens=0,
            stop_token_ids=frozenset(),
            seed=params.seed or 0,
            n=len(group),
            cache_salt=lora_salt(cache_salt, adapter),
            score=group[0],
            children=tuple(group[1:]),
            media=media,
            lora_slot=adapter.slot if adapter is not None else 0,
        )
        return Processed(request, request_id, head, adapter)
