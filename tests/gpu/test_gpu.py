"""GPU checks (marker ``gpu``; skipped without CUDA): the engine on CUDA with the Triton backend
and async batching gives model.generate's greedy tokens (float32, so that tokens compare exactly)."""

from __future__ import annotations

import pytest
import torch

import acb
from tests.conftest import prompts_of_lengths

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _model(arch: str):
    from acb.models import tiny_model

    return tiny_model(arch).to("cuda")


def _reference(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("async_batching,graphs", [(False, False), (True, False), (True, None)])
def test_cuda_parity_triton(arch, async_batching, graphs):
    """graphs=None: the default, decode CUDA graphs on; they must have been captured and replayed."""
    model = _model(arch)
    prompts = prompts_of_lengths([1, 9, 40, 97, 130], seed=90)
    refs = [_reference(model, p, 16) for p in prompts]
    cfg = acb.ContinuousBatchingConfig(block_size=16, num_blocks=512, max_batch_tokens=64,
                                       use_async_batching=async_batching, use_cuda_graph=graphs,
                                       max_requests_per_batch=32)
    with acb.Engine(model, cfg) as eng:
        assert eng.config.attn_backend == "triton", "the Triton backend failed its start-up check"
        outs = [h.result(timeout=300) for h in [eng.submit(p, acb.SamplingParams(max_new_tokens=16)) for p in prompts]]
        if graphs is None:
            assert eng.config.cuda_graphs, "decode graphs were not captured (see the log for why)"
            assert sum(eng._fe.runner.graphs.replays.values()) > 0
    assert [o.generated_tokens for o in outs] == refs


def test_cuda_preemption_and_offload():
    model = _model("llama")
    prompts = prompts_of_lengths([20, 31, 12, 25, 9, 17, 28, 14], seed=91)
    refs = [_reference(model, p, 16) for p in prompts]
    cfg = acb.ContinuousBatchingConfig(block_size=4, num_blocks=17, safety_margin=0.0, cpu_offload_space=0.01,
                                       allow_block_sharing=False)
    with acb.Engine(model, cfg) as eng:
        outs = [h.result(timeout=300) for h in [eng.submit(p, acb.SamplingParams(max_new_tokens=16)) for p in prompts]]
        assert eng.stats.preemptions > 0
    assert [o.generated_tokens for o in outs] == refs
