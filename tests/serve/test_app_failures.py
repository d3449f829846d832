"""Failure paths of ``acb serve``'s app (acb/serve/app.py, issue 26) that need a hand inside the
process: an engine step that fails, an error nobody planned for, a client chat template that
runs away, a slow tokenizer, and malformed bodies (issue 36: whatever the shape of a body, the
answer is never a 500, and a refused request was never submitted to the engine). One real
uvicorn server on a free port, in a thread, for the module, driven over real HTTP with the
``openai`` client (and raw HTTP for status lines and bodies). The app trusts request chat
templates, renders with one thread and a 1 s time bound, parses ``auto`` tool calls (hermes) and
reasoning (deepseek_r1).
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

import acb  # noqa: E402
from acb.models import build_tokenizer, tiny_model  # noqa: E402
from acb.serve.app import build_app  # noqa: E402
from acb.serve.settings import ServerSettings  # noqa: E402
from tests.serve.helpers import check_error_body, raw  # noqa: E402

NAME = "m"
FAIL_SEED = 4242  # a request with this seed fails inside an engine step
BOOM_SEED = 4343  # ...and with this one, submitting it raises an error nobody planned for
SLOW = "slow-to-tokenize"  # text with this in it takes the tokenizer SLOW_S seconds
SLOW_S = 0.7
RENDER_TIMEOUT = 1.0
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# about 16 s of a template's own loops, and no output: far past the time bound
RUNAWAY = "{% for i in range(100000) %}{% for j in range(5000) %}{% endfor %}{% endfor %}x"
CHAT = [{"role": "user", "content": "hello"}]


def _health_times(port: int, stop: threading.Event) -> list[tuple[float, float]]:
    """When each ``GET /health`` was sent and answered (``time.monotonic()``), polled until ``stop``."""
    out = []
    while not stop.is_set():
        t0 = time.monotonic()
        status, _, _ = raw(port, "GET", "/health", timeout=30)
        out.append((t0, time.monotonic()))
        assert status == 200
        time.sleep(0.01)
    return out


@pytest.fixture(scope="module")
def served():
    tok = build_tokenizer()

    slow_spans: list[tuple[float, float]] = []  # when the slow tokenizer was busy

    class SlowTokenizer(type(tok)):  # the same tokenizer, slow on some texts
        def __call__(self, text, *a, **kw):
            texts = [text] if isinstance(text, str) else text
            if any(SLOW in t for t in texts if isinstance(t, str)):
                t0 = time.monotonic()
                time.sleep(SLOW_S)
                slow_spans.append((t0, time.monotonic()))
            return super().__call__(text, *a, **kw)

    tok.__class__ = SlowTokenizer
    tok.chat_template = TEMPLATE
    model = tiny_model("llama", vocab_size=len(tok))
    engine = acb.AsyncEngine(model, acb.ContinuousBatchingConfig(page_size=16, num_blocks=128), tokenizer=tok)
    ready = threading.Event()
    app = build_app(
        engine,
        ServerSettings(
            name=NAME,
            trust_request_chat_template=True,
            render_timeout=RENDER_TIMEOUT,
            render_threads=1,
            tool_call_parser="hermes",
            reasoning_parser="deepseek_r1",
        ),
        on_ready=ready.set,
    )
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

        submitted: list[object] = []  # every request the app submitted to the engine

        def submit_nowait(prompt, sampling=None, **kw):
            if sampling is not None and sampling.seed == BOOM_SEED:
                raise RuntimeError("injected surprise")
            handle = real_submit(prompt, sampling, **kw)
            submitted.append(handle)
            return handle

        runner.execute = execute
        engine.submit_nowait = submit_nowait
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60) as client:
            yield SimpleNamespace(
                port=port, client=client, engine=engine, tok=tok, submitted=submitted, slow_spans=slow_spans
            )
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
    status, _, body = raw(
        served.port,
        "POST",
        "/v1/chat/completions",
        {"model": NAME, "messages": CHAT, "max_tokens": 4, "seed": FAIL_SEED},
    )
    assert status == 500
    err = check_error_body(body)
    assert err["type"] == "server_error" and "injected step failure" in err["message"]

    with pytest.raises(openai.APIError, match="injected step failure"):
        for _ in served.client.chat.completions.create(
            model=NAME, messages=CHAT, max_tokens=4, seed=FAIL_SEED, stream=True
        ):
            pass
    status, _, body = raw(
        served.port,
        "POST",
        "/v1/completions",
        {"model": NAME, "prompt": "fail me", "max_tokens": 4, "seed": FAIL_SEED, "stream": True},
    )
    assert status == 200
    events = [line[5:].strip() for line in body.decode().splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]" and "injected step failure" in check_error_body(events[-2].encode())["message"], (
        events
    )

    out = served.client.completions.create(model=NAME, prompt="fine", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_an_unplanned_error_is_a_500_error_body(served):
    for path, body in [
        ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2, "seed": BOOM_SEED}),
        ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "max_tokens": 2, "seed": BOOM_SEED}),
    ]:
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
        health = pool.submit(_health_times, served.port, stop)
        t0 = time.monotonic()
        try:
            with pytest.raises(openai.BadRequestError) as e:
                served.client.chat.completions.create(
                    model=NAME, messages=CHAT, max_tokens=2, extra_body={"chat_template": RUNAWAY}
                )
        finally:
            took = time.monotonic() - t0
            stop.set()
        times = health.result()
    assert e.value.code == "render_timeout" and "longer than" in e.value.message
    # stopped at the bound: the template alone would run for about 16 s
    assert RENDER_TIMEOUT <= took < RENDER_TIMEOUT + 5, took
    # /health was answered while the template ran (none could be, were it run on the event loop)
    assert [(a, b) for a, b in times if t0 <= a and b <= t0 + took], (t0, took, times)
    # the runaway render was stopped, not left holding the pool's only thread (were it held, this
    # chat's render would never get a thread within its bound: a 503)
    out = served.client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 2
    # a trusted client template is used as given
    own = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    out = served.client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=1, extra_body={"chat_template_kwargs": {"chat_template": own}}
    )
    assert out.usage.prompt_tokens == len(served.tok("<<hello>>")["input_ids"])


def test_tokenizing_is_off_the_event_loop(served):
    """A prompt that keeps the tokenizer busy for 0.7 s: /health is answered meanwhile (a health
    request sent and answered while the tokenizer was busy; with tokenizing on the event loop,
    none could be)."""
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        health = pool.submit(_health_times, served.port, stop)
        try:
            out = served.client.completions.create(
                model=NAME, prompt=[SLOW, "quick"], max_tokens=2, extra_body={"ignore_eos": True}
            )
        finally:
            stop.set()
        times = health.result()
    assert out.usage.completion_tokens == 4
    (start, end), *_ = served.slow_spans[-1:]
    assert [(a, b) for a, b in times if start <= a and b <= end], (start, end, times)


# ------------------------------------------------------------------------------ malformed bodies
DEEP = "[" * 100_000 + "]" * 100_000  # JSON text nested deeper than any parser recurses
CHAT_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
TOOL_F = {
    "type": "function",
    "function": {
        "name": "f",
        "description": "d",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    },
}
FLAT_F = {"type": "function", "name": "f", "parameters": TOOL_F["function"]["parameters"], "strict": True}


def _history(calls) -> list[dict]:
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]


MALFORMED = [  # (path, body, param): each used to be a 500
    ("/v1/chat/completions", {"messages": _history("not a list")}, "messages"),
    ("/v1/chat/completions", {"messages": _history([1, "x", None])}, "messages"),
    (
        "/v1/chat/completions",
        {"messages": _history([{"id": "c1", "type": "function", "function": [1, 2]}])},
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"messages": _history([{**CHAT_CALL, "function": {"name": "f", "arguments": DEEP}}])},
        "messages",
    ),
    (
        "/v1/responses",
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
            ]
        },
        "input",
    ),
    (
        "/v1/responses",
        {"tools": [{"type": "function", "name": {"an": "object"}, "function": TOOL_F["function"]}]},
        "tools",
    ),
    ("/v1/responses", {"tools": [{"type": "function", "name": {"an": "object"}}]}, "tools"),
]


@pytest.mark.parametrize("path,body,param", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_bodies_are_400s_and_submit_nothing(served, path, body, param):
    base = (
        {"model": NAME, "max_tokens": 2}
        if path != "/v1/responses"
        else {"model": NAME, "input": "hi", "max_output_tokens": 2}
    )
    before = len(served.submitted)
    status, _, data = raw(served.port, "POST", path, {**base, **body})
    assert status == 400, data
    assert check_error_body(data, status)["param"] == param
    assert len(served.submitted) == before  # refused before anything ran in the engine


# A fuzz of body shapes: valid bodies of each endpoint, with values anywhere in them replaced by
# JSON of any shape (or removed, or joined by fields of the API's names). Whatever comes out, the
# server answers 2xx or 4xx with an OpenAI error body (a stream never ends with an internal error),
# and a request it refuses was never submitted.
BODIES = {
    "/v1/chat/completions": {
        "model": NAME,
        "max_tokens": 2,
        "temperature": 0,
        "n": 1,
        "stop": ["zz"],
        "seed": 1,
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            *_history([CHAT_CALL])[1:],
        ],
        "tools": [TOOL_F],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": True,
        "response_format": {"type": "text"},
        "logprobs": False,
        "stream_options": None,
        "chat_template_kwargs": {"greeting": "x"},
    },
    "/v1/responses": {
        "model": NAME,
        "max_output_tokens": 2,
        "temperature": 0,
        "instructions": "s",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "tools": [FLAT_F],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "text": {"format": {"type": "text"}},
        "metadata": {"k": "v"},
        "reasoning": None,
    },
    "/v1/completions": {
        "model": NAME,
        "prompt": ["x", "y"],
        "max_tokens": 2,
        "n": 1,
        "logprobs": 1,
        "structured_outputs": {"choice": ["a", "b"]},
    },
}
NAMES = [
    "role",
    "content",
    "tool_calls",
    "function",
    "name",
    "arguments",
    "type",
    "parameters",
    "tools",
    "tool_choice",
    "response_format",
    "json_schema",
    "schema",
    "structured_outputs",
    "text",
    "format",
    "input",
    "call_id",
    "output",
    "stream",
    "n",
    "strict",
    "$ref",
    "$defs",
    "id",
    "messages",
    "prompt",
    "regex",
    "choice",
    "json",
    "json_object",
    "properties",
    "items",
    "required",
    "function_call",
    "message",
]
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-3, 12)
    | st.floats(-2, 2, width=32)
    | st.sampled_from(
        [
            "",
            "f",
            "auto",
            "required",
            "none",
            "function",
            "json_schema",
            "json_object",
            "text",
            "user",
            "assistant",
            "tool",
            "object",
            "{",
            '{"a": 1}',
            "[]",
            "#",
            DEEP[:400],
        ]
    )
    | st.text(max_size=6)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=10,
)


def _paths(value, at=()):
    """Every place in a JSON value: paths of keys and indices."""
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*at, i))


@st.composite
def mutated(draw):
    path = draw(st.sampled_from(sorted(BODIES)))
    body = copy.deepcopy(BODIES[path])
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from([p for p in _paths(body) if p[:1] != ("model",)]))
        if not where:
            continue
        parent = body
        for key in where[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "remove", "add"]))
        if action == "remove" and isinstance(parent, dict):
            del parent[where[-1]]
        elif action == "add" and isinstance(parent[where[-1]], dict):
            parent[where[-1]][draw(st.sampled_from(NAMES))] = draw(JSON)
        else:
            parent[where[-1]] = draw(JSON)
    if draw(st.booleans()):
        body["stream"] = True
    return path, body


@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=mutated())
def test_no_body_shape_is_a_500(served, case):
    path, body = case
    before = len(served.submitted)
    status, headers, data = raw(served.port, "POST", path, body)
    assert status != 500 and status < 600, (status, data)
    if status != 200:
        check_error_body(data, status)
        assert len(served.submitted) == before, ("a refused request was submitted", data)
    elif headers.get("content-type", "").startswith("text/event-stream"):
        for line in data.decode().splitlines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                doc = json.loads(line[5:])
                err = doc.get("error") if isinstance(doc, dict) else None
                assert not err or err.get("type") != "server_error", (body, doc)
    else:
        json.loads(data)


LONG = "x" * 1500  # more tokens than a request may hold (the model's 1024 positions)
CHOICE = {"choice": ["a", "b"]}
ENGINE_REFUSALS = [  # (path, body, param): refused by the engine, named by the field it carries
    ("/v1/completions", {"prompt": LONG}, "prompt"),  # the input processor: a prompt that can never fit
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"100000": 1}}, "logit_bias"),  # outside the vocabulary
    ("/v1/completions", {"prompt": "hi", "n": 600}, "n"),  # more samples than the engine's rows
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 5}, "min_tokens"),  # SamplingParams
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, "top_p"),
    ("/v1/responses", {"input": "hi", "top_p": 0}, "top_p"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    # the grammar: a min_tokens no output of the constraint can reach
    (
        "/v1/chat/completions",
        {"messages": CHAT, "structured_outputs": CHOICE, "min_tokens": 2, "max_tokens": 8},
        "structured_outputs",
    ),
]


@pytest.mark.parametrize("path,body,param", ENGINE_REFUSALS, ids=range(len(ENGINE_REFUSALS)))
def test_an_engine_refusal_names_its_param(served, path, body, param):
    """The engine's refusals carry their field (acb.InvalidRequestError.field): the 400's ``param``
    is the request's name for it, read from the error, not guessed from its message."""
    base = {"model": NAME, "max_tokens": 2} if path != "/v1/responses" else {"model": NAME, "max_output_tokens": 2}
    status, _, data = raw(served.port, "POST", path, {**base, **body})
    assert status == 400, data
    assert check_error_body(data, status)["param"] == param, data


def test_a_prompt_that_can_never_fit_is_the_engines_400(served):
    """The fit check is the engine's alone (its input processor, at submit; the app's render jobs
    no longer repeat it): a rendered chat, a Responses input, or one of several prompts too long
    for the model is a 400 naming the request's field. Of several prompts the message says which,
    and the ones before it were submitted (then cancelled); a chat's is never submitted."""
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2}, "messages", 0),
        ("/v1/responses", {"input": LONG, "max_output_tokens": 2}, "input", 0),
        ("/v1/completions", {"prompt": ["hi", LONG], "max_tokens": 2}, "prompt", 1),
    ]
    for path, body, param, submitted in cases:
        before = len(served.submitted)
        status, _, data = raw(served.port, "POST", path, {"model": NAME, **body})
        assert status == 400, data
        err = check_error_body(data, status)
        assert err["param"] == param and "can never fit" in err["message"], (path, err)
        assert len(served.submitted) - before == submitted, path
    assert err["message"].startswith("prompt[1]: prompt of "), err
    # the server is fine afterwards
    assert served.client.completions.create(model=NAME, prompt="ok", max_tokens=1).usage.completion_tokens == 1
