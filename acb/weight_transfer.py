"""Weights from a trainer to rollout servers over ``torch.distributed``: the group, the buckets,
and the handshake that keeps an update all-or-nothing.

The trainer is rank 0 and hosts the group's ``TCPStore``; each server (each replica) joins with
its own rank (``rank_offset`` + its index). The group is a process group of its own (gloo on
CPU, NCCL on CUDA), built on that store: it never touches a process's default group, so a
server under ``torchrun`` keeps its own.

One update, ``seq``-numbered:

1. The trainer asks every server to receive it (``POST /update_weights``: names, dtypes,
   shapes, the version, the bucket size).
2. Each server checks the names, shapes and dtypes against its model and writes its verdict
   to the store (``"ok"`` or the error).
3. The trainer reads every verdict and writes ``"go"`` if all are ok, else ``"abort"``: then
   nobody receives, every server answers with what was wrong, and the old weights serve.
4. On ``"go"`` the tensors are broadcast from rank 0 in buckets (:func:`buckets`: consecutive
   tensors, at most ``bucket_bytes`` each, sent as one flat byte buffer, not one call per
   tensor). A server stages what it received, then swaps it in between two engine steps.

A sender that dies mid-broadcast makes the receive fail (the group's timeout, or the connection
closed): nothing is swapped, the server closes its group and accepts a new
``init_weight_transfer``.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TransferGroup", "buckets", "dtype_of", "dtype_name"]

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 120.0


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


@dataclass
class TransferGroup:
    """One side of the trainer-servers group (see the module docstring)."""

    store: torch.distributed.Store
    group: Any  # a ProcessGroupGloo or ProcessGroupNCCL of its own
    rank: int
    world_size: int
    device: torch.device

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        world_size: int,
        rank: int,
        *,
        device: torch.device | str = "cpu",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> TransferGroup:
        """Join (rank 0: create) the group; blocks until every rank joined."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout)
        device = torch.device(device)
        pg: Any
        if device.type == "cuda":
            pg = dist.ProcessGroupNCCL(store, rank, world_size, dist.ProcessGroupNCCL.Options())
        else:
            pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        return cls(store, pg, rank, world_size, device)

    def broadcast(self, flat: torch.Tensor) -> None:
        """Rank 0's ``flat`` (a byte buffer) into every rank's (raises when a rank is gone)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([flat], opts).wait()

    def send(self, tensors: Sequence[torch.Tensor], bucket_bytes: int) -> None:
        """Rank 0: broadcast ``tensors`` in buckets."""
        for b in buckets([t.shape for t in tensors], [t.dtype for t in tensors], bucket_bytes):
            parts = [tensors[i].detach().contiguous().to(self.device).reshape(-1).view(torch.uint8) for i in b]
            self.broadcast(torch.cat(parts) if len(parts) > 1 else parts[0].clone())

    def receive(
        self, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], bucket_bytes: int
    ) -> Iterator[torch.Tensor]:
        """Another rank: the tensors rank 0 broadcasts, in order (views of each bucket's buffer)."""
        for b in buckets(shapes, dtypes, bucket_bytes):
            flat = torch.empty(sum(nbytes(shapes[i], dtypes[i]) for i in b), dtype=torch.uint8, device=self.device)
            self.broadcast(flat)
            at = 0
            for i in b:
                n = nbytes(shapes[i], dtypes[i])
                yield flat[at : at + n].view(dtypes[i]).reshape(tuple(shapes[i]))
                at += n

    # the handshake -------------------------------------------------------------
    def verdict(self, seq: int, error: str | None) -> None:
        """A server's answer to update ``seq``: ``None`` (ready) or what is wrong."""
        self.store.set(f"acb/{seq}/verdict/{self.rank}", "ok" if error is None else "error: " + error)

    def verdicts(self, seq: int) -> dict[int, str]:
        """Rank 0: every server's answer to update ``seq`` (waits for them)."""
        keys = [f"acb/{seq}/verdict/{r}" for r in range(1, self.world_size)]
        self.store.wait(keys)
        return {r: self.store.get(k).decode() for r, k in zip(range(1, self.world_size), keys)}

    def decide(self, seq: int, go: bool) -> None:
        self.store.set(f"acb/{seq}/decision", "go" if go else "abort")

    def decision(self, seq: int) -> bool:
        """A server: whether rank 0 will broadcast update ``seq`` (waits for it)."""
        self.store.wait([f"acb/{seq}/decision"])
        return self.store.get(f"acb/{seq}/decision").decode() == "go"

    def close(self) -> None:
        try:
            self.group.shutdown()
        except Exception:  # noqa: BLE001 - a group whose peer is gone
            pass
