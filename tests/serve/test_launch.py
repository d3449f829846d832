"""acb/serve/launch.py: a server built from settings and run inside another host's event loop
(what each Ray Serve replica does): :meth:`Server.start` runs the app's lifespan (the engine
starts; ``/health`` is 200 once it returns; ``/metrics`` is served), :meth:`Server.stop` runs its
shutdown (the engine stops, the render threads end). In a subprocess: ``build_server`` sets the
process's OpenTelemetry providers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import asyncio, json, pickle, threading, time
import httpx
import acb
from acb.model_source import ModelSource
from acb.serve import ServerSettings, build_server
from acb.serve.app import AppOptions

settings = ServerSettings(model=ModelSource(), engine=acb.ContinuousBatchingConfig(num_blocks=64, max_queue_size=3),
                          name="in-a-host", app=AppOptions(render_threads=2))
settings = pickle.loads(pickle.dumps(settings))  # as a replica receives them


def render_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("acb-render"))


async def main():
    server = build_server(settings)
    out = {"running_before": server.engine.is_running}
    await server.start()
    out["running"] = server.engine.is_running
    transport = httpx.ASGITransport(app=server.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://host") as c:
        out["health"] = (await c.get("/health")).status_code
        r = await c.post("/v1/chat/completions", json={"model": "in-a-host", "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "hi"}]})
        out["chat"] = r.status_code
        out["metrics"] = (await c.get("/metrics")).text.count("acb_requests_running")
    out["render_threads_running"] = render_threads()
    out["max_queue_size"] = server.engine.config.max_queue_size
    await server.stop()
    # the render pool's threads end once they see the close (it does not join them): wait for
    # that, bounded, rather than for a fixed time that races their exit
    deadline = time.monotonic() + 60
    while render_threads() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    out["running_after"] = server.engine.is_running
    out["render_threads_after"] = render_threads()
    print(json.dumps(out))


asyncio.run(main())
"""


def test_a_server_started_and_stopped_inside_a_host_runs_its_lifespan():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["running_before"], out["running"], out["health"], out["chat"]) == (False, True, 200, 200), out
    assert out["metrics"] >= 1 and out["max_queue_size"] == 3, out
    assert out["render_threads_running"], out  # the chat was rendered in the pool
    assert out["running_after"] is False and out["render_threads_after"] == [], out
