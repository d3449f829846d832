"""``ContinuousBatchingManager`` with transformers' method names and meanings.

Moving over from transformers is a one-line change::

    manager = model.init_continuous_batching(generation_config=gc)          # transformers
    manager = acb.init_continuous_batching(model, generation_config=gc)     # acb

Results come out of one output queue (``get_result``, iteration, ``request_id_iter``) or,
per request, through ``register_result_handler`` callbacks on the caller's event loop.
Streaming requests put a partial output (all tokens so far, status DECODING) after every
step that gave them a token, then the final one.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

from acb.api.engine import Engine
from acb.api.loops import current_loop
from acb.api.processor import as_token_list
from acb.api.sinks import ThreadSink
from acb.config import ConfigLike, ContinuousBatchingConfig
from acb.core.messages import Delivery
from acb.outputs import GenerationOutput, RequestStatus
from acb.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel
    from transformers.generation.continuous_batching.utils import WorkloadHints

logger = logging.getLogger(__name__)

# per-request processor arguments (transformers' logit_processor_kwargs) acb maps onto SamplingParams
_PROCESSOR_KWARGS = {
    "temperature",
    "do_sample",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "min_new_tokens",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
    "logprobs_mode",
}


class _OutputRouter:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: deque[GenerationOutput] = deque()
        self.handlers: dict[str, tuple[Callable[[GenerationOutput], object], Any]] = {}

    def put(self, out: GenerationOutput) -> None:
        with self._cond:
            handler = self.handlers.get(out.request_id)
            if handler is not None and out.is_finished():
                del self.handlers[out.request_id]
            if handler is None:
                self._items.append(out)
                self._cond.notify_all()
                return
        callback, loop = handler
        try:
            loop.call_soon_threadsafe(callback, out)
        except RuntimeError:
            logger.warning("result handler loop for %r is closed; output dropped", out.request_id)

    def get(self, request_id: str | None, timeout: float | None) -> GenerationOutput | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if request_id is None:
                    if self._items:
                        return self._items.popleft()
                else:
                    for i, out in enumerate(self._items):
                        if out.request_id == request_id:
                            del self._items[i]
                            return out
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def empty(self) -> bool:
        with self._cond:
            return not self._items

    def set_handler(
        self, request_id: str, callback: Callable[[GenerationOutput], object], loop: Any
    ) -> list[GenerationOutput]:
        """Route ``request_id``'s outputs to ``callback`` on ``loop`` from now on; returns (and
        removes from the queue) the outputs that arrived before."""
        with self._cond:
            self.handlers[request_id] = (callback, loop)
            early = [o for o in self._items if o.request_id == request_id]
            for o in early:
                self._items.remove(o)
        return early

    def drop_handler(self, request_id: str) -> None:
        with self._cond:
            self.handlers.pop(request_id, None)


class ContinuousBatchingManager:
    """transformers-compatible manager running on acb's engine."""

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ConfigLike | None = None,
        workload_hints: WorkloadHints | None = None,
    ) -> None:
        self.model = model
        self.generation_config = generation_config if generation_config is not None else model.generation_config
        self.continuous_batching_config = (
            ContinuousBatchingConfig() if continuous_batching_config is None else continuous_batching_config
        )
        self._engine = Engine(model, self.continuous_batching_config, self.generation_config)
        self.output_router = _OutputRouter()
        self.warmed_up = False

    @property
    def engine(self) -> Engine:
        """The :class:`acb.Engine` the manager runs on (acb only)."""
        return self._engine

    # ------------------------------------------------------------ control
    def warmup(self) -> None:
        """Check the model and allocate the KV cache now rather than at ``start``."""
        self._engine.prepare()
        self.warmed_up = True

    def is_running(self) -> bool:
        return self._engine.is_running

    def start(self) -> None:
        if self.is_running():
            logger.warning("manager is already running")
            return
        self._engine.start()

    def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        """Stop the engine thread (a stopped acb manager can always be started again).

        Args:
            block: wait for the engine thread (up to ``timeout``).
            timeout: the most seconds to wait.
            keep_for_next_session: transformers' argument; accepted, no effect.
            hard_stop: cancel the requests already added (else they finish first).
        """
        if self._engine.core is None:
            logger.warning("manager not started")
            return
        self._engine.stop(drain=not hard_stop, timeout=timeout if block else 0)

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        """Wait for the engine thread to exit (after ``stop``).

        Args:
            stop_trigger_time: transformers' argument; accepted, no effect.
            timeout: the most seconds to wait.
        """
        self._engine.join(timeout)

    def destroy(self) -> None:
        if self.is_running():
            self.stop(block=True, hard_stop=True)

    # ----------------------------------------------------------- requests
    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        lora: str | None = None,
        **logit_processor_kwargs: Any,
    ) -> str:
        """Queue one request (transformers' ``add_request``). Blocks while ``max_queue_size``
        requests wait.

        Args:
            input_ids: the prompt's token ids.
            request_id: its id (default: a fresh ``req_<n>``, which no live request has).
            max_new_tokens: most tokens to generate (default: the generation config's).
            streaming: deliver partial outputs as tokens come (``get_result`` returns them).
            record_timestamps: record each token's arrival time.
            eos_token_id: the stop token(s) (default: the generation config's).
            lora: the LoRA adapter it runs with, by name (``manager.engine.add_lora``; None: the
                base model).
            **logit_processor_kwargs: sampling settings (``temperature``, ``top_k``...), applied
                per request with ``per_request_processors=True`` (else ignored with a warning).

        Returns:
            The request's id.

        Raises:
            ValueError: bad input; nothing else is affected.
        """
        per_request: dict[str, Any] = {}
        if logit_processor_kwargs:
            if not self.continuous_batching_config.per_request_processors:
                # transformers' meaning: without per_request_processors every request uses the defaults
                warnings.warn(
                    f"per-request processor arguments {sorted(logit_processor_kwargs)} are ignored because "
                    "ContinuousBatchingConfig.per_request_processors is False",
                    stacklevel=2,
                )
            else:
                unknown = set(logit_processor_kwargs) - _PROCESSOR_KWARGS
                if unknown:
                    raise ValueError(f"acb has no per-request processor for {sorted(unknown)}")
                per_request = dict(logit_processor_kwargs)
        input_ids = as_token_list(input_ids)  # a tensor prompt is reported back as a list of ints
        stop = None
        if eos_token_id is not None:
            eos = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
            if isinstance(eos, (str, bytes)) or not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
                raise TypeError(f"eos_token_id must be an int or a list of ints, got {eos_token_id!r}")
            stop = tuple(e for e in eos if e >= 0)
        sampling = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop, **per_request)
        router = self.output_router
        if streaming and (sampling.n or self._engine.defaults.n or 1) > 1:
            raise ValueError(
                "streaming=True with num_return_sequences > 1 is not supported by the manager: its partial "
                "outputs hold one token list; use streaming=False (the final output lists every sample) or "
                "acb.AsyncEngine, whose stream deltas carry sample_index"
            )

        def make_sink(rid: str) -> ThreadSink:
            # the id is the engine's: the caller's, or a fresh req_<n> no live request has
            if not streaming:
                return ThreadSink(rid, on_final=router.put)
            acc: list[int] = []
            acc_lp: list[float] = []

            def on_push(d: Delivery) -> None:
                if d.final is not None:
                    router.put(d.final)
                    return
                acc.extend(d.token_ids)
                if d.logprobs:
                    acc_lp.extend(d.logprobs)
                router.put(
                    GenerationOutput(
                        request_id=rid,
                        prompt_ids=list(input_ids),
                        generated_tokens=list(acc),
                        logprobs=list(acc_lp),
                        status=RequestStatus.DECODING,
                    )
                )

            return ThreadSink(rid, on_push=on_push)

        req = self._engine.make_request(
            input_ids,
            sampling,
            request_id=request_id,
            record_timestamps=record_timestamps,
            sink_factory=make_sink,
            lora=lora,
        )
        rid = req.request_id
        self._engine.enqueue_blocking(req)
        return rid

    def add_requests(
        self,
        inputs: list[list[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        **logit_processor_kwargs: Any,
    ) -> list[str]:
        """:meth:`add_request` for each prompt.

        Args:
            inputs: the prompts' token ids.
            max_new_tokens: as for :meth:`add_request`.
            streaming: as for :meth:`add_request`.
            record_timestamps: as for :meth:`add_request`.
            **logit_processor_kwargs: as for :meth:`add_request`.

        Returns:
            The requests' ids, in order.
        """
        return [
            self.add_request(
                ids,
                max_new_tokens=max_new_tokens,
                streaming=streaming,
                record_timestamps=record_timestamps,
                **logit_processor_kwargs,
            )
            for ids in inputs
        ]

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request; unknown ids are a logged no-op.

        Args:
            request_id: the request's id.
        """
        self._engine.cancel(request_id)

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output.

        Args:
            request_id: only this request's (default: any request's).
            timeout: the most seconds to wait (``None``: no limit).

        Returns:
            A :class:`GenerationOutput` (partial ones when streaming), or None after ``timeout``.
        """
        if not self.is_running() and self.output_router.empty():
            return None
        return self.output_router.get(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        while self.is_running() or not self.output_router.empty():
            out = self.output_router.get(None, 0.1)
            if out is not None:
                yield out

    def request_id_iter(self, request_id: str) -> Generator[GenerationOutput, None, None]:
        """Outputs of one request until its final one.

        Args:
            request_id: the request's id.
        """
        while self.is_running() or not self.output_router.empty():
            out = self.output_router.get(request_id, 0.1)
            if out is not None:
                yield out
                if out.is_finished():
                    return

    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], Any]) -> None:
        """Call ``callback(output)`` on the current event loop (asyncio's or trio's) for each output
        of ``request_id``.

        Args:
            request_id: the request's id.
            callback: called with each :class:`GenerationOutput`; an exception it raises is
                logged, and the engine goes on.
        """
        early = self.output_router.set_handler(request_id, callback, current_loop())
        for o in early:  # outputs that arrived before the handler was registered
            callback(o)
            if o.is_finished():
                self.output_router.drop_handler(request_id)


def init_continuous_batching(
    model: PreTrainedModel,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ConfigLike | None = None,
    workload_hints: WorkloadHints | None = None,
) -> ContinuousBatchingManager:
    """acb's ``model.init_continuous_batching(...)``: a manager, not yet started.

    Args:
        model: a transformers causal LM.
        generation_config: the requests' defaults (default: the model's).
        continuous_batching_config: acb's or transformers' ``ContinuousBatchingConfig``.
        workload_hints: transformers' argument; accepted, no effect.

    Returns:
        A :class:`ContinuousBatchingManager` (call ``start()``).
    """
    return ContinuousBatchingManager(model, generation_config, continuous_batching_config, workload_hints)
