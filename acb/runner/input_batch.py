"""Host-side preparation of one flattened batch: positions, slot mapping, block table rows.

The block table is persistent (one row per running request, updated by the scheduler's
``block_updates``), so a step copies only what changed. Everything here is vectorised numpy:
no Python loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from acb.core.scheduler import SchedulerOutput
from acb.runner.attention import BatchInputs


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long
    logits_indices: torch.Tensor  # [S] long: rows of the flattened batch that sample
    attn: BatchInputs


class InputBatch:
    def __init__(self, max_rows: int, max_blocks_per_seq: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.block_table = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int64)

    def prepare(self, out: SchedulerOutput) -> PreparedBatch:
        bs = self.block_size
        bt = self.block_table
        for row, col, blocks in out.block_updates:
            bt[row, col : col + len(blocks)] = blocks
        num_new = np.asarray(out.num_new, dtype=np.int64)
        start = np.asarray(out.start_pos, dtype=np.int64)
        seq_lens = start + num_new
        qsl = np.zeros(len(num_new) + 1, dtype=np.int64)
        np.cumsum(num_new, out=qsl[1:])
        total = int(qsl[-1])
        seq_of_tok = np.repeat(np.arange(len(num_new)), num_new)
        positions = np.arange(total, dtype=np.int64) + np.repeat(start - qsl[:-1], num_new)
        max_seq_len = int(seq_lens.max())
        rows = bt[np.asarray(out.rows, dtype=np.int64), : -(-max_seq_len // bs)]  # [B, cols]
        slots = rows[seq_of_tok, positions // bs] * bs + positions % bs
        logits_idx = qsl[1:][np.asarray(out.sample_idx, dtype=np.int64)] - 1  # may repeat (n > 1)

        dev = self.device

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)

        attn = BatchInputs(
            slot_mapping=t(slots),
            block_table=t(np.ascontiguousarray(rows)),
            seq_lens=t(seq_lens),
            query_start_loc=t(qsl),
            num_new=out.num_new,
            start_pos=out.start_pos,
            max_seq_len=max_seq_len,
        )
        return PreparedBatch(
            input_ids=t(np.asarray(out.input_ids, dtype=np.int64))[None],
            position_ids=t(positions)[None],
            logits_indices=t(logits_idx),
            attn=attn,
        )
