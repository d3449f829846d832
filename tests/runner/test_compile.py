"""torch.compile paths: outputs are unchanged (dynamo's "eager" backend keeps this fast on CPU)."""

from __future__ import annotations

import acb
from tests.conftest import get_model, prompts_of_lengths, reference_generate


def test_compiled_decode_and_varlen_paths_keep_greedy_parity():
    model = get_model("llama")
    prompts = prompts_of_lengths([3, 17, 30], seed=80)
    refs = [reference_generate(model, p, 8) for p in prompts]
    cc = {"backend": "eager", "dynamic": True}
    cfg = acb.ContinuousBatchingConfig(block_size=8, num_blocks=64, max_batch_tokens=16,
                                       decode_compile_config=cc, varlen_compile_config=cc)
    with acb.Engine(model, cfg) as eng:
        assert set(eng._fe.core.runner._compiled) == {"decode", "varlen"}
        outs = [h.result(timeout=300) for h in [eng.submit(p, acb.SamplingParams(max_new_tokens=8)) for p in prompts]]
    assert [o.generated_tokens for o in outs] == refs
