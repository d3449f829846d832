"""Failure paths of ``acb serve``'s app (acb/serve/app.py, issue 26) that need a hand inside the
process: an engine step that fails, an error nobody planned for, a client chat template that
runs away, a slow tokenizer. One real uvicorn server on a free port, in a thread, for the
module, driven over real HTTP with the ``openai`` client (and raw HTTP for status lines and
bodies). The app trusts request chat templates, renders with one thread and a 1 s time bound.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

import acb  # noqa: E402
from acb.models import build_tokenizer, tiny_model  # noqa: E402
from acb.serve.app import build_app  # noqa: E402
from tests.serve.helpers import check_error_body, raw  # noqa: E402

NAME = "m"
FAIL_SEED = 4242  # a request with this seed fails inside an engine step
BOOM_SEED = 4343  # ...and with this one, submitting it raises an error nobody planned for
SLOW = "slow-to-tokenize"  # text with this in it takes the tokenizer SLOW_S seconds
SLOW_S = 0.7
RENDER_TIMEOUT = 1.0
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
# about 16 s of a template's own loops, and no output: far past the time bound
RUNAWAY = "{% for i in range(100000) %}{% for j in range(5000) %}{% endfor %}{% endfor %}x"
CHAT = [{"role": "user", "content": "hello"}]


def _health_latencies(port: int, stop: threading.Event) -> list[float]:
    """Seconds each ``GET /health`` took, polled until ``stop``."""
    out = []
    while not stop.is_set():
        t0 = time.monotonic()
        status, _, _ = raw(port, "GET", "/health", timeout=30)
        out.append(time.monotonic() - t0)
        assert status == 200
        time.sleep(0.05)
    return out


@pytest.fixture(scope="module")
def served():
    tok = build_tokenizer()

    class SlowTokenizer(type(tok)):  # the same tokenizer, slow on some texts
        def __call__(self, text, *a, **kw):
            texts = [text] if isinstance(text, str) else text
            if any(SLOW in t for t in texts if isinstance(t, str)):
                time.sleep(SLOW_S)
            return super().__call__(text, *a, **kw)

    tok.__class__ = SlowTokenizer
    tok.chat_template = TEMPLATE
    model = tiny_model("llama", vocab_size=len(tok))
    engine = acb.AsyncEngine(model, acb.ContinuousBatchingConfig(page_size=16, num_blocks=128), tokenizer=tok)
    ready = threading.Event()
    app = build_app(engine, NAME, on_ready=ready.set, trust_request_chat_template=True,
                    render_timeout=RENDER_TIMEOUT, render_threads=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert ready.wait(60), "the engine did not start"
        runner = engine.core.runner
        real_execute, real_submit = runner.execute, engine.submit_nowait

        def execute(sched):
            if any(r.params.seed == FAIL_SEED for r in sched.requests):
                raise RuntimeError("injected step failure")
            return real_execute(sched)

        def submit_nowait(prompt, sampling=None, **kw):
            if sampling is not None and sampling.seed == BOOM_SEED:
                raise RuntimeError("injected surprise")
            return real_submit(prompt, sampling, **kw)

        runner.execute = execute
        engine.submit_nowait = submit_nowait
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60) as client:
            yield SimpleNamespace(port=port, client=client, engine=engine, tok=tok)
    finally:
        server.should_exit = True
        thread.join(60)
    assert not thread.is_alive()
    assert not engine.is_running


def test_a_request_failing_in_the_engine_is_a_500_error_body(served):
    """Non-streamed: a 500 with an OpenAI error body (anyio's task group used to wrap the
    engine's RequestFailedError in an ExceptionGroup: a plain-text 500). Streamed: an error
    event, then [DONE]. The server serves the next request."""
    with pytest.raises(openai.InternalServerError) as e:
        served.client.completions.create(model=NAME, prompt="fail me", max_tokens=4, seed=FAIL_SEED)
    assert e.value.status_code == 500 and "injected step failure" in e.value.message
    status, _, body = raw(served.port, "POST", "/v1/chat/completions",
                           {"model": NAME, "messages": CHAT, "max_tokens": 4, "seed": FAIL_SEED})
    assert status == 500
    err = check_error_body(body)
    assert err["type"] == "server_error" and "injected step failure" in err["message"]

    with pytest.raises(openai.APIError, match="injected step failure"):
        for _ in served.client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, seed=FAIL_SEED,
                                                       stream=True):
            pass
    status, _, body = raw(served.port, "POST", "/v1/completions",
                           {"model": NAME, "prompt": "fail me", "max_tokens": 4, "seed": FAIL_SEED, "stream": True})
    assert status == 200
    events = [line[5:].strip() for line in body.decode().splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]" and "injected step failure" in check_error_body(events[-2].encode())["message"], events

    out = served.client.completions.create(model=NAME, prompt="fine", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_an_unplanned_error_is_a_500_error_body(served):
    for path, body in [("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2, "seed": BOOM_SEED}),
                       ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "max_tokens": 2,
                                                 "seed": BOOM_SEED})]:
        status, _, data = raw(served.port, "POST", path, body)
        assert status == 500, data
        err = check_error_body(data)
        assert err["type"] == "server_error" and "injected surprise" in err["message"]
    with pytest.raises(openai.InternalServerError, match="injected surprise"):
        served.client.completions.create(model=NAME, prompt="x", max_tokens=2, seed=BOOM_SEED)
    status, _, data = raw(served.port, "GET", "/v1/no-such-path")
    assert status == 404 and check_error_body(data)["code"] == "not_found"


def test_a_runaway_chat_template_is_stopped_at_the_time_bound(served):
    """A client's template (trusted here) that would loop for ~16 s: the request gets a 400
    after the 1 s bound while /health keeps answering at once, and the render thread is free
    again (the one thread of this app's pool serves the next chat at once)."""
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        health = pool.submit(_health_latencies, served.port, stop)
        t0 = time.monotonic()
        try:
            with pytest.raises(openai.BadRequestError) as e:
                served.client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2,
                                                      extra_body={"chat_template": RUNAWAY})
        finally:
            took = time.monotonic() - t0
            stop.set()
        latencies = health.result()
    assert e.value.code == "render_timeout" and "longer than" in e.value.message
    assert RENDER_TIMEOUT <= took < RENDER_TIMEOUT + 3, took
    assert len(latencies) >= 3 and max(latencies) < 0.5, latencies
    # the runaway render was stopped, not left holding the pool's only thread
    t0 = time.monotonic()
    out = served.client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2,
                                                extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2 and time.monotonic() - t0 < RENDER_TIMEOUT
    # a trusted client template is used as given
    own = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    out = served.client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1,
                                                extra_body={"chat_template_kwargs": {"chat_template": own}})
    assert out.usage.prompt_tokens == len(served.tok("<<hello>>")["input_ids"])


def test_tokenizing_is_off_the_event_loop(served):
    """A prompt that takes the tokenizer 0.7 s: /health answers at once meanwhile."""
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        health = pool.submit(_health_latencies, served.port, stop)
        time.sleep(0.1)
        try:
            out = served.client.completions.create(model=NAME, prompt=[SLOW, "quick"], max_tokens=2,
                                                   extra_body={"ignore_eos": True})
        finally:
            stop.set()
        latencies = health.result()
    assert out.usage.completion_tokens == 4
    assert len(latencies) >= 5 and max(latencies) < 0.5, latencies
