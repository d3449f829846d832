"""Host-to-device staging of each step's inputs, double-buffered, and the device block table.

A step's host arrays (ids, positions, slot mapping, sampling rows and parameters, block-table
updates, ...) are packed into one pinned staging buffer and sent with **one** host-to-device
copy on the copy stream; the compute stream waits for that copy with an event. There are two
staging sets, used alternately, so step N+1 is packed and copied while step N computes:

* a set's host buffer is rewritten only after its previous copy finished (``copied`` event;
  by then it is two steps old, so the wait is normally free);
* a set's device buffer is overwritten only after the compute that read it finished (the copy
  stream waits for the ``consumed`` event recorded on the compute stream).

The block table lives on the device (one row per block-table row, plus one all-zero row,
:attr:`InputBatch.scratch_row`, for padded rows, which then read scratch block 0). The
scheduler's ``block_updates`` reach it as a scatter of the staged (index, block) pairs; a step
gathers its own rows. A host copy is kept to compute slot mappings with numpy (no device
round trip). No Python loop over tokens.

On CPU the same bookkeeping runs synchronously (no pinned memory, no streams, events that are
complete at once), so CI exercises it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from acb.core.messages import SchedulerOutput
from acb.runner.attention import BatchInputs

_ALIGN = 16  # bytes; every staged array starts aligned, so byte views can be re-typed
_TORCH_DTYPE = {np.int64: torch.int64, np.float32: torch.float32, np.bool_: torch.bool, np.int32: torch.int32}
# Host fast paths (issue 54, item 5): a staging layout's device views made once and reused, and a
# decode-only step's arrays computed without the general path's repeats and cumsums. False runs
# the general path every step (benchmarks' A/B; results are the same either way).
REUSE = True
_MAX_LAYOUTS = 32  # layouts remembered per staging set (mixed steps' shapes vary; decode ones repeat)


class _DoneEvent:
    """A CPU stand-in for ``torch.cuda.Event``: work on CPU is synchronous, so it is always complete."""

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class DeviceStreams:
    """The compute stream (the current one), a host-to-device copy stream and a
    device-to-host copy stream, with events ordering them. ``None`` streams on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.compute = torch.cuda.current_stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None

    def event(self) -> torch.cuda.Event | _DoneEvent:
        return torch.cuda.Event() if self.cuda else _DoneEvent()


class StagingSet:
    """One of the two staging sets: a host buffer (pinned on CUDA) and a device buffer, both bytes."""

    def __init__(self, index: int, capacity: int, device: torch.device, streams: DeviceStreams) -> None:
        self.index = index
        self.device = device
        self.streams = streams
        self.capacity = 0
        self.copied = streams.event()  # host buffer free again once this completes
        self.consumed = streams.event()  # device buffer free again once this completes
        self.uses = 0  # steps staged through this set (tests read it)
        self._arrays: list[tuple[str, np.ndarray]] = []
        # (name, dtype, shape) of each queued array -> (offsets, bytes, device views): a step shaped
        # like an earlier one (every decode step of a batch) reuses its views (about 3 torch calls
        # an array)
        self._layouts: dict[
            tuple[tuple[str, str, tuple[int, ...]], ...], tuple[list[int], int, dict[str, torch.Tensor]]
        ] = {}
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        if self.capacity:  # rare: wait for every copy and compute using the old buffers
            self.copied.synchronize()
            self.consumed.synchronize()
        self.capacity = capacity
        self._layouts = {}  # their views are of the old device buffer
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.streams.cuda)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        h2d, compute = self.streams.h2d, self.streams.compute
        if h2d is not None and compute is not None:  # CUDA
            # the allocator may hand back memory that kernels queued on the compute stream still
            # use (it orders reuse on the allocating stream only); the copy stream writes it
            h2d.wait_stream(compute)

    def add(self, name: str, array: np.ndarray) -> None:
        """Queue a host array (int64, float32 or bool) for this step's copy."""
        self._arrays.append((name, np.ascontiguousarray(array)))

    def send(self) -> dict[str, torch.Tensor]:
        """Pack the queued arrays, copy them to the device in one transfer on the copy stream,
        make the compute stream wait for it, and return device views by name."""
        arrays = self._arrays
        key = tuple((name, a.dtype.char, a.shape) for name, a in arrays)
        known = self._layouts.get(key) if REUSE else None
        if known is not None:
            offsets, total, views = known
        else:
            offsets = []
            off = 0
            for _, a in arrays:
                offsets.append(off)
                off += -(-a.nbytes // _ALIGN) * _ALIGN
            total = max(off, _ALIGN)
            if total > self.capacity:
                self._grow(max(total, 2 * self.capacity))
        self.copied.synchronize()  # the previous copy out of this host buffer is done (two steps ago)
        buf = self.host_np
        for (_, a), o in zip(arrays, offsets):
            buf[o : o + a.nbytes] = a.reshape(-1).view(np.uint8)
        s = self.streams
        if s.cuda:
            h2d, compute = s.h2d, s.compute
            assert h2d is not None and compute is not None  # the streams exist on CUDA
            # the events are torch.cuda.Events here; their type also allows the CPU stand-in
            with torch.cuda.stream(h2d):
                # the device buffer's last reader is done
                h2d.wait_event(self.consumed)  # type: ignore[arg-type]
                self.dev[:total].copy_(self.host[:total], non_blocking=True)
                self.copied.record(h2d)
            compute.wait_event(self.copied)  # type: ignore[arg-type]
        else:
            self.dev[:total].copy_(self.host[:total])
        if known is None:
            views = {}
            for (name, a), o in zip(arrays, offsets):
                dtype = _TORCH_DTYPE[a.dtype.type]
                views[name] = self.dev[o : o + a.nbytes].view(dtype).view(a.shape)
            if REUSE:
                if len(self._layouts) >= _MAX_LAYOUTS:
                    self._layouts.clear()
                self._layouts[key] = (offsets, total, views)
        self._arrays = []
        self.uses += 1
        return dict(views)  # (a copy: the cached one stays as made)

    def release(self) -> None:
        """Mark, on the compute stream, the point after which this set's device views are unused."""
        if self.streams.cuda:
            self.consumed.record(self.streams.compute)


class StagingRing:
    """The two staging sets, handed out alternately (step N uses set N % 2)."""

    def __init__(self, capacity: int, device: torch.device, streams: DeviceStreams) -> None:
        self.sets = [StagingSet(i, capacity, device, streams) for i in range(2)]
        self._next = 0

    def begin(self) -> StagingSet:
        s = self.sets[self._next]
        self._next ^= 1
        return s


@dataclass
class LoraRows:
    """A step's LoRA rows (``acb.runner.lora``): the flattened batch's tokens of requests with an
    adapter, sorted by slot (stable), on the device; and, on the host, the runs of equal slots.
    A step of one token a request also has every token's slot (``per_token``: what a decode
    graph's static slot row takes, ``acb.runner.cuda_graphs``)."""

    order: torch.Tensor  # [n] long: token indices into the step's T tokens
    slots: torch.Tensor  # [n] long: each one's slot (1..max_loras)
    runs: list[tuple[int, int, int]]  # (slot, start in order, count), slots ascending
    num_tokens: int  # T
    per_token: torch.Tensor | None = None  # [T] long: each token's slot (0: none); one token a request only


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long
    logits_indices: torch.Tensor  # [S] long: rows of the flattened batch that sample
    attn: BatchInputs
    rows: torch.Tensor  # [B] long: block-table rows of the scheduled sequences
    decode_only: bool
    logits_identity: bool = False  # sequence i samples row i, once each (logits_indices is arange(B))
    # [1, T, D]: the token embeddings with image rows put in (acb.runner.media), or None
    inputs_embeds: torch.Tensor | None = None
    lora: LoraRows | None = None  # the adapter rows, when any request of the step has an adapter


class InputBatch:
    """The block table (host copy and device copy) and the per-step input arrays."""

    def __init__(
        self, max_rows: int, max_blocks_per_seq: int, block_size: int, device: torch.device, lora: bool = False
    ) -> None:
        self.block_size = block_size
        self.lora = lora  # stage each step's per-token LoRA slots (max_loras > 0)
        self.device = device
        self.scratch_row = max_rows  # all zeros: padded rows read scratch block 0
        self.block_table = np.zeros((max_rows + 1, max_blocks_per_seq), dtype=np.int64)
        self.block_table_dev = torch.zeros((max_rows + 1, max_blocks_per_seq), dtype=torch.long, device=device)
        self._aranges: dict[int, np.ndarray] = {}  # B -> arange(B + 1): a decode step's qsl (read-only)

    def stage(self, out: SchedulerOutput, st: StagingSet) -> _HostBatch:
        """Compute the step's host arrays and queue them on ``st``."""
        bs = self.block_size
        bt = self.block_table
        cols = bt.shape[1]
        upd_idx, upd_val = [], []
        for row, col, blocks in out.block_updates:
            bt[row, col : col + len(blocks)] = blocks
            upd_idx.append(np.arange(row * cols + col, row * cols + col + len(blocks), dtype=np.int64))
            upd_val.append(np.asarray(blocks, dtype=np.int64))
        n = len(out.num_new)
        if REUSE and n and len(out.input_ids) == n and max(out.num_new) == 1:
            return self._stage_decode(out, st, upd_idx, upd_val)
        num_new = np.asarray(out.num_new, dtype=np.int64)
        start = np.asarray(out.start_pos, dtype=np.int64)
        seq_lens = start + num_new
        qsl = np.zeros(len(num_new) + 1, dtype=np.int64)
        np.cumsum(num_new, out=qsl[1:])
        total = int(qsl[-1])
        seq_of_tok = np.repeat(np.arange(len(num_new)), num_new)
        positions = np.arange(total, dtype=np.int64) + np.repeat(start - qsl[:-1], num_new)
        rows = np.asarray(out.rows, dtype=np.int64)
        slots = bt[rows[seq_of_tok], positions // bs] * bs + positions % bs
        logits_idx = qsl[1:][np.asarray(out.sample_idx, dtype=np.int64)] - 1  # may repeat (n > 1)
        st.add("input_ids", np.asarray(out.input_ids, dtype=np.int64))
        st.add("positions", positions)
        st.add("slots", slots)
        st.add("logits_idx", logits_idx)
        st.add("seq_lens", seq_lens)
        st.add("qsl", qsl)
        st.add("rows", rows)
        self._stage_rest(out, st, upd_idx, upd_val)
        identity = len(out.sample_idx) == len(num_new) and out.sample_idx == list(range(len(num_new)))
        runs = self._stage_lora(out, st, num_new) if self.lora else None
        return _HostBatch(out.num_new, out.start_pos, int(seq_lens.max()), total == len(num_new), identity, runs)

    def _stage_decode(
        self, out: SchedulerOutput, st: StagingSet, upd_idx: list[np.ndarray], upd_val: list[np.ndarray]
    ) -> _HostBatch:
        """:meth:`stage` for a decode-only step (one query token a row): the same arrays, with no
        cumsum or repeat (token i is row i, at position ``start_pos[i]``)."""
        n = len(out.num_new)
        ar = self._aranges.get(n)
        if ar is None:
            ar = self._aranges[n] = np.arange(n + 1, dtype=np.int64)
        bs = self.block_size
        start = np.asarray(out.start_pos, dtype=np.int64)
        rows = np.asarray(out.rows, dtype=np.int64)
        identity = len(out.sample_idx) == n and out.sample_idx == list(range(n))
        st.add("input_ids", np.asarray(out.input_ids, dtype=np.int64))
        st.add("positions", start)
        st.add("slots", self.block_table[rows, start // bs] * bs + start % bs)
        st.add("logits_idx", ar[:n] if identity else np.asarray(out.sample_idx, dtype=np.int64))
        st.add("seq_lens", start + 1)
        st.add("qsl", ar)
        st.add("rows", rows)
        self._stage_rest(out, st, upd_idx, upd_val)
        runs = self._stage_lora(out, st, None) if self.lora else None
        return _HostBatch(out.num_new, out.start_pos, max(out.start_pos) + 1, True, identity, runs)

    @staticmethod
    def _stage_lora(
        out: SchedulerOutput, st: StagingSet, num_new: np.ndarray | None
    ) -> list[tuple[int, int, int]] | None:
        """The per-token LoRA slot index (``num_new`` None: one token a request): the tokens of
        requests with an adapter, sorted by slot, and their slots; None when the step has none
        (then the interceptions return the base output at once). A step of one token a request
        also sends every token's slot (``lora_tok``: a decode graph's static slot row)."""
        slots = np.fromiter((r.lora_slot for r in out.requests), dtype=np.int64, count=len(out.requests))
        if not slots.any():
            return None
        tok = slots if num_new is None else np.repeat(slots, num_new)
        if tok.shape[0] == slots.shape[0]:
            st.add("lora_tok", tok)
        order = np.argsort(tok, kind="stable")
        order = order[int((tok == 0).sum()) :]
        tok_slots = tok[order]
        uniq, starts, counts = np.unique(tok_slots, return_index=True, return_counts=True)
        st.add("lora_order", order.astype(np.int64))
        st.add("lora_slot", tok_slots)
        return list(zip(uniq.tolist(), starts.tolist(), counts.tolist()))

    @staticmethod
    def _stage_rest(out: SchedulerOutput, st: StagingSet, upd_idx: list[np.ndarray], upd_val: list[np.ndarray]) -> None:
        if upd_idx:
            st.add("bt_idx", np.concatenate(upd_idx))
            st.add("bt_val", np.concatenate(upd_val))
        if out.placeholders:
            ph = np.asarray(out.placeholders, dtype=np.int64)
            st.add("ph_at", ph[:, 0])
            st.add("ph_src", ph[:, 1])

    def build(self, host: _HostBatch, dev: dict[str, torch.Tensor], prev_ids: torch.Tensor) -> PreparedBatch:
        """Device side (compute stream): apply block-table updates, fill placeholders, gather rows."""
        if "bt_idx" in dev:
            self.block_table_dev.view(-1).index_copy_(0, dev["bt_idx"], dev["bt_val"])
        input_ids = dev["input_ids"]
        if "ph_at" in dev:  # async batching: tokens sampled by the previous step, taken on the device
            input_ids.index_copy_(0, dev["ph_at"], prev_ids.index_select(0, dev["ph_src"]))
        cols = -(-host.max_seq_len // self.block_size)
        attn = BatchInputs(
            slot_mapping=dev["slots"],
            block_table=self.block_table_dev[:, :cols].index_select(0, dev["rows"]),
            seq_lens=dev["seq_lens"],
            query_start_loc=dev["qsl"],
            num_new=host.num_new,
            start_pos=host.start_pos,
            max_seq_len=host.max_seq_len,
        )
        return PreparedBatch(
            input_ids=input_ids[None],
            position_ids=dev["positions"][None],
            logits_indices=dev["logits_idx"],
            attn=attn,
            rows=dev["rows"],
            decode_only=host.decode_only,
            logits_identity=host.logits_identity,
            lora=None
            if host.lora_runs is None
            else LoraRows(
                dev["lora_order"], dev["lora_slot"], host.lora_runs, int(input_ids.shape[0]), dev.get("lora_tok")
            ),
        )


@dataclass
class _HostBatch:
    num_new: list[int]
    start_pos: list[int]
    max_seq_len: int
    decode_only: bool
    logits_identity: bool
    lora_runs: list[tuple[int, int, int]] | None = None  # LoRA: (slot, start, count) of the adapter rows
