"""torch.compile paths: outputs are unchanged (dynamo's "eager" backend keeps this fast on CPU).

Runs in a subprocess: dynamo's import-time patching breaks Triton's interpreter for the rest of
a pytest process (the Triton kernel tests run in the same session)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import acb
    from tests.conftest import get_model, prompts_of_lengths, reference_generate

    model = get_model("llama")
    prompts = prompts_of_lengths([3, 17, 30], seed=80)
    refs = [reference_generate(model, p, 8) for p in prompts]
    cc = {"backend": "eager", "dynamic": True}
    cfg = acb.ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=16,
                                       decode_compile_config=cc, varlen_compile_config=cc)
    with acb.Engine(model, cfg) as eng:
        assert eng.core.runner.compiled_paths == {"decode", "varlen"}
        outs = [h.result(timeout=300) for h in [eng.submit(p, acb.SamplingParams(max_new_tokens=8)) for p in prompts]]
        eng.call(lambda c: c.check_invariants()).result(timeout=30)
    assert [o.generated_tokens for o in outs] == refs, "compiled forward changed greedy tokens"
    print("OK")
""")


def test_compiled_decode_and_varlen_paths_keep_greedy_parity():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
