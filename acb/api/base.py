"""What the async and blocking engines share: :class:`EngineBase` (httpx style: one base,
two facades with the same method names).

Its public surface is what every facade (``AsyncEngine``, ``Engine``, ``generate_batch``,
the manager) and every client of the library uses: ``prepare``/``start``/``stop``/``join``;
``make_request``, the one submit path (the input processor, ``processor``, checks the submit and
builds its engine request; ``submissions`` claims its ids, registers its sink and begins its
trace; a scoring group's is :func:`acb.api.scoring.make_score_request`); ``admit`` (hand it to the engine), ``abandon``,
``cancel``, ``call`` (run a function on the engine thread); and read-only ``core``, ``runner``,
``gate``, ``defaults``, ``config``, ``stats``.

The API layer never touches the device: the runner is built here (which measures memory and
swaps the attention implementation) and what submits are checked against is read from it once,
at start (:class:`~acb.api.processor.ModelFacts`); after that, only the engine thread drives it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from acb.api.gate import AdmissionGate
from acb.api.grammars import Grammars
from acb.api.ids import RequestIds
from acb.api.loading import build_runner, load_pretrained
from acb.api.loras import Loras
from acb.api.processor import InputProcessor, ModelFacts, request_defaults
from acb.api.sinks import SinkRegistry
from acb.api.submissions import Submission, Submissions
from acb.api.weights import stage_checkpoint, stage_weights
from acb.config import ConfigLike, ResolvedConfig, as_config
from acb.core.engine_core import EngineCore
from acb.core.messages import EngineStats
from acb.errors import EngineNotRunningError
from acb.media import placeholder_token_ids
from acb.runner.host_threads import release_idle_threads
from acb.telemetry import watch_engine
from acb.text import text_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig, PreTrainedModel
    from typing_extensions import Self

    from acb.runner.model_runner import ModelRunner
    from acb.sampling_params import SamplingParams
    from acb.structured import GrammarCompiler
    from acb.text import Prompt, TokenizerLike

logger = logging.getLogger(__name__)


def text_and_processor(
    tokenizer: TokenizerLike | None, processor: TokenizerLike | None
) -> tuple[TokenizerLike | None, TokenizerLike | None]:
    """The engine's text tokenizer and the model's processor (a vision-language model's
    ``AutoProcessor``: its chat template, media processing and tokenizer; ``None`` for a text model),
    from what it was given: a processor given as ``tokenizer`` is taken as one (acb serve and acb
    generate load one so), and without a tokenizer the processor's own decodes the text."""
    from transformers.processing_utils import ProcessorMixin

    if processor is None and isinstance(tokenizer, ProcessorMixin):
        processor, tokenizer = tokenizer, None
    return (tokenizer if tokenizer is not None or processor is None else text_tokenizer(processor)), processor


class EngineBase:
    """What :class:`acb.AsyncEngine` and :class:`acb.Engine` share besides their submit style:
    start-up, the submit path, the engine core and its thread.

    ``tokenizer`` turns text into ids and decodes it (``engine.tokenizer``); ``processor`` (the
    model's ``AutoProcessor``, ``engine.model_processor``: :func:`text_and_processor`) renders the
    chats and media (:mod:`acb.media`) of a model that sees images. ``runner_cls`` builds the model runner (default
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
        self.tokenizer, self.model_processor = text_and_processor(tokenizer, processor)
        # the model's name in telemetry (gen_ai.request.model); acb serve sets the served name
        self.model_name: str = getattr(model.config, "name_or_path", "") or model.config.model_type or "model"
        self._runner_cls = runner_cls
        self.core: EngineCore | None = None
        self.runner: ModelRunner | None = None
        self.gate = AdmissionGate(config.max_queue_size)
        self.sinks = SinkRegistry()  # where the engine delivers each submit's results
        self.ids = RequestIds()  # the ids live requests hold (claimed at submit, released with the final output)
        self.loras = Loras(self.ids)  # the LoRA adapters by name (the facades' add_lora, remove_lora)
        # where a checked submit claims its ids, draws its seed and registers its sink
        self.submissions = Submissions(self.ids, self.sinks, config.seed, self.loras)
        self._grammars = Grammars(self.tokenizer)  # structured outputs: the compiler, built on first use
        self._facts: ModelFacts | None = None  # what submits are checked against (read at start)
        self.set_generation_config(generation_config)  # (and the input processor, ``processor``)
        self._start_lock = threading.Lock()
        self._context_depth = 0
        self._context_lock = threading.Lock()

    @property
    def renderer(self) -> TokenizerLike | None:
        """What turns a prompt's text, chat and media into ids: the model's processor where the
        engine has one (its chat template and media processing), else the tokenizer."""
        return self.model_processor if self.model_processor is not None else self.tokenizer

    def set_generation_config(self, generation_config: GenerationConfig | None) -> None:
        """Make ``generation_config`` the defaults of the requests submitted from now on (a live
        engine kept across calls that each bring their own, as a trainer's rollouts do).

        Args:
            generation_config: a transformers ``GenerationConfig`` (None: acb's defaults).
        """
        self.generation_config = generation_config
        self.defaults = request_defaults(generation_config, self.model.config, self.cb_config)
        self._renew_processor()

    def _renew_processor(self) -> None:
        # the input processor holds plain values: a new one when the defaults or the facts change
        marks = placeholder_token_ids(self.model.config)
        self.processor = InputProcessor(self._facts, self.renderer, self.defaults, self._grammars, marks, self.loras)

    # ------------------------------------------------------------------ life
    def prepare(self) -> None:
        """Check the model, size and allocate the KV cache (idempotent; ``start`` calls it)."""
        if self.runner is None:
            self.runner = build_runner(self.model, self.cb_config, self._runner_cls)

    def start(self) -> None:
        """Check the model, build the KV cache and start the engine thread (the context manager does this)."""
        with self._start_lock:
            if self.core is not None and self.core.is_running:
                return
            self.prepare()
            runner = self.runner
            assert runner is not None  # prepare() built it
            self.gate = AdmissionGate(self.cb_config.max_queue_size)
            from acb.runner.tp_sync import StepSync, tp_group

            group = tp_group(self.model)  # tensor parallel: every rank's engine runs the leader's requests
            sync = StepSync(group) if group is not None else None
            follower = sync is not None and not sync.is_leader
            # read once, before the engine thread drives the runner: submits never call it
            self._facts = ModelFacts(runner.cfg, runner.vocab_size, runner.input_vocab_size, runner.media_facts())
            self._renew_processor()
            self._grammars.open(runner.vocab_size, self.cb_config, follower)
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
            watch_engine(self, self.model_name)

    def _about_to_wait(self) -> None:
        """The calling thread is about to wait on the engine: on a CPU engine, hand back its
        OpenMP workers, so that the engine thread's parallel regions are not throttled
        (:mod:`acb.runner.host_threads`; a GPU engine's thread opens few, and keeps them)."""
        runner = self.runner
        if runner is not None and runner.device.type == "cpu":
            release_idle_threads()

    def _on_core_exit(self) -> None:
        self.gate.close()
        self._grammars.close()
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
        """An engine (not started) for a checkpoint (a local folder or a hub id): the model, its
        tokenizer (a vision-language checkpoint's ``AutoProcessor``) and its generation config, as
        :func:`acb.api.loading.load_pretrained` loads them (its arguments, and its ``OSError`` for
        a checkpoint that is nowhere); ``config`` is the engine's."""
        model, tok = load_pretrained(path, dtype=dtype, device=device, tokenizer=tokenizer, **model_kwargs)
        return cls(model, config, getattr(model, "generation_config", None), tokenizer=tok)

    # -------------------------------------------- the engine thread's commands
    def call(self, fn: Callable[[EngineCore], Any]) -> Future[Any]:
        """Run ``fn(core)`` on the engine thread between steps.

        Args:
            fn: called with the :class:`acb.core.engine_core.EngineCore`.

        Returns:
            A ``concurrent.futures.Future`` of ``fn``'s result.
        """
        return self._live_core().call(fn)

    def _live_core(self, not_running: str = "the engine is not running") -> EngineCore:
        """The running core (the facades' pause, sleep, weight swap and reset go through it)."""
        core = self.core
        if core is None:
            raise EngineNotRunningError(not_running)
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

    @property
    def weight_version(self) -> Any:
        """The version of the weights the engine runs (0: those it started with)."""
        return self.core.weight_version if self.core is not None else 0

    def stage_weights(self, named_tensors: Any) -> Any:
        """An update's tensors checked and staged on this thread, for the engine thread's swap
        (:func:`acb.api.weights.stage_weights`: a name, shape or dtype that does not fit is a
        ``WeightUpdateError``, and nothing is written).

        Args:
            named_tensors: ``{name: tensor}`` or ``(name, tensor)`` pairs, by the model's own names.
        """
        return stage_weights(self.model, named_tensors)

    def stage_checkpoint(self, path: Any) -> Any:
        """:meth:`stage_weights` for a safetensors checkpoint (:func:`acb.api.weights.stage_checkpoint`).

        Args:
            path: the checkpoint (a directory or one file), on local disk.
        """
        return stage_checkpoint(self.model, path)

    # --------------------------------------------------------------- submit
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler of structured outputs (built on first use: xgrammar reads the
        tokenizer's whole vocabulary once). Its stop tokens are the engine's EOS ids."""
        return self._grammars.get(self.defaults.stop_token_ids, self._live_core)

    def submit_core(self) -> EngineCore:
        """The core a submit goes to: running, alive and this rank's own (every submit path asks
        first; ``EngineNotRunningError``, ``EngineDeadError``, or a ``RuntimeError`` on a
        tensor-parallel follower, whose leader takes the submits)."""
        core = self._live_core("the engine is not running (start it, or use it as a context manager)")
        if core.sync is not None and not core.sync.is_leader and threading.current_thread() is not core.thread:
            raise RuntimeError(
                f"this is a tensor-parallel follower (rank {core.sync.rank}): submit requests on the leader, rank "
                f"{core.sync.leader_rank}, whose engine runs them on every rank (generate_batch returns {{}} here)"
            )
        return core

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
        lora: str | None = None,
    ) -> Submission:
        """A generation's submit: checked and built by the input processor
        (``processor.process``), then opened (``submissions.open``: its ids claimed, its sink
        registered, its trace begun). Post it with :meth:`admit`, or give it back with
        :meth:`abandon`. Bad input is a ``ValueError``/``TypeError`` naming its ``field``, and
        leaves nothing behind.

        Args:
            prompt_ids: token ids, text or a chat (with a tokenizer), or a prompt with images.
            sampling: how to decode (merged over the engine's defaults).
            sink_factory: ``sink_factory(request_id)`` makes the sink its results go to.
            request_id: its id (default: a fresh ``req_<n>``); none of its samples' may be live.
            record_timestamps: record each token's arrival time.
            cache_salt: keeps its prefix-cache entries apart from other salts'.
            chat_template_kwargs: the chat template's variables (a chat prompt).
            lora: the LoRA adapter it runs with, by name (``loras``; None: the base model).
        """
        self.submit_core()
        made = self.processor.process(
            prompt_ids, sampling, request_id=request_id, record_timestamps=record_timestamps,
            cache_salt=cache_salt, chat_template_kwargs=chat_template_kwargs, lora=lora,
        )  # fmt: skip
        return self.submissions.open(made, sink_factory, self.tokenizer, self.model_name)

    def admit(self, req: Submission) -> None:
        """Hand a submit, holding a queue slot, to the engine; if the engine died
        (``EngineDeadError``), give back the slot, the sink and the ids.

        Args:
            req: what :meth:`make_request` returned.
        """
        try:
            core = self.core
            assert core is not None  # (make_request needed one; it is never unset)
            core.check_alive()
            core.add(req.engine_request)
        except BaseException:
            self.gate.release()
            self.abandon(req)
            raise

    def abandon(self, req: Submission) -> None:
        """Undo :meth:`make_request` for a submit that will not be posted (its sink and ids).

        Args:
            req: what :meth:`make_request` returned.
        """
        self.submissions.abandon(req)

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
