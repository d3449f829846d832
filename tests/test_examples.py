"""Every script in examples/ runs, as a user would run it (a subprocess, the embedded model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    p = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                       env=env, cwd=cwd, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_every_example_is_tested():
    tested = {"eval_dataset.py", "tracing.py"}
    assert {p.name for p in (ROOT / "examples").glob("*.py")} == tested


def test_eval_dataset(tmp_path):
    p = _run("eval_dataset.py", "--out", "answers.jsonl", "--max-new-tokens", "4", cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(isinstance(r["generated"], str) and "correct" in r for r in rows)
    assert f"{sum(r['correct'] for r in rows)}/5 correct" in p.stdout


def test_tracing(tmp_path):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from tests.otlp_receiver import Receiver

    with Receiver() as r:
        _run("tracing.py", "--endpoint", r.http_endpoint, cwd=tmp_path)
        spans = r.collected.spans
    parent = [s for s in spans if s["name"] == "answer-questions"]
    requests = [s for s in spans if s["scope"] == "acb"]
    assert len(parent) == 1 and len(requests) == 2
    assert {s["parent_span_id"] for s in requests} == {parent[0]["span_id"]}
    assert all(s["attrs"]["gen_ai.usage.output_tokens"] == 16 for s in requests)
    assert all(s["resource"]["service.name"] == "acb-example" for s in spans)
