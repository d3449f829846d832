"""``acb generate`` and ``acb serve`` under ``torchrun --nproc-per-node 2`` (gloo, CPU) on the
embedded model loaded tensor-parallel: rank 0 writes the results / serves HTTP, rank 1 follows.
Both give the single-process command's greedy output."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "ACB_TP_TIMEOUT_S": "30",
    "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
}
ARGS = ["--num-blocks", "64", "--no-progress"]

pytestmark = pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not installed")


def _ids(path: Path) -> list[list[int]]:
    return [json.loads(line)["generated_ids"] for line in path.read_text().splitlines()]


def test_acb_generate_under_torchrun(tmp_path):
    gen = ["generate", "--num-prompts", "6", "--max-new-tokens", "8", *ARGS]
    tp = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "2", "-m", "acb", *gen, "--output", "tp.jsonl"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert tp.returncode == 0, tp.stderr[-3000:]
    assert tp.stderr.count("acb generate: 6 requests: 6 finished") == 1  # rank 0 reports; rank 1 follows
    single = subprocess.run(
        [sys.executable, "-m", "acb", *gen, "--output", "one.jsonl"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    assert _ids(tmp_path / "tp.jsonl") == _ids(tmp_path / "one.jsonl")
    assert all(len(ids) == 8 for ids in _ids(tmp_path / "tp.jsonl"))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_acb_serve_under_torchrun(tmp_path):
    from openai import OpenAI

    port = _port()
    server = subprocess.Popen(
        [TORCHRUN, "--nproc-per-node", "2", "-m", "acb", "serve", "--port", str(port), "--num-blocks", "64"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        import httpx

        t0 = time.monotonic()
        while True:  # /health is the readiness signal (/v1/models answers before the engine runs)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, server.stdout.read()[-3000:] if server.stdout else ""
            assert time.monotonic() - t0 < 120, "acb serve under torchrun did not come up"
            time.sleep(0.5)
        model = client.models.list().data[0].id
        full = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0)
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0, stream=True)
        )
        assert full.usage.completion_tokens == 8 and streamed == full.choices[0].text
    finally:
        server.send_signal(signal.SIGTERM)  # to torchrun, which passes it on to both ranks
        out = server.communicate(timeout=60)[0]
    # rank 0 shut the server and the engines down; rank 1 followed (no engine died on the way)
    assert "engine thread died" not in out and "acb serve: 'acb-default' ready" in out, out[-3000:]
    # the same completion from a single-process engine on the same embedded model
    import acb
    from acb.models import build_tokenizer, default_model

    with acb.Engine(default_model(), acb.ContinuousBatchingConfig(num_blocks=64), tokenizer=build_tokenizer()) as eng:
        ref = eng.generate("Hello", max_new_tokens=8, temperature=0.0)
    assert ref.text == full.choices[0].text
