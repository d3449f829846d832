"""The inbox's commands as tensor parallelism sends them from the leader to the other ranks:
plain values (tuples of ints, strings, lists, dicts; no futures or objects), which
:mod:`acb.runner.tp_sync` encodes into byte frames. An ``Add`` is its :class:`EngineRequest`'s
fields, with the leader's resolved sampling parameters, seeds and stop ids, so every rank builds
the same request state."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from acb.core.messages import (
    Add,
    Cancel,
    Command,
    EngineRequest,
    Pause,
    ResetPrefix,
    Resume,
    ScoreTarget,
    Sleep,
    Stop,
    Wake,
)
from acb.sampling_params import SamplingParams
from acb.structured_outputs import StructuredOutputs

__all__ = ["from_wire", "to_wire"]


def _plain(value: Any) -> Any:
    """A SamplingParams field as the wire carries it (a StructuredOutputs spec as its dict)."""
    return value.to_dict() if isinstance(value, StructuredOutputs) else value


def _target_wire(t: ScoreTarget) -> list[Any]:
    return [list(t.prompt_ids), t.lp_start, None if t.next_tokens is None else list(t.next_tokens)]


def to_wire(cmd: Command) -> tuple[Any, ...]:
    """A command as the other ranks receive it."""
    match cmd:
        case Add(req):
            score = None if req.score is None else [_target_wire(t) for t in (req.score, *req.children)]
            return (
                "add",
                req.request_id,
                list(req.prompt_ids),
                [_plain(getattr(req.params, f.name)) for f in dataclasses.fields(req.params)],
                req.max_new_tokens,
                sorted(req.stop_token_ids),
                req.seed,
                req.n,
                req.record_timestamps,
                req.cache_salt,
                score,
                req.lora_slot,
            )
        case Cancel(request_id):
            return ("cancel", request_id)
        case Stop(drain):
            return ("stop", drain)
        case Pause(mode, _):
            return ("pause", mode)
        case Resume():
            return ("resume",)
        case ResetPrefix():
            return ("reset_prefix",)
        case Sleep():
            return ("sleep",)
        case Wake():
            return ("wake",)
    raise ValueError(f"{cmd!r} is not sent to the other ranks")


def from_wire(wire: tuple[Any, ...]) -> Command:
    """The command a follower applies for the leader's ``wire`` (its sink key is -1: a follower
    delivers nowhere; its futures are its own)."""
    kind = wire[0]
    if kind == "add":
        _, rid, prompt, values, max_new, stop_ids, seed, n, stamps, salt, score, lora_slot = wire
        params = SamplingParams(**dict(zip((f.name for f in dataclasses.fields(SamplingParams)), values)))
        targets = [ScoreTarget(tuple(p), start, None if nxt is None else tuple(nxt)) for p, start, nxt in score or ()]
        return Add(
            EngineRequest(
                rid,
                -1,
                tuple(prompt),
                params,
                max_new,
                frozenset(stop_ids),
                seed,
                n,
                time.perf_counter(),
                stamps,
                salt,
                targets[0] if targets else None,
                tuple(targets[1:]),
                lora_slot=lora_slot,
            )
        )
    simple: dict[str, Callable[[], Command]] = {
        "cancel": lambda: Cancel(wire[1]),
        "stop": lambda: Stop(wire[1]),
        "pause": lambda: Pause(wire[1], Future()),
        "resume": lambda: Resume(Future()),
        "reset_prefix": lambda: ResetPrefix(Future()),
        "sleep": lambda: Sleep(Future()),
        "wake": lambda: Wake(Future()),
    }
    return simple[kind]()
