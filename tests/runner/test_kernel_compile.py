"""The Triton kernels compile for a real GPU (sm_90, the H100/H200), here on CPU.

The interpreter tests check what the kernels compute; this checks that the compiler accepts them
for the target the engine will meet (``tl.dot`` shapes and dtypes, layouts, shared memory), which
the interpreter never exercises. ``benchmarks/kernel_compile.py`` does the work in a subprocess,
because Triton's interpreter is chosen when triton is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOBS = str(min(4, os.cpu_count() or 1))  # specialisations compiled at a time (threads)


def _run(
    tmp_path: Path, *args: str, env_extra: dict | None = None, cache: Path | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # compile for real, not from an earlier run's cache (``cache``: this module's own sm_90 run's)
    env["TRITON_CACHE_DIR"] = str(cache or tmp_path / "triton-cache")
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernel_compile.py"), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def sm90(tmp_path_factory):
    pytest.importorskip("triton")
    tmp = tmp_path_factory.mktemp("kernel_compile")
    out = tmp / "sm90.json"
    p = _run(tmp, "--quick", "--arch", "90", "--jobs", JOBS, "--json", str(out))
    _SM90_CACHE.append(tmp / "triton-cache")
    return p, (json.loads(out.read_text()) if out.exists() else None)


_SM90_CACHE: list[Path] = []  # the sm90 fixture's Triton cache: what it compiled, compiled for real


def test_every_kernel_compiles_for_sm90(sm90):
    p, doc = sm90
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    failed = [(r["kernel"], r["case"], r.get("error")) for r in doc["records"] if not r["ok"]]
    assert not failed, failed
    assert doc["failed"] == 0 and doc["archs"] == ["sm_90"]
    kernels = {r["kernel"] for r in doc["records"]}
    assert kernels == {
        "store_kv_kernel",
        "decode_split_kernel",
        "decode_reduce_kernel",
        "prefill_kernel",
        "latent_decode_kernel",  # an MLA layer's latent pages (DeepSeek V3's 512 + 64)
        "shrink_kernel",  # LoRA (acb.runner.lora_kernels), a step's runs and a decode graph's rows
        "expand_kernel",
        "matmul_kernel",  # the batch-invariant mode's linear (acb.runner.batch_invariant_kernels)
        "row_mean_kernel",  # and its RMSNorm mean
    }
    for r in doc["records"]:
        assert r["registers"] > 0 and r["shared_bytes"] <= 227 * 1024
    assert "0 failed" in p.stdout


def test_warm_up_compiles_everything_serving_needs(sm90):
    """After ``precompile`` (the backend's first forward of each layer kind), random engine-like
    steps (batch sizes, contexts, block-table widths, split counts, decode/prefill/mixed) ask
    Triton for no new specialisation: nothing compiles mid-serving. (Before the block table's
    width was left unspecialised, contexts of <= 16 tokens or of a multiple of 256 recompiled.)"""
    p, doc = sm90
    assert doc is not None
    assert len(doc["mid_serving_compiles"]) >= 4
    assert all(v == [] for v in doc["mid_serving_compiles"].values()), doc["mid_serving_compiles"]
    assert "asks for 0 new specialisations" in p.stdout


def test_compiled_variants_cover_the_switches(sm90):
    """Each constexpr switch the engine flips was compiled both ways, for every dtype in the subset."""
    _, doc = sm90
    assert doc is not None
    seen: dict[str, set] = {}
    for r in doc["records"]:
        for name, value in r["constexprs"].items():
            seen.setdefault(name, set()).add(value)
    for switch in ("SINGLE_SPLIT", "HAS_QSL", "HAS_WINDOW", "HAS_SOFTCAP", "SKIP_DECODE", "F32", "HAS_ROWS"):
        assert seen[switch] == {True, False}, (switch, seen.get(switch))
    assert {r["case"]["dtype"] for r in doc["records"]} == {"bf16", "fp16", "fp32"}
    assert {r["case"]["head_dim"] for r in doc["records"] if "head_dim" in r["case"]} >= {80, 96, 128, 256}


def test_a_kernel_over_the_shared_memory_limit_is_reported(tmp_path, sm90):
    """The check can fail: prefill tiles of 128 x 256 keys fit in the interpreter (and on CPU, where
    all the interpreter tests pass with them) but need more shared memory than an sm_90 block
    has, so the GPU would refuse the launch; the compile check must report them. (The other
    kernels come from the sm90 run's cache; the oversized prefill tiles are new to it.)"""
    pytest.importorskip("triton")
    shim = tmp_path / "shim"
    shim.mkdir()
    # sitecustomize runs at start-up: oversized prefill tiles
    (shim / "sitecustomize.py").write_text(
        "import acb.runner.attention.triton_kernels as tk\ntk._prefill_blocks = lambda head_dim_block: (128, 256, 4)\n"
    )
    out = tmp_path / "broken.json"
    p = _run(
        tmp_path,
        "--quick",
        "--first",
        "1",  # (a layer's first forward compiles every kernel of its kind: the prefill kernel too)
        "--skip-sweep",
        "--arch",
        "90",
        "--jobs",
        JOBS,
        "--json",
        str(out),
        env_extra={"PYTHONPATH": os.pathsep.join([str(shim), str(ROOT)])},
        cache=_SM90_CACHE[0],
    )
    assert p.returncode == 1, (p.stdout + p.stderr)[-4000:]
    doc = json.loads(out.read_text())
    bad = [r for r in doc["records"] if not r["ok"]]
    assert bad and {r["kernel"] for r in bad} == {"prefill_kernel"}
    assert all("over the sm_90 limit" in r["error"] for r in bad)
    assert any(r["ok"] for r in doc["records"])  # the other kernels still compile


def test_half_precision_attention_uses_tensor_cores_and_async_copies(sm90):
    """On sm_90 the bf16/fp16 attention kernels multiply on tensor cores (prefill with Hopper's
    wgmma) and stream K/V through cp.async pipelines; an accidental fp32 upcast or a layout that
    defeats vectorised loads would show up here."""
    _, doc = sm90
    assert doc is not None
    for r in doc["records"]:
        if r["kernel"] not in ("decode_split_kernel", "prefill_kernel"):
            continue
        if r["case"]["dtype"] == "fp32":
            assert r["mma"] == "none"  # IEEE fp32, no TF32: matches torch
            continue
        assert r["mma"] == ("wgmma" if r["kernel"] == "prefill_kernel" else "mma.sync"), r
        assert r["cp_async"] > 0, r


def test_lora_kernels_compile_in_both_forms_without_mid_serving_compiles(sm90):
    """LoRA's shrink and expand kernels compile for sm_90 in each dtype (bf16/fp16 on tensor cores,
    fp32 in IEEE fp32) without spills; the decode graphs' per-row form asks for the same
    specialisations as an eager step's runs (warm-up: the per-row form; then random eager and
    per-row steps of every size ask for nothing new)."""
    _, doc = sm90
    assert doc is not None
    lora = [r for r in doc["records"] if "form" in r["case"]]
    assert {r["kernel"] for r in lora} == {"shrink_kernel", "expand_kernel"}
    assert {r["case"]["dtype"] for r in lora} == {"bf16", "fp16", "fp32"}
    for r in lora:
        assert r["ok"] and r["spill_bytes"] == 0, r
        assert r["mma"] == ("none" if r["case"]["dtype"] == "fp32" else "mma.sync"), r
    late = {k: v for k, v in doc["mid_serving_compiles"].items() if k.startswith("lora ")}
    assert len(late) >= 3 and all(v == [] for v in late.values()), late


def test_batch_invariant_kernels_compile_with_one_specialisation_for_every_row_count(sm90):
    """The batch-invariant mode's matmul compiles for sm_90 in each dtype without spills (bf16/fp16
    on Hopper's wgmma, fp32 in IEEE fp32), one specialisation per dtype for every linear shape and
    row count (1 to 600 rows and strided rows ask for nothing new: one compiled kernel, so one
    arithmetic, whatever the batch); the Triton backend's fixed-order steps need no kernel variant
    of their own (and the sweep's fixed-order steps ask for nothing new either)."""
    _, doc = sm90
    assert doc is not None
    mm = [r for r in doc["records"] if r["kernel"] == "matmul_kernel"]
    assert sorted(r["case"]["dtype"] for r in mm) == ["bf16", "fp16", "fp32"]  # one per dtype
    for r in mm:
        assert r["ok"] and r["spill_bytes"] == 0, r
        assert r["mma"] == ("none" if r["case"]["dtype"] == "fp32" else "wgmma"), r
        assert "M" not in r["constexprs"], r
    late = {k: v for k, v in doc["mid_serving_compiles"].items() if k.startswith("invariant matmul")}
    assert len(late) >= 4 and all(v == [] for v in late.values()), late
    # the backend's fixed-order steps (every query through the decode kernel, one split) ran and
    # asked for no specialisation of their own: the one-split decode kernel's, compiled for "decode"
    assert not [r for r in doc["records"] if r["case"].get("step") == "fixed"]
    assert any(r["constexprs"].get("SINGLE_SPLIT") and not r["constexprs"].get("HAS_QSL") for r in doc["records"])
