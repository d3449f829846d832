"""``Engine`` (blocking twin of ``AsyncEngine``) and ``generate_batch`` for plain scripts.

Neither needs an event loop, so both work inside a running one (Jupyter) as well.
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from acb.api import scoring
from acb.api.base import EngineBase
from acb.api.handles import SyncRequestHandle
from acb.api.sinks import ThreadSink
from acb.api.submissions import Submission
from acb.api.weights import swap
from acb.config import ConfigLike
from acb.errors import AcbError, QueueFullError, RequestFailedError
from acb.outputs import FailureKind, GenerationOutput, RequestStatus, ScoreOutput
from acb.sampling_params import SamplingParams, with_overrides

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch
    from typing_extensions import Unpack

    from acb.api.loras import LoraInfo
    from acb.runner.model_runner import MemoryReleased
    from acb.sampling_params import SamplingKwargs
    from acb.text import Prompt

logger = logging.getLogger(__name__)


class Engine(EngineBase):
    """Blocking engine with the same method names as :class:`acb.AsyncEngine`.

    ::

        with acb.Engine(model) as engine:
            handle = engine.submit(prompt_ids)
            for delta in handle:                # blocks for each new piece
                ...
            output = handle.result()
    """

    def __enter__(self) -> Engine:
        self._enter_context()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._exit_context():  # the outermost block: stop
            self.shutdown()

    def shutdown(self, *, cancel_pending: bool = True, timeout: float | None = None) -> None:
        """Stop the engine and wait for its thread.

        Args:
            cancel_pending: cancel the live requests (else they finish first).
            timeout: the most seconds to wait for the engine thread.
        """
        self.stop(drain=not cancel_pending, timeout=timeout)

    def enqueue_blocking(self, req: Submission, *, wait: bool = True, timeout: float | None = None) -> None:
        """Take a queue slot for a submit (:meth:`make_request`) and hand it to the engine.
        On failure the request's id is given back.

        Args:
            req: what :meth:`make_request` returned.
            wait: wait while ``max_queue_size`` requests wait (else raise at once).
            timeout: the most seconds to wait for a slot.

        Raises:
            QueueFullError: ``wait=False`` and the queue is full.
            TimeoutError: no slot within ``timeout``.
        """
        ok = self.gate.acquire_blocking(timeout) if wait else self.gate.try_acquire()
        if not ok:
            self.abandon(req)
            if wait:
                raise TimeoutError(f"no queue slot within {timeout}s (max_queue_size={self.gate.limit})")
            raise QueueFullError(f"{self.gate.limit} requests are already waiting (max_queue_size)")
        self.admit(req)

    def _submit(
        self, prompt_ids: Prompt, sampling: SamplingParams | None, wait: bool, timeout: float | None, **kw: Any
    ) -> SyncRequestHandle:
        req = self.make_request(prompt_ids, sampling, sink_factory=ThreadSink, **kw)
        # before the enqueue, so that submits in a row reach the engine as close together as they did
        self._about_to_wait()
        self.enqueue_blocking(req, wait=wait, timeout=timeout)
        return SyncRequestHandle(req.request_id, req.sink, self.cancel)

    def submit(
        self,
        prompt_ids: Prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        record_timestamps: bool = False,
        timeout: float | None = None,
        cache_salt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora: str | None = None,
        **sampling_kwargs: Unpack[SamplingKwargs],
    ) -> SyncRequestHandle:
        """Validate and admit a request; blocks while ``max_queue_size`` requests are waiting.

        Args:
            prompt_ids: token ids, or (with a tokenizer) a string or a chat.
            sampling: how to decode; ``None`` fields take the engine's defaults.
            request_id: the request's id (default ``req_<n>``); it must not be live already.
            record_timestamps: record each token's arrival time in the output.
            timeout: the most seconds to wait for a queue slot.
            cache_salt: keeps the request's prefix-cache entries apart from other salts'.
            chat_template_kwargs: the chat template's variables (a chat prompt).
            lora: the LoRA adapter it runs with, by name (:meth:`add_lora`; None: the base model).
            **sampling_kwargs: fields of :class:`SamplingParams` laid over ``sampling``.

        Returns:
            The request's handle: iterate it for deltas, ``handle.result()`` for the output.

        Raises:
            ValueError: bad input (as for :meth:`acb.AsyncEngine.submit`); nothing else is affected.
            TimeoutError: no queue slot within ``timeout``.
        """
        sampling = with_overrides("submit", sampling, sampling_kwargs)
        return self._submit(
            prompt_ids,
            sampling,
            True,
            timeout,
            request_id=request_id,
            record_timestamps=record_timestamps,
            cache_salt=cache_salt,
            chat_template_kwargs=chat_template_kwargs,
            lora=lora,
        )

    def submit_nowait(
        self,
        prompt_ids: Prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        record_timestamps: bool = False,
        cache_salt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora: str | None = None,
        **sampling_kwargs: Unpack[SamplingKwargs],
    ) -> SyncRequestHandle:
        """Like :meth:`submit`, but raises :class:`QueueFullError` instead of waiting.

        Args:
            prompt_ids: as for :meth:`submit`.
            sampling: as for :meth:`submit`.
            request_id: as for :meth:`submit`.
            record_timestamps: as for :meth:`submit`.
            cache_salt: as for :meth:`submit`.
            chat_template_kwargs: as for :meth:`submit`.
            lora: as for :meth:`submit`.
            **sampling_kwargs: as for :meth:`submit`.

        Returns:
            The request's handle.

        Raises:
            QueueFullError: ``max_queue_size`` requests are already waiting.
            ValueError: bad input, as for :meth:`submit`.
        """
        sampling = with_overrides("submit_nowait", sampling, sampling_kwargs)
        return self._submit(
            prompt_ids,
            sampling,
            False,
            None,
            request_id=request_id,
            record_timestamps=record_timestamps,
            cache_salt=cache_salt,
            chat_template_kwargs=chat_template_kwargs,
            lora=lora,
        )

    def generate(
        self,
        prompt_ids: Prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        record_timestamps: bool = False,
        timeout: float | None = None,
        cache_salt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora: str | None = None,
        **sampling_kwargs: Unpack[SamplingKwargs],
    ) -> GenerationOutput:
        """Submit and wait for the final output in one call.

        Args:
            prompt_ids: as for :meth:`submit`.
            sampling: as for :meth:`submit`.
            request_id: as for :meth:`submit`.
            record_timestamps: as for :meth:`submit`.
            timeout: the most seconds to wait for a queue slot.
            cache_salt: as for :meth:`submit`.
            chat_template_kwargs: as for :meth:`submit`.
            lora: as for :meth:`submit`.
            **sampling_kwargs: as for :meth:`submit`.

        Returns:
            The request's :class:`acb.GenerationOutput`.

        Raises:
            ValueError: bad input, as for :meth:`submit`.
            RequestFailedError: the engine failed the request (``.output`` has what it made).
        """
        sampling = with_overrides("generate", sampling, sampling_kwargs)
        return self._submit(
            prompt_ids,
            sampling,
            True,
            timeout,
            request_id=request_id,
            record_timestamps=record_timestamps,
            cache_salt=cache_salt,
            chat_template_kwargs=chat_template_kwargs,
            lora=lora,
        ).result()

    def add_lora(self, name: str, source: Any, *, timeout: float | None = None) -> LoraInfo:
        """Load a LoRA adapter on this thread and install it between two steps; submits then
        name it (``lora=name``). The engine needs ``max_loras >= 1`` free slots (:mod:`acb.api.loras`).

        Args:
            name: what submits call it.
            source: a PEFT adapter folder (``save_pretrained``'s), or a ``peft.PeftModel`` (its
                active adapter).
            timeout: the most seconds to wait for the engine thread to install it.

        Returns:
            The adapter's :class:`acb.api.loras.LoraInfo` (its slot, rank, content hash).

        Raises:
            ValueError: LoRA off (``max_loras=0``), no free slot, the name loaded already, or an
                adapter that does not fit the model (a rank over ``max_lora_rank``, a target module
                the model does not have); the field of each is ``lora``.
        """
        return self.loras.add(name, source, self.model, self.config, self.call, timeout)

    def remove_lora(self, name: str, *, timeout: float | None = None) -> LoraInfo:
        """Take a LoRA adapter out of the engine, freeing its slot; refused while a live request
        (queued or running) was submitted with it.

        Args:
            name: the adapter's name.
            timeout: the most seconds to wait for the engine thread.

        Returns:
            The removed adapter's :class:`acb.api.loras.LoraInfo`.

        Raises:
            ValueError: no adapter of that name, or live requests use it (field ``lora``).
        """
        return self.loras.remove(name, self.call, timeout)

    def list_loras(self) -> list[LoraInfo]:
        """The LoRA adapters loaded now, by slot."""
        return self.loras.list()

    def update_lora(self, name: str, source: Any, *, version: Any = None, timeout: float | None = None) -> Any:
        """Replace a loaded LoRA adapter's weights in place (same name, same slot): an RL trainer's
        LoRA policy after an optimizer step. Everything is checked before anything changes; the swap
        happens between two steps once no request that uses the adapter has started (those in
        flight finish on the old weights; those not started yet run the new). Versioned like
        :meth:`update_weights`: the engine's ``weight_version`` becomes ``version``, the prefix
        cache is dropped (:mod:`acb.api.loras`).

        Args:
            name: the adapter's name.
            source: its new weights: a PEFT adapter folder, a ``peft.PeftModel`` (its active
                adapter), or ``{key: tensor}`` / ``(key, tensor)`` pairs by PEFT's keys
                (``peft.get_peft_model_state_dict(model)``): some or all of its tensors, same shapes.
            version: the new version (default: the current one plus one).
            timeout: the most seconds to wait for the requests in flight with the adapter.

        Returns:
            The version now running.

        Raises:
            ValueError: no adapter of that name (field ``lora``), or tensors that do not fit it
                (``WeightUpdateError``), or a bad version; nothing changed.
            TimeoutError: requests using it were still running at ``timeout``; nothing changed.
        """
        return self.loras.update(name, source, self.model, self.config, self.call, version, timeout)

    def reset_prefix_cache(self, timeout: float | None = None) -> int:
        """Forget every cached prefix (needed after changing the weights in place). Safe while
        requests run: blocks in use stay in use.

        Args:
            timeout: the most seconds to wait for the engine thread to do it.

        Returns:
            How many blocks were forgotten.
        """
        forgotten: int = self._live_core().command("reset_prefix").result(timeout)
        return forgotten

    def update_weights(self, named_tensors: Any, *, version: Any = None, timeout: float | None = None) -> Any:
        """Replace weights by name, atomically: every name, shape and dtype is checked against
        the model and the tensors are staged before anything is written; the swap happens on
        the engine thread between two steps. The prefix cache is dropped; requests that go on
        report the version their tokens were sampled under (``GenerationOutput.weight_version``).

        Args:
            named_tensors: ``{name: tensor}`` or ``(name, tensor)`` pairs, by the model's own
                names (``model.named_parameters()``, persistent buffers); any subset.
            version: the new version (default: the current one plus one).
            timeout: the most seconds to wait for the swap.

        Returns:
            The version now running.

        Raises:
            WeightUpdateError: an unknown name, a shape or dtype that does not fit, a version that
                is neither an int nor a str (nothing written).
        """
        from acb.runner.weight_update import check_version

        check_version(version)  # (before the staging's work)
        return swap(self._live_core, self.stage_weights(named_tensors), version).result(timeout)

    def load_weights(self, path: Any, *, version: Any = None, timeout: float | None = None) -> Any:
        """:meth:`update_weights` from a safetensors checkpoint (a directory or one file) on
        local disk; every tensor in it is checked before anything is written.

        Args:
            path: the checkpoint.
            version: the new version (default: the current one plus one).
            timeout: the most seconds to wait for the swap.

        Returns:
            The version now running.

        Raises:
            WeightUpdateError: a checkpoint that does not read, a tensor that does not fit, a
                version that is neither an int nor a str (nothing written).
        """
        from acb.runner.weight_update import check_version

        check_version(version)  # (before the checkpoint is read)
        return swap(self._live_core, self.stage_checkpoint(path), version).result(timeout)

    def pause(self, mode: str = "wait", timeout: float | None = None) -> None:
        """Stop running steps, e.g. while the model trains between rounds; returns once paused.
        Requests submitted while paused are accepted and wait.

        Args:
            mode: ``"wait"`` lets the live requests finish first, ``"cancel"`` cancels them,
                ``"keep"`` parks them where they are (they continue after :meth:`resume`).
            timeout: the most seconds to wait (``"wait"``: for the live requests to finish).
        """
        self._live_core().pause(mode).result(timeout)

    def resume(self, timeout: float | None = None) -> None:
        """Run steps again after :meth:`pause`.

        Args:
            timeout: the most seconds to wait for the engine thread to do it.
        """
        self._live_core().resume().result(timeout)

    def sleep(self, timeout: float | None = None) -> MemoryReleased:
        """Free the KV cache, the decode graphs and the step buffers (the model stays) and return
        the bytes freed. No steps run until :meth:`wake_up`; running requests are taken off the
        device and recomputed after it; the prefix cache is emptied. A pause in effect (or a
        ``pause("wait")`` still draining) is left as it is and holds after waking.

        Args:
            timeout: the most seconds to wait for the engine thread to do it.

        Returns:
            What was freed, in bytes by kind (:class:`acb.runner.model_runner.MemoryReleased`).
        """
        released: MemoryReleased = self._live_core().command("sleep").result(timeout)
        return released

    def wake_up(self, timeout: float | None = None) -> None:
        """Allocate again what :meth:`sleep` freed (and capture the graphs); steps run again
        unless a :meth:`pause` holds them (a paused engine stays paused until :meth:`resume`; a
        drain that ``sleep`` interrupted goes on).

        Args:
            timeout: the most seconds to wait for the engine thread to do it.
        """
        self._live_core().command("wake").result(timeout)

    def generate_batch(
        self,
        inputs: Sequence[Prompt] | torch.Tensor,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        record_timestamps: bool = False,
        progress_bar: bool = True,
        on_result: Callable[[int, GenerationOutput], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        lora: str | Sequence[str | None] | None = None,
        **kwargs: Unpack[SamplingKwargs],
    ) -> dict[str, GenerationOutput]:
        """:func:`acb.generate_batch` on this running engine (kept across calls: a trainer's
        rounds, an evaluation's batches): submit every prompt, block until all ended, return
        ``{"req_0": output, ...}`` in input order. The results are named ``req_<i>`` of this call
        (the engine requests themselves take fresh ids, so calls from several threads, and submits
        beside them, never collide).

        A ``KeyboardInterrupt`` cancels what this call started and gives back the rest before
        it propagates, so the engine outlives it. On a tensor-parallel follower rank
        (``is_follower``) this returns ``{}`` at once: the leader's call runs the batch on every
        rank, and its result is the answer.

        Args:
            inputs: the prompts (token ids, text or chats), or a ``[B, T]`` tensor of token ids.
            sampling: one :class:`SamplingParams` for every prompt, or one per prompt.
            record_timestamps: record each token's arrival time in the outputs.
            progress_bar: a tqdm bar of requests done and tokens/s.
            on_result: ``on_result(index, output)``, called on this thread as each request ends
                (in the order they end), e.g. to write results as they come.
            should_stop: polled while the batch runs (every 0.5 s at least); once it returns
                True nothing more is submitted, the running and queued requests are cancelled,
                and the call returns when each has its final output (the prompts never
                submitted are left out of the result).
            lora: the LoRA adapter every prompt runs with, by name, or one per prompt (None: the
                base model); one batch mixes adapters and the base model freely.
            **kwargs: fields of :class:`SamplingParams` laid over each prompt's ``sampling``.

        Returns:
            ``{"req_<i>": GenerationOutput}`` in input order; a failed request keeps its place
            with ``status`` FAILED and ``error`` set.

        Raises:
            ValueError: a bad input, named ``inputs[i]`` (every input is validated before any runs).
            TypeError: an argument of the wrong type."""
        if self.is_follower:
            return {}
        inputs = _prompt_list(inputs)
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(inputs):
                raise ValueError(
                    f"generate_batch(): {len(sampling)} SamplingParams for {len(inputs)} inputs "
                    "(give one for every prompt, or a single one for all)"
                )
            per_prompt = [with_overrides("generate_batch", sp, kwargs) for sp in sampling]
        else:
            one = with_overrides("generate_batch", sampling, kwargs)  # type: ignore[arg-type]
            per_prompt = [one] * len(inputs)
        if not inputs:
            return {}
        loras = _per_prompt_lora(lora, len(inputs))
        done: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
        n = len(inputs)
        sink = functools.partial(ThreadSink, on_final=done.put)
        # the engine requests take fresh ids (another call, or a submit, may be running beside this
        # one); the results are named req_<i> of this call, as transformers' are
        reqs = self.submissions.make_all(
            "inputs",
            (
                (
                    i,
                    functools.partial(
                        self.make_request,
                        prompt,
                        per_prompt[i],
                        record_timestamps=record_timestamps,
                        sink_factory=sink,
                        lora=loras[i],
                    ),
                )
                for i, prompt in enumerate(inputs)
            ),
        )

        def named(i: int, output: GenerationOutput) -> None:
            output.request_id = f"req_{i}"  # (this call's own output object: its sink made it)
            if on_result is not None:
                on_result(i, output)

        results = self._run_made(reqs, done, _progress(n, progress_bar), named, should_stop)
        out = {f"req_{i}": results[r.request_id] for i, r in enumerate(reqs) if r.request_id in results}
        failed = [rid for rid, o in out.items() if o.status == RequestStatus.FAILED]
        if failed:
            logger.error(
                "acb.generate_batch: %d of %d requests failed (e.g. %s: %s)",
                len(failed),
                n,
                failed[0],
                out[failed[0]].error,
            )
        return out

    def _run_made(
        self,
        reqs: list[Submission],
        done: queue.SimpleQueue[GenerationOutput],
        bar: Any,
        on_result: Callable[[int, GenerationOutput], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> dict[str, GenerationOutput]:
        """The one batch loop (``generate_batch``, ``score_batch``, ``acb generate``): enqueue
        requests from :meth:`make_request` (whose sinks put their
        final output on ``done``) in order, taking queue slots as they free up, and block until
        every request enqueued has ended; their outputs by request id. ``should_stop`` and
        interrupts: see :meth:`generate_batch`."""
        index = {r.request_id: i for i, r in enumerate(reqs)}
        results: dict[str, GenerationOutput] = {}
        meter = _Meter(bar)
        self._about_to_wait()
        expected = 0  # requests that will have an output: enqueued, or failed for a dead engine
        stopping = given_back = False

        def collect(block: bool) -> None:
            for out in _take(done, block):
                results[out.request_id] = out
                meter.add(out)
                if on_result is not None:
                    on_result(index[out.request_id], out)

        def stop_now() -> bool:
            nonlocal stopping
            if not stopping and should_stop is not None and should_stop():
                stopping = True
                for r in reqs[:expected]:
                    if r.request_id not in results:
                        self.cancel(r.request_id)
            return stopping

        try:
            for k, req in enumerate(reqs):
                while not stop_now() and not self.gate.acquire_blocking(0.5):
                    collect(block=False)  # waiting for a slot: the bar and the callback go on
                if stopping:
                    break
                try:
                    self.admit(req)  # (on failure it gives back the slot and the id)
                except AcbError as exc:  # the engine died: the rest never ran
                    for r in reqs[k + 1 :]:
                        self.abandon(r)
                    for r in reqs[k:]:
                        done.put(r.failed_output(f"{type(exc).__name__}: {exc}", FailureKind.ENGINE_DEAD))
                    expected = len(reqs)
                    break
                expected = k + 1
                collect(block=False)
            if stopping:
                given_back = True
                for r in reqs[expected:]:
                    self.abandon(r)
            while len(results) < expected:
                stop_now()
                collect(block=True)
                if not self.is_running and done.empty() and len(results) < expected:
                    for r in reqs[:expected]:  # cannot happen unless delivery itself broke; never hang
                        if r.request_id not in results:
                            done.put(r.failed_output("the engine stopped", FailureKind.ENGINE_DEAD))
        except BaseException:  # interrupted: the engine outlives this call, its requests must not
            if not given_back:
                for r in reqs[expected:]:
                    self.abandon(r)
            for r in reqs[:expected]:
                if r.request_id not in results:
                    self.cancel(r.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return results

    def score(
        self,
        context: Prompt,
        continuations: Sequence[Prompt],
        *,
        top_logprobs: int = 0,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> ScoreOutput:
        """How likely each continuation of ``context`` is. Nothing is sampled: the context's prefix
        is read from and written to the prefix cache like any prompt's, one-token continuations
        all come from one forward of the context, and the LM head runs only on the scored rows
        (:mod:`acb.api.scoring`).

        Args:
            context: token ids (or text, with a tokenizer; see :func:`acb.api.scoring.as_ids`).
            continuations: what may follow ``context``, each as token ids (or text).
            top_logprobs: also return the ``k`` most likely tokens at each scored position.
            request_id: the id of the (first) engine request (default: a fresh ``score_<n>``).
            cache_salt: keeps the prefix-cache entries apart from other salts'.
            lora: the LoRA adapter it is scored with, by name (None: the base model).

        Returns:
            A :class:`acb.ScoreOutput`: per continuation, every token's logprob (raw
            log-softmax), whether it is the greedy one, and the top alternatives when asked.

        Raises:
            ValueError: a bad input (an empty context or continuation, a token outside the
                vocabulary, more than can ever fit).
            RequestFailedError: the engine failed the scoring request."""
        (out,) = self.score_batch(
            [(context, continuations)],
            top_logprobs=top_logprobs,
            cache_salt=cache_salt,
            progress_bar=False,
            request_ids=[request_id] if request_id else None,
            lora=lora,
        )
        if out.status != RequestStatus.FINISHED:
            raise RequestFailedError(out.error or f"scoring {out.request_id!r} ended {out.status.name}")
        return out

    def score_batch(
        self,
        items: Sequence[tuple[Prompt, Sequence[Prompt]]],
        *,
        top_logprobs: int = 0,
        cache_salt: str | None = None,
        progress_bar: bool = True,
        request_ids: Sequence[str] | None = None,
        lora: str | None = None,
    ) -> list[ScoreOutput]:
        """:meth:`score` for many items at once. Every item is validated before any runs; the
        engine requests are submitted sorted by their tokens, so that contexts sharing a prefix (a
        task's few-shot preamble) meet in the prefix cache.

        Args:
            items: ``(context, continuations)`` pairs.
            top_logprobs: also return the ``k`` most likely tokens at each scored position.
            cache_salt: keeps the prefix-cache entries apart from other salts'.
            progress_bar: a tqdm bar counting engine requests.
            request_ids: one id per item (default: a fresh ``score_<n>`` each, unique per call).
            lora: the LoRA adapter every item is scored with, by name (None: the base model).

        Returns:
            One :class:`acb.ScoreOutput` per item, in input order; a failed item keeps its place
            with ``status`` FAILED and ``error`` set.

        Raises:
            ValueError: a bad item, named ``items[i]``.
        """
        if self.is_follower:
            return []
        done: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
        plans, ids, engine_ids, reqs = scoring.make_requests(
            self, items, top_logprobs, cache_salt, request_ids, lambda rid: ThreadSink(rid, on_final=done.put), lora
        )
        results = self._run_made(reqs, done, _progress(len(reqs), progress_bar, desc="score_batch"))
        return scoring.assemble_batch(plans, ids, engine_ids, results, top_logprobs)


def generate_batch(
    model: Any,
    inputs: Sequence[Prompt] | torch.Tensor,
    generation_config: Any = None,
    continuous_batching_config: ConfigLike | None = None,
    *,
    record_timestamps: bool = False,
    progress_bar: bool = True,
    persistent_manager: bool = False,
    warmup: bool = True,
    sampling: SamplingParams | None = None,
    tokenizer: Any = None,
    **kwargs: Unpack[SamplingKwargs],
) -> dict[str, GenerationOutput]:
    """Generate for every prompt in ``inputs`` with continuous batching; block until all are done.

    An engine is started for the call and stopped after it (for many calls, keep an
    :class:`Engine` and call its :meth:`Engine.generate_batch`).

    Args:
        model: a transformers causal LM.
        inputs: the prompts (token ids, text or chats with a tokenizer), or a ``[B, T]`` tensor.
        generation_config: the requests' defaults (default: the model's).
        continuous_batching_config: acb's or transformers' ``ContinuousBatchingConfig``.
        record_timestamps: record each token's arrival time in the outputs.
        progress_bar: a tqdm bar of requests done and output tokens/s.
        persistent_manager: transformers' argument; no effect.
        warmup: transformers' argument; no effect.
        sampling: the requests' :class:`SamplingParams` (over the generation config's).
        tokenizer: needed for text prompts, chats and output text.
        **kwargs: fields of :class:`SamplingParams` (``temperature=0.7``) laid over ``sampling``.

    Returns:
        ``{request_id: GenerationOutput}`` in input order, ids ``req_0, req_1, ...`` (as
        transformers' ``generate_batch``); a request that fails keeps its place with
        ``status == FAILED`` and ``error`` set.

    Raises:
        ValueError: a bad input, named ``inputs[i]`` (every input is validated before any runs).
        UnsupportedModelError: the model cannot run in acb (the message says why).
    """
    del persistent_manager, warmup  # transformers' knobs: acb's engine needs neither
    sampling = with_overrides("generate_batch", sampling, kwargs)
    inputs = _prompt_list(inputs)
    if not inputs:
        return {}
    engine = Engine(model, continuous_batching_config, generation_config, tokenizer=tokenizer)
    engine.start()
    try:
        return engine.generate_batch(inputs, sampling, record_timestamps=record_timestamps, progress_bar=progress_bar)
    finally:
        engine.shutdown()


def _per_prompt_lora(lora: str | Sequence[str | None] | None, n: int) -> Sequence[str | None]:
    """``generate_batch``'s ``lora``: one adapter name for every prompt, or one per prompt."""
    if lora is None or isinstance(lora, str):
        return [lora] * n
    if not isinstance(lora, (list, tuple)) or len(lora) != n:
        raise ValueError(
            f"generate_batch(): lora must be one adapter name, or a list of one per prompt ({n}), got {lora!r}"
        )
    return lora


def _prompt_list(inputs: Any) -> list[Any]:
    """``inputs`` as a list of prompts: a list (or tuple) of prompts, or a ``[B, T]`` tensor/array
    whose rows are the prompts (each prompt is validated at submit)."""
    ndim = getattr(inputs, "ndim", None)
    if ndim is not None and hasattr(inputs, "tolist"):
        if ndim != 2:
            raise ValueError(f"inputs as a tensor must be [batch, tokens], got shape {tuple(inputs.shape)}")
        return list(inputs.tolist())
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs must be a list of prompts (lists of token ids), got {type(inputs).__name__}")
    return list(inputs)


def _progress(total: int, enabled: bool, desc: str = "generate_batch") -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    # labelled for the library call; ``acb generate`` draws its own bar
    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True)


def _take(done: queue.SimpleQueue[GenerationOutput], block: bool) -> list[GenerationOutput]:
    """The outputs waiting on ``done`` (after up to 0.5 s for the first, with ``block``)."""
    items = []
    try:
        items.append(done.get(block=block, timeout=0.5 if block else None))
        while True:
            items.append(done.get_nowait())
    except queue.Empty:
        pass
    return items


class _Meter:
    """The progress bar of a batch: requests ended, and generated tokens per second (every
    sample's with ``n > 1``, summed over the requests ended so far, divided by the time since
    the first submit)."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.tokens = 0
        self.t0 = time.perf_counter()

    def add(self, out: GenerationOutput) -> None:
        self.tokens += sum(len(s.generated_tokens) for s in out.samples) if out.samples else len(out.generated_tokens)
        if self.bar is not None:
            if self.tokens:  # (scoring requests generate nothing: no rate to show)
                elapsed = max(time.perf_counter() - self.t0, 1e-9)
                self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
            self.bar.update(1)
