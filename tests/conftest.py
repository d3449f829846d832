"""Shared fixtures: tiny models, reference generation, and the KV-leak check after every engine test.

Async tests run on asyncio (pytest-asyncio) unless marked ``anyio``: those run once per anyio
backend, asyncio and trio (anyio's pytest plugin, ``anyio_backend`` below).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os

import pytest
import torch

from acb.api.ids import RequestIds
from acb.core.engine_core import EngineCore
from acb.models import tiny_model

# the README's test command runs two pytest-xdist workers on the 2-core CI: a thread each
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
# engines (here and in the servers, trainers and workers the tests start) keep the count torch gives
# their thread, as the tests set it (torch.set_num_threads, OMP_NUM_THREADS): the tuner of
# cpu_threads="auto" would pick by the machine's load, and some float32 GEMMs round differently at
# another count, so bitwise comparisons between engines would hang on the load
# (tests/runner/test_thread_tuner.py tests "auto" itself)
os.environ["ACB_CPU_THREADS"] = "fixed"


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """Give the ``asyncio`` mark to every coroutine test not marked ``anyio``.

    pytest-asyncio runs in strict mode (pyproject): in auto mode it takes every coroutine test,
    anyio's included, and runs it on asyncio, so a ``[trio]`` test would silently run on asyncio.
    This keeps auto mode's behaviour for the other async tests. Runs before the test items are
    built (``tryfirst``), which read the marks from the function.
    """
    if not collector.istestfunction(obj, name):
        return None
    inner = obj.hypothesis.inner_test if hasattr(obj, "hypothesis") else obj
    if not inspect.iscoroutinefunction(inner):
        return None
    own = {m.name for m in getattr(obj, "pytestmark", ())}
    if (
        own & {"anyio", "asyncio"}
        or collector.get_closest_marker("anyio")
        or collector.get_closest_marker("asyncio")
        or "anyio_backend" in inspect.signature(inner).parameters
    ):
        return None
    pytest.mark.asyncio(obj)
    return None


@pytest.fixture(
    scope="module",
    params=[
        "asyncio",
        pytest.param(
            "trio",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("trio") is None, reason="trio is not installed (pip install -e .[test])"
            ),
        ),
    ],
)
def anyio_backend(request):
    """The backends ``anyio``-marked tests run on: asyncio and trio."""
    return request.param


@functools.cache
def _cached_model(arch: str, **kw):
    return tiny_model(arch, **kw)


def get_model(arch: str = "llama", **kw):
    """A cached tiny model (read-only: tests must not change its weights)."""
    return _cached_model(arch, **kw)


def reference_generate(
    model, prompt: list[int], max_new_tokens: int, *, ignore_eos: bool = False, cache=None
) -> list[int]:
    """Greedy tokens from plain ``model.generate`` on one unpadded prompt (``ignore_eos``: EOS does
    not stop it; ``cache``: resumed from a cache the prompt's first tokens filled)."""
    extra = dict(eos_token_id=None, pad_token_id=0) if ignore_eos else {}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            past_key_values=cache,
            **extra,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(autouse=True)
def kv_leak_check(monkeypatch):
    """After every test: every engine is stopped, every request ended, no KV block held."""
    cores: list[EngineCore] = []
    registries: list[RequestIds] = []
    original = EngineCore.__init__
    original_ids = RequestIds.__init__

    def tracking_init(self, *a, **kw):
        original(self, *a, **kw)
        cores.append(self)

    def tracking_ids(self):
        original_ids(self)
        registries.append(self)

    monkeypatch.setattr(EngineCore, "__init__", tracking_init)
    monkeypatch.setattr(RequestIds, "__init__", tracking_ids)
    yield cores
    for core in cores:
        if core.is_running:
            core.stop(timeout=30)
        assert not core.is_running, "engine thread did not stop"
        core.check_invariants()
        assert core.pool.num_used == 0, f"{core.pool.num_used} KV blocks still held"
        assert not core.scheduler.live, f"requests left without an outcome: {list(core.scheduler.live)}"
    for ids in registries:
        assert not ids.live, f"request ids never released: {sorted(ids.live)}"


# A wait on the engine that never ends fails after this many seconds: a hang-guard, far above what
# any test needs on a slow machine (tests wait for conditions, never for a time: no test's outcome
# may depend on the machine's speed).
HANG_GUARD = 120.0


def wait_until(cond, what: str, timeout: float = HANG_GUARD) -> None:
    """Poll ``cond()`` until it holds (from a plain thread); fails only past the hang-guard."""
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"still waiting after {timeout:.0f} s: {what}"
        time.sleep(0.002)


async def eventually(cond, what: str, timeout: float = HANG_GUARD) -> None:
    """``wait_until`` from a coroutine (asyncio or trio): poll ``cond()`` between short sleeps."""
    import anyio

    deadline = anyio.current_time() + timeout
    while not cond():
        assert anyio.current_time() < deadline, f"still waiting after {timeout:.0f} s: {what}"
        await anyio.sleep(0.002)


def prompts_of_lengths(lengths, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def triton_test_device() -> torch.device:
    """Where Triton kernel tests run: CPU under the interpreter (``TRITON_INTERPRET=1``, which
    the module must set before importing triton), else CUDA; skips the module otherwise."""
    from acb.runner.attention import triton_kernels as tk

    if tk.interpreted():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("compiled Triton kernels need CUDA (set TRITON_INTERPRET=1 on CPU)", allow_module_level=True)


def assert_scores_match_forward(engine, model, context: list[int], conts: list[list[int]]) -> None:
    """``engine.score(context, conts)``: each continuation's logprobs are a plain forward's
    log-softmax of the model on context + continuation (within 1e-4)."""
    scored = engine.score(context, conts)
    for cont, got in zip(conts, scored.continuations):
        with torch.no_grad():
            logits = model(torch.tensor([context + cont])).logits[0].float()
        want = torch.log_softmax(logits, -1)[len(context) - 1 : -1].gather(1, torch.tensor(cont)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(got.logprobs), want, atol=1e-4), (got.logprobs, want)
