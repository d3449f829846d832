"""Weights from a trainer to rollout servers over ``torch.distributed``: the group, the buckets,
and the handshake that keeps an update all-or-nothing.

The trainer is rank 0 and hosts the group's ``TCPStore`` (:func:`host_store`: one per trainer,
kept for its life, so that joining again never has to bind the port again); each server (each
replica) joins with its own rank (``rank_offset`` + its index). The group is a process group of
its own (gloo on CPU, NCCL on CUDA), built on that store: it never touches a process's default
group, so a server under ``torchrun`` keeps its own.

Each group has a ``group_id`` (the trainer's choice, or the server's when the trainer gives
none): every key the group and its handshake write is under ``acb/<group_id>/``, and every
update names its group, so a server that left one trainer's group for another's refuses the
first one's updates instead of answering them on the second's.

One update, ``seq``-numbered within its group:

1. The trainer asks every server to receive it (``POST /update_weights``: the group id, names,
   dtypes, shapes, the version, the bucket size).
2. Each server checks the names, shapes and dtypes against its model and writes its verdict
   to the store (``"ok"`` or the error).
3. The trainer reads every verdict and writes ``"go"`` if all are ok, else ``"abort"``: then
   nobody receives, every server answers with what was wrong, and the old weights serve.
4. On ``"go"`` the tensors are broadcast from rank 0 (:func:`pieces`): each tensor of at least
   :data:`DIRECT_BYTES` as it is, each run of smaller ones packed into one broadcast. A server
   receives each into its place in a bucket's buffer (:func:`layout`: consecutive tensors, at
   most ``bucket_bytes`` a bucket, each at an aligned offset), stages views of them, then swaps
   them in between two engine steps (on CPU by rebinding the weights to them where they fit: the
   next update then goes into the group's other set of buffers).

A sender that dies or stalls mid-broadcast makes the receive fail (the group's timeout, or the
connection closed): nothing is swapped, the server closes its side of the group and accepts a new
``init_weight_transfer``.
"""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TransferGroup", "buckets", "check_group_id", "dtype_of", "dtype_name", "host_store"]

DEFAULT_BUCKET_BYTES = 256 << 20
# a tensor this large is broadcast on its own, as it is (no packing copy); smaller ones are packed
# into runs (one broadcast each). Fewer, larger broadcasts win over the packing copy here: a push of
# Qwen3-0.6B's shape (8 layers) to one server over gloo on loopback, raw broadcast / push, median
# of 9 alternating rounds, two runs each (benchmarks/weight_push.py, 2026-11-29): 1 MiB 78%, 77%;
# 16 MiB 95%, 87%; 64 MiB 114%, 90%, 84% (the sender's two packing buffers hold a run of up to
# bucket_bytes each)
DIRECT_BYTES = 16 << 20
ALIGN = 16  # each tensor's offset in a bucket's buffer (any dtype views its bytes there)
RECEIVE_AHEAD = 4  # broadcasts a receiver posts ahead (into their places in its buffers)
DEFAULT_TIMEOUT_S = 120.0
MAX_TIMEOUT_S = 3600.0  # the longest a join, a handshake or one bucket may wait
MAX_WORLD_SIZE = 1 << 16
# where a server connects for a trainer's group unless its operator says otherwise
LOOPBACK_HOSTS = ("127.0.0.0/8", "::1")
_GROUP_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_group_id(group_id: object) -> str:
    """``group_id`` if it is one (1 to 64 letters, digits, ``_``, ``.``, ``-``: it names store keys)."""
    if not isinstance(group_id, str) or not _GROUP_ID.fullmatch(group_id):
        raise ValueError(f"group_id must be 1 to 64 letters, digits, '_', '.' or '-'; got {group_id!r}")
    return group_id


def host_store(master_address: str, master_port: int, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Rank 0's ``TCPStore`` on ``master_port`` (it listens there until dropped). It does not wait
    for the others: each group's own rendezvous does."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(master_address, int(master_port), None, True, timeout, wait_for_workers=False)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize


def buckets(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], bucket_bytes: int) -> list[range]:
    """Consecutive tensors (by index) grouped into buckets of at most ``bucket_bytes`` (a larger
    tensor is a bucket of its own); both sides compute the same."""
    out: list[range] = []
    start, size = 0, 0
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        b = nbytes(shape, dtype)
        if i > start and size + b > bucket_bytes:
            out.append(range(start, i))
            start, size = i, 0
        size += b
    if start < len(shapes):
        out.append(range(start, len(shapes)))
    return out


def layout(
    shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], bucket_bytes: int
) -> list[tuple[range, list[int], int]]:
    """Each bucket's tensors (:func:`buckets`), the offset of each in the bucket's buffer (aligned
    to :data:`ALIGN` bytes, so that every tensor can be viewed in its dtype) and the buffer's size."""
    out = []
    for b in buckets(shapes, dtypes, bucket_bytes):
        offsets, at = [], 0
        for i in b:
            at = -(-at // ALIGN) * ALIGN
            offsets.append(at)
            at += nbytes(shapes[i], dtypes[i])
        out.append((b, offsets, at))
    return out


@dataclass(frozen=True)
class Piece:
    """One broadcast of an update: tensors ``tensors`` (consecutive indices) of bucket
    ``bucket``, ``nbytes`` from ``offset`` in its buffer, each at its offset in ``offsets``."""

    bucket: int
    offset: int
    nbytes: int
    tensors: range
    offsets: tuple[int, ...]


def pieces(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], bucket_bytes: int) -> list[Piece]:
    """The broadcasts of an update, in order (both sides compute the same): within each bucket
    (:func:`layout`, the receiver's buffers), each tensor of at least :data:`DIRECT_BYTES` on its
    own (the sender sends it as it is: no copy) and each run of smaller ones as one (packed)."""
    out: list[Piece] = []

    def piece(k: int, run: range, offsets: list[int]) -> None:
        at = [offsets[i - run.start] for i in run]
        end = at[-1] + nbytes(shapes[run[-1]], dtypes[run[-1]])
        out.append(Piece(k, at[0], end - at[0], run, tuple(at)))

    for k, (b, offsets, _) in enumerate(layout(shapes, dtypes, bucket_bytes)):
        first = b.start
        for i in b:
            if nbytes(shapes[i], dtypes[i]) >= DIRECT_BYTES:
                if i > first:
                    piece(k, range(first, i), offsets[first - b.start :])
                piece(k, range(i, i + 1), offsets[i - b.start :])
                first = i + 1
        if first < b.stop:
            piece(k, range(first, b.stop), offsets[first - b.start :])
    return out


@dataclass
class TransferGroup:
    """One side of the trainer-servers group (see the module docstring)."""

    store: Any  # the group's own keys: a torch.distributed.PrefixStore over the trainer's TCPStore
    group: Any  # a ProcessGroupGloo or ProcessGroupNCCL of its own
    rank: int
    world_size: int
    device: torch.device
    group_id: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    # CPU buffers kept for the group's life (see send and receive)
    _send_buffers: list[torch.Tensor] = field(default_factory=list, repr=False)
    _receive_pool: list[list[torch.Tensor]] = field(default_factory=list, repr=False)

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        world_size: int,
        rank: int,
        *,
        group_id: str,
        device: torch.device | str = "cpu",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        store: Any = None,
    ) -> TransferGroup:
        """Join group ``group_id`` (rank 0 with ``store`` from :func:`host_store`, or a new one);
        blocks until every rank joined (at most ``timeout_s``)."""
        import torch.distributed as dist

        check_group_id(group_id)
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            if rank == 0:
                store = host_store(master_address, master_port, timeout_s=timeout_s)
            else:
                store = dist.TCPStore(master_address, int(master_port), None, False, timeout, wait_for_workers=False)
        own = dist.PrefixStore(f"acb/{group_id}", store)
        device = torch.device(device)
        pg: Any
        if device.type == "cuda":
            pg = dist.ProcessGroupNCCL(own, rank, world_size, dist.ProcessGroupNCCL.Options())
        else:
            pg = dist.ProcessGroupGloo(own, rank, world_size, timeout)
        return cls(own, pg, rank, world_size, device, group_id, timeout_s)

    def start_broadcast(self, flat: torch.Tensor) -> Any:
        """Start broadcasting rank 0's ``flat`` (a byte buffer) into every rank's; the work, whose
        ``wait()`` ends it (and raises when a rank is gone). Until then ``flat`` is the group's."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.group.broadcast([flat], opts)

    def broadcast(self, flat: torch.Tensor) -> None:
        """Rank 0's ``flat`` (a byte buffer) into every rank's (raises when a rank is gone)."""
        self.start_broadcast(flat).wait()

    def send(self, tensors: Sequence[torch.Tensor], bucket_bytes: int) -> None:
        """Rank 0: broadcast ``tensors`` piece by piece (:func:`pieces`: each large tensor on its
        own, each run of small ones packed into one), pipelined: a packing thread packs piece k+1
        while piece k is on the wire, and two pieces are in flight at most. A piece of one
        contiguous tensor on the group's device is sent as it is (the root's buffer is only
        read: no copy); the others are packed into two buffers that alternate (on CPU kept for
        the group's life: a fresh buffer costs its page faults on every push; on CUDA fresh
        ones, which the caching allocator reuses). The packing thread copies with one intra-op
        thread: a copy is bound by memory, not cores, and it leaves the caller's threads to the
        caller."""
        from concurrent.futures import ThreadPoolExecutor

        sizes = [nbytes(t.shape, t.dtype) for t in tensors]
        plan = [p for p in pieces([t.shape for t in tensors], [t.dtype for t in tensors], bucket_bytes) if p.nbytes]
        packed = [0]

        def pack(p: Piece) -> torch.Tensor:
            first = tensors[p.tensors[0]].detach()
            if len(p.tensors) == 1 and first.device == self.device and first.is_contiguous():
                return first.reshape(-1).view(torch.uint8)
            flat = self._packing_buffer(packed[0] % 2, p.nbytes)
            packed[0] += 1
            for i, at in zip(p.tensors, p.offsets):
                t = tensors[i].detach()
                at -= p.offset
                flat[at : at + sizes[i]].view(t.dtype).view(t.shape).copy_(t)
            return flat

        in_flight: list[Any] = []
        with ThreadPoolExecutor(1, "acb-pack", initializer=torch.set_num_threads, initargs=(1,)) as packer:
            next_flat = packer.submit(pack, plan[0]) if plan else None
            for k in range(len(plan)):
                assert next_flat is not None
                in_flight.append(self.start_broadcast(next_flat.result()))
                if len(in_flight) == 2:  # (piece k-1 ends before piece k+1 is packed into its buffer)
                    in_flight.pop(0).wait()
                next_flat = packer.submit(pack, plan[k + 1]) if k + 1 < len(plan) else None
            for work in in_flight:
                work.wait()

    def _packing_buffer(self, k: int, n: int) -> torch.Tensor:
        """``n`` bytes of packing buffer ``k`` (0 or 1)."""
        if self.device.type != "cpu":
            return torch.empty(n, dtype=torch.uint8, device=self.device)
        while len(self._send_buffers) <= k:
            self._send_buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._send_buffers[k].numel() < n:
            self._send_buffers[k] = torch.empty(0, dtype=torch.uint8)  # (freed before the larger one)
            self._send_buffers[k] = torch.empty(n, dtype=torch.uint8)
        return self._send_buffers[k][:n]

    def receive(
        self,
        shapes: Sequence[Sequence[int]],
        dtypes: Sequence[torch.dtype],
        bucket_bytes: int,
        on_bucket: Callable[[int], None] | None = None,
        busy: Collection[int] = (),
    ) -> Iterator[torch.Tensor]:
        """Another rank: the tensors rank 0 broadcasts, in order, as views of the group's receive
        buffers (one per bucket; on CPU kept for the group's life and reused by a later update,
        so the views are valid until then). Bucket k+1's receive is already under way while the
        caller takes bucket k's tensors. ``on_bucket(k)``: called once bucket k arrived.
        ``busy``: storage addresses in use elsewhere (weights rebound to a former update's
        buffers): a set of buffers one of which is busy is not received into; the group keeps
        two sets at most, so that updates alternate between them."""
        plan = layout(shapes, dtypes, bucket_bytes)
        flats = self._receive_buffers([size for _, _, size in plan], busy)
        # each piece straight into its place in its bucket's buffer, a few posted ahead
        todo = [p for p in pieces(shapes, dtypes, bucket_bytes) if p.nbytes]
        works: dict[int, Any] = {}
        started = done = 0
        for k, (b, offsets, _) in enumerate(plan):
            while done < len(todo) and todo[done].bucket == k:
                while started < min(done + RECEIVE_AHEAD, len(todo)):
                    p = todo[started]
                    works[started] = self.start_broadcast(flats[p.bucket][p.offset : p.offset + p.nbytes])
                    started += 1
                works.pop(done).wait()
                done += 1
            if on_bucket is not None:
                on_bucket(k)
            for i, at in zip(b, offsets):
                n = nbytes(shapes[i], dtypes[i])
                yield flats[k][at : at + n].view(dtypes[i]).reshape(tuple(shapes[i]))

    def _receive_buffers(self, sizes: Sequence[int], busy: Collection[int] = ()) -> list[torch.Tensor]:
        """One byte buffer per bucket: on CPU a set of the group's own, reused while the sizes fit
        (a fresh one costs its page faults: about as much as the wire on loopback) and none of its
        buffers is ``busy``; at most two sets are kept; on CUDA fresh ones (the caching allocator
        reuses its memory)."""
        if self.device.type != "cpu":
            return [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        # (the old sets freed before new ones are made; a busy set lives on in what uses it)
        self._receive_pool = [p for p in self._receive_pool if [int(f.numel()) for f in p] == list(sizes)]
        for flats in self._receive_pool:
            if not any(f.untyped_storage().data_ptr() in busy for f in flats):
                return flats
        self._receive_pool = self._receive_pool[-1:]
        flats = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        self._receive_pool.append(flats)
        return flats

    # the handshake -------------------------------------------------------------
    def verdict(self, seq: int, error: str | None) -> None:
        """A server's answer to update ``seq``: ``None`` (ready) or what is wrong."""
        self.store.set(f"{seq}/verdict/{self.rank}", "ok" if error is None else "error: " + error)

    def verdicts(self, seq: int, stop: Callable[[], bool] | None = None) -> dict[int, str] | None:
        """Rank 0: every server's answer to update ``seq``, waiting for them (at most the group's
        timeout: a ``TimeoutError`` naming the ranks that did not answer); ``None`` as soon as
        ``stop()`` says to give up (a server answered the trainer's request with an error, so it
        will write no verdict)."""
        keys = {r: f"{seq}/verdict/{r}" for r in range(1, self.world_size)}
        deadline = time.monotonic() + self.timeout_s
        pause = 0.002
        while not self.store.check(list(keys.values())):
            if stop is not None and stop():
                return None
            if time.monotonic() > deadline:
                missing = [r for r, k in keys.items() if not self.store.check([k])]
                raise TimeoutError(f"ranks {missing} gave no verdict on update {seq} within {self.timeout_s:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return {r: self.store.get(k).decode() for r, k in keys.items()}

    def decide(self, seq: int, go: bool) -> None:
        self.store.set(f"{seq}/decision", "go" if go else "abort")

    def decision(self, seq: int) -> bool:
        """A server: whether rank 0 will broadcast update ``seq`` (waits for it, at most the
        group's timeout)."""
        self.store.wait([f"{seq}/decision"])
        return self.store.get(f"{seq}/decision").decode() == "go"

    def close(self) -> None:
        self._send_buffers, self._receive_pool = [], []
        try:
            self.group.shutdown()
        except Exception:  # noqa: BLE001 - a group whose peer is gone
            pass
