"""Tensor parallel under ``torchrun``: see :mod:`acb.runner.tp_sync`, where the step sync lives
beside the runner that uses it (the engine's layers import downward only); its names are
re-exported here, the scale-out package's home for them. A follower rank's own job is here:
:func:`is_tp_follower` says whether this process is one, :func:`follow` runs it (``acb serve``
and ``acb generate`` under ``torchrun``)."""

from __future__ import annotations

import signal
from typing import Any

from acb.runner.tp_sync import (
    FRAME_BYTES,
    StepSync,
    agree_min,
    check_same_settings,
    decode_commands,
    encode_commands,
    tp_group,
    tp_size_of,
)

__all__ = [
    "FRAME_BYTES",
    "StepSync",
    "agree_min",
    "check_same_settings",
    "decode_commands",
    "encode_commands",
    "follow",
    "is_tp_follower",
    "tp_group",
    "tp_size_of",
]


def is_tp_follower(model: Any) -> bool:
    """Whether this process is a tensor-parallel rank other than its group's first (whose engine
    follows the leader's).

    Args:
        model: the loaded model.

    Returns:
        True on a follower rank; False on the leader or without tensor parallelism.
    """
    group = tp_group(model)
    if group is None:
        return False
    import torch.distributed as dist

    return bool(dist.get_rank() != dist.get_process_group_ranks(group)[0])


def follow(model: Any, config: Any, tokenizer: Any) -> None:
    """A follower rank's whole job: run the leader's requests in lock step until it stops (with
    the tokenizer: the leader's stop strings end a request on every rank at the same token).

    Args:
        model: this rank's shard of the model.
        config: the engine's ``ContinuousBatchingConfig`` (the leader's settings).
        tokenizer: the tokenizer, or None.

    Raises:
        RuntimeError: the tensor-parallel engine died.
    """
    from acb.api.engine import Engine

    # torchrun passes SIGTERM (and a terminal's Ctrl-C reaches every rank): the leader stops the
    # engines of all ranks, so a follower leaving on its own would only break the leader's step
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    engine = Engine(model, config, tokenizer=tokenizer)
    engine.start()
    engine.join()
    if engine.core is not None and engine.core.dead_error is not None:
        raise RuntimeError(f"the tensor-parallel engine died: {engine.core.dead_error!r}")
