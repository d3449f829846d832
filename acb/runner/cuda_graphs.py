"""CUDA graphs for decode-only steps: capture at padded batch sizes, replay with static inputs.

A decode-only step of ``B`` sequences runs as the replay of the graph captured for the smallest
padded size ``>= B`` (``graph_sizes``: 1, 2, 4, 8, then steps of 8 to 64, then of 16 up to the
request cap). Its inputs are copied into one static ``[5, max_size]`` buffer (ids, positions,
slots, context lengths, block-table rows; a sixth row, each row's LoRA slot, with LoRA on);
padded rows get slot -1 (nothing stored), context length 0 (nothing read), the block table's
all-zero scratch row and LoRA slot 0. The graph gathers its block table rows from the
device-resident table inside the replay, so no host value of the step is baked in except the
batch size and the decode split count, which form the graph key (the backend's
``graph_variants``) with whether the graph applies LoRA adapters. The forward is captured up to
the sampling rows' logits; sampling runs eagerly after the replay (its kernel set depends on each
step's parameters).

LoRA (``max_loras > 0``): every size and variant is captured twice, keys ``(b, v, False)`` and
``(b, v, True)``. A step without adapter rows replays the first, which is the base model's graph
(the interception returns at once: no adapter cost). A step with adapter rows replays the second,
captured with the adapters' per-row form (:meth:`acb.runner.lora.LoraLayers.graph_step`: each
row's update from the stacked buffers gathered by the static slot row; slot 0 adds nothing), after
:meth:`~acb.runner.lora.LoraLayers.prepare_graphs` gave every possible target its buffers: adding,
updating or removing an adapter writes those buffers in place, and the next replay reads them.
Steps whose slots have fused experts' factors (``acb.runner.lora_experts``) run eagerly.

All graphs share one memory pool, captured largest first. Mixed prefill/decode steps run
eagerly. ``warmup()`` captures everything, logs capture time and memory, and checks a replay
against the eager forward; a failure there turns graphs off with a warning instead of failing.

On CPU the same code runs with :class:`EagerGraph` (the CPU twin): "capture" freezes the step
closure built from the static buffers and "replay" calls it again, reading whatever the static
buffers hold, which is what a CUDA graph does. CI tests the padding, static buffers and keys
this way (with the Triton kernels in the interpreter).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from acb.runner.attention import BatchInputs, StepContext
from acb.runner.input_batch import PreparedBatch
from acb.runner.step import entered

logger = logging.getLogger(__name__)

IDS, POS, SLOT, LEN, ROW, LORA = range(6)  # the static buffer's rows (LORA: with LoRA on only)


def graph_sizes(max_batch: int, step: int | None = None) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then multiples of 8 to 64 and of 16 beyond
    (or multiples of ``step``), always ending at ``max_batch``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    n = 8
    while n < max_batch:
        n += step or (8 if n < 64 else 16)
        sizes.append(min(n, max_batch))
    sizes.append(max_batch)
    return sorted(set(sizes))


class EagerGraph:
    """The CPU twin of ``torch.cuda.CUDAGraph``: replay re-runs the closure frozen at capture."""

    def __init__(self) -> None:
        self._fn: Callable[[], torch.Tensor] | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._fn = fn
        return fn()

    def replay(self) -> torch.Tensor:
        assert self._fn is not None
        return self._fn()


class CudaGraph:
    """One captured CUDA graph; ``replay`` returns the (static) output tensor."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()
        self.out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()  # warm-up runs (kernel compilation, library workspaces) off the capture
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.out = fn()
        return self.out

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        assert self.out is not None
        return self.out


class DecodeGraphs:
    """Captured decode graphs of one runner, keyed by (padded batch size, backend variant,
    whether it applies LoRA adapters)."""

    def __init__(self, runner: Any, sizes: list[int], *, twin: bool) -> None:
        self.runner = runner
        self.sizes = sizes
        self.twin = twin
        self.lora = runner.lora  # acb.runner.lora.LoraLayers, or None
        dev = runner.device
        max_b = sizes[-1]
        pad = [0, 0, -1, 0, runner.inputs.scratch_row] + ([0] if self.lora is not None else [])
        self.static = torch.zeros((len(pad), max_b), dtype=torch.long, device=dev)
        self.pad = torch.tensor(pad, dtype=torch.long, device=dev)[:, None]
        self.static.copy_(self.pad.expand(len(pad), max_b))
        self.qsl = torch.arange(max_b + 1, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int, bool], EagerGraph | CudaGraph] = {}
        self.variants: dict[int, list[int]] = {}
        self.replays: dict[tuple[int, int, bool], int] = {}  # how often each graph ran (tests, stats)
        self.capture_s = 0.0
        self.capture_bytes = 0

    # ------------------------------------------------------------------ capture
    def _step_fn(self, b: int, variant: int, lora: bool = False) -> Callable[[], torch.Tensor]:
        """The closure a graph freezes: a decode step of ``b`` rows read from the static buffer
        (``lora``: with the adapters' per-row update, slots from the static buffer's LORA row)."""
        r = self.runner
        st = self.static
        table = r.inputs.block_table_dev
        rows = st[ROW, :b]
        ids, pos = st[IDS : IDS + 1, :b], st[POS : POS + 1, :b]
        logits_idx = self.qsl[:b]

        def step() -> torch.Tensor:
            attn = BatchInputs(
                slot_mapping=st[SLOT, :b],
                block_table=table.index_select(0, rows),
                seq_lens=st[LEN, :b],
                query_start_loc=self.qsl[: b + 1],
                num_new=[1] * b,
                start_pos=[0] * b,
                max_seq_len=0,
            )
            ctx = StepContext(r.kv_cache, r.backend, r.backend.graph_metadata(attn, variant))
            batch = PreparedBatch(
                input_ids=ids, position_ids=pos, logits_indices=logits_idx, attn=attn, rows=rows, decode_only=True
            )
            return r.forward(batch, ctx)

        if not lora:
            return step
        assert self.lora is not None
        layers, lora_slots = self.lora, st[LORA, :b]

        def with_adapters() -> torch.Tensor:
            with entered("lora", layers.graph_step(logits_idx, lora_slots)):
                return step()

        return with_adapters

    @torch.inference_mode()
    def capture_all(self) -> None:
        r = self.runner
        kvh = r.kv_cache.spec.num_kv_heads
        t0 = time.perf_counter()
        cuda = not self.twin
        if cuda:
            torch.cuda.synchronize(r.device)
            free_before = torch.cuda.mem_get_info(r.device)[0]
        pool = torch.cuda.graph_pool_handle() if cuda else None
        if self.lora is not None:  # every target's buffers exist before any graph reads them
            self.lora.prepare_graphs()
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
            self.variants[b] = r.backend.graph_variants(b, kvh, r.cfg.max_model_len, r.device)
            for v in self.variants[b]:
                for lora in (False, True) if self.lora is not None else (False,):
                    g = EagerGraph() if self.twin else CudaGraph(pool)
                    g.capture(self._step_fn(b, v, lora))
                    self.graphs[(b, v, lora)] = g
                    self.replays[(b, v, lora)] = 0
        if cuda:
            torch.cuda.synchronize(r.device)
            self.capture_bytes = max(0, free_before - torch.cuda.mem_get_info(r.device)[0])
        self.capture_s = time.perf_counter() - t0
        logger.info(
            "captured %d decode graphs (batch sizes %s) in %.2f s, %.1f MiB",
            len(self.graphs),
            self.sizes,
            self.capture_s,
            self.capture_bytes / 2**20,
        )

    # ------------------------------------------------------------------ replay
    def key_for(self, num_seqs: int, max_seq_len: int, lora: bool = False) -> tuple[int, int, bool] | None:
        i = bisect.bisect_left(self.sizes, num_seqs)
        if i == len(self.sizes) or (lora and self.lora is None):
            return None
        b = self.sizes[i]
        r = self.runner
        v = r.backend.graph_variant(self.variants[b], b, r.kv_cache.spec.num_kv_heads, max_seq_len, r.device)
        return b, v, lora

    def run(self, batch: PreparedBatch) -> torch.Tensor | None:
        """Replay the graph for this decode-only step; logits of its sampling rows, or None when
        no graph fits (more sequences than the largest size; adapter rows without their per-token
        slots)."""
        n = len(batch.attn.num_new)
        lora = batch.lora
        if lora is not None and lora.per_token is None:
            return None
        key = self.key_for(n, batch.attn.max_seq_len, lora is not None)
        if key is None:
            return None
        b = key[0]
        st = self.static
        a = batch.attn
        cols = [batch.input_ids[0], batch.position_ids[0], a.slot_mapping, a.seq_lens, batch.rows]
        if lora is not None:
            assert lora.per_token is not None
            cols.append(lora.per_token)
        st[: len(cols), :n] = torch.stack(cols)  # (a base step leaves the LORA row as it was: unread)
        if b > n:
            st[:, n:b] = self.pad  # rows a larger earlier step left behind
        out = self.graphs[key].replay()
        self.replays[key] += 1
        return out[:n] if batch.logits_identity else out.index_select(0, batch.logits_indices)

    # ------------------------------------------------------------------ check
    @torch.inference_mode()
    def self_check(self) -> str | None:
        """Replay vs the eager forward at the smallest and largest sizes, every split variant, on a
        synthetic step whose rows have different context lengths (up to 4k tokens, 130 for the CPU
        twin, so the split variant really splits) through the block table's scratch row (every
        page is block 0); None when they agree. Same kernels on the same inputs, so they should
        agree to rounding; a stale or mis-wired graph is off by far more. With LoRA on, the
        adapters' graphs too, their rows spread over every slot.

        The step stores nothing (slot -1 on every row): were every row to write its new K/V into
        the same slot, as the check once did, a GPU's store kernel (one program per row) would
        race, the eager and the replayed forward would read different caches, and the check would
        fail at large batch with nothing wrong in the graphs (an H100 saw 5.1 against a tolerance
        of 0.036 at batch 256). Storing is checked by the parity tests."""
        r = self.runner
        longest = max(1, min(r.cfg.max_model_len, 130 if self.twin else 4096))  # the interpreter is slow
        for b in (self.sizes[0], self.sizes[-1]):
            lens = torch.tensor([1 + (250 + 389 * i) % longest for i in range(b)], device=self.static.device)
            cols = [
                torch.full_like(lens, 7),
                lens - 1,
                torch.full_like(lens, -1),
                lens,
                torch.full_like(lens, r.inputs.scratch_row),
            ]
            if self.lora is not None:  # rows on every slot (an empty one adds zeros; at wake-up, adapters)
                cols.append(torch.arange(b, device=lens.device) % (self.lora.max_loras + 1))
            rows = torch.stack(cols)
            for _, v, lora in [key for key in self.graphs if key[0] == b]:
                st = self.static
                st[:, :b] = rows
                want = self._step_fn(b, v, lora)().float()
                got = self.graphs[(b, v, lora)].replay()[:b].float()
                st.copy_(self.pad.expand_as(st))
                if not torch.isfinite(want).all():
                    return f"eager logits at batch {b} are not finite"
                tol = 1e-2 * max(1.0, want.abs().max().item())
                err = (want - got).abs().max().item()
                if not err <= tol:
                    return (
                        f"replay at batch {b} (split variant {v}{', LoRA' if lora else ''}) differs from eager by "
                        f"{err:.3g} (tolerance {tol:.3g})"
                    )
        return None
