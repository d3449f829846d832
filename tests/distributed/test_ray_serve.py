"""``acb serve --ray --num-replicas 2`` (acb/distributed/ray_serve.py, issue 31): the Ray Serve
application on a local Ray, started as a user starts it, driven by the real ``openai`` client.
One server (two one-CPU replicas) serves the module: greedy parity with ``model.generate``,
streaming, concurrent requests spread over both replicas (each response names its replica),
and a graceful stop (SIGTERM: a request in flight finishes, the process exits 0)."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")

from tests.conftest import reference_generate  # noqa: E402
from tests.serve.helpers import raw, tiny_checkpoint  # noqa: E402
from tests.serve.test_openai_server import Server, chat_ids, decode  # noqa: E402

NAME = "tiny-ray"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
CHAT = [{"role": "user", "content": "hello over ray"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "tiny-ray", TEMPLATE, 4096)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    s = Server(checkpoint.dir, ["--ray", "--num-replicas", "2", "--served-model-name", NAME,
                                "--page-size", "16", "--num-blocks", "128", "--grace-period", "20"],
               tmp_path_factory.mktemp("ray-serve-logs") / "ray.log")
    try:
        s.wait_ready(timeout=240)
        _both_replicas_known(s)
        yield s
    finally:
        rc = s.stop(timeout=60)
        assert rc in (0, None), f"acb serve --ray exited with {rc} on SIGTERM:\n{s.tail()}"


def _both_replicas_known(server, timeout: float = 90) -> None:
    """Serve's routers learn of replicas asynchronously: until both answered, the first requests
    may all go to the one the ingress's router knew first."""
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    i = 0
    while len(seen) < 2 and time.monotonic() < deadline:
        status, headers, _ = raw(server.port, "POST", "/v1/completions",
                                 {"model": NAME, "prompt": f"warm-up {i}", "max_tokens": 1})
        i += 1
        if status == 200:
            seen.add(headers.get("x-acb-replica"))
        else:
            time.sleep(0.2)
    assert len(seen) == 2, f"only {seen} answered within {timeout} s:\n{server.tail()}"


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120) as c:
        yield c


def test_greedy_parity_and_streaming(client, checkpoint):
    tok, model = checkpoint.tok, checkpoint.model
    ref = reference_generate(model, chat_ids(tok, CHAT), 10)
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == decode(tok, ref)
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == decode(tok, ref)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_concurrent_requests_spread_over_both_replicas(server, client, checkpoint):
    tok, model = checkpoint.tok, checkpoint.model
    prompts = [f"spread request {i}" for i in range(16)]

    def one(p):
        r = client.completions.with_raw_response.create(model=NAME, prompt=p, max_tokens=24, temperature=0,
                                                         extra_body={"ignore_eos": True})
        return r.headers.get("x-acb-replica"), r.parse().choices[0].text

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, prompts))
    replicas = {rid for rid, _ in results}
    assert len(replicas) == 2 and None not in replicas, replicas  # both replicas served some
    for p, (_, text) in zip(prompts, results):
        assert text == decode(tok, reference_generate(model, tok(p).input_ids, 24))


def test_prefix_affinity_meets_the_replica_that_holds_the_prefix(client):
    """Chats sharing a long system prompt (more than the key's 256 characters) go to one replica,
    whose prefix cache then serves the shared part (cached_tokens)."""
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    seen, cached = set(), []
    for i in range(6):
        r = client.chat.completions.with_raw_response.create(
            model=NAME, messages=[system, {"role": "user", "content": f"question {i}"}], max_tokens=2)
        seen.add(r.headers["x-acb-replica"])
        cached.append(r.parse().usage.prompt_tokens_details.cached_tokens)
    assert len(seen) == 1, seen
    assert all(c and c > 100 for c in cached[1:]), cached


def test_a_replica_killed_mid_stream(server, client):
    """Its stream ends with an SSE error event (the openai client raises); the next requests
    succeed; Serve brings the replica back."""
    import ray

    stream = client.completions.with_streaming_response.create(
        model=NAME, prompt="a long stream", max_tokens=1500, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    with stream as resp:
        victim = resp.headers["x-acb-replica"]
        lines = resp.iter_lines()
        assert any(line.startswith("data:") for line in (next(lines), next(lines), next(lines)))
        ray.init(address="auto", log_to_driver=False)
        try:
            names = [a for a in ray.util.list_named_actors(all_namespaces=True)
                     if "AcbEngine" in a["name"] and victim in a["name"]]
            assert len(names) == 1, names
            ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
        finally:
            ray.shutdown()
        rest = [line for line in lines if line.startswith("data:")]
    events = [json.loads(line[5:]) for line in rest if line.strip() != "data: [DONE]"]
    assert "error" in events[-1] and rest[-1].strip() == "data: [DONE]", rest[-3:]
    # the other replica serves meanwhile; then the killed one is replaced and serves again
    deadline = time.monotonic() + 120
    replicas = set()
    while time.monotonic() < deadline and len(replicas) < 2:
        r = client.completions.with_raw_response.create(model=NAME, prompt=f"after {time.monotonic()}",
                                                         max_tokens=2)
        assert r.parse().choices[0].finish_reason in ("length", "stop")
        replicas.add(r.headers["x-acb-replica"])
    assert len(replicas) == 2 and victim not in replicas, replicas


def test_graceful_stop_finishes_the_request_in_flight(server, checkpoint):
    """SIGTERM while a request runs: it finishes (Serve drains the replica), then the process exits 0."""
    done: dict = {}

    def long_request():
        status, _, body = raw(server.port, "POST", "/v1/completions", {
            "model": NAME, "prompt": "a long one", "max_tokens": 400, "temperature": 0, "ignore_eos": True},
            timeout=120)
        done["status"], done["body"] = status, body

    t = threading.Thread(target=long_request)
    t.start()
    deadline_wait = threading.Event()
    deadline_wait.wait(3)  # the request is running in a replica
    server.proc.send_signal(signal.SIGTERM)
    server.signalled = True
    t.join(120)
    assert done.get("status") == 200, done
    assert json.loads(done["body"])["choices"][0]["finish_reason"] == "length"
    assert server.wait_exit(90) == 0, server.tail()


def test_the_config_file_builder_checks_the_flags():
    """``serve run``'s builder takes ``acb serve``'s flags as ``argv`` (a string or a list) and
    refuses a bad one before any replica starts."""
    from acb.distributed.ray_serve import build_application, deployment_options

    app = build_application({"argv": "--num-blocks 64 --served-model-name x", "num_replicas": 2})
    assert app is not None
    with pytest.raises(ValueError, match="--no-such-flag"):
        build_application({"argv": ["--no-such-flag"]})
    auto = deployment_options(min_replicas=1, max_replicas=3)
    assert auto["autoscaling_config"]["max_replicas"] == 3 and "num_replicas" not in auto
    assert deployment_options(num_replicas=2, num_gpus=1)["ray_actor_options"]["num_gpus"] == 1


def test_the_launcher_passes_every_other_flag_to_the_replicas():
    """``acb serve --ray``'s own flags (and --host/--port: the proxy binds them) stay with the
    launcher; every other flag goes to every replica, as written. ``--data-parallel N`` is
    ``--ray --num-replicas N``, and giving both is refused."""
    from acb.cli import main
    from acb.cli.serve import _replica_argv

    argv = ["serve", "--model", "/m", "--ray", "--num-replicas=2", "--host", "0.0.0.0", "--port", "9",
            "--num-blocks", "64", "--ray-address", "auto", "--tool-call-parser", "hermes", "--data-parallel", "2"]
    assert _replica_argv(argv) == ["--model", "/m", "--num-blocks", "64", "--tool-call-parser", "hermes"]
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--data-parallel", "2", "--ray", "--num-replicas", "3"])
    assert exc.value.code == 2
