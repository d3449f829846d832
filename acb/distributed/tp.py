"""Tensor parallel under ``torchrun``: see :mod:`acb.runner.tp_sync`, where the step sync lives
beside the runner that uses it (the engine's layers import downward only); its names are
re-exported here, the scale-out package's home for them."""

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
    "tp_group",
    "tp_size_of",
]
