"""LoRA adapters inside engine steps: the base layer runs once for the whole batch, and each row
adds its own adapter's low-rank update (issue 56).

:class:`LoraLayers` holds, for each target linear an adapter has named (an ``nn.Linear`` of the
model's decoder, :func:`acb.lora.lora_targets`), stacked buffers ``A [max_loras + 1, r_max, in]``,
``B [max_loras + 1, out, r_max]`` and a scaling per slot (slot 0 is "no adapter" and stays zero),
filled by :meth:`LoraLayers.add` / :meth:`LoraLayers.remove` on the engine thread. The first adapter
that targets a linear installs an instance ``forward`` on it for the engine's life
(:class:`acb.runner.intercept.Interception`; with decode graphs every target gets its buffers and
``forward`` before the capture); outside a step, or in a step with no adapter row, it returns the
base layer's output at once (one thread-local read).

A step's adapter rows reach it as :class:`acb.runner.input_batch.LoraRows` (staged with the step's
inputs in the one host-to-device copy: the token indices of the adapter rows sorted by slot, their
slots, and the host's runs of equal slots), through ``CURRENT.lora`` (:mod:`acb.runner.step`),
entered by the kind's :class:`acb.runner.kinds.LoraHooks`. Each target linear then computes

    out = base(x);  out[rows of slot s] += lora_B_s(lora_A_s(x[rows of slot s])) * scaling_s

in PEFT's order (``result + lora_B(lora_A(x)) * scaling``), in an eager step in one of three forms:

* **grouped**: one gather of the adapter rows, then per slot present one pair of matmuls on its
  rows at the adapter's own rank, and an ``index_add_`` back;
* **gathered**: ``A`` and ``B`` gathered per row and two ``bmm`` at ``r_max`` (SGMV's shape; its
  per-row ``[out, r_max]`` copy of ``B`` makes it costly for prefill rows);
* **kernel** (on CUDA when triton imports, :data:`KERNEL`): :mod:`acb.runner.lora_kernels`' two
  Triton kernels in punica's SGMV style, shrink then expand over the step's runs (read from a
  device copy of the runs made once a step); tested against the grouped form under Triton's
  interpreter (``tests/runner/test_lora_kernels.py``), compiled for sm_90 and sm_80 without a GPU
  (``benchmarks/kernel_compile.py``: no spills, ``mma.sync`` in fp16/bf16), not yet timed on a GPU.

:data:`GATHERED` picks (default None: per step, :func:`_gathered`, grouped in the batch-invariant mode; tested in
``tests/runner/test_lora.py``). ``benchmarks/lora_offline.py`` times them
(``benchmarks/results/lora_cpu.json``; CPU, 2 threads, 48 requests of 16-128 prompt tokens and 32
new, rank-16 adapters on every decoder linear of the default Llama). Its runs before 2026-11-29
16:00 left prefix caching on while every side reran the same prompts on one engine, so the sides
after the first of each adapter count (gathered, then the pick) skipped most prefills: the pick at
one adapter, which is the grouped form itself, read 1.4-1.6x grouped in all three, and the
gathered form's wins there (1.34x grouped at 16 adapters in the quietest) were measured against
a cold grouped side. With prefix
caching off, two runs: grouped 2,715 / 2,363 / 1,279 tok/s at 1 / 4 / 16 adapters, gathered
645 / 90 / 529 (its per-row copy of ``B`` on every prefill row), the pick 2,722 / 2,004 / 1,444
(load average 2.2-3.4, best of 2); then, quieter (load 2.1-2.3, best of 3): grouped 2,730 / 2,408
/ 1,555, gathered 544 / 597 / 633, the pick 2,781 / 2,375 / 1,832. The pick is the grouped form at
1 and 4 adapters (their gaps are noise) and took its gathered decode steps at 16: 1.13x and 1.18x
grouped. So the pick is the default (``GATHERED = None``; the batch-invariant mode keeps grouped).
No device sync either way: the runs' slots and counts are host values.

Decode CUDA graphs (:mod:`acb.runner.cuda_graphs`) are captured twice per size with LoRA on: the
base model's graph (no adapter row: the interception returns at once) and the adapters' graph,
in a fourth, fixed-shape form (:meth:`LoraLayers.graph_step`, ``LoraStep.per_row``): every row
of the graph, its slot read from the graph's static slot row (0 on base and padded rows), the
kernel form per row on CUDA (:func:`acb.runner.lora_kernels.per_row_runs`: slot-0 rows are
skipped and keep their bits) and elsewhere ``A`` and ``B`` gathered per row and two ``bmm``
(BGMV's shape; slot 0's zero ``A``, ``B`` and scaling add exact zeros). Before the capture,
:meth:`LoraLayers.prepare_graphs` gives every possible target its buffers and interception, so
adapters added, updated or removed later are written into buffers the graphs read at replay. A
decode step whose slots have fused experts' factors runs eagerly (:meth:`LoraLayers.graphable`).
torch.compile is off with ``max_loras > 0``. Not supported yet (refused with the reason): tensor
parallel, the own-cache runner path, linears inside layers acb runs per request segment (state
layers, indexers, own-cache attention) and MLA's ``kv_b_proj``; PEFT's ``target_parameters``
(fused MoE experts' 3-D parameters) run in :mod:`acb.runner.lora_experts`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from acb.errors import InvalidRequestError
from acb.lora import FIELD, LoraAdapter, lora_targets
from acb.runner import batch_invariant_flag
from acb.runner.intercept import Interception
from acb.runner.lora_experts import ExpertAdapters
from acb.runner.step import CURRENT

if TYPE_CHECKING:
    from acb.runner.input_batch import LoraRows

# True: the gathered form (A and B gathered per row, bmm); False: the grouped form (a pair of
# matmuls per slot present); None (the default): per step (_gathered; grouped in the
# batch-invariant mode). Measured by benchmarks/lora_offline.py; tests/runner/test_lora.py runs each.
GATHERED: bool | None = None
# the step's pick: gathered when it has more than GATHER_MIN_SLOTS slots and at most GATHER_MAX_ROWS
# adapter rows (its per-row copies of B stay small)
GATHER_MIN_SLOTS = 6
GATHER_MAX_ROWS = 256
# the kernel form (acb.runner.lora_kernels: Triton shrink/expand over the step's runs, SGMV's
# style): None: on CUDA when triton imports (CPU keeps GATHERED's form); True: always (tests, under
# Triton's interpreter on CPU); False: never
KERNEL: bool | None = None


@functools.cache
def _kernels() -> Any:
    """acb.runner.lora_kernels, or None where triton does not import."""
    try:
        from acb.runner import lora_kernels
    except ImportError:
        return None
    return lora_kernels


def _use_kernel(x: torch.Tensor) -> bool:
    if KERNEL is None:
        return x.is_cuda and _kernels() is not None
    return KERNEL


def _gathered(rows: LoraRows) -> bool:
    if GATHERED is not None:
        return GATHERED
    if batch_invariant_flag.is_on():  # the mode's fixed linear is the grouped form's F.linear
        return False
    return len(rows.runs) > GATHER_MIN_SLOTS and rows.order.shape[0] <= GATHER_MAX_ROWS


class _Slots:
    """One target linear's stacked adapter buffers."""

    def __init__(self, lin: torch.nn.Linear, slots: int, max_rank: int, device: torch.device) -> None:
        dtype = lin.weight.dtype
        self.A = torch.zeros((slots, max_rank, lin.in_features), dtype=dtype, device=device)
        self.B = torch.zeros((slots, lin.out_features, max_rank), dtype=dtype, device=device)
        self.scale = [0.0] * slots  # PEFT multiplies by a Python float: so does the grouped form
        self.scale_dev = torch.zeros(slots, dtype=dtype, device=device)  # the gathered form's
        # the kernel form's and the per-row form's fp32 copy of ``scale`` (PEFT's product in the
        # float opmath), written in place: a captured graph reads it at replay (a few bytes a slot,
        # outside reserved_bytes)
        self.scale_f32 = torch.zeros(slots, dtype=torch.float32, device=device)
        self.rank = [0] * slots  # 0: the slot's adapter does not target this linear

    def put_scale(self, slot: int, scale: float) -> None:
        self.scale[slot] = scale
        self.scale_dev[slot] = scale
        self.scale_f32[slot] = scale

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[slot].zero_()
        self.put_scale(slot, 0.0)
        self.rank[slot] = 0


def reserved_bytes(targets: dict[str, torch.nn.Linear], max_loras: int, max_rank: int) -> int:
    """The device bytes the stacked buffers take when every target linear has them (priced in
    the memory budget before the KV blocks are counted, whichever an adapter names)."""
    total = 0
    for lin in targets.values():
        elem = lin.weight.element_size()
        total += (max_loras + 1) * (max_rank * (lin.in_features + lin.out_features) + 1) * elem
    return total


@dataclass
class LoraStep:
    """``CURRENT.lora`` inside a step with adapter rows: the engine's layers and the step's rows.

    ``per_row``: the decode graphs' fixed-shape form (:meth:`LoraLayers.graph_step`): ``rows.order``
    is every token (``arange(T)``), ``rows.slots`` each token's slot (0: the base model, whose
    ``A``/``B`` are zero and scaling 0), ``rows.runs`` empty; no host value of the step is read."""

    layers: LoraLayers
    rows: LoraRows
    runs_dev: torch.Tensor | None = None  # the kernel form's [R, 3] runs on the device (made once a step)
    max_count: int = 0
    per_row: bool = False


class LoraLayers:
    """The adapters' stacked buffers per target linear, and the interception of those linears
    (engine thread only; installed for the engine's life as adapters first name them)."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        per_segment: Iterable[torch.nn.Module] = (),
        not_per_token: Iterable[torch.nn.Module] = (),
    ) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.targets = lora_targets(model)
        # linears whose input is not the step's tokens in batch order: inside layers run per request
        # segment (state layers, indexers, own-cache attention), or fed other rows (MLA's kv_b_proj)
        self._refused: dict[int, str] = {}
        for layer in per_segment:
            for m in layer.modules():
                self._refused[id(m)] = f"inside {type(layer).__name__}, which acb runs per request segment"
        for m in not_per_token:
            self._refused[id(m)] = "it is fed the cached latent, not the step's tokens (MLA's kv_b_proj)"
        # (the fused experts' factors and their transient folded copy: acb.runner.lora_experts)
        self.reserved_bytes = reserved_bytes(self.targets, max_loras, max_rank) + ExpertAdapters.reserved_bytes(
            model, max_loras, max_rank, self._refused
        )
        self.buffers: dict[torch.nn.Module, _Slots] = {}
        self.slot_names: list[str | None] = [None] * (max_loras + 1)
        self._interceptions: list[Interception] = []
        # target_parameters (fused MoE experts' 3-D parameters): acb.runner.lora_experts
        self.experts = ExpertAdapters(model, device)

    @property
    def nbytes(self) -> int:
        """The device bytes of the buffers allocated so far."""
        per_linear = sum(
            b.A.nbytes + b.B.nbytes + b.scale_dev.nbytes + b.scale_f32.nbytes for b in self.buffers.values()
        )
        return per_linear + self.experts.nbytes

    def add(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` in ``slot`` (``1..max_loras``), replacing what was there."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside 1..max_loras={self.max_loras}")
        if adapter.rank > self.max_rank:
            raise InvalidRequestError(
                f"LoRA adapter {adapter.name!r}: rank {adapter.rank} is over max_lora_rank={self.max_rank}", FIELD
            )
        for path in adapter.weights:  # all checked before anything is written
            lin = self.targets.get(path)
            if lin is None:
                raise InvalidRequestError(
                    f"LoRA adapter {adapter.name!r}: {path!r} is not an nn.Linear of the engine's model's decoder",
                    FIELD,
                )
            why = self._refused.get(id(lin))
            if why is not None:
                raise InvalidRequestError(
                    f"LoRA adapter {adapter.name!r}: {path!r} cannot take an adapter in acb yet: {why}", FIELD
                )
        experts = self.experts.check(adapter, self._refused)
        self.remove(slot)
        self.experts.put(slot, experts)
        self._allocate([self.targets[path] for path in adapter.weights])
        with torch.no_grad():
            for path, (a, b) in adapter.weights.items():
                buf = self.buffers[self.targets[path]]
                r = int(a.shape[0])
                buf.A[slot, :r].copy_(a)
                buf.B[slot, :, :r].copy_(b)
                buf.rank[slot] = r
                buf.put_scale(slot, float(adapter.scalings.get(path, adapter.scaling)))
        self.slot_names[slot] = adapter.name

    def _allocate(self, linears: Iterable[torch.nn.Linear]) -> None:
        """Stacked buffers (all slots empty) and the interception for those of ``linears`` without them."""
        new = []
        with torch.inference_mode(False):  # (normal tensors: add and remove write them in place)
            for lin in linears:
                if lin not in self.buffers and lin not in new:
                    self.buffers[lin] = _Slots(lin, self.max_loras + 1, self.max_rank, self.device)
                    new.append(lin)
        if new:
            self._interceptions.append(Interception(new, _lora_forward))

    def prepare_graphs(self) -> None:
        """Before the decode graphs are captured: buffers and the interception on every target an
        adapter may name (the bytes :func:`reserved_bytes` priced), so that a graph captured now
        holds every linear's update, reading buffers that later adds, updates and removes write in
        place."""
        self._allocate(lin for lin in self.targets.values() if id(lin) not in self._refused)

    def graphable(self, rows: LoraRows) -> bool:
        """Whether a decode step with these adapter rows can replay a graph: not when one of its
        slots has fused experts' factors (:mod:`acb.runner.lora_experts` runs the experts once more
        per slot present, a host-dependent shape)."""
        per_module = self.experts.per_module
        return not any(slot in per_slot for per_slot in per_module.values() for slot, _, _ in rows.runs)

    def graph_step(self, order: torch.Tensor, slots: torch.Tensor) -> LoraStep:
        """``CURRENT.lora`` inside a decode graph of ``T`` rows: ``order`` is ``arange(T)`` and
        ``slots [T]`` the graph's static per-row slots (0 on base and padded rows)."""
        from acb.runner.input_batch import LoraRows

        return LoraStep(self, LoraRows(order, slots, [], int(order.shape[0])), per_row=True)

    def remove(self, slot: int) -> None:
        """Empty ``slot``: its rows get no update (the interceptions stay)."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside 1..max_loras={self.max_loras}")
        with torch.no_grad():
            for buf in self.buffers.values():
                if buf.rank[slot]:
                    buf.clear(slot)
        self.experts.remove(slot)
        self.slot_names[slot] = None

    def close(self) -> None:
        """Give the linears their own ``forward`` back (the engine closes)."""
        for i in self._interceptions:
            i.remove()
        self._interceptions = []
        self.experts.close()


def _lora_forward(original: Any, sig: inspect.Signature, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    out = original(*args, **kwargs)
    step: LoraStep | None = CURRENT.lora
    if step is None:  # outside a step, or a step without adapter rows
        return out
    buf = step.layers.buffers.get(module)
    if buf is None:  # (another engine's target, on a model two engines share)
        return out
    x = args[0] if args else kwargs["input"]
    rows = step.rows
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] != rows.num_tokens:
        raise RuntimeError(
            f"LoRA on {type(module).__name__} (in {x2.shape[0]} rows): the step has {rows.num_tokens} tokens; "
            "acb applies adapters to linears that see every token of the step in batch order"
        )
    o2 = out.view(-1, out.shape[-1])
    if _use_kernel(x2):
        lk = _kernels()
        if step.runs_dev is None:
            if step.per_row:  # one run a row, (slot, i, 1): slot-0 runs are skipped (scaling 0)
                step.runs_dev, step.max_count = lk.per_row_runs(rows.slots, rows.order), 1
            else:
                step.runs_dev = lk.runs_tensor(rows.runs, x2.device)
                step.max_count = max((c for _, _, c in rows.runs), default=0)
        lk.lora_apply(x2.contiguous(), o2, buf.A, buf.B, buf.scale_f32, rows.order, step.runs_dev, step.max_count)
        return out
    if step.per_row:  # every row, A and B gathered by its slot (BGMV's shape); slot 0 adds exact zeros
        slots = rows.slots
        h = torch.bmm(buf.A.index_select(0, slots), x2[:, :, None])  # [T, r_max, 1]
        d = torch.bmm(buf.B.index_select(0, slots), h)[:, :, 0]  # [T, out]
        o2.add_((d * buf.scale_f32.index_select(0, slots)[:, None]).to(o2.dtype))
        return out
    xs = x2.index_select(0, rows.order)  # [n, in]: the adapter rows, sorted by slot
    if _gathered(rows):
        slots = rows.slots
        h = torch.bmm(buf.A.index_select(0, slots), xs[:, :, None])  # [n, r_max, 1]
        d = torch.bmm(buf.B.index_select(0, slots), h)[:, :, 0]  # [n, out]
        o2.index_add_(0, rows.order, d * buf.scale_dev.index_select(0, slots)[:, None])
        return out
    for slot, start, count in rows.runs:
        r = buf.rank[slot]
        if not r:  # this slot's adapter does not target this linear
            continue
        d = F.linear(F.linear(xs[start : start + count], buf.A[slot, :r]), buf.B[slot, :, :r]) * buf.scale[slot]
        o2.index_add_(0, rows.order[start : start + count], d)
    return out
