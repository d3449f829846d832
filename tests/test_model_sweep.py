"""The catalogue sweep (``benchmarks/model_sweep.py``) on a sample, in CI.

Runs the architectures acb claims plus a deterministic sample of transformers' other causal-LM
model types through the sweep (tiny random models, acb against ``model.generate``), and checks:

- no sampled model ``failed`` (an acb exception other than a refusal at start, a failed
  request, a hang or a crash) and none ``differs`` from ``model.generate``, except the known
  issues listed below with their reason: a new failure fails CI;
- the committed table (``benchmarks/results/model_sweep.json``, ``docs/MODELS.md``) gives the
  sampled models the statuses they have now: a fix or a regression must regenerate it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from acb.bench import families

ROOT = Path(__file__).resolve().parents[1]

# The architectures acb claims to run (acb.models' tiny ones, and the newer ones acb targets).
CLAIMED = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt_oss",
    "llama4_text",
    "gemma3n_text",
    "qwen3_next",
    "qwen3_5_text",
    # latent attention (keys and values of different widths), and a layer that drops its kwargs
    "deepseek_v3",
    "minicpm3",
    "nemotron",
    # per-layer page shapes (head size or KV heads by layer kind): KV cache groups
    "gemma4_text",
    "gemma4",
    "gemma4_unified_text",
    "gemma4_unified",
    "mimo_v2_flash",
    # state layers found by their cache interface: state-space (Mamba1, Mamba2) and other linear kinds
    "mamba",
    "mamba2",
    "falcon_mamba",
    "jamba",
    "bamba",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
    "zamba2",
    "kimi_linear",
    "olmo_hybrid",
    "zaya",
    "minimax",
    "lfm2",
    "lfm2_moe",
    "lfm3",
    # indexed sparse attention (DSA): the indexers' keys paged
    "deepseek_v32",
    "glm_moe_dsa",
    "hy_v4",
    "axk2",
    # compressed sparse attention on the model's own cache
    "deepseek_v4",
    # hand-written tiny configs (their defaults cannot build a model): NoPE full-attention layers
    # among sliding ones, MoE with a sub-config per module, a shared attention block over Mamba
    "cohere_compass_text",
    "dbrx",
    "zamba",
    # the second runner path: the whole model on its own cache objects
    "gptj",
    "bloom",
    "doge",
    "moshi",
    "prophetnet",
    "rwkv",
)
SAMPLE_SIZE = 20  # others from the catalogue, drawn with SAMPLE_SEED (deterministic per transformers version)
SAMPLE_SEED = 30

# model type -> why it fails or differs today (see docs/MODELS.md); remove an entry once fixed.
# Fixed: the latent-attention models (axk1, deepseek_v2/v3, glm4_moe_lite, longcat_flash,
# minicpm3, youtu: keys and values of different widths) and nemotron (its layers drop kwargs).
# Refused at start (acb.runner.model_support): doge, diffllama, moshi, jetmoe. Fixed by the KV
# cache's groups of page shapes: mimo_v2_flash, gemma4, gemma4_text, gemma4_unified(_text).
KNOWN_ISSUES: dict[str, str] = {}


def _load_sweep() -> ModuleType:
    """benchmarks/ is not a package: load the script as module ``model_sweep`` (the name its
    forked processes import it by)."""
    if "model_sweep" in sys.modules:
        return sys.modules["model_sweep"]
    spec = importlib.util.spec_from_file_location("model_sweep", ROOT / "benchmarks" / "model_sweep.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["model_sweep"] = module
    spec.loader.exec_module(module)
    return module


ms = _load_sweep()


def sampled_types() -> list[str]:
    cat = ms.catalogue()
    claimed = [t for t in CLAIMED if t in cat]
    others = [t for t in cat if t not in claimed]
    return sorted(set(claimed) | set(ms.sample_types(others, SAMPLE_SIZE, SAMPLE_SEED)))


# the runs of the sample (the generated table has all of ms.RUNS): whole, chunked and
# preempt+async, and the own-cache run of a paged model; n=2 forks are tested in tests/api
CI_RUNS = "default,chunked,preempt+async"


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    t0 = time.monotonic()
    os.environ["ACB_SWEEP_RUNS"] = CI_RUNS  # (the workers inherit it)
    try:
        out = ms.sweep(sampled_types(), jobs=2, timeout_s=120, verbose=False)
    finally:
        del os.environ["ACB_SWEEP_RUNS"]
    print(f"swept {len(out)} model types in {time.monotonic() - t0:.0f} s")
    return out


def test_no_new_failures(results: dict[str, dict[str, Any]]) -> None:
    bad = {t: r for t, r in results.items() if r["status"] in ("failed", "differs") and t not in KNOWN_ISSUES}
    assert not bad, "acb fails or differs from model.generate on:\n" + "\n".join(
        f"  {t}: {r['status']}: {r['reason']}" for t, r in bad.items()
    )


def test_known_issues_still_listed_only_while_they_fail(results: dict[str, dict[str, Any]]) -> None:
    fixed = [t for t in KNOWN_ISSUES if t in results and results[t]["status"] not in ("failed", "differs")]
    assert not fixed, f"fixed (now {[results[t]['status'] for t in fixed]}): remove from KNOWN_ISSUES: {fixed}"


def test_claimed_architectures_run(results: dict[str, dict[str, Any]]) -> None:
    """What acb claims is built here (the sweep's tiny configs work for them) and not failing."""
    for t in CLAIMED:
        if t in results:
            assert results[t]["status"] != "cannot build", f"{t}: {results[t]['reason']}"


def test_committed_table_is_current(results: dict[str, dict[str, Any]]) -> None:
    import transformers

    table = ms.load_table()
    assert table is not None, "benchmarks/results/model_sweep.json is missing: run benchmarks/model_sweep.py"
    if table["transformers_version"] != transformers.__version__:
        pytest.skip(
            f"the table is for transformers {table['transformers_version']}, this is {transformers.__version__}"
        )
    changes = ms.status_changes(results, table)
    assert not changes, (
        "the committed model table is stale (regenerate: nice -n 10 python "
        "benchmarks/model_sweep.py):\n  " + "\n  ".join(changes)
    )
    assert (ROOT / "docs" / "MODELS.md").read_text() == ms.render_markdown(table), (
        "docs/MODELS.md is not the rendering of benchmarks/results/model_sweep.json"
    )


def test_tiny_config_keeps_each_layer_type() -> None:
    """The tiny config keeps the first layer of each distinct per-layer pattern (layer type,
    per-layer values, membership of layer-index lists); per-layer lists and indices follow."""
    d = {
        "model_type": "x",
        "num_hidden_layers": 8,
        "hidden_size": 4096,
        "num_key_value_heads": 1,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
        "intermediate_size": [11008] * 8,
        "mlp_only_layers": [3, 5],
        "eos_token_id": [50000, 50001],
    }
    out = families.shrink_config_dict(d, {})
    # kept: 0 (sliding), 3 (full, MLP-only), 5 (sliding, MLP-only), 7 (full)
    assert out["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert out["num_hidden_layers"] == 4
    assert out["intermediate_size"] == [128] * 4
    assert out["mlp_only_layers"] == [1, 2]
    assert out["hidden_size"] == 64 and out["num_key_value_heads"] == 1 and out["eos_token_id"] == [2]


def test_hand_config_lays_over_sub_configs() -> None:
    """A hand-written dict for a sub-config is laid over that sub-config (its other fields kept);
    a hand-written layer count drops the shrunk per-layer lists and overrides it does not set."""
    d = {
        "model_type": "x",
        "num_hidden_layers": 2,
        "layer_types": ["a", "b"],
        "per_layer_config": {"1": {"num_attention_heads": 2}},
        "attn_config": {"model_type": "", "kv_n_heads": 1, "clip_qkv": None},
        "vision_config": {"model_type": "v", "num_hidden_layers": 2, "mlp_layer_types": ["dense", "sparse"]},
    }
    out = families.lay_over(d, {"num_hidden_layers": 3, "attn_config": {"rope_theta": 1.0}, "vision_config": {"x": 1}})
    assert out["num_hidden_layers"] == 3 and "layer_types" not in out and "per_layer_config" not in out
    assert out["attn_config"] == {"model_type": "", "kv_n_heads": 1, "clip_qkv": None, "rope_theta": 1.0}
    assert out["vision_config"]["mlp_layer_types"] == ["dense", "sparse"] and out["vision_config"]["x"] == 1
