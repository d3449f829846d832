"""The app's life in-process (acb/serve/app.py): ``/health`` and the API answer 503 until the
engine has started, then serve; shutting the server down stops the engine. A real uvicorn
server on a free port, in a thread, with the engine's start held back by the test."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

import acb  # noqa: E402
from acb.models import build_tokenizer, tiny_model  # noqa: E402
from acb.serve import build_app  # noqa: E402


def _get(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"} if body is not None else {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def test_503_until_the_engine_has_started_then_served():
    tok = build_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok))
    engine = acb.AsyncEngine(model, acb.ContinuousBatchingConfig(page_size=16, num_blocks=64), tokenizer=tok)
    release = threading.Event()
    real_start = engine.start

    def held_start() -> None:  # runs in a worker thread (the app starts the engine in the background)
        assert release.wait(60)
        real_start()

    engine.start = held_start  # type: ignore[method-assign]
    ready = threading.Event()
    app = build_app(engine, "m", on_ready=ready.set)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        status, _, body = _get(port, "GET", "/health")
        assert (status, body) == (503, b"starting")
        status, headers, body = _get(port, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
        assert status == 503 and headers.get("retry-after") == "1"
        err = json.loads(body)["error"]
        assert err["type"] == "server_error" and "not ready" in err["message"]
        assert not ready.is_set()

        release.set()
        assert ready.wait(30)
        assert _get(port, "GET", "/health")[:1] == (200,)
        status, _, body = _get(port, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3,
                                                                 "ignore_eos": True})
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 3
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()
    assert not engine.is_running  # the app's shutdown stopped the engine
