"""Tensor parallel: the engine threads of a tensor-parallel model's ranks kept in lock step.

A model loaded with ``from_pretrained(..., tp_plan="auto")`` under ``torchrun`` holds a slice of
every attention and MLP layer on each rank, and every forward is collective (all-reduces inside
the row-parallel layers): every rank must run every step with identical inputs. acb does not
send the steps; it makes the ranks' engines identical. Every rank runs the same scheduler over the
same requests, and the first rank of the tensor-parallel group (the *leader*) is the only one that
takes requests from callers. Once per loop iteration the leader broadcasts what it applied since
the last one (new requests, cancellations, stop, pause, sleep, a prefix-cache reset) as one
packed byte frame on a dedicated gloo group; the followers apply the same commands in the same
order. The scheduler is deterministic and the logits are replicated (bit-identical on every
rank), so samples, preemptions, prefix-cache hits and offloads agree without being sent.

The frame is :data:`FRAME_BYTES` long; an iteration whose commands do not fit (large prompts)
sends the rest in a second broadcast of the size the first announced. An idle leader sends an
empty frame every second (``acb.core.engine_core.HEARTBEAT_S``), so a follower waiting in the broadcast can tell a
quiet leader from a dead one (the group's timeout, ``ACB_TP_TIMEOUT_S``, default 300 s).

Requests travel as their token ids and their fully resolved :class:`~acb.SamplingParams` (the
seed drawn on the leader included), encoded field by field into the frame (no pickling).

Lock step needs the same engine settings on every rank: at start the runner compares the ranks'
resolved settings (:func:`check_same_settings`, one all-gather) and every rank refuses to start,
naming each setting that differs, rather than abort later in a mismatched collective.
"""

from __future__ import annotations

import os
import struct
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    import torch.distributed as dist_t

FRAME_BYTES = 4096


def tp_size_of(model: Any) -> int:
    """The model's tensor-parallel degree (1 when it was not sharded)."""
    return int(getattr(model, "_tp_size", None) or 1)


def tp_group(model: Any) -> dist_t.ProcessGroup | None:
    """The process group of the model's tensor-parallel ranks (None without tensor parallelism)."""
    if tp_size_of(model) <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return dist.group.WORLD
    return mesh["tp"].get_group() if "tp" in (mesh.mesh_dim_names or ()) else mesh.get_group()


def agree_min(group: dist_t.ProcessGroup, values: list[int]) -> list[int]:
    """The element-wise minimum of ``values`` over the group's ranks (sizes every rank can hold)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_cpu_group(group))
    return [int(v) for v in t.tolist()]


# ResolvedConfig fields that may differ between ranks: the device, the cache's bytes (the
# block count is agreed), and what only the leader's front reads (its admission queue, the
# seeds it draws, the logprob defaults it resolves requests with before they are sent)
PER_RANK_SETTINGS = frozenset({"device", "kv_cache_bytes", "seed", "max_queue_size", "return_logprobs"})
# the ContinuousBatchingConfig field behind a resolved setting, where the names differ
_CONFIG_FIELD = {
    "block_size": "page_size",
    "async_batching": "use_async_batching",
    "prefix_caching": "allow_block_sharing",
    "cuda_graphs": "use_cuda_graph",
    "graph_step": "q_padding_interval_size",
    "num_swap_blocks": "cpu_offload_space",
    "packed_linears": "cpu_packed_linears",
}


def check_same_settings(group: dist_t.ProcessGroup, settings: Any) -> None:
    """Refuse to run when the ranks' engines resolved different settings.

    Every rank runs the same schedule from the same commands, so a setting that shapes the
    schedule or the step (``max_batch_tokens``, ``max_requests_per_batch``, async batching, the
    block size, the decode graphs, ...) must be the same on every rank; otherwise the ranks'
    forwards stop matching and the model's collectives fail (gloo aborts the process) or hang. ``settings``: this rank's :class:`~acb.config.ResolvedConfig` (or a mapping of
    setting names to plain values); :data:`PER_RANK_SETTINGS` are left out. One all-gather of
    one frame on the group's gloo twin, before any step; every rank then raises the same
    ``ValueError``, naming each differing setting and its value on every rank.
    """
    import torch.distributed as dist

    mine = {k: v for k, v in _as_mapping(settings).items() if k not in PER_RANK_SETTINGS}
    out = bytearray()
    _put(out, mine)
    data = bytes(out)
    if len(data) > FRAME_BYTES - 8:
        raise ValueError(f"the engine settings take {len(data)} bytes encoded, more than a frame holds")
    frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    view = frame.numpy()
    view[:8] = np.frombuffer(struct.pack("<q", len(data)), dtype=np.uint8)
    view[8 : 8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    cpu = _cpu_group(group)
    frames = [torch.empty_like(frame) for _ in range(dist.get_world_size(cpu))]
    dist.all_gather(frames, frame, group=cpu)
    ranks = dist.get_process_group_ranks(group)
    every = []
    for f in frames:
        (n,) = struct.unpack("<q", f.numpy()[:8].tobytes())
        every.append(_get(memoryview(f.numpy()[8 : 8 + n].tobytes()), 0)[0])
    names = sorted({k for s in every for k in s}, key=lambda k: (k not in mine, k))
    differing = [k for k in names if any(s.get(k, _MISSING) != every[0].get(k, _MISSING) for s in every)]
    if differing:

        def show(k: str) -> str:
            field = _CONFIG_FIELD.get(k)
            values = ", ".join(f"{s.get(k, '(unset)')!r} on rank {r}" for r, s in zip(ranks, every))
            return f"{k}{f' (ContinuousBatchingConfig.{field})' if field else ''}: {values}"

        raise ValueError(
            "the tensor-parallel ranks' engines were started with different settings; every rank "
            "runs the same steps, so give each the same ContinuousBatchingConfig. Differing: "
            + "; ".join(show(k) for k in differing)
        )


_MISSING = object()


def _as_mapping(settings: Any) -> dict[str, Any]:
    import dataclasses

    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    return dict(settings)


_CPU_GROUPS: dict[Any, Any] = {}


def _cpu_group(group: dist_t.ProcessGroup) -> dist_t.ProcessGroup:
    """A gloo group over ``group``'s ranks (the model's may be NCCL): host tensors, its own timeout."""
    import torch.distributed as dist

    found = _CPU_GROUPS.get(group)
    if found is None:
        ranks = dist.get_process_group_ranks(group)
        timeout = timedelta(seconds=float(os.environ.get("ACB_TP_TIMEOUT_S", "300")))
        found = _CPU_GROUPS[group] = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    return found


# ---------------------------------------------------------------- encoding
# a tagged, self-describing encoding of the plain values a command holds
_NONE, _FALSE, _TRUE, _INT, _FLOAT, _STR, _SEQ, _MAP = range(8)


def _put(out: bytearray, v: Any) -> None:
    if v is None:
        out.append(_NONE)
    elif isinstance(v, bool):
        out.append(_TRUE if v else _FALSE)
    elif isinstance(v, int):
        out.append(_INT)
        out += struct.pack("<q", v)
    elif isinstance(v, float):
        out.append(_FLOAT)
        out += struct.pack("<d", v)
    elif isinstance(v, str):
        b = v.encode()
        out.append(_STR)
        out += struct.pack("<I", len(b))
        out += b
    elif isinstance(v, (list, tuple)):
        out.append(_SEQ)
        out += struct.pack("<I", len(v))
        for x in v:
            _put(out, x)
    elif isinstance(v, dict) or hasattr(v, "items"):
        items = list(v.items())
        out.append(_MAP)
        out += struct.pack("<I", len(items))
        for k, x in items:
            _put(out, k)
            _put(out, x)
    else:
        raise TypeError(f"cannot send a {type(v).__name__} to the other tensor-parallel ranks")


def _get(buf: memoryview, i: int) -> tuple[Any, int]:
    tag = buf[i]
    i += 1
    if tag == _NONE:
        return None, i
    if tag in (_FALSE, _TRUE):
        return tag == _TRUE, i
    if tag == _INT:
        return struct.unpack_from("<q", buf, i)[0], i + 8
    if tag == _FLOAT:
        return struct.unpack_from("<d", buf, i)[0], i + 8
    (n,) = struct.unpack_from("<I", buf, i)
    i += 4
    if tag == _STR:
        return bytes(buf[i : i + n]).decode(), i + n
    if tag == _SEQ:
        seq = []
        for _ in range(n):
            x, i = _get(buf, i)
            seq.append(x)
        return tuple(seq), i
    if tag == _MAP:
        m = {}
        for _ in range(n):
            k, i = _get(buf, i)
            m[k], i = _get(buf, i)
        return m, i
    raise ValueError(f"corrupt command frame (tag {tag})")


def encode_commands(cmds: list[tuple]) -> bytes:
    out = bytearray()
    _put(out, cmds)
    return bytes(out)


def decode_commands(data: bytes) -> list[tuple]:
    cmds, _ = _get(memoryview(data), 0)
    return [tuple(c) for c in cmds]


# ------------------------------------------------------------------- sync
class StepSync:
    """One rank's end of the per-iteration command broadcast (see the module docstring)."""

    def __init__(self, group: dist_t.ProcessGroup) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = _cpu_group(group)
        ranks = dist.get_process_group_ranks(group)
        self.leader_rank = ranks[0]
        self.rank = dist.get_rank()
        self.is_leader = self.rank == self.leader_rank
        self.world = len(ranks)
        self._frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        self.broadcasts = 0  # collectives issued (tests, and the overhead benchmark)
        self.bytes_sent = 0

    def exchange(self, cmds: list[tuple] | None) -> list[tuple]:
        """Leader: send ``cmds`` (applied already); followers: receive the leader's. One
        broadcast when they fit a frame, two when they do not."""
        frame = self._frame
        view = frame.numpy()
        if self.is_leader:
            data = encode_commands(cmds or []) if cmds else b""
            view[:8] = np.frombuffer(struct.pack("<q", len(data)), dtype=np.uint8)
            head = min(len(data), FRAME_BYTES - 8)
            view[8 : 8 + head] = np.frombuffer(data[:head], dtype=np.uint8)
            self._bcast(frame)
            if len(data) > head:
                self._bcast(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8))
            self.bytes_sent += len(data)
            return cmds or []
        self._bcast(frame)
        (n,) = struct.unpack("<q", view[:8].tobytes())
        if n == 0:
            return []
        head = min(n, FRAME_BYTES - 8)
        data = view[8 : 8 + head].tobytes()
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8)
            self._bcast(rest)
            data += rest.numpy().tobytes()
        return decode_commands(data)

    def _bcast(self, t: torch.Tensor) -> None:
        self._dist.broadcast(t, src=self.leader_rank, group=self.group)
        self.broadcasts += 1
