"""The app's life in-process (acb/serve/app.py): ``/health`` and the API answer 503 until the
engine has started, then serve; shutting the server down stops the engine. A real uvicorn
server on a free port, in a thread, with the engine's start held back by the test."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

import acb  # noqa: E402
from acb.models import build_tokenizer, tiny_model  # noqa: E402
from acb.serve import ServerSettings, build_app  # noqa: E402
from tests.serve.helpers import raw  # noqa: E402


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
    app = build_app(engine, ServerSettings(name="m"), on_ready=ready.set)
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
        status, _, body = raw(port, "GET", "/health")
        assert (status, body) == (503, b"starting")
        status, headers, body = raw(port, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
        assert status == 503 and headers.get("retry-after") == "1"
        err = json.loads(body)["error"]
        assert err["type"] == "server_error" and "not ready" in err["message"]
        assert not ready.is_set()

        release.set()
        assert ready.wait(30)
        assert raw(port, "GET", "/health")[:1] == (200,)
        status, _, body = raw(
            port, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
        )
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 3
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()
    assert not engine.is_running  # the app's shutdown stopped the engine
