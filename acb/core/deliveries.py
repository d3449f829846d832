"""What the callers receive: each step's :class:`Delivery` per request, and the final outputs.

Engine thread only. A request's new token (with its logprobs, and the text it completes when
the engine decodes it for stop strings) is one :class:`Delivery` per sample per step; an
outcome rides on its sink's last item of the step, after every sample's token. A request of a
group (``n > 1``, scoring groups) has no outcome of its own: the group's is delivered once, when
its last member ended. Building a final output releases the request ids it covers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from acb.core.messages import Delivery
from acb.core.request import Request
from acb.outputs import FailureKind, FinishReason, GenerationOutput, RequestStatus

__all__ = ["DeliveryBuilder"]


class DeliveryBuilder:
    """Builds the deliveries of the engine's steps and the requests' final outputs."""

    def __init__(self, release_id: Callable[[str], None]) -> None:
        """Args:
        release_id: gives a request id back once its final output is built.
        """
        self._release_id = release_id

    def final_of(self, req: Request) -> GenerationOutput | None:
        """The final output to deliver now that ``req`` ended; releases the ids it covers.

        Args:
            req: a request that ended.

        Returns:
            Its own output, or its group's once all samples ended (None before that, and after
            the group's was delivered).
        """
        group = req.group
        if group is None:
            self._release_id(req.request_id)
            return req.to_output()
        if group.delivered or not group.done:
            return None
        group.delivered = True
        for m in group.members:
            self._release_id(m.request_id)
        return group.to_output()

    def step(self, progressed: list[Request], scored: list[Request]) -> tuple[list[Delivery], int]:
        """The deliveries of one step's recorded output.

        Args:
            progressed: the samples that received a token this step
                (``Scheduler.update_from_output``), in sample order.
            scored: the scoring requests whose prompt this step completed.

        Returns:
            The deliveries, and how many tokens were recorded (a grammar's dead end records none).
        """
        items: list[Delivery] = []
        ended: list[Request] = []
        recorded = len(progressed)
        for req in progressed:  # the step's one loop over its samples: positional, no keywords
            out = req.out
            if req.finish_reason is FinishReason.GRAMMAR:  # its grammar could not go on: no token was recorded
                recorded -= 1
                items.append(
                    Delivery(
                        out.key, [], None, None, req.sample_index, None, None if req.detok is None else out.new_text
                    )
                )
                ended.append(req)
                continue
            lp = top = None
            if req.want_logprobs:
                lp = [out.logprobs[-1]]
                top = [out.top_logprobs[-1]] if out.top_logprobs else None
            if req.detok is None:
                items.append(Delivery(out.key, [req.token_ids[-1]], lp, top, req.sample_index))
            else:  # the text its token completes, decoded here for its stop strings
                items.append(Delivery(out.key, [req.token_ids[-1]], lp, top, req.sample_index, None, out.new_text))
            if req.status.is_terminal:
                ended.append(req)
        if ended:  # an outcome rides on its sink's last item of the step (after every sample's token)
            last = {d.key: i for i, d in enumerate(items)}
            for req in ended:
                final = self.final_of(req)
                if final is not None:
                    i = last[req.out.key]
                    items[i] = items[i]._replace(final=final)
        for req in scored:  # scoring requests end with no token of their own
            if req.status == RequestStatus.FINISHED:  # (not cancelled meanwhile)
                final = self.final_of(req)
                if final is not None:
                    items.append(Delivery(req.out.key, [], final=final))
        return items, recorded

    def finals(self, reqs: Iterable[Request]) -> list[Delivery]:
        """The outcome-only deliveries of requests that ended outside a step's output.

        Args:
            reqs: the requests (cancelled, failed, or ended unscheduled).

        Returns:
            One delivery per final output due (a group's once).
        """
        items: list[Delivery] = []
        for req in reqs:
            final = self.final_of(req)
            if final is not None:
                items.append(Delivery(req.out.key, [], final=final))
        return items

    @staticmethod
    def dead_output(req: Request, msg: str) -> GenerationOutput:
        """The bare failed output of a request whose own could not be built as the engine died.

        Args:
            req: the request.
            msg: the error.

        Returns:
            A FAILED output with its prompt and the error, nothing that can fail to build.
        """
        return GenerationOutput(
            request_id=req.group.request_id if req.group else req.request_id,
            prompt_ids=req.token_ids[: req.prompt_len],
            status=RequestStatus.FAILED,
            finish_reason=FinishReason.ERROR,
            error=msg,
            failure=FailureKind.ENGINE_DEAD,
        )
