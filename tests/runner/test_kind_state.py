"""The state layers' kind at the layer level (``acb.runner.linear_state``), no engine: a row's state
snapshotted, restored, copied, offloaded to a host row and back, bitwise; a segment split where a
snapshot is taken gives what two chunks give; Mamba1's one-token-at-a-time resumption against its
whole scan. The engine-level proof (tokens equal to ``model.generate`` on every state family) is
``tests/api/test_state_layers.py``."""

from __future__ import annotations

import functools

import pytest
import torch

from acb.runner import linear_state
from acb.runner.linear_state import (
    STEPWISE,
    LinearLayers,
    LinearStates,
    _RequestCache,
    linear_layers,
    linear_step,
    resumes_prefill,
    resumes_stepwise,
)
from tests.test_model_sweep import ms


@functools.cache
def layer_of(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ms.tiny_config(arch), dtype=torch.float32).eval()
    return linear_layers(model)[0]


def hidden(arch: str, n: int, seed: int = 0) -> torch.Tensor:
    return hidden_of(ms.tiny_config(arch).get_text_config().hidden_size, n, seed)


def hidden_of(size: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, n, size, generator=torch.Generator().manual_seed(seed))


def run(layer: torch.nn.Module, states: LinearStates, row: int, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = layer(x, cache_params=_RequestCache(states, row))
    return out[0] if isinstance(out, tuple) else out


def same(a: LinearStates, ra: int, b: LinearStates, rb: int, layer: int) -> bool:
    return all(
        torch.equal(ta[layer][ra], tb[layer][rb])
        for ta, tb in ((a.conv, b.conv), (a.recurrent, b.recurrent))
        if layer in ta
    ) and (layer in a.valid[ra]) == (layer in b.valid[rb])


@pytest.mark.parametrize("arch", ["qwen3_next", "mamba2", "lfm2"])
def test_snapshot_restore_copy_and_offload_round_trips_are_bitwise(arch):
    layer = layer_of(arch)
    idx = layer.layer_idx
    states = LinearStates(
        4, torch.device("cpu"), frozenset({idx}) if arch == "lfm2" else frozenset(), slots=2, host_rows=2
    )
    run(layer, states, 0, hidden(arch, 9))
    states.snapshot(idx, 0, 1)
    run(layer, states, 0, hidden(arch, 3, seed=1))  # the row moves on; the snapshot does not
    states.restore(1, 2)
    fresh = LinearStates(1, torch.device("cpu"), states.conv_only)
    run(layer, fresh, 0, hidden(arch, 9))
    assert same(states, 2, fresh, 0, idx)  # the restored row is the state after the 9 tokens
    states.copy(0, 3)
    assert same(states, 3, states, 0, idx)
    states.swap_out(0, 1)
    states.reset(0)
    assert idx not in states.valid[0]
    states.swap_in(1, 0)
    assert same(states, 0, states, 3, idx)
    # the host rows survive a rebuild of the device states (sleep)
    again = LinearStates(4, torch.device("cpu"), states.conv_only, slots=2, host_rows=2)
    run(layer, again, 0, hidden(arch, 1))  # (the device tables exist)
    again.keep_host_rows(states)
    again.swap_in(1, 1)
    assert same(again, 1, states, 3, idx)


@pytest.mark.parametrize("arch", ["qwen3_next", "mamba2"])
def test_a_segment_split_at_a_snapshot_is_two_chunks(arch):
    """The interception runs a segment in pieces split where a snapshot is taken: what it gives is
    what two chunks give (the chunked prefill's exactness), and the slot holds the state there."""
    layer = layer_of(arch)
    idx = layer.layer_idx
    x = hidden(arch, 12, seed=3)
    intercept = LinearLayers(layer)  # (the module itself is its only state layer)
    try:
        states = LinearStates(1, torch.device("cpu"), slots=1)
        with torch.no_grad(), linear_step(states, [12], [0], [(0, 7, 0)]):
            got = layer(x)
        got = got[0] if isinstance(got, tuple) else got
    finally:
        intercept.remove()
    chunks = LinearStates(1, torch.device("cpu"))
    first = run(layer, chunks, 0, x[:, :7])
    at_seven = LinearStates(1, torch.device("cpu"))
    run(layer, at_seven, 0, x[:, :7])
    second = run(layer, chunks, 0, x[:, 7:])
    assert torch.equal(got, torch.cat([first, second], dim=1))
    assert same(states, 1, at_seven, 0, idx)  # slot 0 is row 1 of a table with one request row
    assert resumes_prefill(layer, x.shape[-1])


def test_mamba1_resumes_a_token_at_a_time_not_whole():
    """Mamba1's scan ignores a state it is handed, its one-token form reads it: the start-up tries
    say so, and stepping the rest after a state gives the whole scan's outputs to float rounding
    (the largest difference is recorded in the assertion's message)."""
    layer = layer_of("mamba")
    x = hidden("mamba", 12, seed=4)
    assert not resumes_prefill(layer, x.shape[-1])
    assert resumes_stepwise(layer, x.shape[-1]) and type(layer) in STEPWISE
    whole = run(layer, LinearStates(1, torch.device("cpu")), 0, x)
    kept = LinearStates(1, torch.device("cpu"))
    run(layer, kept, 0, x[:, :7])
    steps = torch.cat([run(layer, kept, 0, x[:, t : t + 1]) for t in range(7, 12)], dim=1)
    diff = float((steps - whole[:, 7:]).abs().max())
    assert diff <= 1e-5 * float(whole.abs().max()) + 1e-6, diff


# family -> the arguments its state layer's forward requires besides the input (MiniMax: rotary
# embeddings and a mask, which its lightning attention does not read; Zaya: its cache argument)
BATCH_ARCHS = {
    "qwen3_next": {},
    "mamba2": {},
    "mamba": {},  # Mamba1: fresh and decode rows batched, resumed ones stepped a token at a time
    "lfm2": {},
    "minimax": {"position_embeddings": None, "attention_mask": None},
    "zaya": {"past_key_values": None},
}


def step_through(layer, states, num_new, rows, x, kwargs, snapshots=()):
    with torch.no_grad(), linear_step(states, num_new, rows, snapshots):
        return layer(x, **kwargs)


def clone(states: LinearStates) -> LinearStates:
    out = LinearStates(states.rows, states.device, states.conv_only, states.slots)
    out.conv = {k: v.clone() for k, v in states.conv.items()}
    out.recurrent = {k: v.clone() for k, v in states.recurrent.items()}
    out.valid = [set(v) for v in states.valid]
    return out


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-7)


@pytest.mark.parametrize("arch", sorted(BATCH_ARCHS))
def test_prefill_segments_batched_give_what_one_call_each_gives(arch, monkeypatch):
    """A step of fresh prompts (9, 2 and 1 tokens: left-padded into one call), resumed segments
    of one length (4 tokens each: stepped together in the decode form; 10 tokens each: one call),
    decode rows (one call), a resumed segment of its own length (stepped alone), one split at a
    snapshot (its own calls),
    snapshots at two
    segments' ends: the layer's output at every token and every row's state afterwards (the
    snapshot slots' too) are what the per-request
    path gives (``BATCH_PREFILL`` off), and the batched groups were taken."""
    layer = layer_of(arch)
    idx = layer.layer_idx
    kwargs = BATCH_ARCHS[arch]
    size = ms.tiny_config(arch).get_text_config().hidden_size
    if not resumes_prefill(layer, size):  # (as the engine does at start: Mamba1 resumes a token at a time)
        assert resumes_stepwise(layer, size)
    intercept = LinearLayers(layer)
    try:
        conv_only = intercept.conv_only
        states = LinearStates(11, torch.device("cpu"), conv_only, slots=3)
        # rows 0, 1 (resumed, 4 tokens each), 9, 10 (resumed, 10 tokens each), 2, 3 (decode), 7
        # (resumed, a snapshot inside), 8 (resumed, 3 tokens) hold a state from a first step; rows
        # 4, 5, 6 start fresh
        primed = [(0, 6), (1, 3), (2, 5), (3, 2), (7, 4), (8, 7), (9, 5), (10, 8)]
        step_through(layer, states, [n for _, n in primed], [r for r, _ in primed], hidden(arch, 40, seed=5), kwargs)
        order = [(4, 9), (0, 4), (9, 10), (2, 1), (5, 2), (7, 6), (1, 4), (3, 1), (8, 3), (10, 10), (6, 1)]
        x = hidden(arch, sum(n for _, n in order), seed=6)
        num_new, rows = [n for _, n in order], [r for r, _ in order]
        # row 7's state after 3 of its 6 tokens (its own calls, split there), and rows 5 and 1's at
        # the end of their segments (taken after their batched calls)
        snapshots = [(7, 3, 0), (5, 2, 1), (1, 4, 2)]

        monkeypatch.setattr(linear_state, "BATCH_PREFILL", False)
        want_states = clone(states)
        want = step_through(layer, want_states, num_new, rows, x, kwargs, snapshots)

        monkeypatch.setattr(linear_state, "BATCH_PREFILL", True)
        calls = []
        batched = linear_state._batched
        monkeypatch.setattr(linear_state, "_batched", lambda *a: calls.append(a[8:10]) or batched(*a))
        got = step_through(layer, states, num_new, rows, x, kwargs, snapshots)
    finally:
        intercept.remove()
    # (starts fresh, stepped): the decode rows in one call; the two 4-token resumed rows stepped
    # together, the 3-token one alone (each a call per token); the two 10-token ones in one call
    # (Mamba1's stepped); the fresh rows in one call where their padded call keeps the bits (no
    # family's chunked or projected form does on CPU: a call each)
    ten = (False, type(layer) in STEPWISE)
    fresh = [(True, False)] if linear_state._batches(layer, size)[0].padded else []
    assert sorted(calls) == sorted([(False, False), (False, True), (False, True), ten, *fresh])
    pairs = list(zip(got, want)) if isinstance(want, tuple) else [(got, want)]
    for g, w in pairs:
        if g is None or w is None:  # (not per token: MiniMax's returned state)
            assert g is None and w is None
            continue
        assert g.shape == w.shape and close(g, w), float((g - w).abs().max())
    for row in range(states.rows + states.slots):
        assert states.valid[row] == want_states.valid[row]
        for table, ref in ((states.conv, want_states.conv), (states.recurrent, want_states.recurrent)):
            if idx in ref:
                assert close(table[idx][row], ref[idx][row]), (
                    row,
                    float((table[idx][row] - ref[idx][row]).abs().max()),
                )


class ElementwiseConv(torch.nn.Module):
    """A state layer whose batched call cannot change a bit: a depthwise causal convolution of
    kernel 3 written as per-element products and sums in a fixed order (a short conv's state alone,
    transformers' interface), with the padding mask its forward takes."""

    def __init__(self, size: int, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.weight = torch.nn.Parameter(torch.randn(3, size, generator=torch.Generator().manual_seed(7)))

    def forward(self, hidden_states, cache_params=None, attention_mask=None):
        if attention_mask is not None:
            hidden_states = hidden_states * attention_mask[..., None]
        n = hidden_states.shape[1]
        cols = hidden_states.transpose(1, 2)  # [B, size, n]
        if cache_params is not None:
            previous = cache_params.get_conv_state(self.layer_idx)
            cols = cache_params.update_conv_state(cols, self.layer_idx, conv_kernel_size=3)
            if previous is None:
                cols = cols[..., -n:]
        cols = torch.nn.functional.pad(cols, (2, 0))[..., -(n + 2) :]
        w = self.weight[..., None]
        out = cols[..., 2:] * w[0] + cols[..., 1:-1] * w[1] + cols[..., :-2] * w[2]
        return out.transpose(1, 2)


def test_a_layer_whose_padded_batch_keeps_the_bits_pads_prompts_together(monkeypatch):
    """Fresh prompts share a left-padded call only where the class's start-up try finds it gives a
    call each's very bits: a layer that cannot change a bit in a batch passes (its prompts of
    different lengths go in one call, and the outputs and states are those of a call each, bitwise;
    a one-token prompt keeps its own call), and fails once its pads are not zeroed nor masked."""
    size = 16
    layer = ElementwiseConv(size)
    monkeypatch.setattr(linear_state, "_BATCHES", {})
    assert linear_state._batches(layer, size)[0] == (True, True, True)
    intercept = LinearLayers(layer)
    assert intercept.conv_only == {0}
    try:
        lens = [9, 1, 2, 5, 2]
        x = hidden_of(size, sum(lens), seed=3)
        want_states = LinearStates(len(lens), torch.device("cpu"), intercept.conv_only)
        monkeypatch.setattr(linear_state, "BATCH_PREFILL", False)
        want = step_through(layer, want_states, lens, list(range(len(lens))), x, {})
        monkeypatch.setattr(linear_state, "BATCH_PREFILL", True)
        calls = []
        batched = linear_state._batched
        monkeypatch.setattr(linear_state, "_batched", lambda *a: calls.append(a[7].rows) or batched(*a))
        states = LinearStates(len(lens), torch.device("cpu"), intercept.conv_only)
        got = step_through(layer, states, lens, list(range(len(lens))), x, {})
    finally:
        intercept.remove()
    assert sorted(map(sorted, calls)) == [[0, 2, 3, 4]]  # (one group: PAD_CALL_TOKENS outweighs the pads)
    assert torch.equal(got, want)
    assert torch.equal(states.conv[0], want_states.conv[0]) and states.valid == want_states.valid

    plan = linear_state._Plan.__init__

    def unmasked(self, segs, device):
        plan(self, segs, device)
        if self.real is not None:
            self.real = torch.zeros_like(self.real)  # the pads keep the first token's input
            self.mask = None

    monkeypatch.setattr(linear_state._Plan, "__init__", unmasked)
    assert linear_state.batches_prefill(layer, size) == (False, True, True)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "mamba2", "lfm2"])
def test_fresh_prompts_of_a_step_keep_the_bits_of_a_call_each(arch, monkeypatch):
    """A step of fresh prompts of different lengths (some equal, one of one token, one shorter than
    the convolution kernel) through a state layer gives, bit for bit, the outputs and the states
    one call per prompt gives (which are each prompt's own model.generate's): a left-padded group
    moved the bits (the pads' decays in the chunk's cumulative sums), which flipped a greedy token
    on a near-tie in a Qwen3.5-shaped run."""
    layer = layer_of(arch)
    idx = layer.layer_idx
    monkeypatch.setattr(linear_state, "_BATCHES", {})  # (the start-up try, afresh)
    lens = [30, 17, 12, 12, 5, 2, 1, 40, 40]
    x = hidden(arch, sum(lens), seed=8)
    intercept = LinearLayers(layer)
    try:
        results = []
        for batched in (False, True):
            monkeypatch.setattr(linear_state, "BATCH_PREFILL", batched)
            states = LinearStates(len(lens), torch.device("cpu"), intercept.conv_only)
            out = step_through(layer, states, lens, list(range(len(lens))), x, {})
            results.append((out[0] if isinstance(out, tuple) else out, states))
    finally:
        intercept.remove()
    (want, want_states), (got, states) = results
    assert torch.equal(got, want), float((got - want).abs().max())
    assert states.valid == want_states.valid
    for table, ref in ((states.conv, want_states.conv), (states.recurrent, want_states.recurrent)):
        if idx in ref:
            assert torch.equal(table[idx], ref[idx]), float((table[idx] - ref[idx]).abs().max())
