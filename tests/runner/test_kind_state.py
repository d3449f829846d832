"""The state layers' kind at the layer level (``acb.runner.linear_state``), no engine: a row's state
snapshotted, restored, copied, offloaded to a host row and back, bitwise; a segment split where a
snapshot is taken gives what two chunks give; Mamba1's one-token-at-a-time resumption against its
whole scan. The engine-level proof (tokens equal to ``model.generate`` on every state family) is
``tests/api/test_state_layers.py``."""

from __future__ import annotations

import functools

import pytest
import torch

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
    size = ms.tiny_config(arch).get_text_config().hidden_size
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
