"""Tensor parallel under ``torchrun --nproc-per-node 2`` (gloo, CPU): every rank builds the same
engine on its shard of a ``tp_plan="auto"`` model and runs rank 0's requests in lock step.

One torchrun (``tp_run.py``) serves the module: greedy parity with the single-process
``model.generate`` for Llama and Qwen3 with GQA (chunked prefill, preemption, prefix caching,
async batching), an AsyncEngine on rank 0 streaming and cancelling, ranks started with different
settings refused at start on every rank, and a rank whose step fails making every handle on rank 0
fail instead of hanging."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from acb.models import build_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from tp_run import CONSTRAINED_REGEX, SCORE_ITEMS, prompts  # noqa: E402

ARCHS = ("llama", "qwen3")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("torchrun is not installed")
    models = tmp_path_factory.mktemp("tp_models")
    out = tmp_path_factory.mktemp("tp_out")
    vocab = len(build_tokenizer())  # the tokenizer's (every rank matches grammars and stop strings with it)
    for arch in ARCHS:  # 4 heads / 2 KV heads: one KV head per rank
        tiny_model(
            arch, num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64, vocab_size=vocab
        ).save_pretrained(models / arch)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "ACB_TP_TIMEOUT_S": "20",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    torchrun = str(Path(sys.executable).parent / "torchrun")
    p = subprocess.run(
        [torchrun, "--nproc-per-node", "2", str(Path(__file__).parent / "tp_run.py"), str(out), str(models)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    files = {f.name: json.loads(f.read_text()) for f in out.glob("*.json")}
    assert {"parity_rank0.json", "parity_rank1.json"} <= set(files), p.stderr[-4000:]
    return models, files


def _reference(models: Path, arch: str, max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models / arch, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in prompts():
            g = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            refs.append(g[0, len(p) :].tolist())
    return refs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_and_lock_step(run, arch):
    models, files = run
    lead, follow = files["parity_rank0.json"][arch], files["parity_rank1.json"][arch]
    refs = _reference(models, arch, 10)
    assert lead["outputs"] == refs
    assert lead["again"] == [r[:4] for r in refs[:3]]
    assert follow["outputs"] == [] and follow["facts"]["follower"] and not lead["facts"]["follower"]
    lf, ff = lead["facts"], follow["facts"]
    # both ranks ran the same steps, preempted and hit the prefix cache alike
    for key in ("steps", "preemptions", "prefix_hits", "finished", "num_blocks", "broadcasts"):
        assert lf[key] == ff[key], key
    assert lf["preemptions"] > 0 and lf["prefix_hits"] > 0
    assert lf["kv_heads"] == ff["kv_heads"] == 1  # each rank caches its own KV head
    pre = lead["before_constrained"]
    assert pre["broadcasts"] <= pre["steps"] + 20  # one broadcast per loop iteration


@pytest.mark.parametrize("arch", ARCHS)
def test_structured_outputs_under_tensor_parallel(run, arch):
    """Constrained sampling on rank 0 (n=2, seeded): every sample fits the regex; rank 1 ran the
    same steps (its matchers advanced alike: the parity test's step counts cover this round)."""
    import re

    _, files = run
    lead, follow = files["parity_rank0.json"][arch], files["parity_rank1.json"][arch]
    assert follow["constrained"] == [] and len(lead["constrained"]) == 4
    for samples in lead["constrained"]:
        assert len(samples) == 2 and all(re.fullmatch(CONSTRAINED_REGEX, t) for t in samples), samples


@pytest.mark.parametrize("arch", ARCHS)
def test_scoring_requests_under_tensor_parallel(run, arch):
    """Engine.score_batch on rank 0 (rank 1 follows its scoring requests): each continuation
    token's logprob is a single-process full forward's log-softmax."""
    from transformers import AutoModelForCausalLM

    models, files = run
    lead, follow = files["parity_rank0.json"][arch], files["parity_rank1.json"][arch]
    assert follow["scores"] == []
    model = AutoModelForCausalLM.from_pretrained(models / arch, dtype=torch.float32).eval()
    for (ctx, conts), got in zip(SCORE_ITEMS, lead["scores"]):
        for cont, (lps, greedy) in zip(conts, got):
            with torch.no_grad():
                lp = model(torch.tensor([ctx + cont])).logits[0].double().log_softmax(-1)
            rows = lp[len(ctx) - 1 : len(ctx) + len(cont) - 1]
            want = rows[torch.arange(len(cont)), torch.tensor(cont)].tolist()
            assert lps == pytest.approx(want, abs=1e-4)
            assert greedy == (rows.argmax(-1).tolist() == cont)


def test_async_engine_on_rank_0_streams_and_cancels(run):
    models, files = run
    lead, follow = files["parity_rank0.json"]["async"], files["parity_rank1.json"]["async"]
    ref = _reference(models, "llama", 12)[3]
    assert [t for d in lead["deltas"] for t in d] == lead["final"] == ref
    assert lead["cancelled"] == "cancelled"
    assert lead["facts"]["cancelled"] == follow["facts"]["cancelled"] == 1
    assert lead["facts"]["steps"] == follow["facts"]["steps"]
    assert "submit requests on the leader, rank 0" in files["parity_rank1.json"]["submit_refused"]


def test_ranks_started_with_different_settings_are_refused(run):
    """No SIGABRT inside gloo, no hang: every rank raises, naming each differing setting with its
    value on each rank; the group is still usable after."""
    models, files = run
    assert {"mismatch_rank0.json", "mismatch_rank1.json"} <= set(files), "the ranks did not survive it"
    for rank in (0, 1):
        got = files[f"mismatch_rank{rank}.json"]
        error = got["error"]
        assert error is not None and "different settings" in error, got
        assert "max_batch_tokens: 16 on rank 0, 8 on rank 1" in error
        assert "max_requests_per_batch: 4 on rank 0, 2 on rank 1" in error
        assert "async_batching (ContinuousBatchingConfig.use_async_batching): False on rank 0, True on rank 1" in error
        assert "num_blocks" not in error and "device" not in error  # what agrees, or may differ, is not named
        assert got["seconds"] < 15
    assert files["mismatch_rank0.json"]["after"] == _reference(models, "llama", 4)[:2]
    assert files["mismatch_rank1.json"]["after"] == []


def test_a_failing_rank_fails_every_handle(run):
    _, files = run
    lead, follow = files["die_rank0.json"], files["die_rank1.json"]
    assert "injected failure on rank 1" in follow["dead"]
    assert lead["errors"] == ["EngineDeadError"] * 4
    assert lead["seconds"] < 60  # failed, not hung
