"""What the async and blocking engines share: :class:`EngineBase` (httpx style: one base,
two facades with the same method names).

Its public surface is what every facade (``AsyncEngine``, ``Engine``, ``generate_batch``,
the manager) and every client of the library uses: ``prepare``/``start``/``stop``/``join``,
``processor`` (the :class:`~acb.api.processor.InputProcessor`: validate a submit and claim its
id), ``admit``/``enqueue`` (hand it to the engine), ``abandon``, ``cancel``, ``call`` (run a
function on the engine thread), and read-only ``core``, ``runner``, ``gate``, ``defaults``,
``config``, ``stats``.

The API layer never touches the device: the runner is built here (which measures memory
and swaps the attention implementation) but only ever driven by the engine thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from acb import telemetry
from acb.api.gate import AdmissionGate
from acb.api.ids import RequestIds
from acb.api.processor import InputProcessor, Submission
from acb.api.sinks import SinkRegistry
from acb.config import ConfigLike, ResolvedConfig, as_config
from acb.core.engine_core import EngineCore
from acb.core.messages import EngineStats
from acb.errors import EngineNotRunningError, InvalidRequestError
from acb.runner.host_threads import release_idle_threads
from acb.sampling_params import FALLBACK, SamplingParams
from acb.text import text_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig, PreTrainedModel
    from typing_extensions import Self

    from acb.runner.model_runner import MemoryReleased, ModelRunner
    from acb.structured import GrammarCompiler
    from acb.text import TokenizerLike

logger = logging.getLogger(__name__)


class EngineBase:
    """What :class:`acb.AsyncEngine` and :class:`acb.Engine` share besides their submit style:
    start-up, validation at submit, the engine core and its thread.

    ``tokenizer`` turns text and chats into token ids; ``processor`` (a vision-language model's
    ``AutoProcessor``) takes its place for a model that sees images, whose prompts may then hold
    images (:mod:`acb.images`). ``runner_cls`` builds the model runner (default
    :class:`acb.runner.model_runner.ModelRunner`); the overhead benchmark passes a runner whose
    forward costs nothing.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: ConfigLike | None = None,
        generation_config: GenerationConfig | None = None,
        *,
        tokenizer: TokenizerLike | None = None,
        processor: TokenizerLike | None = None,
        runner_cls: type[ModelRunner] | None = None,
    ) -> None:
        config = as_config(config)  # the one entry point: None, acb's, or a transformers instance
        config.warn_unsupported()
        self.model = model
        self.cb_config = config  # acb's form of what was given; ``config`` is what it resolves to here
        if generation_config is None:
            generation_config = getattr(model, "generation_config", None)
        # a vision-language model's processor (its AutoProcessor: chat template, image processor
        # and tokenizer) stands where a tokenizer does: text is its tokenizer's, images its own
        self.tokenizer = processor if processor is not None else tokenizer
        # the model's name in telemetry (gen_ai.request.model); acb serve sets the served name
        self.model_name: str = getattr(model.config, "name_or_path", "") or model.config.model_type or "model"
        self.set_generation_config(generation_config)
        self._runner_cls = runner_cls
        self.core: EngineCore | None = None
        self.runner: ModelRunner | None = None
        self.gate = AdmissionGate(config.max_queue_size)
        self.sinks = SinkRegistry()  # where the engine delivers each submit's results
        self.ids = RequestIds()  # the ids live requests hold (claimed at submit, released with the final output)
        self._grammar_compiler: GrammarCompiler | None = None  # structured outputs: built on first use
        self._grammar_lock = threading.Lock()
        # the input processor: every submit is checked and made an engine request there
        self.processor = InputProcessor(self, config.seed)
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
            core = EngineCore(
                runner,
                deliver=self.sinks.deliver,
                release_id=self.ids.release,
                on_dequeued=None if follower else self.gate.release,
                sync=sync,
                tokenizer=self.tokenizer,
                grammars=self.grammars,
            )
            core.on_exit = self._on_core_exit
            self.core = core
            core.start()
            # this thread built the model: its idle OpenMP workers would slow every parallel
            # region of the engine thread's (acb.runner.host_threads)
            self._about_to_wait()
            telemetry.watch_engine(self, self.model_name)

    def _about_to_wait(self) -> None:
        """The calling thread is about to wait on the engine: on a CPU engine, hand back its
        OpenMP workers, so that the engine thread's parallel regions are not throttled
        (:mod:`acb.runner.host_threads`; a GPU engine's thread opens few, and keeps them)."""
        runner = self.runner
        if runner is not None and runner.device.type == "cpu":
            release_idle_threads()

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
        model goes (``"cuda"``, ``"cpu"``...); ``model_kwargs`` go to ``from_pretrained``. A
        vision-language checkpoint (one ``AutoModelForImageTextToText`` loads) comes with its
        ``AutoProcessor`` in place of the tokenizer, so chats with images work.

        Raises:
            OSError: ``path`` is no checkpoint folder and the hub (or, with ``HF_HUB_OFFLINE=1``,
                its local cache) does not have it; the message says how to use a local folder.
        """
        import os

        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

        from acb.model_source import load_processor, vision_checkpoint

        vision = vision_checkpoint(path)
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        try:
            model: PreTrainedModel = auto.from_pretrained(path, dtype=dtype, **model_kwargs)
        except OSError as exc:
            if os.path.isdir(path):
                raise
            raise OSError(
                f"cannot load {path!r}: it is not a local folder, and neither the Hugging Face hub nor its "
                f"cache has it ({exc}). Pass a checkpoint folder instead (one save_pretrained wrote, or "
                "`hf download ORG/NAME --local-dir DIR`); without a network, HF_HUB_OFFLINE=1 makes a hub "
                "id fail at once instead of after retries"
            ) from exc
        if device is not None:
            # PreTrainedModel.to is wrapped with functools.wraps(nn.Module.to): mypy sees it unbound
            model = model.to(device)  # type: ignore[arg-type]
        if tokenizer is None:
            if vision:  # its processor: the chat template, the image processor and the tokenizer
                tokenizer = load_processor(path)
            else:
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
    # ---------------------------------------------------------- weight updates
    @property
    def weight_version(self) -> Any:
        """The version of the weights the engine runs (0: those it started with)."""
        return self.core.weight_version if self.core is not None else 0

    def stage_weights(self, named_tensors: Any) -> Any:
        """An update's tensors checked and staged (:func:`acb.runner.weight_update.stage`): the
        caller's thread does the copying, the engine thread only the swap.

        Args:
            named_tensors: ``{name: tensor}`` or ``(name, tensor)`` pairs, by the model's own names.

        Returns:
            The staged update (:class:`acb.runner.weight_update.Staged`), for ``swap_weights``.

        Raises:
            WeightUpdateError: a name, shape or dtype that does not fit (nothing written).
        """
        from acb.runner.tp_sync import tp_size_of
        from acb.runner.weight_update import stage

        if tp_size_of(self.model) > 1:
            raise RuntimeError("weight updates are not supported under tensor parallel yet")
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        return stage(self.model, items)

    def stage_checkpoint(self, path: Any) -> Any:
        """:meth:`stage_weights` for a safetensors checkpoint (a directory or one file).

        Args:
            path: the checkpoint, on local disk.

        Returns:
            The staged update.

        Raises:
            WeightUpdateError: a checkpoint that does not read, or a tensor that does not fit.
        """
        from acb.runner.weight_update import read_checkpoint

        return self.stage_weights(read_checkpoint(path))

    def _swap_future(self, staged: Any, version: Any) -> Future[Any]:
        from acb.runner.weight_update import check_version, version_after

        version = check_version(version)  # (every facade's update comes through here)
        return self._live_core().call(
            lambda core: core.swap_weights(staged, version_after(core.weight_version, version))
        )

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
                    raise InvalidRequestError(
                        "structured_outputs need a tokenizer: pass tokenizer=... to the engine", "structured_outputs"
                    )
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
                self._grammar_compiler = GrammarCompiler(
                    text_tokenizer(self.tokenizer), vocab, stop_token_ids=eos or None, budget=budget
                )
            return self._grammar_compiler

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
        self.sinks.discard(req.engine_request.sink_key)
        self.ids.release_all(req.engine_request.member_ids)

    def cancel(self, request_id: str) -> bool:
        """Cancel a request by id.

        Args:
            request_id: the request's id.

        Returns:
            Whether a live request had that id (unknown or finished ids: a logged no-op).
        """
        core = self.core
        if core is None or not self.ids.is_live(request_id):
            logger.info("cancel(%r): no live request with that id; nothing to do", request_id)
            return False
        core.cancel(request_id)
        return True
