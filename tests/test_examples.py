"""Every script in examples/ runs, as a user would run it (a subprocess, the embedded model)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    p = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_every_example_is_tested():
    tested = {
        "eval_dataset.py",
        "tracing.py",
        "openai_client.py",
        "async_app.py",
        "grpo_loop.py",
        "grpo_trl.py",
        "lm_eval_acb.py",
        "ray_data_offline.py",
        "score_choices.py",
    }
    # lm_eval_acb.py: tests/integrations/test_lm_eval.py; ray_data_offline.py: tests/distributed/test_ray.py
    assert {p.name for p in (ROOT / "examples").glob("*.py")} == tested


def test_grpo_loop(tmp_path):
    """Each round's samples (tokens and logprobs) are, bit for bit, a fresh engine's on a copy of
    the round's weights: the same kernels on the same batches, so equal by construction unless
    the long-lived engine ran on something stale (round 2 follows an optimizer step). The
    sampler's logprobs equal the trainer's forward's exactly: the engine runs batch_invariant=True
    and the trainer under acb.runner.batch_invariant.enabled (without the mode they differ by up to
    ~1e-4 on this model)."""
    import re

    p = _run("grpo_loop.py", "--rounds", "2", "-n", "3", "--max-new-tokens", "8", cwd=tmp_path)
    rounds = re.findall(
        r"round (\d): 4 prompts x 3 samples, .* max \|sampler - trainer logprob\| (\S+), "
        r"a fresh engine samples the same: (\w+), slept freeing (\S+) MiB",
        p.stdout,
    )
    assert [r[0] for r in rounds] == ["1", "2"], p.stdout
    assert all(r[2] == "True" and float(r[3]) > 0 for r in rounds), p.stdout
    assert all(float(r[1]) == 0.0 for r in rounds), p.stdout  # sampler == trainer, bit for bit
    resets = re.search(r"engine: 24 sequences generated, prefix cache dropped (\d+) times", p.stdout)
    assert resets and int(resets.group(1)) >= 1, p.stdout  # round 2 saw the optimizer step


def test_grpo_trl(tmp_path):
    pytest.importorskip("trl")
    p = _run("grpo_trl.py", "--steps", "2", cwd=tmp_path)
    assert "trained 2 steps" in p.stdout and "acb generated 16 completions in 2 rounds" in p.stdout, p.stdout


def test_eval_dataset(tmp_path):
    p = _run("eval_dataset.py", "--out", "answers.jsonl", "--max-new-tokens", "4", cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(isinstance(r["generated"], str) and "correct" in r for r in rows)
    assert f"{sum(r['correct'] for r in rows)}/5 correct" in p.stdout


def test_score_choices(tmp_path):
    """The four sample questions share the preamble: after the first, every context reads it
    from the prefix cache."""
    import re

    p = _run("score_choices.py", cwd=tmp_path)
    m = re.search(r"(\d)/4 correct \(.*\); (\d+) of (\d+) context tokens read from the prefix cache", p.stdout)
    assert m, p.stdout
    assert int(m.group(2)) >= 3 * 176  # the 3 later contexts read the 182-token preamble's 11 full blocks of 16


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


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(argv: list[str], port: int, path: str, cwd: Path):
    """Start a server process and wait until ``path`` answers 200."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail("the server did not start")


def test_openai_client_against_acb_serve(tmp_path):
    """As its docstring says: ``acb serve --model ./my-checkpoint``, then the client with no model
    name (it asks the server which it serves; a fixed default would be a 404 here)."""
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from acb.models import build_tokenizer, default_model

    default_model().save_pretrained(tmp_path / "my-checkpoint")
    build_tokenizer().save_pretrained(tmp_path / "my-checkpoint")
    port = _port()
    server = _serving(
        [
            sys.executable,
            "-m",
            "acb",
            "serve",
            "--model",
            "./my-checkpoint",
            "--port",
            str(port),
            "--num-blocks",
            "128",
            "--page-size",
            "16",
        ],
        port,
        "/health",
        tmp_path,
    )
    try:
        p = _run("openai_client.py", "--base-url", f"http://127.0.0.1:{port}/v1", cwd=tmp_path)
    finally:
        server.terminate()
        server.wait(30)
    assert "model: my-checkpoint" in p.stdout
    assert "chat:" in p.stdout and "streamed tokens:" in p.stdout
    streamed = int(p.stdout.split("streamed tokens:")[1].split()[0])
    assert 1 <= streamed <= 16


def test_async_app_streams_text(tmp_path):
    pytest.importorskip("fastapi")
    port = _port()
    app = _serving(
        [sys.executable, str(ROOT / "examples" / "async_app.py"), "--port", str(port)],
        port,
        "/generate?prompt=warm&max_new_tokens=1",
        tmp_path,
    )
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/generate?prompt=Hello&max_new_tokens=12")
        r = conn.getresponse()
        body = r.read().decode("utf-8")
        assert r.status == 200 and r.getheader("content-type").startswith("text/plain")
        assert len(body) > 0
    finally:
        app.terminate()
        app.wait(30)
