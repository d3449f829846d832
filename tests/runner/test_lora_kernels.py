"""LoRA's kernel form (``acb.runner.lora_kernels``: Triton shrink/expand over the step's runs)
against the grouped form, through the linears' interception (``acb.runner.lora``).

Runs under the Triton interpreter on CPU (``TRITON_INTERPRET=1``, set here before triton is
imported), in float32 (the interpreter's bf16 ``tl.dot`` is wrong). On a CUDA machine run with
``TRITON_INTERPRET=0`` to test the compiled kernels on the GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from acb.lora import LoraAdapter  # noqa: E402
from acb.runner import lora as runner_lora  # noqa: E402
from acb.runner.input_batch import LoraRows  # noqa: E402
from acb.runner.lora import LoraLayers, LoraStep  # noqa: E402
from acb.runner.step import entered  # noqa: E402
from tests.conftest import triton_test_device  # noqa: E402

DEVICE = triton_test_device()


def _rows(slots: torch.Tensor) -> LoraRows:
    order = torch.argsort(slots, stable=True)
    order = order[slots[order] > 0]
    runs, start = [], 0
    for s in sorted(set(slots.tolist()) - {0}):
        c = int((slots == s).sum())
        runs.append((s, start, c))
        start += c
    return LoraRows(order.to(DEVICE), slots[order].to(DEVICE), runs, int(slots.shape[0]))


def _forward(model, layers, rows, x, kernel: bool, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setattr(runner_lora, "KERNEL", kernel)
    monkeypatch.setattr(runner_lora, "GATHERED", False)
    with entered("lora", LoraStep(layers, rows)):
        h = model[0](x)
        return h, model[1](h)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_kernel_form_equals_the_grouped_form(monkeypatch, seed):
    """Random shapes off the kernels' tiles, several runs of different slots and counts (one over
    a row tile), ranks below ``r_max``, a slot whose adapter does not target the first linear:
    the kernel form gives the grouped form's output, slot-0 rows get the base output, and the
    scalings (none of them 1) are applied."""
    g = torch.Generator().manual_seed(seed)
    din, dmid, dout = 40 + 8 * seed, 72, 24
    model = torch.nn.Sequential(torch.nn.Linear(din, dmid), torch.nn.Linear(dmid, dout)).to(DEVICE)
    layers = LoraLayers(model, 4, 8, DEVICE)
    try:
        for slot, r, paths in ((1, 3, ("0", "1")), (2, 8, ("0", "1")), (3, 5, ("1",)), (4, 6, ("0", "1"))):
            w = {}
            for p in paths:
                i, o = (din, dmid) if p == "0" else (dmid, dout)
                w[p] = (torch.randn(r, i, generator=g), torch.randn(o, r, generator=g))
            scalings = {p: 0.25 * slot + 0.1 for p in paths}
            layers.add(slot, LoraAdapter(f"s{slot}", r, 0.25 * slot + 0.1, w, b"", 0, scalings))
        T = 53
        slots = torch.randint(0, 5, (T,), generator=g)
        slots[:20] = 2  # one run longer than the kernels' 16-row tile
        rows = _rows(slots)
        x = torch.randn(1, T, din, generator=g).to(DEVICE)
        with torch.no_grad():
            want_h, want = _forward(model, layers, rows, x, False, monkeypatch)
            got_h, got = _forward(model, layers, rows, x, True, monkeypatch)
            base_h = model[0](x)
        assert len(rows.runs) >= 3 and max(c for _, _, c in rows.runs) > 16
        torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-4)
        # (the second linear's input already differs by the first's rounding, amplified by randn weights)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
        keep = (slots == 0) | (slots == 3)  # no adapter, or one that does not target the first linear
        assert torch.equal(got_h[0, keep.to(DEVICE)], base_h[0, keep.to(DEVICE)])
        # the scalings count: the unscaled update is far from what the kernel gave
        buf = layers.buffers[model[0]]
        i = int(rows.order[0])
        s = int(slots[i])
        unscaled = base_h[0, i] + (x[0, i] @ buf.A[s].T) @ buf.B[s].T
        assert not torch.allclose(got_h[0, i], unscaled, rtol=1e-3, atol=1e-2)
    finally:
        layers.close()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_the_per_row_form_equals_the_grouped_form(monkeypatch, kernel):
    """The decode graphs' fixed-shape form (``LoraLayers.graph_step``: every row, its slot from a
    static buffer, slot 0 on base rows): the kernels run per row (``per_row_runs``) or A and B
    gathered per row (the CPU twin's torch form) give the grouped form's output; rows of slot 0,
    and of a slot whose adapter does not target the linear, keep the base output's bits; and a
    slot emptied and refilled in place is read by the next call through the same buffers."""
    g = torch.Generator().manual_seed(3)
    din, dmid, dout = 40, 72, 24
    model = torch.nn.Sequential(torch.nn.Linear(din, dmid), torch.nn.Linear(dmid, dout)).to(DEVICE)
    layers = LoraLayers(model, 3, 8, DEVICE)

    def adapter(slot: int, r: int, paths: tuple[str, ...]) -> LoraAdapter:
        w = {}
        for p in paths:
            i, o = (din, dmid) if p == "0" else (dmid, dout)
            w[p] = (torch.randn(r, i, generator=g), torch.randn(o, r, generator=g))
        return LoraAdapter(f"s{slot}", r, 0.3 * slot, w, b"", 0, {p: 0.3 * slot for p in paths})

    try:
        layers.prepare_graphs()  # (what the graphs' capture does: every target's buffers up front)
        for slot, r, paths in ((1, 3, ("0", "1")), (2, 8, ("0", "1")), (3, 5, ("1",))):
            layers.add(slot, adapter(slot, r, paths))
        T = 21  # (decode graphs: one token a row)
        slots = torch.randint(0, 4, (T,), generator=g)
        slots[:3] = torch.tensor([0, 1, 3])
        x = torch.randn(1, T, din, generator=g).to(DEVICE)
        static = slots.to(DEVICE)  # the graph's static slot row
        order = torch.arange(T, device=DEVICE)
        monkeypatch.setattr(runner_lora, "KERNEL", kernel)

        def per_row() -> tuple[torch.Tensor, torch.Tensor]:
            with entered("lora", layers.graph_step(order, static)):
                h = model[0](x)
                return h, model[1](h)

        with torch.no_grad():
            want_h, want = _forward(model, layers, _rows(slots), x, False, monkeypatch)
            monkeypatch.setattr(runner_lora, "KERNEL", kernel)
            got_h, got = per_row()
            base_h = model[0](x)
            torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
            keep = ((slots == 0) | (slots == 3)).to(DEVICE)
            assert torch.equal(got_h[0, keep], base_h[0, keep])
            # slot 1 emptied, then slot 2's adapter put in slot 1: the same call reads the new content
            layers.remove(1)
            h_removed, _ = per_row()
            assert torch.equal(h_removed[0, (slots == 1).to(DEVICE)], base_h[0, (slots == 1).to(DEVICE)])
            g.manual_seed(3)
            layers.add(1, adapter(1, 3, ("0", "1")))  # the same draws as before: slot 1's first adapter
            h_back, _ = per_row()
            torch.testing.assert_close(h_back, got_h, rtol=0, atol=0)
    finally:
        layers.close()


def test_the_kernel_form_is_not_the_cpu_default():
    """``KERNEL = None`` (the default) picks the kernel form only for CUDA tensors."""
    assert runner_lora.KERNEL is None
    assert not runner_lora._use_kernel(torch.zeros(2, 3))
