"""``acb serve --data-parallel 2`` (acb/serve/router.py): one router process in front of two
``acb serve`` replicas, as a real subprocess on the embedded default model, driven with the
``openai`` client. One router serves the whole module; the tests run in order, and the last
two take a replica down and then the router (SIGTERM with requests in flight: one finishes in
the grace period, eight do not and get a proper end).

Also unit tests of the routing rule and the metrics merge, without processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from acb.serve.router import (  # noqa: E402
    AFFINITY_SLACK_TOKENS, Replica, RequestInfo, _merge_exposition, choose,
)
from tests.serve.helpers import check_error_body, raw  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-dp-test"
NAME = "acb-default"
GRACE = 5.0
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo wörld"}]


# ---------------------------------------------------------------------------------------------
# routing rule and metrics merge, in-process


def _replicas(*loads: int) -> list[Replica]:
    return [Replica(index=i, port=0, alive=True, outstanding_tokens=t) for i, t in enumerate(loads)]


def test_affinity_is_stable_and_yields_to_load():
    rs = _replicas(0, 0, 0)
    key = RequestInfo.of(json.dumps({"prompt": "x" * 300 + "tail"}).encode(), chat=False, default_max_tokens=8).key
    pref, hit = choose(rs, key)
    assert hit
    # the same first 256 characters: the same replica, whatever follows
    key2 = RequestInfo.of(json.dumps({"prompt": "x" * 300 + "other"}).encode(), chat=False,
                          default_max_tokens=8).key
    assert choose(rs, key2)[0] is pref
    # within the slack: still preferred; past it: the least loaded
    pref.outstanding_tokens = AFFINITY_SLACK_TOKENS
    assert choose(rs, key) == (pref, True)
    pref.outstanding_tokens = AFFINITY_SLACK_TOKENS + 1
    other, hit = choose(rs, key)
    assert other is not pref and not hit
    # a dead preferred replica: another live one
    pref.outstanding_tokens = 0
    pref.alive = False
    assert choose(rs, key)[0] is not pref
    for r in rs:
        r.alive = False
    with pytest.raises(Exception, match="no replica"):
        choose(rs, key)


def test_request_info_estimates():
    chat = RequestInfo.of(json.dumps({"messages": CHAT, "max_completion_tokens": 100, "n": 2, "stream": True,
                                      "cache_salt": "s"}).encode(), chat=True, default_max_tokens=7)
    assert chat.stream and chat.key == b"salt:s" and chat.cost > 200
    comp = RequestInfo.of(json.dumps({"prompt": [[1, 2, 3], [4, 5]]}).encode(), chat=False, default_max_tokens=7)
    assert comp.cost == 5 + 16 * 2 and not comp.stream  # OpenAI's completions default of 16 tokens
    bad = RequestInfo.of(b"not json", chat=True, default_max_tokens=7)
    assert (bad.key, bad.cost) == (b"", 7)


def test_merge_exposition_is_valid_prometheus():
    from prometheus_client.parser import text_string_to_metric_families

    text = ("# HELP a_total things\n# TYPE a_total counter\na_total{k=\"v\"} 1.0\n"
            "# HELP g a gauge\n# TYPE g gauge\ng 2.0\ng{} 3.0\n")
    families: dict = {}
    _merge_exposition(families, text, "0")
    _merge_exposition(families, text, "1")
    merged = "\n".join(line for head, samples in families.values() for line in head + samples) + "\n"
    parsed = {f.name: f for f in text_string_to_metric_families(merged)}
    assert set(parsed) == {"a", "g"}
    assert sorted(s.labels["replica"] for s in parsed["a"].samples) == ["0", "1"]
    assert [s.labels for s in parsed["g"].samples][:2] == [{"replica": "0"}, {"replica": "0"}]


# ---------------------------------------------------------------------------------------------
# the router as a process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, timeout: float = 10) -> tuple[int, bytes]:
    return _request(port, "GET", path, timeout=timeout)[::2]


def _request(port: int, method: str, path: str, body: bytes | None = None, timeout: float = 10
             ) -> tuple[int, dict[str, str], bytes]:
    return raw(port, method, path, body, headers=AUTH, timeout=timeout)


def _stats(port: int) -> list[dict]:
    status, body = _get(port, "/router/stats")
    assert status == 200, body
    return json.loads(body)["replicas"]


def _routed(port: int) -> list[int]:
    return [r["routed"] for r in _stats(port)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Router:
    def __init__(self, log: Path) -> None:
        self.port = _free_port()
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("ACB_API_KEY", None)
        self.log_path = log
        self._log = open(log, "w", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "acb", "serve", "--data-parallel", "2", "--port", str(self.port),
             "--num-blocks", "64", "--api-key", KEY, "--grace-period", str(GRACE)],
            cwd=log.parent, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"router exited with {self.proc.returncode}:\n{self.tail()}"
            try:
                if _get(self.port, "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        pytest.fail(f"router not ready after {timeout} s:\n{self.tail()}")


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    r = Router(tmp_path_factory.mktemp("dp") / "router.log")
    pids: list[int] = []
    try:
        r.wait_ready()
        pids = [s["pid"] for s in _stats(r.port)]
        yield r
    finally:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
            try:
                r.proc.wait(60)
            except subprocess.TimeoutExpired:
                r.proc.kill()
        for pid in pids:  # never leave a replica behind, whatever a test did
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        r._log.close()


@pytest.fixture(scope="module")
def client(router):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{router.port}/v1", api_key=KEY, max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of a single in-process engine on the same embedded model."""
    import acb
    from acb.cli import DEFAULT_CHAT_TEMPLATE
    from acb.models import build_tokenizer, default_model

    tok = build_tokenizer()
    tok.chat_template = DEFAULT_CHAT_TEMPLATE  # what `acb serve` gives the embedded tokenizer
    with acb.Engine(default_model(), acb.ContinuousBatchingConfig(num_blocks=64), tokenizer=tok) as eng:
        yield {"chat": eng.generate(CHAT, max_new_tokens=12, temperature=0.0).text,
               "completion": eng.generate("Hello", max_new_tokens=10, temperature=0.0).text}


def test_health_models_and_greedy_parity(router, client, reference):
    assert _get(router.port, "/health")[0] == 200
    assert [m.id for m in client.models.list().data] == [NAME]
    with pytest.raises(openai.AuthenticationError):  # the router checks the key itself
        with openai.OpenAI(base_url=f"http://127.0.0.1:{router.port}/v1", api_key="wrong", max_retries=0) as bad:
            bad.completions.create(model=NAME, prompt="x", max_tokens=1)

    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == reference["chat"]
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["chat"]

    comp = client.completions.create(model=NAME, prompt="Hello", max_tokens=10, temperature=0)
    assert comp.choices[0].text == reference["completion"]
    chunks = list(client.completions.create(model=NAME, prompt="Hello", max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference["completion"]

    status, body = _get(router.port, "/v1/nothing")
    assert status == 404 and check_error_body(body)["code"] == "not_found"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"model": "%s", "prompt": "lone \\ud800 surrogate", "max_tokens": 2}' % NAME.encode()),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}'
     % NAME.encode()),
    ("/v1/completions", b'{"model": "%s", "prompt": ' % NAME.encode() + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("/v1/completions", b'{"model": "%s", "prompt": ' % NAME.encode() + b"[" * 500 + b"1" + b"]" * 500 + b"}"),
    ("/v1/chat/completions", b'{"model": "%s", "messages": ' % NAME.encode() + b"[" * 100_000 + b"]" * 100_000
     + b"}"),
], ids=["surrogate-prompt", "surrogate-message", "deep-json", "deep-prompt", "deep-messages"])
def test_bodies_the_router_cannot_read_get_the_servers_400(router, path, body):
    """Lone UTF-16 surrogates and deeply nested JSON: the replica's 400, not the router's 500."""
    status, _, data = _request(router.port, "POST", path, body)
    assert status == 400, data[:300]
    assert check_error_body(data)["type"] == "invalid_request_error"


def test_load_spreads_over_both_replicas(router, client):
    before = _routed(router.port)

    def one(i: int) -> int:
        r = client.completions.create(model=NAME, prompt=f"request number {i}: " + "abc" * i, max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(16))) == [8] * 16
    delta = [a - b for a, b in zip(_routed(router.port), before)]
    assert sum(delta) == 16 and min(delta) > 0, delta
    assert all(r["in_flight"] == 0 and r["outstanding_tokens"] == 0 for r in _stats(router.port))

    # /metrics: valid Prometheus text with both replicas' series and the router's counters
    from prometheus_client.parser import text_string_to_metric_families

    status, body = _get(router.port, "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    routed = {s.labels["replica"]: s.value for s in families["acb_router_requests_routed"].samples}
    assert routed == {str(r["index"]): float(r["routed"]) for r in _stats(router.port)}
    engine_series = [f for name, f in families.items() if name.startswith("acb_") and "router" not in name]
    assert engine_series and {s.labels.get("replica") for f in engine_series for s in f.samples} == {"0", "1"}


def test_prefix_affinity(router, client):
    prefix = "You are a careful assistant. " * 12  # > 256 characters: the affinity key
    before = _stats(router.port)
    for i in range(5):
        client.completions.create(model=NAME, prompt=prefix + f"question {i}?", max_tokens=2, temperature=0)
    after = _stats(router.port)
    delta = [a["routed"] - b["routed"] for a, b in zip(after, before)]
    assert sorted(delta) == [0, 5], delta
    assert sum(a["affinity_hits"] - b["affinity_hits"] for a, b in zip(after, before)) == 5
    # the same cache_salt: one replica, whatever the prompts
    before = _routed(router.port)
    for i in range(4):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": f"q{i} " * (i + 1)}],
                                       max_tokens=2, temperature=0, extra_body={"cache_salt": "tenant-7"})
    delta = [a - b for a, b in zip(_routed(router.port), before)]
    assert sorted(delta) == [0, 4], delta


def _wait_idle(port: int, timeout: float = 10) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(port)
        if all(r["in_flight"] == 0 and r["outstanding_tokens"] == 0 for r in stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_client_going_away_releases_its_replica(router, stream):
    """A client that leaves mid-request: the router closes the upstream request (the replica
    then cancels it) and its books return to zero, long before 1500 tokens could be made."""
    body = json.dumps({"model": NAME, "prompt": f"leave early {stream}", "max_tokens": 1500, "temperature": 0,
                       "ignore_eos": True, "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", router.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        if stream:
            got = b""
            while b"data:" not in got:  # until streaming has begun
                chunk = s.recv(65536)
                assert chunk, got
                got += chunk
        else:
            deadline = time.monotonic() + 10
            while not any(r["in_flight"] for r in _stats(router.port)):
                assert time.monotonic() < deadline
                time.sleep(0.02)
    t0 = time.monotonic()
    stats = _wait_idle(router.port)
    assert all(r["in_flight"] == 0 and r["outstanding_tokens"] == 0 for r in stats), stats
    assert time.monotonic() - t0 < 5
    assert all(r["alive"] for r in stats)


def test_replica_death_fails_its_requests_and_spares_the_rest(router, client):
    stream = client.completions.create(model=NAME, prompt="a long one", max_tokens=1500, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)  # it runs
    busy = [r for r in _stats(router.port) if r["in_flight"] == 1]
    assert len(busy) == 1, _stats(router.port)
    victim = busy[0]
    os.kill(victim["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for chunk in it:
            assert not (chunk.choices and chunk.choices[0].finish_reason), "the stream finished on a dead replica"
    assert time.monotonic() - t0 < 10  # an error, not a hang

    assert _get(router.port, "/health")[0] == 200
    before = _routed(router.port)
    for i in range(4):
        r = client.completions.create(model=NAME, prompt=f"after the crash {i}", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
    delta = [a - b for a, b in zip(_routed(router.port), before)]
    assert delta[victim["index"]] == 0 and sum(delta) == 4, delta
    dead = _stats(router.port)[victim["index"]]
    assert not dead["alive"] and dead["returncode"] is not None and dead["dead_reason"], dead


def _long_request(port: int, stream: bool, i: int) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"model": NAME, "prompt": f"endless {stream} {i}", "max_tokens": 2000, "temperature": 0,
                       "ignore_eos": True, "stream": stream}).encode()
    return _request(port, "POST", "/v1/completions", body, timeout=60)


def _events(data: bytes) -> list[str]:
    return [line[5:].strip() for line in data.decode().splitlines() if line.startswith("data:")]


def test_sigterm_drains_then_stops_replicas(router, client):
    """SIGTERM with nine requests in flight: /health and new requests get 503 during the grace
    period (the port stays open); the one that can finish does; each of the eight that cannot
    ends at the end of the grace period with an OpenAI error (a 503 body, or an error event and
    [DONE]); then the router stops the replicas and exits 0."""
    pids = [r["pid"] for r in _stats(router.port)]
    stream = client.completions.create(model=NAME, prompt="finish me", max_tokens=60, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_long_request, router.port, i % 2 == 0, i) for i in range(8)]
        deadline = time.monotonic() + 30
        while sum(r["in_flight"] for r in _stats(router.port)) < 9:
            assert time.monotonic() < deadline, _stats(router.port)
            time.sleep(0.02)
        router.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        time.sleep(0.3)
        health = _get(router.port, "/health")
        late = _request(router.port, "POST", "/v1/completions",
                        json.dumps({"model": NAME, "prompt": "late", "max_tokens": 2}).encode())
        reasons = [c.choices[0].finish_reason for c in it if c.choices and c.choices[0].finish_reason]
        results = [f.result(timeout=60) for f in futures]
    ended = time.monotonic() - t0
    assert reasons == ["length"]  # the in-flight request that could finish did
    assert health == (503, b"shutting down"), health
    assert late[0] == 503 and late[1].get("retry-after") == "1" and "shutting down" in check_error_body(late[2])["message"]
    for i, (status, headers, data) in enumerate(results):
        if i % 2 == 0:  # streamed: cut at a whole event, then an error event and [DONE]
            assert status == 200, data[-300:]
            events = _events(data)
            assert events[-1] == "[DONE]" and check_error_body(events[-2].encode())["code"] == "server_shutdown", events[-3:]
            assert not any(ch.get("finish_reason") for e in events[:-2] for ch in json.loads(e)["choices"])
        else:
            assert status == 503 and check_error_body(data)["code"] == "server_shutdown", (status, data)
    assert GRACE - 0.5 <= ended < GRACE + 10, ended
    rc = router.proc.wait(GRACE + 15)
    print(f"router exit {time.monotonic() - t0:.2f} s after SIGTERM")
    assert rc == 0, router.tail()
    assert not any(_alive(p) for p in pids), pids
