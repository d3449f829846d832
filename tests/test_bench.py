"""Smoke tests: every benchmark workload runs end to end at tiny size and writes well-formed JSON
(no timing assertions)."""

from __future__ import annotations

import json

import pytest

from acb.bench import WORKLOADS, run_workload
from acb.bench.report import markdown_for, update_readme


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # serve: acb serve alone (its baselines, transformers serve and the in-process engine, take ~25 s more)
    docs = {w: run_workload(w, size="tiny", out_dir=str(out), plot=True, baselines=w != "serve") for w in WORKLOADS}
    return out, docs


@pytest.mark.parametrize("workload", WORKLOADS)
def test_workload_json(results, workload):
    out, docs = results
    doc = docs[workload]
    with open(doc["json_path"]) as f:
        data = json.load(f)
    assert data["result"]["workload"] == workload
    for key in ("platform", "torch", "transformers", "acb", "date", "device"):
        assert data["machine"][key]
    assert data["model"]["params"] > 0 and data["size"] == "tiny"
    rows = data["result"]["rows"]
    assert rows
    if workload in ("offline", "offline-uniform"):
        assert [r["engine"] for r in rows] == ["acb", "transformers CB", "padded generate"]
        assert all(r["counts_ok"] and r["tokens_per_s"] > 0 for r in rows)
        assert data["result"]["greedy_tokens_match_transformers"] is True
        roof = data["result"]["roofline"]
        assert roof["matmul_peak_gflops"] > 0 and roof["total"] == pytest.approx(
            roof["linear"] + roof["attention"] + roof["lm_head"]
        )
        assert all(r["roofline_pct"] == pytest.approx(100 * r["gflops"] / roof["matmul_peak_gflops"]) for r in rows)
        if workload == "offline-uniform":
            assert rows[2]["wasted_tokens"] == 0
    elif workload == "shared-prefix":
        assert data["result"]["outputs_identical"] is True
        on, off = rows
        assert on["prefix_hit_rate"] > 0 and off["prefix_hit_rate"] == 0
        assert on["prefill_tokens"] < off["prefill_tokens"]
    elif workload == "online":
        for r in rows:
            assert r["ttft_s"]["p50"] > 0 and r["itl_s"]["p99"] >= r["itl_s"]["p50"] > 0
    elif workload == "eval":
        assert [r["engine"] for r in rows] == ["acb", "hf (batch 16)"]  # (hf's batch "auto" on a GPU only)
        tasks = {"fewshot_letters", "endings", "fewshot_gen", "rolling"}
        assert all(set(r["per_task"]) == tasks for r in rows)
        assert all(set(r["per_task_limited"]) == tasks | {"together", "three together"} for r in rows)
        assert data["result"]["agreement"]["ok"] is True  # acb's numbers are hf's
        assert data["result"]["agreement_limited"]["ok"] is True
        floor = data["result"]["floor"]
        assert floor["total"] == pytest.approx(floor["linear"] + floor["attention"] + floor["lm_head"])
        assert 0 < floor["floor_s"] and floor["positions"] > 0
    elif workload == "overhead":
        for r in rows:
            a = r["acb"]
            assert a["steps_measured"] > 0 and a["host_us"] == pytest.approx(
                a["schedule_us"] + a["stage_us"] + a["process_us"]
            )
            assert r["transformers"]["host_us"] > 0
        steps = data["result"]["steps"]
        assert [r["batch"] for r in steps] == [1, 4]
        for r in steps:
            for side in (r["acb"], r["generate"]):
                assert side["step_ms"] > 0
                assert side["outside_matmul_ms"] == pytest.approx(side["step_ms"] - side["matmul_ms"])
                assert "sdpa" in side["outside_ops_ms"]
            # the profiles saw every matmul of a step on both sides: the tiny Llama's 2 x 7 linears and its head
            assert r["acb"]["matmul_calls"] == r["generate"]["matmul_calls"] == 15
            assert r["greedy_tokens_equal"] is True
        tel = {t["mode"]: t for t in data["result"]["telemetry"]}
        assert set(tel) == {"off", "api", "sdk"} and all(t["host_us"] > 0 for t in tel.values())
        assert not tel["off"]["sdk_imported"] and not tel["api"]["sdk_imported"] and tel["sdk"]["sdk_imported"]
    elif workload == "serve":  # acb serve over HTTP: every level, the exact token counts, latencies measured
        assert [r["engine"] for r in rows] == ["acb serve"] * 3
        assert [r.get("concurrency", r.get("rate")) for r in rows] == [1, 4, 20.0]
        for r in rows:
            assert r["counts_ok"] and r["output_tokens"] == r["requests"] * 8 and r["tokens_per_s"] > 0
            assert r["ttft_s"]["p50"] > 0 and r["itl_s"]["p99"] >= r["itl_s"]["p50"] > 0
        assert data["model"]["vocab_size"] == 259  # the saved checkpoint's, not the in-process model's
    assert markdown_for(data).count("|") > 8
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert doc["png_path"] is None
    else:
        assert doc["png_path"].endswith(".png")


def test_update_readme(results, tmp_path):
    out, _ = results
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- acb-bench:cpu:start -->\nold\n<!-- acb-bench:cpu:end -->\nrest\n")
    # the tiny results are named cpu_<workload>_tiny.json; the README block takes cpu_*.json
    assert update_readme(str(readme), str(out), "cpu")
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro") and text.rstrip().endswith("rest")
    for w in WORKLOADS:
        assert f"**{w}**" in text


def test_gpu_check_script_runs_on_cpu(tmp_path):
    """The GPU check's own code paths, on CPU with a tiny model, so the first GPU run does not die on a typo."""
    import subprocess
    import sys

    out = tmp_path / "smoke.json"
    p = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--cpu-smoke", "--skip-compile", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    errors = {k: v["error"] for k, v in res.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    a = res["throughput A: Qwen3-0.6B"]["acb"]
    assert a["tokens"] == res["throughput A: Qwen3-0.6B"]["output_tokens"] and a["tokens_per_s"] > 0
    rows = [r for k, v in res.items() if k.startswith("decode A") for r in v]
    assert len(rows) == 6 and all(r["steps_measured"] > 0 and r["step_ms"] > 0 for r in rows)
    latent = {k: v for k, v in res.items() if k.startswith("decode MLA")}  # section 5: latent vs expanded
    assert sorted(latent) == ["decode MLA latent=False", "decode MLA latent=True"], sorted(latent)
    assert all(v and all(r["steps_measured"] > 0 and r["step_ms"] > 0 for r in v) for v in latent.values())
    assert "decode batch" in p.stdout and "wrote" in p.stdout


def test_each_benchmark_has_one_home_and_a_row():
    """What ``acb bench`` runs is in the package, one module per workload; every standalone script
    in benchmarks/ has a row in benchmarks/README.md (a reader finds what it runs and writes)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    readme = (root / "benchmarks" / "README.md").read_text()
    unlisted = [p.name for p in sorted((root / "benchmarks").glob("*.py")) if f"benchmarks/{p.name}" not in readme]
    assert unlisted == [], f"benchmarks/ scripts without a row in benchmarks/README.md: {unlisted}"
    modules = {p.stem.replace("_", "-") for p in (root / "acb" / "bench").glob("*.py")}
    assert set(WORKLOADS) <= modules, f"acb bench workloads not in acb/bench/: {sorted(set(WORKLOADS) - modules)}"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """The benchmarks on the Qwen3.5-shaped hybrid (``--arch qwen3_5``): shared-prefix, and lm-eval's
    ``acb`` against its ``hf`` on the few-shot scoring and generation tasks (the full documents)."""
    from acb.bench import eval as eval_
    from acb.bench.common import ModelSpec

    out = tmp_path_factory.mktemp("bench_hybrid")
    prefix = run_workload("shared-prefix", size="tiny", out_dir=str(out), plot=False, arch="qwen3_5")
    spec = ModelSpec("tiny", arch="qwen3_5")
    ev = eval_.run("tiny", spec, tasks=("fewshot_letters", "fewshot_gen"), docs=2, warmup=False)
    return prefix, ev


HYBRID_LAYERS = ["linear_attention"] * 3 + ["full_attention"]


def test_hybrid_shared_prefix_resumes_state_layers(hybrid):
    doc, _ = hybrid
    assert doc["json_path"].endswith("cpu_shared-prefix_qwen3_5_tiny.json")
    with open(doc["json_path"]) as f:
        data = json.load(f)
    assert data["model"]["arch"] == "qwen3_5 (random weights)" and data["model"]["layer_types"] == HYBRID_LAYERS
    r = data["result"]
    assert r["outputs_identical"] is True  # prefix cache on (snapshots restored) = off
    on, off = r["rows"]
    assert on["prefix_hit_rate"] > 0.5 and on["state_snapshot_restores"] > 0
    assert on["prefill_tokens"] < off["prefill_tokens"]
    assert off["prefix_hit_rate"] == 0 and off["state_snapshot_restores"] == 0
    assert "state snapshots restored" in markdown_for(data)


def test_hybrid_eval_agrees_with_hf(hybrid):
    _, ev = hybrid
    assert ev["model"]["arch"] == "qwen3_5 (random weights)" and ev["model"]["layer_types"] == HYBRID_LAYERS
    acb_row, hf_row = ev["rows"]
    assert [acb_row["engine"], hf_row["engine"]] == ["acb", "hf (batch 16)"]
    assert set(acb_row["per_task"]) == {"fewshot_letters", "fewshot_gen"}
    assert ev["agreement"]["ok"] is True, ev["agreement"]  # lm-eval's hf loaded the same saved checkpoint
    assert acb_row["metrics"] == hf_row["metrics"]
    floor = ev["floor"]
    assert floor["state"] > 0 and floor["total"] == pytest.approx(
        floor["linear"] + floor["attention"] + floor["state"] + floor["lm_head"]
    )
    assert acb_row["prefix"]["prefix_queries"] > 0


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """``--arch`` of a family outside the three sized ones, at the tiniest size and fewer steps:
    GPT-J (the own-cache path, whose per-request forward the null model skips), offline against
    transformers' continuous batching and padded generate, and overhead (one running count, one
    short real step)."""
    from acb.bench import offline, overhead

    out = tmp_path_factory.mktemp("bench_families")
    mp = pytest.MonkeyPatch()
    mp.setitem(offline.SIZES, "tiny", dict(offline.SIZES["tiny"], num_prompts=4, max_new=4))
    mp.setitem(overhead.SIZES, "tiny", dict(overhead.SIZES["tiny"], running=[4], steps=6))
    mp.setitem(overhead.STEP_SIZES, "tiny", dict(overhead.STEP_SIZES["tiny"], batches=[2], decode_steps=4))
    try:
        docs = [
            run_workload(w, size="tiny", out_dir=str(out), plot=False, arch="gptj") for w in ("offline", "overhead")
        ]
    finally:
        mp.undo()
    return docs


def test_family_offline_reports_a_ratio(families):
    doc, _ = families
    assert doc["json_path"].endswith("cpu_offline_gptj_tiny.json")
    with open(doc["json_path"]) as f:
        data = json.load(f)
    assert data["model"]["arch"] == "gptj (random weights)" and data["model"]["model_type"] == "gptj"
    assert data["model"]["config"].startswith("the sweep's tiny config")
    r = data["result"]
    assert [row["engine"] for row in r["rows"]] == ["acb", "transformers CB", "padded generate"]
    assert all(row["counts_ok"] for row in r["rows"])
    assert r["vs_generate"] > 0 and r["vs_generate"] == pytest.approx(r["rows"][-1]["acb_speedup"])
    assert "padded generate" in markdown_for(data)


def test_family_overhead_null_model_and_real_step(families):
    _, doc = families
    r = doc["result"]
    assert r["arch"] == "gptj" and doc["model"]["arch"] == "gptj (random weights)"
    (row,) = r["rows"]
    a = row["acb"]  # the tiny GPT-J on its own caches, its per-request forward skipped
    assert a["steps_measured"] > 0 and a["host_us"] > 0
    assert row["transformers"]["host_us"] > 0 and row["ratio"] > 0
    (step,) = r["steps"]
    assert step["batch"] == 2 and step["greedy_tokens_equal"] is True
    assert sum(step["acb"]["host_ms"].values()) > 0 and step["acb"]["step_ms"] != 0
    assert r["telemetry"] is None  # (measured on the Llama only)
    assert "tiny gptj" in markdown_for(doc)


def test_unknown_or_unbuildable_family_is_refused(capsys):
    """An unknown model type is refused before anything runs, with the close names; a family whose
    tiny config does not build says why; the CLI prints the one line and exits 2."""
    from acb.cli import main

    with pytest.raises(ValueError, match=r"unknown model type 'lama'.*did you mean 'llama'"):
        run_workload("offline", size="tiny", arch="lama", plot=False)
    with pytest.raises(ValueError, match=r"model type 'gemma4_assistant': .*(cannot be built|does not run)"):
        run_workload("overhead", size="tiny", arch="gemma4_assistant", plot=False)
    with pytest.raises(ValueError, match=r"unknown size 'small' for eval"):
        run_workload("eval", size="small", plot=False)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "offline", "--size", "tiny", "--arch", "no_such_model"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown model type 'no_such_model'" in err and "Traceback" not in err
