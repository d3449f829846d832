"""``acb serve`` (acb/serve, issue 14): the OpenAI-compatible server in a subprocess, driven with
the real ``openai`` client (which parses every response against its schema) and with raw HTTP
where the client hides what is under test (status lines, headers, SSE framing, disconnects).

Three servers at most, each a ``python -m acb serve`` on this checkout:

- the main one (``--api-key``, ``--served-model-name``, a small ``--max-body-bytes``, a small
  ``--max-prompts-per-request``, and ``--async-batching``, the CUDA default), for the
  endpoints, greedy parity with ``model.generate``, streaming, logprobs, metrics and errors;
- a small one (queue of one, one request per step, no key, default name, the CPU default of
  synchronous batching, ``--trust-request-chat-template``), for 429, a client's chat template,
  and for SIGTERM past ``--grace-period``;
- one for SIGTERM with requests in flight: one that finishes in the grace period, eight that
  do not.

The checkpoint is a tiny random Llama saved with a byte-level tokenizer and a chat template
(which refuses developer messages, as some models' templates refuse roles they lack).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import torch  # noqa: E402

from acb.models import build_tokenizer, tiny_model  # noqa: E402
from tests.conftest import reference_generate  # noqa: E402
from tests.otlp_receiver import Receiver  # noqa: E402
from tests.serve.helpers import check_error_body, raw  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-acb-test"
NAME = "tiny-served"
AUTH = {"Authorization": f"Bearer {KEY}"}
# a small KV cache (the CPU default sizes one for many full-length requests: slow to allocate)
SMALL_KV = ["--page-size", "16", "--num-blocks", "256"]
MAX_BODY = 100_000
MAX_POS = 4096
LONG = 3000  # tokens of a request meant to be cut short (about 2 ms a token on a CPU core)
MAX_PROMPTS = 16  # the main server's --max-prompts-per-request
# the chat template of tests/test_text.py, plus an optional variable for chat_template_kwargs, and
# a refusal (raise_exception, as Gemma's and Mistral's templates refuse chats they cannot take)
CHAT_TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'developer' %}"
    "{{ raise_exception('this model takes no developer messages') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo wörld"}]
# OpenTelemetry names as Prometheus spells them (dots -> underscores, unit and _total suffixes)
PROMPT_TOKENS = "gen_ai_client_token_usage_sum|gen_ai_token_type=input"
GENERATED = "gen_ai_client_token_usage_sum|gen_ai_token_type=output"
METRIC_NAMES = (
    "acb_requests_running",
    "acb_requests_waiting",
    "acb_kv_cache_usage",
    "gen_ai_client_token_usage_sum",
    "gen_ai_server_request_duration_seconds_count",
    "gen_ai_server_time_to_first_token_seconds_count",
    "gen_ai_server_time_per_output_token_seconds_count",
    "acb_engine_steps_total",
    "acb_preemptions_total",
    "acb_prefix_cache_hit_rate",
)


# ---------------------------------------------------------------------------------------------
# helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sse_events(raw_body: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    out = []
    for line in raw_body.decode("utf-8").splitlines():
        if line.startswith("data:"):
            out.append(line[len("data:") :].strip())
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text, parsed by prometheus-client's own parser (it raises on malformed text):
    each sample name -> the sum of its values over all label sets, and ``name|label=value`` ->
    the sum over the label sets with that label."""
    from prometheus_client.parser import text_string_to_metric_families

    vals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key in (sample.name, *(f"{sample.name}|{k}={v}" for k, v in sample.labels.items())):
                vals[key] = vals.get(key, 0.0) + sample.value
    return vals


def metrics(port: int) -> tuple[str, dict[str, float]]:
    status, headers, body = raw(port, "GET", "/metrics", headers=AUTH)
    assert status == 200, body
    text = body.decode()
    return text, parse_metrics(text)


def wait_health(port: int, pred, timeout: float = 60.0) -> tuple[int, dict, bytes]:
    """Poll ``GET /health`` until ``pred(status)``; the last answer either way. (A wait for what
    the test waits for, not a sleep that guesses how long it takes.)"""
    deadline = time.monotonic() + timeout
    while True:
        answer = raw(port, "GET", "/health", timeout=timeout)
        if pred(answer[0]) or time.monotonic() > deadline:
            return answer
        time.sleep(0.01)


def wait_metrics(port: int, pred, timeout: float = 120.0) -> dict[str, float]:
    """Poll /metrics until ``pred(values)``; the last values either way (the timeout only bounds
    a failing test: it is no measure of the engine's speed)."""
    deadline = time.monotonic() + timeout
    while True:
        _, m = metrics(port)
        if pred(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def chat_ids(tok, messages, **kw) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in some versions
    return list(ids)


def reason(ref: list[int], eos: int) -> str:
    """The finish reason of greedy output ``ref``: it ended at EOS, or ran out of tokens."""
    return "stop" if ref and ref[-1] == eos else "length"


def ref_logprobs(model, prompt: list[int], gen: list[int]) -> torch.Tensor:
    """``[len(gen), V]`` log-softmax of the raw logits that chose each generated token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(gen)], dim=-1)


class Server:
    """``python -m acb serve`` in a subprocess on a free port; its output goes to a log file."""

    def __init__(self, model_dir: Path, args: list[str], log: Path, extra_env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log
        self.health_statuses: set[int] = set()
        self.signalled = False  # a test sent SIGTERM itself (and checks the exit)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("ACB_API_KEY", None)
        env.update(extra_env or {})
        self._log = open(log, "w", encoding="utf-8")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "acb",
                "serve",
                "--model",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *args,
            ],
            cwd=log.parent,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def tail(self, n: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-n:]

    def wait_ready(self, timeout: float = 120) -> None:
        """Poll ``GET /health`` (no key) until 200; 503 is allowed while it starts."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"acb serve exited with {self.proc.returncode} before it was ready:\n{self.tail()}")
            try:
                status, _, _ = raw(self.port, "GET", "/health", timeout=5)
            except OSError:
                time.sleep(0.1)
                continue
            self.health_statuses.add(status)
            if status == 200:
                return
            time.sleep(0.1)
        pytest.fail(
            f"acb serve was not ready after {timeout} s (health statuses seen: "
            f"{sorted(self.health_statuses)}):\n{self.tail()}"
        )

    def terminate(self) -> None:
        self.signalled = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"acb serve did not exit within {timeout} s of SIGTERM:\n{self.tail()}")

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM and wait; None if a test had already stopped it (the test checked the exit)."""
        checked_by_test = self.signalled
        self.terminate()
        rc = self.wait_exit(timeout)
        self._log.close()
        return None if checked_by_test else rc


def _serve(checkpoint, tmp_path_factory, name: str, args: list[str], extra_env: dict[str, str] | None = None):
    s = Server(checkpoint.dir, args, tmp_path_factory.mktemp("serve-logs") / f"{name}.log", extra_env)
    try:
        s.wait_ready()
        yield s
    finally:
        rc = s.stop()
    assert rc in (0, None), f"acb serve exited with {rc} on SIGTERM:\n{s.tail()}"


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama and its byte-level tokenizer (with a chat template), saved to a dir;
    the model object and the tokenizer loaded back from the dir, for references."""
    from transformers import AutoTokenizer

    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    # long positions: requests of thousands of tokens outlast a disconnect or a grace period
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=MAX_POS)
    d = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    loaded = AutoTokenizer.from_pretrained(d)
    assert loaded.chat_template == CHAT_TEMPLATE
    return SimpleNamespace(dir=d, model=model, tok=loaded, eos=model.config.eos_token_id)


@pytest.fixture(scope="module")
def otlp():
    """A real OTLP/HTTP receiver the main server exports its spans and metrics to."""
    with Receiver() as r:
        yield r


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory, otlp):
    yield from _serve(
        checkpoint,
        tmp_path_factory,
        "main",
        [
            "--served-model-name",
            NAME,
            "--api-key",
            KEY,
            "--max-body-bytes",
            str(MAX_BODY),
            "--async-batching",
            "--max-prompts-per-request",
            str(MAX_PROMPTS),
            "--otlp-endpoint",
            otlp.http_endpoint,
            *SMALL_KV,
        ],
        # export spans within 0.2 s and metrics every second, not after 5 s and 60 s
        {"OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_METRIC_EXPORT_INTERVAL": "1000"},
    )


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def small_server(checkpoint, tmp_path_factory):
    """One request per step, one waiting at most: more get 429. No key; the dir's name. Clients
    may bring their own chat template."""
    yield from _serve(
        checkpoint,
        tmp_path_factory,
        "small",
        [
            "--max-queue-size",
            "1",
            "--max-requests-per-batch",
            "1",
            "--grace-period",
            "1",
            "--trust-request-chat-template",
            *SMALL_KV,
        ],
    )


# ---------------------------------------------------------------------------------------------
# the main server: endpoints


def test_health_and_models(server, client):
    assert server.health_statuses <= {200, 503}, server.health_statuses  # 503 only while starting
    status, _, _ = raw(server.port, "GET", "/health")  # a probe needs no key
    assert status == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert all(m.object == "model" for m in models.data)


def test_chat_greedy_equals_generate(client, checkpoint):
    tok, model = checkpoint.tok, checkpoint.model
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0)
    ids = chat_ids(tok, CHAT)
    ref = reference_generate(model, ids, 12)
    assert r.object == "chat.completion" and r.model == NAME and r.id
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant"
    assert c.message.content == decode(tok, ref)
    assert c.finish_reason == reason(ref, checkpoint.eos)
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), len(ref), len(ids) + len(ref))
    assert u.prompt_tokens_details is not None
    assert isinstance(u.prompt_tokens_details.cached_tokens, int)
    assert 0 <= u.prompt_tokens_details.cached_tokens <= u.prompt_tokens


def test_completion_prompt_forms_greedy_equal_generate(client, checkpoint):
    tok, model = checkpoint.tok, checkpoint.model
    texts = ["héllo", "ça va? 😀"]
    ids = [tok(t)["input_ids"] for t in texts]
    refs = [reference_generate(model, p, 10) for p in ids]

    by_text = client.completions.create(model=NAME, prompt=texts[0], max_tokens=10, temperature=0)
    assert by_text.object == "text_completion" and by_text.model == NAME
    assert by_text.choices[0].text == decode(tok, refs[0])
    assert by_text.choices[0].finish_reason == reason(refs[0], checkpoint.eos)
    assert by_text.usage.prompt_tokens == len(ids[0])
    assert by_text.usage.completion_tokens == len(refs[0])

    by_ids = client.completions.create(model=NAME, prompt=ids[1], max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == decode(tok, refs[1])
    assert by_ids.usage.prompt_tokens == len(ids[1])
    assert by_ids.usage.completion_tokens == len(refs[1])
    assert by_ids.usage.total_tokens == len(ids[1]) + len(refs[1])

    both = client.completions.create(model=NAME, prompt=texts, max_tokens=10, temperature=0)
    assert sorted(c.index for c in both.choices) == [0, 1]
    by_index = {c.index: c for c in both.choices}
    for i in range(2):
        assert by_index[i].text == decode(tok, refs[i])
        assert by_index[i].finish_reason == reason(refs[i], checkpoint.eos)
    assert both.usage.prompt_tokens == sum(map(len, ids))
    assert both.usage.completion_tokens == sum(map(len, refs))


def test_chat_stream_with_usage(client, checkpoint):
    tok = checkpoint.tok
    ids = chat_ids(tok, CHAT)
    ref = reference_generate(checkpoint.model, ids, 12)
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=CHAT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert len(chunks) >= 2
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and {c.model for c in chunks} == {NAME}
    *body, last = chunks
    assert last.choices == [] and last.usage is not None  # the include_usage chunk comes last
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        len(ids),
        len(ref),
        len(ids) + len(ref),
    )
    assert all(c.usage is None for c in body)
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body if c.choices) == decode(tok, ref)
    reasons = [c.choices[0].finish_reason for c in body if c.choices and c.choices[0].finish_reason]
    assert reasons == [reason(ref, checkpoint.eos)]


def test_completion_stream_sse_framing(server, checkpoint):
    tok = checkpoint.tok
    ids = tok("stream me")["input_ids"]
    ref = reference_generate(checkpoint.model, ids, 9)
    status, headers, body = raw(
        server.port,
        "POST",
        "/v1/completions",
        headers=AUTH,
        body={"model": NAME, "prompt": "stream me", "max_tokens": 9, "temperature": 0, "stream": True},
    )
    assert status == 200, body
    assert headers["content-type"].startswith("text/event-stream")
    events = sse_events(body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    docs = [json.loads(e) for e in events[:-1]]
    assert all(d["object"] == "text_completion" for d in docs)
    assert "".join(d["choices"][0]["text"] for d in docs if d["choices"]) == decode(tok, ref)
    assert [d["choices"][0]["finish_reason"] for d in docs if d["choices"] and d["choices"][0]["finish_reason"]] == [
        reason(ref, checkpoint.eos)
    ]


def test_completion_stream_with_usage_matches_non_streamed(client):
    kw = dict(model=NAME, prompt="abc", max_tokens=8, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert "".join(c.choices[0].text for c in body if c.choices) == whole.choices[0].text


def test_n_samples(client, checkpoint):
    tok = checkpoint.tok
    ids = chat_ids(tok, CHAT)
    ref = reference_generate(checkpoint.model, ids, 6)
    # greedy: both samples are the greedy answer
    g = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=6, temperature=0, n=2)
    assert sorted(c.index for c in g.choices) == [0, 1]
    assert [c.message.content for c in g.choices] == [decode(tok, ref)] * 2
    assert g.usage.prompt_tokens == len(ids) and g.usage.completion_tokens == 2 * len(ref)
    # sampled, non-streamed chat
    s = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=6, temperature=1, n=2, seed=3, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in s.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in s.choices)
    assert s.usage.completion_tokens == 12
    # sampled, streamed completions: every index gets its text and exactly one finish reason
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt="two",
            max_tokens=5,
            temperature=1,
            n=2,
            seed=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts, reasons = {0: "", 1: ""}, {0: [], 1: []}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                reasons[ch.index].append(ch.finish_reason)
    assert reasons == {0: ["length"], 1: ["length"]}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    # the same seed, not streamed: the same two samples
    again = client.completions.create(
        model=NAME, prompt="two", max_tokens=5, temperature=1, n=2, seed=4, extra_body={"ignore_eos": True}
    )
    assert {c.index: c.text for c in again.choices} == texts


def test_chat_logprobs_are_the_models(client, checkpoint):
    tok, model = checkpoint.tok, checkpoint.model
    ids = chat_ids(tok, CHAT)
    ref = reference_generate(model, ids, 6)
    r = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    c = r.choices[0]
    assert c.message.content == decode(tok, ref)
    items = c.logprobs.content
    assert len(items) == len(ref) == r.usage.completion_tokens
    lp = ref_logprobs(model, ids, ref)
    for i, item in enumerate(items):
        assert isinstance(item.token, str)
        assert item.logprob == pytest.approx(lp[i, ref[i]].item(), abs=1e-3)
        assert len(item.top_logprobs) == 2
        want = lp[i].topk(2).values.tolist()
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(want, abs=1e-3)
        assert all(isinstance(t.token, str) for t in item.top_logprobs)
    # each token's bytes are its own UTF-8 bytes: together they make the text, even where a
    # character is split over tokens (each token here is one byte)
    assert [len(item.bytes) for item in items] == [1] * len(items)
    assert bytes(b for item in items for b in item.bytes).decode("utf-8", errors="replace") == c.message.content
    # without logprobs=true there are none
    plain = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_are_the_models(client, checkpoint):
    tok, model = checkpoint.tok, checkpoint.model
    ids = tok("log me")["input_ids"]
    ref = reference_generate(model, ids, 6)
    r = client.completions.create(model=NAME, prompt="log me", max_tokens=6, temperature=0, logprobs=2)
    lp = ref_logprobs(model, ids, ref)
    got = r.choices[0].logprobs
    assert r.choices[0].text == decode(tok, ref)
    assert len(got.tokens) == len(got.token_logprobs) == len(got.top_logprobs) == len(ref)
    assert all(isinstance(t, str) for t in got.tokens)
    assert got.token_logprobs == pytest.approx([lp[i, t].item() for i, t in enumerate(ref)], abs=1e-3)
    for i, top in enumerate(got.top_logprobs):
        # two alternatives (two byte tokens may share a display string: then one key), each one
        # of the model's two most likely
        assert 1 <= len(top) <= 2
        best = lp[i].topk(2).values.tolist()
        for v in top.values():
            assert any(v == pytest.approx(b, abs=1e-3) for b in best), (i, top, best)


def _greedy_text_with_an_ascii_char(client, checkpoint):
    """A prompt whose greedy text has a printable ASCII character first seen after position 0."""
    for i in range(12):
        prompt = f"stop here {i}"
        text = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
        for j in range(1, len(text)):
            ch = text[j]
            if ch.isascii() and ch.isprintable() and not ch.isspace() and text.index(ch) == j:
                return prompt, text, j
    pytest.fail("no greedy text with a usable stop character")


def test_stop_string(client, checkpoint):
    prompt, text, j = _greedy_text_with_an_ascii_char(client, checkpoint)
    # ignore_eos (as vLLM's) leaves explicit stop strings in force
    kw = dict(model=NAME, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw, stop=[text[j], "\u2603never"])
    assert r.choices[0].text == text[:j]  # cut before the stop string
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16
    one = client.completions.create(**kw, stop=text[j])  # a single string
    assert one.choices[0].text == text[:j]
    chunks = list(client.completions.create(**kw, stop=[text[j]], stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:j]  # nothing of the stop leaks
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_text_with_a_stop_string_is_a_prefix_of_the_text_without(client):
    """One decode per request (issue 28): with special tokens generated mid-output (a logit bias
    on ``<s>``), the text that a stop string cuts is a prefix of the same request's text without
    one, whether special tokens are skipped or kept, streamed or not."""
    for skip in (True, False):
        kw = dict(
            model=NAME,
            prompt="special tokens mid-output",
            max_tokens=24,
            temperature=0,
            logit_bias={"1": 6},
            extra_body={"ignore_eos": True, "skip_special_tokens": skip},
        )
        free = client.completions.create(**kw).choices[0].text
        if not skip:
            assert "<s>" in free[1:]  # the case this is about: a special token inside the text
        k = next(k for k in range(len(free) // 2, len(free) - 1) if free.find(free[k : k + 2]) == k)
        stop = free[k : k + 2]
        cut = client.completions.create(**kw, stop=[stop]).choices[0]
        assert cut.text == free[:k] and cut.finish_reason == "stop"
        chunks = list(client.completions.create(**kw, stop=[stop], stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == free[:k]


def test_seed_reproducible(client):
    kw = dict(model=NAME, prompt="seeded", max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw, seed=1234).choices[0].text
    b = client.completions.create(**kw, seed=1234).choices[0].text
    assert a == b
    chat_kw = dict(model=NAME, messages=CHAT, max_tokens=8, temperature=1.0, top_p=0.95)
    assert (
        client.chat.completions.create(**chat_kw, seed=5).choices[0].message.content
        == client.chat.completions.create(**chat_kw, seed=5).choices[0].message.content
    )
    # other seeds usually give other texts (not asserted: a random tiny model can be peaked)
    others = {client.completions.create(**kw, seed=s).choices[0].text for s in range(3)}
    assert others  # they are answered


def test_extras_and_sampling_fields(client, checkpoint):
    tok, eos = checkpoint.tok, checkpoint.eos
    # every field accepted together
    r = client.completions.create(
        model=NAME,
        prompt="all fields",
        max_tokens=6,
        temperature=0.8,
        top_p=0.9,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="u-1",
        logit_bias={"70": 1.0},
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": True,
            "skip_special_tokens": True,
        },
    )
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    # max_completion_tokens (chat)
    r = client.chat.completions.create(
        model=NAME, messages=CHAT, max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    # logit_bias forces a token
    z = tok.convert_tokens_to_ids("Z")
    r = client.completions.create(
        model=NAME,
        prompt="bias",
        max_tokens=4,
        temperature=0,
        logit_bias={str(z): 100},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == "ZZZZ"
    # EOS forced by logit_bias: the request stops at once; min_tokens holds it off
    r = client.completions.create(model=NAME, prompt="bias", max_tokens=8, temperature=0, logit_bias={str(eos): 100})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ""
    assert r.usage.completion_tokens == 1
    r = client.completions.create(
        model=NAME, prompt="bias", max_tokens=8, temperature=0, logit_bias={str(eos): 100}, extra_body={"min_tokens": 3}
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4
    # skip_special_tokens=false keeps the EOS in the text
    r = client.completions.create(
        model=NAME,
        prompt="bias",
        max_tokens=8,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"min_tokens": 1, "skip_special_tokens": False},
    )
    assert r.choices[0].text.endswith("</s>")
    # chat_template_kwargs reach the template
    plain = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1, temperature=0)
    greeted = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=1, temperature=0, extra_body={"chat_template_kwargs": {"greeting": "hey"}}
    )
    assert plain.usage.prompt_tokens == len(chat_ids(tok, CHAT))
    assert greeted.usage.prompt_tokens == len(chat_ids(tok, CHAT, greeting="hey")) == plain.usage.prompt_tokens + 4


async def test_fifty_concurrent_streams_equal_their_non_streamed_answers(server, checkpoint):
    tok = checkpoint.tok
    prompts = [f"{'xyz'[i % 3] * (1 + i % 7)} prompt {i}" for i in range(50)]
    async with openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120) as ac:

        async def whole(p):
            r = await ac.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0)
            return r.choices[0].text, r.choices[0].finish_reason

        async def streamed(p):
            text, reasons = "", []
            stream = await ac.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0, stream=True)
            async for c in stream:
                for ch in c.choices:
                    text += ch.text
                    if ch.finish_reason:
                        reasons.append(ch.finish_reason)
            assert len(reasons) == 1, reasons
            return text, reasons[0]

        wholes = await asyncio.gather(*(whole(p) for p in prompts))
        streams = await asyncio.gather(*(streamed(p) for p in prompts))
    assert streams == wholes
    for p, (text, fin) in zip(prompts, wholes):
        ref = reference_generate(checkpoint.model, tok(p)["input_ids"], 8)
        assert (text, fin) == (decode(tok, ref), reason(ref, checkpoint.eos)), p


def test_metrics(server, client):
    _, m0 = metrics(server.port)
    r = client.completions.create(
        model=NAME, prompt="count me", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    want = {
        PROMPT_TOKENS: r.usage.prompt_tokens,
        GENERATED: r.usage.completion_tokens,
        "gen_ai_server_request_duration_seconds_count": 1,
        "gen_ai_server_time_to_first_token_seconds_count": 1,
        f"gen_ai_server_request_duration_seconds_count|gen_ai_request_model={NAME}": 1,
    }
    m1 = wait_metrics(server.port, lambda m: all(m.get(k, 0) - m0.get(k, 0) >= v for k, v in want.items()))
    assert {k: m1.get(k, 0) - m0.get(k, 0) for k in want} == want
    assert m1["acb_requests_running"] == 0 and m1["acb_requests_waiting"] == 0
    assert 0 <= m1["acb_kv_cache_usage"] <= 1
    text, _ = metrics(server.port)
    for name in METRIC_NAMES:
        assert name in m1, f"no {name} in /metrics:\n{text}"
    # the conventions' buckets
    assert "gen_ai_server_time_to_first_token_seconds_bucket{" in text and 'le="0.001"' in text


def test_traceparent_gives_a_server_span_in_the_callers_trace(server, otlp):
    trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
    status, _, body = raw(
        server.port,
        "POST",
        "/v1/completions",
        headers={**AUTH, "traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "vendor=x"},
        body={"model": NAME, "prompt": ["traced", "twice"], "max_tokens": 3, "ignore_eos": True, "temperature": 0},
    )
    assert status == 200, body
    usage = json.loads(body)["usage"]

    def mine(c):
        return [s for s in c.spans if s["trace_id"] == trace_id]

    assert otlp.collected.wait(lambda c: len(mine(c)) >= 3), otlp.collected.spans[-5:]
    spans = mine(otlp.collected)
    servers = [s for s in spans if s["kind"] == "SERVER" and s["scope"] == "acb"]
    assert len(servers) == 1, spans
    srv = servers[0]
    assert srv["parent_span_id"] == parent_id and srv["name"] == f"text_completion {NAME}"
    a = srv["attrs"]
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == NAME
    assert a["gen_ai.request.max_tokens"] == 3 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert a["gen_ai.response.finish_reasons"] == ["length", "length"]
    # one INTERNAL span per prompt, children of the SERVER span
    engine = [s for s in spans if s["kind"] == "INTERNAL" and s["scope"] == "acb"]
    assert len(engine) == 2 and {s["parent_span_id"] for s in engine} == {srv["span_id"]}
    assert sorted(s["attrs"]["gen_ai.usage.output_tokens"] for s in engine) == [3, 3]
    assert all(s["resource"]["service.name"] == "acb" for s in spans if s["scope"] == "acb")
    # the metrics go out over OTLP too
    assert otlp.collected.wait(lambda c: "gen_ai.server.request.duration" in c.latest_metrics())
    dur = otlp.collected.latest_metrics()["gen_ai.server.request.duration"]
    assert dur["unit"] == "s" and dur["kind"] == "histogram"


def test_client_disconnect_cancels_the_request(server):
    m0 = wait_metrics(server.port, lambda m: m["acb_requests_running"] == 0)
    n = LONG  # far more than can be generated before the client leaves
    with openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60) as c:
        stream = c.chat.completions.create(
            model=NAME, messages=CHAT, max_tokens=n, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        it = iter(stream)
        next(it), next(it)
        _, during = metrics(server.port)
        assert during["acb_requests_running"] >= 1
        stream.close()
    m1 = wait_metrics(server.port, lambda m: m["acb_requests_running"] == 0 and m["acb_requests_waiting"] == 0)
    assert m1["acb_requests_running"] == 0 and m1["acb_requests_waiting"] == 0, m1
    assert m1["acb_kv_cache_usage"] == 0, m1  # its KV is freed
    generated = m1.get(GENERATED, 0) - m0.get(GENERATED, 0)
    assert generated < n, "the request ran to the end after its client left"
    cancelled = "gen_ai_server_request_duration_seconds_count|error_type=cancelled"
    m2 = wait_metrics(server.port, lambda m: m.get(cancelled, 0) > m0.get(cancelled, 0))
    assert m2.get(cancelled, 0) == m0.get(cancelled, 0) + 1  # recorded as cancelled
    # the server carries on
    status, _, body = raw(
        server.port,
        "POST",
        "/v1/completions",
        headers=AUTH,
        body={"model": NAME, "prompt": "still there?", "max_tokens": 2},
    )
    assert status == 200, body


def test_client_disconnect_cancels_a_non_streamed_request(server):
    """A non-streamed request whose client closes the connection while it waits for the whole
    answer is cancelled too: the server watches for the disconnect while the engine runs it."""
    m0 = wait_metrics(server.port, lambda m: m["acb_requests_running"] == 0)
    n = LONG
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    body = json.dumps({"model": NAME, "messages": CHAT, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    sock.sendall(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
    )
    wait_metrics(server.port, lambda m: m["acb_requests_running"] >= 1)
    sock.close()
    m1 = wait_metrics(server.port, lambda m: m["acb_requests_running"] == 0 and m["acb_requests_waiting"] == 0)
    assert m1["acb_requests_running"] == 0 and m1["acb_kv_cache_usage"] == 0, m1
    assert m1.get(GENERATED, 0) - m0.get(GENERATED, 0) < n, "the request ran to the end after its client left"


def test_a_slow_reader_does_not_stall_others(server):
    """A stream whose client stops reading: its request still runs to the end in the engine
    while another stream is served start to end; when it reads again it gets every token.
    (What the socket's buffers cannot take waits in the request's handle, coalesced; on Linux
    loopback they hold megabytes, so the coalescing itself is tested in-process by
    tests/api/test_async_engine.py::test_slow_consumer_gets_coalesced_deltas.)"""
    m0 = wait_metrics(server.port, lambda m: m["acb_requests_running"] == 0)
    n = 400
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server must wait on it
    sock.settimeout(60)
    sock.connect(("127.0.0.1", server.port))
    slow = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    slow.sock = sock
    slow.request(
        "POST",
        "/v1/chat/completions",
        headers={**AUTH, "Content-Type": "application/json"},
        body=json.dumps(
            {
                "model": NAME,
                "messages": CHAT,
                "max_tokens": n,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "logprobs": True,
                "top_logprobs": 20,
                "stream_options": {"include_usage": True},
            }
        ),
    )
    resp = slow.getresponse()
    assert resp.status == 200
    first = resp.read(64)  # then it stops reading
    # another client is served meanwhile, start to end (were it stalled behind the slow reader, it
    # would wait for it forever: the slow one reads again only after this one has ended)
    with openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60) as c:
        chunks = list(
            c.completions.create(
                model=NAME,
                prompt="meanwhile",
                max_tokens=16,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
    assert sum(len(ch.choices[0].text) for ch in chunks if ch.choices) > 0
    # the slow one's request runs to its end while nobody reads it
    done = wait_metrics(server.port, lambda m: m.get(GENERATED, 0) - m0.get(GENERATED, 0) >= n + 16, timeout=60)
    assert done.get(GENERATED, 0) - m0.get(GENERATED, 0) >= n + 16, done
    assert done["acb_requests_running"] == 0, done
    events = sse_events(first + resp.read())
    slow.close()
    assert events[-1] == "[DONE]"
    docs = [json.loads(e) for e in events[:-1]]
    usage = docs[-1]["usage"]
    assert usage["completion_tokens"] == n
    content = [lp for d in docs for ch in d["choices"] for lp in ((ch.get("logprobs") or {}).get("content") or [])]
    assert len(content) == n  # every token came through
    assert all(len(lp["top_logprobs"]) == 20 for lp in content)


# ---------------------------------------------------------------------------------------------
# the main server: errors


def test_401_wrong_or_missing_key(server):
    with openai.OpenAI(base_url=server.url, api_key="sk-wrong", max_retries=0, timeout=30) as bad:
        with pytest.raises(openai.AuthenticationError) as e:
            bad.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2)
    assert e.value.status_code == 401
    for path, body in [
        ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "max_tokens": 2}),
        ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2}),
    ]:
        status, _, data = raw(server.port, "POST", path, body=body)  # no Authorization header
        assert status == 401, data
        check_error_body(data, status)
    status, _, data = raw(server.port, "GET", "/v1/models")
    assert status == 401, data


def test_404_unknown_model(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert e.value.status_code == 404 and "no-such-model" in e.value.message
    status, _, data = raw(
        server.port, "POST", "/v1/completions", headers=AUTH, body={"model": "no-such-model", "prompt": "x"}
    )
    assert status == 404
    check_error_body(data, status)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize(
    "endpoint,fields,named",
    [
        ("chat", {"temperature": -1}, "temperature"),
        ("chat", {"n": 0}, "n"),
        ("chat", {"max_tokens": 0}, "max_tokens"),
        ("chat", {"top_p": 1.5}, "top_p"),
        ("chat", {"tools": TOOLS}, "tool_choice"),  # auto (the default with tools) needs --tool-call-parser
        ("chat", {"tools": [{"type": "code_interpreter"}]}, "tools"),
        ("chat", {"response_format": {"type": "xml"}}, "response_format"),
        ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ("chat", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
        ("completions", {"temperature": -1}, "temperature"),
        ("completions", {"prompt": [3, 5, 10**9]}, "prompt"),
    ],
    ids=lambda v: json.dumps(v)[:40] if not isinstance(v, str) else v,
)
def test_400_names_the_field(server, client, endpoint, fields, named):
    if endpoint == "chat":
        kw = {"model": NAME, "messages": CHAT, "max_tokens": 2, **fields}
        call, path = client.chat.completions.create, "/v1/chat/completions"
    else:
        kw = {"model": NAME, "prompt": "x", "max_tokens": 2, **fields}
        call, path = client.completions.create, "/v1/completions"
    with pytest.raises(openai.BadRequestError) as e:
        call(**kw)
    assert e.value.status_code == 400
    assert named in f"{e.value.param} {e.value.message}", (e.value.param, e.value.message)
    status, _, data = raw(server.port, "POST", path, headers=AUTH, body=kw)
    assert status == 400
    check_error_body(data, status)


def test_413_body_too_large(server, client):
    big = {"model": NAME, "messages": [{"role": "user", "content": "a" * (MAX_BODY + 1000)}], "max_tokens": 2}
    status, _, data = raw(server.port, "POST", "/v1/chat/completions", headers=AUTH, body=big)
    assert status == 413, data
    check_error_body(data, status)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**big)
    assert e.value.status_code == 413
    # the server is fine afterwards
    assert client.completions.create(model=NAME, prompt="ok", max_tokens=1).usage.completion_tokens == 1


def test_400_a_clients_own_chat_template(server, client):
    """A chat template is code the server runs: a request's own is refused (the server was not
    started with --trust-request-chat-template), in chat_template_kwargs or at the top level,
    and so are tokenizer options smuggled in chat_template_kwargs."""
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for extra, param in [
        ({"chat_template_kwargs": {"chat_template": own}}, "chat_template_kwargs"),
        ({"chat_template": own}, "chat_template"),
        ({"chat_template_kwargs": {"padding": "max_length", "max_length": 10**9}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2, extra_body=extra)
        assert e.value.param == param, (extra, e.value.param, e.value.message)
        status, _, data = raw(
            server.port,
            "POST",
            "/v1/chat/completions",
            headers=AUTH,
            body={"model": NAME, "messages": CHAT, "max_tokens": 2, **extra},
        )
        assert status == 400
        check_error_body(data, status)
    with pytest.raises(openai.BadRequestError, match="--trust-request-chat-template"):
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2, extra_body={"chat_template": own})


def test_trusted_client_chat_template_is_used(small_server, checkpoint):
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    with openai.OpenAI(base_url=small_server.url, api_key="x", max_retries=0, timeout=60) as c:
        for extra in ({"chat_template": own}, {"chat_template_kwargs": {"chat_template": own}}):
            out = c.chat.completions.create(model=checkpoint.dir.name, messages=CHAT, max_tokens=1, extra_body=extra)
            assert out.usage.prompt_tokens == len(chat_ids(checkpoint.tok, CHAT, chat_template=own))


def test_400_when_the_chat_template_refuses_the_chat(server, client):
    """The model's own template raising (raise_exception) is the request's problem: a 400 with
    the template's message, streamed or not; not a plain-text 500."""
    chat = [{"role": "developer", "content": "be terse"}, *CHAT]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="this model takes no developer messages") as e:
            client.chat.completions.create(model=NAME, messages=chat, max_tokens=2, stream=stream)
        assert e.value.param == "messages"
    status, _, data = raw(
        server.port,
        "POST",
        "/v1/chat/completions",
        headers=AUTH,
        body={"model": NAME, "messages": chat, "max_tokens": 2},
    )
    assert status == 400
    check_error_body(data, status)


def test_400_too_many_prompts(server, client):
    """At most --max-prompts-per-request completions (prompts x n) in one request; 15,000
    prompts are refused at once, not worked through on the event loop."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=["x"] * (MAX_PROMPTS + 1), max_tokens=1)
    assert e.value.param == "prompt" and str(MAX_PROMPTS) in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=["x"] * 6, max_tokens=1, n=3)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1, n=MAX_PROMPTS + 1)
    assert e.value.param == "n"
    status, _, data = raw(
        server.port,
        "POST",
        "/v1/completions",
        headers=AUTH,
        body={"model": NAME, "prompt": [[5]] * 15_000, "max_tokens": 1},
    )
    # refused by the count alone (code too_many_prompts), before any prompt is checked or submitted
    err = check_error_body(data, status)
    assert status == 400 and (err["param"], err["code"]) == ("prompt", "too_many_prompts"), err
    # as many as allowed: served
    out = client.completions.create(model=NAME, prompt=["x"] * (MAX_PROMPTS // 2), max_tokens=1, n=2)
    assert len(out.choices) == MAX_PROMPTS


def test_404_unknown_path_is_an_error_body(server):
    status, _, data = raw(server.port, "GET", "/v1/nothing-here", headers=AUTH)
    assert status == 404
    assert check_error_body(data, status)["code"] == "not_found"


# ---------------------------------------------------------------------------------------------
# the small server: default name, no key, queue full, SIGTERM past the grace period


def test_default_name_is_the_directory_and_no_key_needed(small_server, checkpoint):
    with openai.OpenAI(base_url=small_server.url, api_key="anything", max_retries=0, timeout=60) as c:
        assert [m.id for m in c.models.list().data] == [checkpoint.dir.name]
    status, _, data = raw(
        small_server.port,
        "POST",
        "/v1/completions",
        body={"model": checkpoint.dir.name, "prompt": "x", "max_tokens": 2},
    )
    assert status == 200, data


def test_429_when_the_queue_is_full(small_server, checkpoint):
    body = {"model": checkpoint.dir.name, "prompt": "long one", "max_tokens": 200, "ignore_eos": True}
    results: list = [None] * 8
    go = threading.Barrier(len(results))

    def fire(i):
        go.wait()
        try:
            results[i] = raw(small_server.port, "POST", "/v1/completions", body=body, timeout=120)
        except Exception as exc:  # noqa: BLE001 (reported by the asserts)
            results[i] = exc

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    statuses = [r[0] if isinstance(r, tuple) else r for r in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
    for status, headers, data in results:
        if status == 429:
            assert float(headers["retry-after"]) >= 0
            check_error_body(data, status)
        else:
            assert json.loads(data)["usage"]["completion_tokens"] == 200
    m = wait_metrics(small_server.port, lambda m: m["acb_requests_running"] == 0 and m["acb_requests_waiting"] == 0)
    assert m["acb_requests_running"] == 0 and m["acb_requests_waiting"] == 0


def _open_stream(port: int, body: dict, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return conn, resp


def _read_events(resp, until_first: bool = False) -> list[str]:
    events = []
    while True:
        line = resp.readline()
        if not line:
            return events
        line = line.decode("utf-8").strip()
        if line.startswith("data:"):
            events.append(line[len("data:") :].strip())
            if until_first:
                return events


def test_sigterm_past_the_grace_period_cancels_and_exits_0(small_server, checkpoint):
    """Past the grace period, a stream still running ends with an error event and [DONE] (not
    cut mid-chunk); meanwhile /health answers 503 (the port stays open)."""
    conn, resp = _open_stream(
        small_server.port,
        {
            "model": checkpoint.dir.name,
            "prompt": "never ending",
            "max_tokens": LONG,
            "ignore_eos": True,
            "stream": True,
        },
    )
    try:
        first = _read_events(resp, until_first=True)
        t0 = time.monotonic()
        small_server.terminate()
        health = wait_health(small_server.port, lambda status: status != 200)
        rest = _read_events(resp)  # the stream ends: it must not hang
    finally:
        conn.close()
    elapsed = time.monotonic() - t0
    rc = small_server.wait_exit(30)
    assert health[0] == 503 and health[2] == b"shutting down", health
    assert rest[-1] == "[DONE]", rest[-3:]
    err = check_error_body(rest[-2].encode(), 503)
    assert err["code"] == "server_shutdown" and err["type"] == "server_error", err
    docs = [json.loads(e) for e in first + rest[:-2]]
    reasons = [ch.get("finish_reason") for d in docs for ch in d["choices"] if ch.get("finish_reason")]
    assert not reasons, "the request ran to its end: it was not cancelled after the grace period"
    assert elapsed >= 1, elapsed  # not before the grace period (1 s) ended
    assert rc == 0, f"exit status {rc}:\n{small_server.tail()}"


# ---------------------------------------------------------------------------------------------
# SIGTERM with requests in flight: one finishes in the grace period, eight do not


def _long_request(port: int, name: str, stream: bool, via_openai: bool) -> dict:
    """One request of 4000 tokens, ended by the end of the grace period, and how it ended."""
    body = {
        "model": name,
        "prompt": f"endless {stream} {via_openai}",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": stream,
    }
    if via_openai:
        kw = {k: v for k, v in body.items() if k != "ignore_eos"}
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600) as c:
            try:
                if stream:
                    chunks = list(c.completions.create(**kw, extra_body={"ignore_eos": True}))
                    return {"kind": "finished", "chunks": chunks}
                c.completions.create(**kw, extra_body={"ignore_eos": True})
                return {"kind": "finished"}
            except openai.APIStatusError as exc:
                return {"kind": "status", "status": exc.status_code, "message": exc.message}
            except openai.APIError as exc:  # an error event in the stream
                return {"kind": "stream_error", "message": exc.message, "body": exc.body}
    status, headers, data = raw(port, "POST", "/v1/completions", body=body, timeout=600)
    return {"kind": "raw", "status": status, "headers": headers, "data": data}


def test_sigterm_every_client_gets_a_proper_end(checkpoint, tmp_path_factory):
    """SIGTERM with nine requests in flight: the port stays open (/health and new requests get
    503), the one that can finish in the grace period does, and each of the eight that cannot
    gets an OpenAI error when the grace period ends (non-streamed: a 503 body; streamed: an error
    event, then [DONE]); then the server exits 0.

    Nothing here races the engine: the grace period is long (600 s), and a second SIGTERM ends
    it once the first request has finished (a second signal ends the grace period at once). The
    first request runs beside the others from its first token, one token per step each, and needs
    400 tokens where they need 4000: whatever the machine's speed, it ends first, and the others
    are still running when the grace period ends. (Its end by the clock is
    ``test_sigterm_past_the_grace_period_cancels_and_exits_0``'s.)"""
    grace = 600.0
    # a KV cache for all nine at full length: none is preempted
    s = Server(
        checkpoint.dir,
        ["--grace-period", str(grace), "--page-size", "16", "--num-blocks", "2304"],
        tmp_path_factory.mktemp("serve-logs") / "term.log",
    )
    try:
        s.wait_ready()
        name = checkpoint.dir.name
        with openai.OpenAI(base_url=s.url, api_key="x", max_retries=0, timeout=600) as c, ThreadPoolExecutor(8) as pool:
            # 400 tokens: running when all nine are, and it ends long before the others
            stream = c.completions.create(
                model=name,
                prompt="finish me",
                max_tokens=400,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            it = iter(stream)
            chunks = [next(it)]
            kinds = [(st, via) for st in (True, False) for via in (True, True, False, False)]
            futures = [pool.submit(_long_request, s.port, name, st, via) for st, via in kinds]
            running = wait_metrics(s.port, lambda m: m["acb_requests_running"] + m["acb_requests_waiting"] >= 9)
            assert running["acb_requests_running"] + running["acb_requests_waiting"] >= 9, running
            s.terminate()
            health = wait_health(s.port, lambda status: status != 200)
            late = raw(
                s.port, "POST", "/v1/completions", body={"model": name, "prompt": "late", "max_tokens": 2}, timeout=60
            )
            chunks += list(it)  # it runs to its end in the grace period
            # the grace period is not over: the eight are still waiting for their ends
            assert not [f for f in futures if f.done()], [f.result() for f in futures if f.done()]
            s.proc.send_signal(signal.SIGTERM)  # a second signal: the grace period ends now
            results = [f.result(timeout=120) for f in futures]
        rc = s.wait_exit(120)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
        s._log.close()
    assert health[0] == 503 and health[2] == b"shutting down", health
    assert late[0] == 503 and late[1].get("retry-after") == "1", late
    assert "shutting down" in check_error_body(late[2], 503)["message"]
    reasons = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert reasons == ["length"]  # it ran to its end
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 400
    for (stream, via_openai), r in zip(kinds, results):
        if via_openai and stream:
            assert r["kind"] == "stream_error" and "shut down" in r["message"], r
        elif via_openai:
            assert r["kind"] == "status" and r["status"] == 503 and "shut down" in r["message"], r
        elif stream:
            assert r["status"] == 200, r
            events = sse_events(r["data"])
            assert events[-1] == "[DONE]", events[-3:]
            assert check_error_body(events[-2].encode(), 503)["code"] == "server_shutdown"
            assert not any(ch.get("finish_reason") for e in events[:-2] for ch in json.loads(e)["choices"])
        else:
            assert r["status"] == 503 and r["headers"].get("retry-after") == "1", r
            assert check_error_body(r["data"], 503)["code"] == "server_shutdown"
    assert rc == 0, f"exit status {rc}:\n{s.tail()}"
