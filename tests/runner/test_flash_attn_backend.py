"""The flash_attn backend's calls, checked against a pure-torch double of flash-attn's documented
API (``tests/fakes/flash_attn.py``; flash-attn itself needs CUDA and is not in CI) and against
the torch backend. New K/V go through acb's Triton store kernel, so on CPU this runs under
``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import acb  # noqa: E402
from acb.models import tiny_model  # noqa: E402
from acb.runner.attention import AttentionCall, BatchInputs, StepContext, check_backend, flash_attn_backend  # noqa: E402
from acb.runner.attention import triton_kernels as tk  # noqa: E402
from acb.runner.attention.torch_backend import TorchBackend  # noqa: E402
from acb.runner.kv_cache import KVCache, KVSpec  # noqa: E402
from tests.conftest import prompts_of_lengths, reference_generate  # noqa: E402
from tests.fakes import flash_attn as fake  # noqa: E402

if not tk.interpreted():
    pytest.skip("runs the flash-attn double on CPU (TRITON_INTERPRET=1)", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.*")
CPU = torch.device("cpu")


@pytest.fixture
def fake_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    before = dict(fake.calls)
    yield fake
    fake.calls.update(before)


def test_unavailable_reasons(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    assert "CUDA" in flash_attn_backend.unavailable_reason(CPU, torch.bfloat16, None)
    cuda = torch.device("cuda")
    assert "fp16/bf16" in flash_attn_backend.unavailable_reason(cuda, torch.float32, None)
    assert "multiple of 256" in flash_attn_backend.unavailable_reason(cuda, torch.bfloat16, 32)
    assert flash_attn_backend.unavailable_reason(cuda, torch.bfloat16, 512) is None
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert "not installed" in flash_attn_backend.unavailable_reason(cuda, torch.bfloat16, None)


def test_explicit_flash_attn_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="flash_attn.*cannot run here"):
        acb.Engine(tiny_model("llama"), acb.ContinuousBatchingConfig(attn_backend="flash_attn", num_blocks=8)).start()


@pytest.mark.parametrize(
    "num_new,start_pos,window,softcap",
    [
        ([1, 1, 1, 1], [6, 0, 300, 12], None, None),  # decode only: flash_attn_with_kvcache
        ([1, 9, 1, 4, 1], [20, 0, 3, 270, 0], None, None),  # mixed: flash_attn_varlen_func
        ([1, 9, 1, 4, 1], [20, 0, 3, 11, 0], 7, None),
        ([12, 1, 5], [0, 33, 8], None, 3.0),
        ([1, 1], [40, 3], 5, 2.0),
    ],
)
def test_backend_matches_torch(fake_flash_attn, num_new, start_pos, window, softcap):
    bs, hkv, heads, d = 256, 2, 4, 16
    seq_lens = [s + n for s, n in zip(start_pos, num_new)]
    cols = max(-(-n // bs) for n in seq_lens)
    nb = 1 + len(seq_lens) * cols
    spec = KVSpec.uniform(1, hkv, d, torch.float32)
    g = torch.Generator().manual_seed(5)
    ctx_k = torch.randn(nb, bs, hkv, d, generator=g)
    caches = [KVCache(spec, nb, bs, CPU) for _ in range(2)]
    for c in caches:
        c.k[0].copy_(ctx_k)
        c.v[0].copy_(ctx_k.flip(0))
    bt = (torch.randperm(nb - 1, generator=g) + 1)[: len(seq_lens) * cols].view(len(seq_lens), cols)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(start_pos, num_new)])
    seq_of = torch.repeat_interleave(torch.arange(len(num_new)), torch.tensor(num_new))
    slots = bt[seq_of, pos // bs] * bs + pos % bs
    qsl = torch.tensor([0] + torch.tensor(num_new).cumsum(0).tolist())
    batch = BatchInputs(
        slot_mapping=slots,
        block_table=bt,
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=qsl,
        num_new=num_new,
        start_pos=start_pos,
        max_seq_len=max(seq_lens),
    )
    t = len(slots)
    query = torch.randn(1, t, heads, d, generator=g).transpose(1, 2)
    key = torch.randn(1, t, hkv, d, generator=g).transpose(1, 2)
    value = torch.randn(1, t, hkv, d, generator=g).transpose(1, 2)
    outs = []
    for backend, cache in zip((TorchBackend(), flash_attn_backend.FlashAttnBackend()), caches):
        ctx = StepContext(cache, backend, backend.build_metadata(batch, bs))
        outs.append(
            backend.forward(
                0, query, key, value, ctx, AttentionCall(scaling=0.25, sliding_window=window, softcap=softcap)
            )
        )
    assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])
    assert outs[1].shape == (1, t, heads, d)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    decode_only = t == len(num_new)
    assert fake.calls["kvcache" if decode_only else "varlen"] > 0


def test_start_up_check_uses_both_entry_points(fake_flash_attn):
    calls = dict(fake.calls)
    assert check_backend(flash_attn_backend.FlashAttnBackend(), CPU, torch.float32, block_size=256) is None
    assert fake.calls["varlen"] > calls["varlen"] and fake.calls["kvcache"] > calls["kvcache"]


@pytest.mark.parametrize("arch,graphs", [("llama", False), ("mistral", True)])
def test_engine_parity_with_generate(fake_flash_attn, monkeypatch, arch, graphs):
    # the double runs on CPU in float32; the real kernels need CUDA and fp16/bf16
    monkeypatch.setattr(flash_attn_backend, "unavailable_reason", lambda *a: None)
    model = tiny_model(arch)  # mistral: sliding_window=24
    prompts = prompts_of_lengths([30, 5, 17, 300], seed=12)
    refs = [reference_generate(model, p, 8) for p in prompts]
    cfg = acb.ContinuousBatchingConfig(
        attn_backend="flash_attn", num_blocks=12, max_batch_tokens=64, use_cuda_graph=graphs, max_requests_per_batch=4
    )
    with acb.Engine(model, cfg) as eng:
        assert eng.config.block_size == 256
        outs = [h.result(timeout=600) for h in [eng.submit(p, acb.SamplingParams(max_new_tokens=8)) for p in prompts]]
        if graphs:
            assert sum(eng.runner.graphs.replays.values()) > 0
    assert [o.generated_tokens for o in outs] == refs
