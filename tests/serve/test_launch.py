"""acb/serve/launch.py: a server built from settings and run inside another host's event loop
(what each Ray Serve replica does): :meth:`Server.start` runs the app's lifespan (the engine
starts; ``/health`` is 200 once it returns; ``/metrics`` is served), :meth:`Server.stop` runs its
shutdown (the engine stops, the render threads end). The settings come from ``acb serve``'s own
parser (what a replica receives), so the flags are seen to reach the app's requests through
:class:`~acb.serve.settings.ServerSettings`. In a subprocess (one for the module):
``build_server`` sets the process's OpenTelemetry providers."""

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
import asyncio, dataclasses, json, pickle, threading, time
import httpx
from acb.cli import build_parser
from acb.cli.serve import server_settings
from acb.serve import build_server

args = build_parser().parse_args(["serve", "--num-blocks", "64", "--max-queue-size", "3", "--served-model-name",
                                  "in-a-host", "--api-key", "k", "--max-prompts-per-request", "3"])
settings = dataclasses.replace(server_settings(args), render_threads=2)  # (no flag: a setting in code)
settings = pickle.loads(pickle.dumps(settings))  # as a replica receives them
AUTH = {"Authorization": "Bearer k"}


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
                                                        "messages": [{"role": "user", "content": "hi"}]},
                         headers=AUTH)
        out["chat"] = r.status_code
        out["metrics"] = (await c.get("/metrics")).text.count("acb_requests_running")
        # the flags, through the settings, in the app's requests
        out["no_key"] = (await c.get("/v1/models")).status_code
        models = (await c.get("/v1/models", headers=AUTH)).json()
        out["models"] = [m["id"] for m in models["data"]]
        r = await c.post("/v1/completions", json={"model": "in-a-host", "prompt": ["a", "b"], "n": 2,
                                                   "max_tokens": 1}, headers=AUTH)
        out["too_many"] = [r.status_code, r.json()["error"]["message"]]
    out["state_has_the_settings"] = server.app.state.acb.settings == settings
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


@pytest.fixture(scope="module")
def hosted() -> dict:
    """What the script saw of its server, started and stopped inside its own event loop."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_server_started_and_stopped_inside_a_host_runs_its_lifespan(hosted):
    out = hosted
    assert (out["running_before"], out["running"], out["health"], out["chat"]) == (False, True, 200, 200), out
    assert out["metrics"] >= 1 and out["max_queue_size"] == 3, out
    assert out["render_threads_running"], out  # the chat was rendered in the pool
    assert out["running_after"] is False and out["render_threads_after"] == [], out


def test_the_command_line_reaches_the_apps_requests_through_the_settings(hosted):
    """``acb serve``'s flags, parsed by its own parser, become the one settings object the app
    and its requests read: the served name in ``/v1/models``, the API key (401 without it),
    ``--max-prompts-per-request`` (2 prompts x n=2 is over 3: a 400 naming the limit)."""
    out = hosted
    assert out["state_has_the_settings"] is True, out
    assert (out["no_key"], out["models"]) == (401, ["in-a-host"]), out
    assert out["too_many"][0] == 400 and "at most 3 (--max-prompts-per-request)" in out["too_many"][1], out


def test_the_serve_flags_default_to_the_settings_defaults(monkeypatch):
    """``acb serve``'s flags left out give :class:`ServerSettings`' own defaults (the one place
    each is defined; the parser must not drift from it): a flag that did would serve other
    values than the settings document."""
    import dataclasses

    from acb.cli import build_parser
    from acb.cli.serve import server_settings
    from acb.serve.settings import DEFAULT_GRACE_PERIOD, ServerSettings

    monkeypatch.delenv("ACB_API_KEY", raising=False)
    parsed = server_settings(build_parser().parse_args(["serve"]))
    default = ServerSettings()
    for f in dataclasses.fields(ServerSettings):
        if f.name in ("model", "engine"):  # (the model's and engine's flags: acb.cli.common, tests/test_cli.py)
            continue
        want = DEFAULT_GRACE_PERIOD if f.name == "grace_period" else getattr(default, f.name)
        assert getattr(parsed, f.name) == want, f.name
