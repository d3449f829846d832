"""``AsyncEngine``: the async front of acb, for asyncio and trio (any anyio backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from acb.api import scoring
from acb.api.base import EngineBase
from acb.api.handles import RequestHandle
from acb.api.loops import await_future, current_loop
from acb.api.sinks import AsyncSink
from acb.api.submissions import Submission
from acb.api.weights import swap
from acb.errors import InvalidRequestError, QueueFullError, RequestFailedError
from acb.media import MediaPrompt, has_media
from acb.outputs import GenerationOutput, RequestStatus, ScoreOutput
from acb.sampling_params import SamplingParams, with_overrides

if TYPE_CHECKING:
    from collections.abc import Sequence

    from typing_extensions import Unpack

    from acb.api.loras import LoraInfo
    from acb.runner.model_runner import MemoryReleased
    from acb.sampling_params import SamplingKwargs
    from acb.structured_outputs import StructuredOutputs
    from acb.text import Prompt


class AsyncEngine(EngineBase):
    """Continuous batching for a transformers causal LM, awaited from asyncio or trio.

    ::

        async with acb.AsyncEngine(model) as engine:
            handle = await engine.submit(prompt_ids, acb.SamplingParams(max_new_tokens=64))
            async for delta in handle:          # streams new tokens
                print(delta.token_ids)
            output = await handle.result()      # the final GenerationOutput

    Handles may be awaited from any event loop (and several at once), asyncio's or trio's. The
    engine runs on its own thread; the model's attention implementation is acb's while the engine
    runs.
    """

    # ------------------------------------------------------------------ life
    async def __aenter__(self) -> AsyncEngine:
        self._enter_context()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._exit_context():  # the outermost block: stop
            # shielded: leaving the block stops the engine even when leaving it because of a
            # cancellation (under trio, an unshielded wait in a cancelled scope would not even start)
            with anyio.CancelScope(shield=True):
                await self.shutdown()

    async def shutdown(self, *, cancel_pending: bool = True, timeout: float | None = None) -> None:
        """Stop the engine. The stop is requested at once; then the engine thread is awaited
        from a worker thread. Cancelling this call stops the wait, not the stop.

        Args:
            cancel_pending: cancel the live requests (else they finish first).
            timeout: the most seconds to wait for the engine thread.
        """
        self.stop(drain=not cancel_pending, timeout=0)  # post the stop; join(0) does not block
        await anyio.to_thread.run_sync(self.join, timeout)

    # --------------------------------------------------------------- submit
    def _make(
        self,
        prompt_ids: Prompt,
        sampling: SamplingParams | None,
        request_id: str | None,
        record_timestamps: bool,
        cache_salt: str | None,
        chat_template_kwargs: Any = None,
        lora: str | None = None,
    ) -> Submission:
        loop = current_loop()  # the handle's home loop (asyncio's, or the trio run's)
        return self.make_request(
            prompt_ids,
            sampling,
            sink_factory=lambda rid: AsyncSink(rid, loop),
            request_id=request_id,
            record_timestamps=record_timestamps,
            cache_salt=cache_salt,
            chat_template_kwargs=chat_template_kwargs,
            lora=lora,
        )

    def _handle(self, req: Submission) -> RequestHandle:
        self._about_to_wait()  # the loop's thread computes nothing for the engine
        self.admit(req)
        return RequestHandle(req.request_id, req.sink, self.cancel)

    async def submit(
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
    ) -> RequestHandle:
        """Validate and admit a request; waits while ``max_queue_size`` requests are waiting.

        Args:
            prompt_ids: token ids, or (with a tokenizer) a string or a chat (a list of
                ``{"role", "content"}`` messages, rendered with the tokenizer's chat template).
            sampling: how to decode; ``None`` fields take the engine's defaults.
            request_id: the request's id (default ``req_<n>``); it must not be live already.
            record_timestamps: record each token's arrival time in the output.
            cache_salt: keeps the request's prefix-cache entries apart from other salts'.
            chat_template_kwargs: the chat template's variables (a chat prompt).
            lora: the LoRA adapter it runs with, by name (:meth:`add_lora`; None: the base model).
            **sampling_kwargs: fields of :class:`SamplingParams` (``max_new_tokens=8,
                temperature=0.7``) laid over ``sampling``.

        Returns:
            The request's handle: ``async for`` its deltas, ``await handle.result()``.

        Raises:
            ValueError: bad input (an empty prompt, a token id outside the vocabulary, a prompt
                that can never fit, a bad sampling value, a live request id, a grammar that
                cannot compile); nothing else is affected.
            TypeError: an argument of the wrong type.
            EngineNotRunningError: the engine is not started.
        """
        sampling = with_overrides("submit", sampling, sampling_kwargs)
        if sampling is not None and sampling.structured_outputs is not None and self.is_running:
            await self.compile_structured_outputs(sampling.structured_outputs)  # (make_request finds it cached)
        if has_media(prompt_ids) and not isinstance(prompt_ids, MediaPrompt):  # decoded and processed off the loop
            prompt_ids = await anyio.to_thread.run_sync(self.processor.process_media, prompt_ids, chat_template_kwargs)
        req = self._make(prompt_ids, sampling, request_id, record_timestamps, cache_salt, chat_template_kwargs, lora)
        try:
            await self.gate.acquire()
        except BaseException:
            self.abandon(req)
            raise
        return self._handle(req)

    async def compile_structured_outputs(self, spec: StructuredOutputs) -> None:
        """Compile a grammar off the event loop (the compiler's own threads; the first call also
        builds the compiler, which reads the whole vocabulary, in a worker thread) and cache it:
        a submit with this spec then finds it compiled. :meth:`submit` calls it; a caller of
        :meth:`submit_nowait` (a server) awaits it first.

        Args:
            spec: the request's structured outputs.

        Raises:
            ValueError: the spec cannot compile (xgrammar's message), is over the compile budget
                (``grammar_max_bytes``, ``grammar_max_repetition``, ``grammar_compile_timeout_s``:
                the message names the limit), can never be met (it matches no text, or the
                vocabulary has no token to start it), or the engine has no tokenizer.
            EngineNotRunningError: the engine stopped while the spec compiled.
        """
        try:
            compiler = await anyio.to_thread.run_sync(self.grammars)
            await await_future(compiler.submit(spec))
        except ValueError as exc:  # (named as submit_nowait's refusal is: the field, and a prefix)
            raise InvalidRequestError(f"structured_outputs: {exc}", "structured_outputs") from None

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
    ) -> RequestHandle:
        """Like :meth:`submit`, but raises :class:`QueueFullError` instead of waiting. Must be
        called from a running event loop (the handle belongs to it).

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
        req = self._make(prompt_ids, sampling, request_id, record_timestamps, cache_salt, chat_template_kwargs, lora)
        if not self.gate.try_acquire():
            self.abandon(req)
            raise QueueFullError(f"{self.gate.limit} requests are already waiting (max_queue_size)")
        return self._handle(req)

    async def generate(
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
    ) -> GenerationOutput:
        """Submit and await the final output in one call.

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
            The request's :class:`acb.GenerationOutput`.

        Raises:
            ValueError: bad input, as for :meth:`submit`.
            RequestFailedError: the engine failed the request (``.output`` has what it made).
            EngineDeadError: the engine died.
        """
        sampling = with_overrides("generate", sampling, sampling_kwargs)
        handle = await self.submit(
            prompt_ids,
            sampling,
            request_id=request_id,
            record_timestamps=record_timestamps,
            cache_salt=cache_salt,
            chat_template_kwargs=chat_template_kwargs,
            lora=lora,
        )
        return await handle.result()

    async def score(
        self,
        context: Prompt,
        continuations: Sequence[Prompt],
        *,
        top_logprobs: int = 0,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> ScoreOutput:
        """How likely each continuation of ``context`` is (as :meth:`acb.Engine.score`).
        Cancelling the awaiting task cancels its engine requests.

        Args:
            context: token ids (or text, with a tokenizer).
            continuations: what may follow ``context``, each as token ids (or text).
            top_logprobs: also return the ``k`` most likely tokens at each scored position.
            request_id: the id of the (first) engine request.
            cache_salt: keeps the prefix-cache entries apart from other salts'.
            lora: the LoRA adapter it is scored with, by name (None: the base model).

        Returns:
            A :class:`acb.ScoreOutput`: per continuation, every token's raw logprob, whether it
            is the greedy one, and the top alternatives when asked.

        Raises:
            ValueError: a bad input.
            RequestFailedError: the engine failed the scoring request.
        """
        (out,) = await self.score_batch(
            [(context, continuations)],
            top_logprobs=top_logprobs,
            cache_salt=cache_salt,
            request_ids=[request_id] if request_id else None,
            lora=lora,
        )
        if out.status != RequestStatus.FINISHED:
            raise RequestFailedError(out.error or f"scoring {out.request_id!r} ended {out.status.name}")
        return out

    async def score_batch(
        self,
        items: Sequence[tuple[Prompt, Sequence[Prompt]]],
        *,
        top_logprobs: int = 0,
        cache_salt: str | None = None,
        request_ids: Sequence[str] | None = None,
        lora: str | None = None,
    ) -> list[ScoreOutput]:
        """:meth:`score` for many items at once (as :meth:`acb.Engine.score_batch`): every item
        is validated before any runs, and the engine requests are submitted sorted by their
        tokens, so that contexts sharing a prefix meet in the prefix cache.

        Args:
            items: ``(context, continuations)`` pairs.
            top_logprobs: also return the ``k`` most likely tokens at each scored position.
            cache_salt: keeps the prefix-cache entries apart from other salts'.
            request_ids: one id per item (default: a fresh ``score_<n>`` each, unique per call).
            lora: the LoRA adapter every item is scored with, by name (None: the base model).

        Returns:
            One :class:`acb.ScoreOutput` per item, in input order; a failed item keeps its
            place with ``status`` FAILED and ``error`` set.

        Raises:
            ValueError: a bad item, named ``items[i]``.
        """
        loop = current_loop()
        plans, ids, engine_ids, reqs = scoring.make_requests(
            self, items, top_logprobs, cache_salt, request_ids, lambda rid: AsyncSink(rid, loop), lora
        )
        handles: list[RequestHandle] = []
        outputs: dict[str, GenerationOutput] = {}
        try:
            for k, req in enumerate(reqs):
                try:
                    await self.gate.acquire()
                except BaseException:
                    for r in reqs[k:]:
                        self.abandon(r)
                    raise
                handles.append(self._handle(req))
            for h in handles:
                try:
                    outputs[h.request_id] = await h.result()
                except RequestFailedError as exc:
                    assert exc.output is not None
                    outputs[h.request_id] = exc.output
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return scoring.assemble_batch(plans, ids, engine_ids, outputs, top_logprobs)

    # --------------------------------------------------------- LoRA adapters
    async def add_lora(self, name: str, source: Any) -> LoraInfo:
        """:meth:`acb.Engine.add_lora`: the adapter read and checked in a worker thread, then
        installed between two steps.

        Args:
            name: what submits call it (``lora=name``).
            source: a PEFT adapter folder, or a ``peft.PeftModel`` (its active adapter).

        Returns:
            The adapter's :class:`acb.api.loras.LoraInfo`.

        Raises:
            ValueError: as for :meth:`acb.Engine.add_lora` (field ``lora``).
        """
        return await anyio.to_thread.run_sync(self.loras.add, name, source, self.model, self.config, self.call)

    async def remove_lora(self, name: str) -> LoraInfo:
        """:meth:`acb.Engine.remove_lora`: refused while a live request uses the adapter.

        Args:
            name: the adapter's name.

        Returns:
            The removed adapter's :class:`acb.api.loras.LoraInfo`.
        """
        return await anyio.to_thread.run_sync(self.loras.remove, name, self.call)

    def list_loras(self) -> list[LoraInfo]:
        """The LoRA adapters loaded now, by slot."""
        return self.loras.list()

    async def update_lora(self, name: str, source: Any, *, version: Any = None, timeout: float | None = None) -> Any:
        """:meth:`acb.Engine.update_lora`: the new weights read and checked, and the wait for the
        requests in flight with the adapter, in a worker thread.

        Args:
            name: the adapter's name.
            source: its new weights (a PEFT folder, a ``PeftModel``, PEFT-keyed tensors).
            version: the new version (default: the current one plus one).
            timeout: the most seconds to wait for the requests in flight with the adapter.

        Returns:
            The version now running.
        """
        return await anyio.to_thread.run_sync(
            lambda: self.loras.update(name, source, self.model, self.config, self.call, version, timeout)
        )

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (needed after changing the weights in place). Safe while
        requests run: blocks in use stay in use. Returns how many blocks were forgotten."""
        forgotten: int = await await_future(self._live_core().command("reset_prefix"))
        return forgotten

    # ------------------------------------------------------ weight updates
    async def update_weights(self, named_tensors: Any, *, version: Any = None) -> Any:
        """:meth:`acb.Engine.update_weights`: the tensors checked and staged in a worker thread,
        swapped in between two steps.

        Args:
            named_tensors: ``{name: tensor}`` or ``(name, tensor)`` pairs, by the model's own names.
            version: the new version (default: the current one plus one).

        Returns:
            The version now running.

        Raises:
            WeightUpdateError: an unknown name, a shape or dtype that does not fit (nothing written).
        """
        staged = await anyio.to_thread.run_sync(self.stage_weights, named_tensors)
        return await await_future(swap(self._live_core, staged, version))

    async def swap_weights(self, staged: Any, version: Any = None) -> Any:
        """Swap in an update already staged (:meth:`stage_weights`: a receiver staged it)
        between two steps.

        Args:
            staged: what :meth:`stage_weights` or :meth:`stage_checkpoint` returned.
            version: the new version (default: the current one plus one).

        Returns:
            The version now running.
        """
        return await await_future(swap(self._live_core, staged, version))

    async def load_weights(self, path: Any, *, version: Any = None) -> Any:
        """:meth:`acb.Engine.load_weights`: the checkpoint read and staged in a worker thread.

        Args:
            path: a safetensors checkpoint (a directory or one file) on local disk.
            version: the new version (default: the current one plus one).

        Returns:
            The version now running.

        Raises:
            WeightUpdateError: a checkpoint that does not read, or a tensor that does not fit.
        """
        staged = await anyio.to_thread.run_sync(self.stage_checkpoint, path)
        return await await_future(swap(self._live_core, staged, version))

    # ------------------------------------------------------ pause and sleep
    async def pause(self, mode: str = "wait") -> None:
        """Stop running steps, e.g. while the model trains between rounds; returns once paused.
        Requests submitted while paused are accepted and wait.

        Args:
            mode: ``"wait"`` lets the live requests finish first, ``"cancel"`` cancels them,
                ``"keep"`` parks them where they are (they continue after :meth:`resume`).
        """
        await await_future(self._live_core().pause(mode))

    async def resume(self) -> None:
        """Run steps again after :meth:`pause`."""
        await await_future(self._live_core().resume())

    async def sleep(self) -> MemoryReleased:
        """Free the KV cache, the decode graphs and the step buffers (the model stays) and return
        the bytes freed. No steps run until :meth:`wake_up`; running requests are taken off the
        device and recomputed after it; the prefix cache is emptied. A pause in effect (or a
        ``pause("wait")`` still draining) is left as it is and holds after waking."""
        released: MemoryReleased = await await_future(self._live_core().command("sleep"))
        return released

    async def wake_up(self) -> None:
        """Allocate again what :meth:`sleep` freed (and capture the graphs); steps run again
        unless a :meth:`pause` holds them (a paused engine stays paused until :meth:`resume`; a
        drain that ``sleep`` interrupted goes on)."""
        await await_future(self._live_core().command("wake"))
