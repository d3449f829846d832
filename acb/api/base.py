"""What the async and blocking engines share: :class:`EngineBase` (httpx style: one base,
two facades with the same method names).

Its public surface is what every facade (``AsyncEngine``, ``Engine``, ``generate_batch``,
the manager) and every client of the library uses: ``prepare``/``start``/``stop``/``join``,
``make_request`` (validate a submit and claim its id), ``admit``/``enqueue`` (hand it to
the engine), ``abandon``, ``cancel``, ``call`` (run a function on the engine thread), and
read-only ``core``, ``runner``, ``gate``, ``defaults``, ``config``, ``stats``.

The API layer never touches the device: the runner is built here (which measures memory
and swaps the attention implementation) but only ever driven by the engine thread.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence, Set
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from acb import telemetry
from acb.api.gate import AdmissionGate
from acb.api import scoring
from acb.api.scoring import ScoreSpec
from acb.api.sinks import SinkRegistry
from acb.config import ConfigLike, ResolvedConfig, as_config
from acb.core.engine_core import EngineCore
from acb.core.messages import EngineRequest, EngineStats, ScoreTarget
from acb.errors import EngineNotRunningError
from acb.outputs import FailureKind, FinishReason, GenerationOutput, RequestStatus
from acb.sampling_params import FALLBACK, SamplingParams
from acb.text import IncrementalDetokenizer, encode_prompt, text_tokenizer

if TYPE_CHECKING:
    import torch

    from acb.structured import CompiledGrammar, GrammarCompiler
    from acb.structured_outputs import StructuredOutputs
    from typing_extensions import Self

    from transformers import GenerationConfig, PreTrainedModel

    from acb.runner.model_runner import MemoryReleased, ModelRunner
    from acb.text import Prompt, TokenizerLike

logger = logging.getLogger(__name__)


def as_token_list(prompt_ids: Any) -> list[int]:
    """One prompt as a list of ints: a sequence of ints, a 1-D tensor/array, or a ``[1, T]`` one."""
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError("prompt_ids must be a sequence of token ids, not text (tokenize it first)")
    if isinstance(prompt_ids, (Mapping, Set)):
        raise TypeError(
            f"prompt_ids must be an ordered sequence of token ids, got a {type(prompt_ids).__name__} "
            "(for a tokenizer's output, pass its 'input_ids')"
        )
    if hasattr(prompt_ids, "tolist") and not isinstance(prompt_ids, list):
        ndim = getattr(prompt_ids, "ndim", 1)
        if ndim == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        elif ndim != 1:
            raise ValueError(
                f"prompt_ids must be 1-D (or [1, T]), got shape {tuple(prompt_ids.shape)}; submit the rows of a "
                "batch one by one, or pass them all to generate_batch"
            )
        prompt_ids = prompt_ids.tolist()
    try:
        ids = list(prompt_ids)
    except TypeError:
        raise TypeError(f"prompt_ids must be a sequence of ints, got {type(prompt_ids).__name__}") from None
    try:
        return [operator.index(t) if not isinstance(t, bool) else _bool_token(t) for t in ids]
    except TypeError as e:
        bad = next(t for t in ids if isinstance(t, bool) or not hasattr(t, "__index__"))
        raise TypeError(f"prompt_ids must hold ints, found {bad!r} ({type(bad).__name__})") from e


def _bool_token(t: bool) -> int:
    raise TypeError(f"prompt_ids must hold ints, found {t!r} (bool)")


def _check_vocab(field: str, ids: Any, vocab: int) -> None:
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"{field} token id {bad} is outside the model's vocabulary [0, {vocab})")


def _member_ids(request_id: str, n: int) -> list[str]:
    """The ids a request of ``n`` samples (or scoring members) claims: its own, then its samples'
    (as :attr:`acb.core.messages.EngineRequest.member_ids` names them)."""
    return [request_id] + [f"{request_id}#{i}" for i in range(1, n)]


def _claim_all(core: EngineCore, ids: Sequence[str]) -> str | None:
    """Claim every id of ``ids`` or, when one is live already, none; returns that live id (None
    when all are claimed)."""
    for k, mid in enumerate(ids):
        if not core.reserve_id(mid):
            for taken in ids[:k]:
                core.release_id(taken)
            return mid
    return None


def compile_grammar(compiler: GrammarCompiler, spec: StructuredOutputs) -> CompiledGrammar:
    """The compiled grammar of a request's structured outputs; one that cannot compile is the
    submit's ``ValueError``, with xgrammar's message."""
    try:
        return compiler.compile_now(spec)
    except ValueError as exc:
        raise ValueError(f"structured_outputs: {exc}") from None


def check_min_tokens(grammar: CompiledGrammar, min_new: int, stop_ids: frozenset[int]) -> None:
    """Refuse a ``min_new_tokens`` that no output of the grammar can reach while it holds back every
    token the grammar can end with (the request's stop tokens are the ones it holds back).

    Args:
        grammar: the request's compiled grammar.
        min_new: its ``min_new_tokens`` (after the clamp to ``max_new_tokens``).
        stop_ids: its stop token ids.

    Raises:
        ValueError: the grammar's outputs are all shorter; the message names both numbers.
    """
    bound = grammar.max_tokens
    if bound is not None and min_new > bound and set(grammar.stop_token_ids) <= stop_ids:
        raise ValueError(f"structured_outputs: min_new_tokens={min_new} (min_tokens) can never be met: every output "
                         f"of the {grammar.spec.kind} constraint has at most {bound} tokens before its end, which "
                         "min_new_tokens holds back")


class Submission:
    """A validated submit on the caller's side (what :meth:`EngineBase.make_request` returns):
    the :class:`EngineRequest` to post, and the sink its results go to. Its request ids are
    claimed until it is posted (:meth:`EngineBase.admit`) or given back (:meth:`EngineBase.abandon`)."""

    __slots__ = ("engine_request", "sink")

    def __init__(self, engine_request: EngineRequest, sink: Any) -> None:
        self.engine_request = engine_request
        self.sink = sink

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id

    def failed_output(self, error: str, failure: FailureKind) -> GenerationOutput:
        """The outcome of a submit that never reached the engine (it died first)."""
        er = self.engine_request
        return GenerationOutput(request_id=er.request_id, prompt_ids=list(er.prompt_ids), status=RequestStatus.FAILED,
                                finish_reason=FinishReason.ERROR, error=error, failure=failure)


class EngineBase:
    """What :class:`acb.AsyncEngine` and :class:`acb.Engine` share besides their submit style:
    start-up, validation at submit, the engine core and its thread.

    ``runner_cls`` builds the model runner (default :class:`acb.runner.model_runner.ModelRunner`);
    the overhead benchmark passes a runner whose forward costs nothing.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: ConfigLike | None = None,
        generation_config: GenerationConfig | None = None,
        *,
        tokenizer: TokenizerLike | None = None,
        runner_cls: type[ModelRunner] | None = None,
    ) -> None:
        config = as_config(config)  # the one entry point: None, acb's, or a transformers instance
        config.warn_unsupported()
        self.model = model
        self.cb_config = config  # acb's form of what was given; ``config`` is what it resolves to here
        if generation_config is None:
            generation_config = getattr(model, "generation_config", None)
        self.tokenizer = tokenizer
        # the model's name in telemetry (gen_ai.request.model); acb serve sets the served name
        self.model_name: str = (getattr(model.config, "name_or_path", "") or model.config.model_type or "model")
        self.set_generation_config(generation_config)
        # requests without a seed draw one here, so that the engine's seed makes runs repeatable
        self._seeds = random.Random(config.seed)
        self._runner_cls = runner_cls
        self.core: EngineCore | None = None
        self.runner: ModelRunner | None = None
        self.gate = AdmissionGate(config.max_queue_size)
        self.sinks = SinkRegistry()  # where the engine delivers each submit's results
        self._grammar_compiler: GrammarCompiler | None = None  # structured outputs: built on first use
        self._grammar_lock = threading.Lock()
        self._ids = itertools.count()
        self._start_lock = threading.Lock()
        self._context_depth = 0
        self._context_lock = threading.Lock()

    def set_generation_config(self, generation_config: GenerationConfig | None) -> None:
        """Make ``generation_config`` the defaults of the requests submitted from now on (a live
        engine kept across calls that each bring their own, as a trainer's rollouts do).

        Args:
            generation_config: a transformers ``GenerationConfig`` (None: acb's defaults).
        """
        config = self.cb_config
        defaults = FALLBACK
        if generation_config is not None:
            defaults = SamplingParams.from_generation_config(
                generation_config, self.model.config, drop_unsupported=config.drop_unsupported_processors
            ).merged_over(FALLBACK)
        if config.return_logprobs:  # transformers' meaning: logprobs of the processed logits
            defaults = replace(defaults, logprobs=defaults.logprobs or 0, logprobs_mode="processed")
        self.generation_config = generation_config
        self.defaults = replace(defaults, logprobs_mode=defaults.logprobs_mode or "raw")

    # ------------------------------------------------------------------ life
    def prepare(self) -> None:
        """Check the model, size and allocate the KV cache (idempotent; ``start`` calls it)."""
        if self.runner is None:
            from acb.runner.model_runner import ModelRunner  # the API's only torch code
            from acb.runner.setup import device_scope, model_device

            with device_scope(model_device(self.model)):
                runner = (self._runner_cls or ModelRunner)(self.model, self.cb_config)
                try:
                    runner.warmup()  # captures the decode CUDA graphs when enabled
                except BaseException:
                    runner.close()
                    raise
            self.runner = runner

    def start(self) -> None:
        """Check the model, build the KV cache and start the engine thread (the context manager does this)."""
        with self._start_lock:
            if self.core is not None and self.core.is_running:
                return
            self.prepare()
            runner = self.runner
            assert runner is not None  # prepare() built it
            self.gate = AdmissionGate(self.cb_config.max_queue_size)
            sync = None
            from acb.runner.tp_sync import StepSync, tp_group

            group = tp_group(self.model)
            if group is not None:  # tensor parallel: every rank's engine runs the leader's requests
                sync = StepSync(group)
            follower = sync is not None and not sync.is_leader
            core = EngineCore(runner, deliver=self.sinks.deliver, on_dequeued=None if follower else self.gate.release,
                              sync=sync, tokenizer=self.tokenizer, grammars=self.grammars)
            core.on_exit = self._on_core_exit
            self.core = core
            core.start()
            telemetry.watch_engine(self, self.model_name)

    def _on_core_exit(self) -> None:
        self.gate.close()
        with self._grammar_lock:
            if self._grammar_compiler is not None:
                self._grammar_compiler.close()
                self._grammar_compiler = None
        if self.runner is not None:
            self.runner.close()
            self.runner = None

    def stop(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the engine thread. On a tensor-parallel follower rank the leader's stop ends the
        engine: this waits for it.

        Args:
            drain: finish the live requests first (else they are cancelled).
            timeout: the most seconds to wait for the engine thread.
        """
        core = self.core
        if core is not None:
            if self.is_follower:
                core.join(timeout)
            else:
                core.stop(drain=drain, timeout=timeout)

    @property
    def is_follower(self) -> bool:
        """Whether this is a tensor-parallel rank other than the leader (the group's first rank):
        its engine runs the leader's requests in lock step and takes none of its own."""
        core = self.core
        return core is not None and core.sync is not None and not core.sync.is_leader

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine thread to exit (after ``stop``).

        Args:
            timeout: the most seconds to wait.
        """
        if self.core is not None:
            self.core.join(timeout)

    def _enter_context(self) -> None:
        """``with``/``async with``: start the engine; nested blocks share it (counted)."""
        with self._context_lock:
            if self._context_depth == 0:
                self.start()
            self._context_depth += 1

    def _exit_context(self) -> bool:
        """True when the outermost ``with`` block is left (the engine is then stopped)."""
        with self._context_lock:
            self._context_depth -= 1
            return self._context_depth == 0

    @property
    def is_running(self) -> bool:
        return self.core is not None and self.core.is_running

    @property
    def config(self) -> ResolvedConfig:
        """The resolved settings (block counts, budgets) the engine runs with."""
        runner = self.runner or (self.core.runner if self.core is not None else None)
        if runner is None:
            raise EngineNotRunningError("the engine has not been started")
        return runner.cfg

    @property
    def stats(self) -> EngineStats:
        """Counters and gauges, as of the last step."""
        return self.core.stats if self.core is not None else EngineStats()

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        config: ConfigLike | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | int | None = None,
        tokenizer: TokenizerLike | None = None,
        **model_kwargs: Any,
    ) -> Self:
        """An engine (not started) for a checkpoint: the model, its tokenizer and its generation
        config, loaded by transformers from a local directory or a hub id. ``device``: where the
        model goes (``"cuda"``, ``"cpu"``...); ``model_kwargs`` go to ``from_pretrained``.

        Raises:
            OSError: ``path`` is no checkpoint folder and the hub (or, with ``HF_HUB_OFFLINE=1``,
                its local cache) does not have it; the message says how to use a local folder.
        """
        import os

        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs)
        except OSError as exc:
            if os.path.isdir(path):
                raise
            raise OSError(f"cannot load {path!r}: it is not a local folder, and neither the Hugging Face hub nor its "
                          f"cache has it ({exc}). Pass a checkpoint folder instead (one save_pretrained wrote, or "
                          "`hf download ORG/NAME --local-dir DIR`); without a network, HF_HUB_OFFLINE=1 makes a hub "
                          "id fail at once instead of after retries") from exc
        if device is not None:
            # PreTrainedModel.to is wrapped with functools.wraps(nn.Module.to): mypy sees it unbound
            model = model.to(device)  # type: ignore[arg-type]
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(path)
        model = model.eval()  # type: ignore[no-untyped-call]  # unannotated in transformers; returns the model
        return cls(model, config, getattr(model, "generation_config", None), tokenizer=tokenizer)

    def call(self, fn: Callable[[EngineCore], Any]) -> Future[Any]:
        """Run ``fn(core)`` on the engine thread between steps.

        Args:
            fn: called with the :class:`acb.core.engine_core.EngineCore`.

        Returns:
            A ``concurrent.futures.Future`` of ``fn``'s result.
        """
        return self._live_core().call(fn)

    def _reset_prefix_cache_future(self) -> Future[int]:
        return self._live_core().command("reset_prefix")

    # ------------------------------------------------------ pause and sleep
    # the blocking and async forms (Engine, AsyncEngine) wrap these futures
    def _pause_future(self, mode: str) -> Future[None]:
        return self._live_core().pause(mode)

    def _resume_future(self) -> Future[None]:
        return self._live_core().resume()

    def _sleep_future(self) -> Future[MemoryReleased]:
        return self._live_core().command("sleep")

    def _wake_up_future(self) -> Future[None]:
        return self._live_core().command("wake")

    def _live_core(self) -> EngineCore:
        core = self.core
        if core is None:
            raise EngineNotRunningError("the engine is not running")
        core.check_alive()
        return core

    @property
    def is_paused(self) -> bool:
        """Whether :meth:`pause` (or ``sleep``) holds the steps back."""
        return self.core is not None and self.core.paused

    @property
    def is_sleeping(self) -> bool:
        """Whether ``sleep`` freed the KV cache (``wake_up`` brings it back)."""
        return self.core is not None and self.core.runner_asleep()

    # --------------------------------------------------------------- submit
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler of structured outputs (built on first use: xgrammar reads the
        tokenizer's whole vocabulary once). Its stop tokens are the engine's EOS ids."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs need a tokenizer: pass tokenizer=... to the engine")
                from acb.grammar_budget import GrammarBudget
                from acb.structured import GrammarCompiler

                core = self._live_core()
                vocab = core.runner.vocab_size
                eos = [t for t in self.defaults.stop_token_ids or () if 0 <= t < vocab]
                budget = GrammarBudget.from_config(self.cb_config)
                if core.sync is not None and not core.sync.is_leader:
                    # a follower compiles what its leader accepted (the static limits agree): a
                    # time limit could refuse here what the leader ran, and the ranks would part
                    budget = replace(budget, compile_timeout_s=None)
                self._grammar_compiler = GrammarCompiler(text_tokenizer(self.tokenizer), vocab,
                                                         stop_token_ids=eos or None, budget=budget)
            return self._grammar_compiler

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
        scoring: ScoreSpec | None = None,
        score_children: Sequence[tuple[list[int], ScoreSpec]] = (),
        id_prefix: str = "req",
    ) -> Submission:
        """The input processor: validate one submit and build its :class:`EngineRequest`, whose
        results go to ``sink_factory(request_id)`` (a ``ThreadSink`` or an ``AsyncSink``).
        Everything is checked before the request id is claimed, so a refused submit leaves
        nothing behind. Hand it to the engine with :meth:`admit` (or :meth:`enqueue` when holding
        a queue slot), or give its id back with :meth:`abandon`.

        Args:
            prompt_ids: token ids, text or a chat (with a tokenizer).
            sampling: how to decode (merged over the engine's defaults).
            sink_factory: ``sink_factory(request_id)`` makes the sink its results go to.
            request_id: its id (default ``<id_prefix>_<n>``, an id no live request has, nor its
                samples: unique per call, whoever else submits at the same time).
            record_timestamps: record each token's arrival time.
            cache_salt: keeps its prefix-cache entries apart from other salts'.
            chat_template_kwargs: the chat template's variables (a chat prompt).
            scoring: makes it a scoring request (:mod:`acb.api.scoring`): it records prompt
                logprobs from ``scoring.lp_start`` and samples nothing.
            score_children: prompts that extend this one, with their specs: they fork from it
                once its prompt is done, as the samples of ``n > 1`` do, in one group.
            id_prefix: the default id's prefix (``score`` for scoring requests).

        Returns:
            The :class:`Submission` (its :class:`EngineRequest` and its sink).

        Raises:
            ValueError: bad input (the message names it); nothing is left behind.
            TypeError: an argument of the wrong type.
            EngineNotRunningError: the engine is not started.
        """
        core = self.core
        if core is None:
            raise EngineNotRunningError("the engine is not running (start it, or use it as a context manager)")
        core.check_alive()
        if core.sync is not None and not core.sync.is_leader and threading.current_thread() is not core.thread:
            raise RuntimeError(
                f"this is a tensor-parallel follower (rank {core.sync.rank}): submit requests on the leader, rank "
                f"{core.sync.leader_rank}, whose engine runs them on every rank (generate_batch returns {{}} here)")
        ids = as_token_list(encode_prompt(self.tokenizer, prompt_ids, chat_template_kwargs))
        if not ids:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        vocab = core.runner.vocab_size
        for pos, tok in enumerate(ids):
            if tok < 0 or tok >= vocab:
                raise ValueError(
                    f"prompt_ids[{pos}] = {tok} is outside the model's vocabulary [0, {vocab})"
                )
        if sampling is None:
            sampling = SamplingParams()
        elif not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be an acb.SamplingParams or None, got {type(sampling).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        params = sampling.merged_over(self.defaults)
        children = [(as_token_list(c), spec) for c, spec in score_children]
        if scoring is not None:  # nothing is sampled: the raw logprobs of the scored positions only
            _check_vocab("continuation", scoring.next_tokens or (), vocab)
            for c, spec in children:
                _check_vocab("continuation", c, vocab)
                _check_vocab("continuation", spec.next_tokens or (), vocab)
                if c[: len(ids)] != ids or len(c) <= len(ids):
                    raise ValueError("a scoring child's prompt must extend its parent's")
            params = replace(FALLBACK, prompt_logprobs=max(scoring.top_logprobs, 1), logprobs_mode="raw")
        _check_vocab("logit_bias", params.logit_bias or (), vocab)
        if sampling.stop_token_ids is not None:
            _check_vocab("stop_token_ids", sampling.stop_token_ids, vocab)
            stop_ids = frozenset(sampling.stop_token_ids)
        elif params.ignore_eos:  # as vLLM: the model's EOS is ignored; stops the caller gives still apply
            stop_ids = frozenset()
        else:  # the generation config's: an id the model cannot produce can never stop anything
            stop_ids = frozenset(t for t in params.stop_token_ids or () if t < vocab)
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs={params.logprobs} asks for more alternatives than the vocabulary's "
                             f"{vocab} tokens")
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} asks for more alternatives than the "
                             f"vocabulary's {vocab} tokens")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer=... to the engine")
        grammar = None
        if params.structured_outputs is not None and scoring is None:
            grammar = compile_grammar(self.grammars(), params.structured_outputs)  # (a cache hit after an async submit)
        cfg = core.runner.cfg
        limit = cfg.max_model_len
        longest = max([len(ids)] + [len(c) for c, _ in children])
        if scoring is not None and longest > limit:
            raise ValueError(f"context and continuation ({longest} tokens) can never fit: a request may hold "
                             f"at most {limit} tokens (the model's max positions, and the KV cache's "
                             f"{cfg.capacity_tokens} tokens)")
        if scoring is None and len(ids) >= limit:
            raise ValueError(
                f"prompt of {len(ids)} tokens can never fit: a request may hold at most {limit} tokens "
                f"(prompt + at least one generated token), the smaller of the model's max positions and "
                f"the KV cache's {cfg.capacity_tokens} tokens"
            )
        n, max_new_tokens = params.n, params.max_new_tokens
        assert n is not None and max_new_tokens is not None  # the defaults (over FALLBACK) set them
        if scoring is not None:
            n = 1 + len(children)
        if n > cfg.max_requests_per_batch and scoring is not None:  # (plan() makes groups that fit)
            raise ValueError(
                f"a scoring request with {n - 1} forked continuation(s) runs {n} requests side by side, but "
                f"max_requests_per_batch is {cfg.max_requests_per_batch}: give it at most "
                f"{cfg.max_requests_per_batch - 1} score_children (Engine.score plans groups that fit)")
        if n > cfg.max_requests_per_batch:
            raise ValueError(
                f"n={n} samples run side by side and need {n} of the engine's rows, but "
                f"max_requests_per_batch is {cfg.max_requests_per_batch}"
            )
        if n > 1:
            # the samples fork when the prompt is done: its full blocks are shared, and each
            # sample needs its own copy of the partial last block at that moment
            bs = cfg.block_size
            fork_blocks = len(ids) // bs + (n if len(ids) % bs else 0)
            usable = cfg.num_blocks - 1
            if fork_blocks > usable and scoring is not None:
                raise ValueError(
                    f"scoring {n - 1} continuation(s) of more than one token after a {len(ids)}-token context can "
                    f"never fit: they fork from the context's KV, which needs {fork_blocks} KV blocks of {bs} tokens "
                    f"(the shared full blocks once, the partial last block once per request), and the cache has "
                    f"{usable}; score them one call at a time or raise num_blocks")
            if fork_blocks > usable:
                raise ValueError(
                    f"n={n} samples of a {len(ids)}-token prompt can never fit: forking them needs "
                    f"{fork_blocks} KV blocks of {bs} tokens (the shared full blocks once, the partial "
                    f"last block once per sample), and the cache has {usable}; lower n or raise num_blocks"
                )
        max_new = min(max_new_tokens, limit - len(ids)) if scoring is None else 0
        min_new = min(params.min_new_tokens or 0, max_new)
        if grammar is not None:
            check_min_tokens(grammar, min_new, stop_ids)
        if min_new != (params.min_new_tokens or 0):
            params = replace(params, min_new_tokens=min_new)
        base_seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        # every check passed: claim the ids (all of them, or none)
        if request_id is None:  # a fresh id whose samples' ids are free too (a caller may hold "req_3#1")
            request_id = f"{id_prefix}_{next(self._ids)}"
            while _claim_all(core, _member_ids(request_id, n)) is not None:
                request_id = f"{id_prefix}_{next(self._ids)}"
        elif not core.reserve_id(request_id):
            raise ValueError(f"request_id {request_id!r} is already used by a live request")
        else:  # the samples' internal ids must not collide either
            taken = _claim_all(core, _member_ids(request_id, n)[1:])
            if taken is not None:
                core.release_id(request_id)
                raise ValueError(f"request id {taken!r} (sample of {request_id!r}) is already live")
        member_ids = _member_ids(request_id, n)
        try:
            sink = sink_factory(request_id)
            sink.state.trace = telemetry.begin(prompt_ids, self.model_name, params)
            if self.tokenizer is not None and scoring is None and not params.stop:
                # text for the stream and the output, decoded on the consumer's side (with stop
                # strings, the engine thread decodes it as it matches them)
                skip = params.skip_special_tokens is not False
                sink.state.detokenizers = [IncrementalDetokenizer(self.tokenizer, skip) for _ in range(n)]
            targets = [ScoreTarget(tuple(p), spec.lp_start, spec.next_tokens)
                       for p, spec in ([(ids, scoring)] + children if scoring is not None else [])]
            er = EngineRequest(
                request_id, self.sinks.register(sink), tuple(ids), params, max_new, stop_ids, base_seed, n,
                time.perf_counter(), record_timestamps, cache_salt or None,
                targets[0] if targets else None, tuple(targets[1:]))
        except BaseException:
            for mid in member_ids:
                core.release_id(mid)
            raise
        return Submission(er, sink)

    def make_score_requests(
        self,
        items: Sequence[tuple[Prompt, Sequence[Prompt]]],
        top_logprobs: int,
        cache_salt: str | None,
        request_ids: Sequence[str] | None,
        sink_factory: Callable[[str], Any],
    ) -> tuple[list[scoring.Plan], list[str], list[list[str]], list[Submission]]:
        """Validate and plan a ``score_batch`` call and build its engine requests (one per group,
        in submission order: sorted for prefix reuse), as :meth:`make_request` does for one
        submit: all of them or, on an error naming the item, none.

        Args:
            items: ``(context, continuations)`` pairs.
            top_logprobs: the top alternatives to record at each scored position.
            cache_salt: keeps the prefix-cache entries apart from other salts'.
            request_ids: one id per item (its groups are ``<id>#g<j>``); by default each group
                gets a fresh ``score_<n>`` id, and an item's id is its first group's (unique per
                call: concurrent calls never collide).
            sink_factory: makes each engine request's sink.

        Returns:
            The plans, the items' ids and each item's engine request ids by group (for
            :func:`acb.api.scoring.assemble_batch`), and the submissions to enqueue.

        Raises:
            ValueError: a bad item, named ``items[i]``.
        """
        plans = scoring.plan_batch(items, top_logprobs, self.tokenizer, self._live_core().runner.cfg.max_requests_per_batch)
        given = scoring.batch_ids(request_ids, len(plans))
        order = scoring.ordered_groups(plans, given)
        reqs = self.make_all("items", (
            (i, functools.partial(self.make_request, group[0].prompt_ids, None, request_id=rid, cache_salt=cache_salt,
                                  scoring=group[0].spec, score_children=[(m.prompt_ids, m.spec) for m in group[1:]],
                                  sink_factory=sink_factory, id_prefix="score"))
            for i, _, rid, group in order))
        engine_ids: list[list[str]] = [[""] * len(gs) for _, _, gs in plans]
        for (i, j, _, _), req in zip(order, reqs):
            engine_ids[i][j] = req.request_id
        ids = [rid if rid is not None else engine_ids[i][0] for i, rid in enumerate(given)]
        return plans, ids, engine_ids, reqs

    def make_all(self, field: str, makers: Iterable[tuple[int, Callable[[], Submission]]]) -> list[Submission]:
        """Several submits validated together (a batch call): all of them, or none.

        Args:
            field: the argument's name in errors (``inputs[i]: ...``).
            makers: ``(i, maker)`` pairs, each ``maker()`` a :meth:`make_request` call.

        Returns:
            The submissions, in order.

        Raises:
            ValueError: the first bad one, named ``field[i]`` (the others are given back).
        """
        made: list[Submission] = []
        try:
            for i, make in makers:
                try:
                    made.append(make())
                except (ValueError, TypeError) as exc:
                    raise type(exc)(f"{field}[{i}]: {exc}") from None
        except BaseException:
            for r in made:
                self.abandon(r)
            raise
        return made

    def _made_core(self) -> EngineCore:
        """The core of a request from :meth:`make_request` (which needed one; it is never unset)."""
        core = self.core
        assert core is not None
        return core

    def enqueue(self, req: Submission) -> None:
        """Hand a validated request to the engine (the caller holds its queue slot).

        Args:
            req: what :meth:`make_request` returned.
        """
        self._made_core().add(req.engine_request)

    def admit(self, req: Submission) -> None:
        """Hand a validated request, holding a queue slot, to the engine; undo both on failure.

        Args:
            req: what :meth:`make_request` returned.

        Raises:
            EngineDeadError: the engine died (the slot and the ids are given back).
        """
        try:
            self._made_core().check_alive()
            self.enqueue(req)
        except BaseException:
            self.gate.release()
            self.abandon(req)
            raise

    def abandon(self, req: Submission) -> None:
        """Undo ``make_request`` for a request that will not be enqueued.

        Args:
            req: what :meth:`make_request` returned.
        """
        core = self._made_core()
        self.sinks.discard(req.engine_request.sink_key)
        for mid in req.engine_request.member_ids:
            core.release_id(mid)

    def cancel(self, request_id: str) -> bool:
        """Cancel a request by id.

        Args:
            request_id: the request's id.

        Returns:
            Whether a live request had that id (unknown or finished ids: a logged no-op).
        """
        core = self.core
        if core is None or not core.is_live(request_id):
            logger.info("cancel(%r): no live request with that id; nothing to do", request_id)
            return False
        core.cancel(request_id)
        return True
