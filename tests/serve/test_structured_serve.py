"""Structured outputs, tool calls and reasoning through ``acb serve`` (issue 29), driven by the
real ``openai`` client against ``python -m acb serve`` subprocesses.

A random model has no preferences, so every constrained output must be valid by construction:
``chat.completions.parse`` with pydantic models, regex and choice, named and ``required`` tool
calls whose arguments fit the tool's schema. It all runs twice: on a server with async batching
(the CUDA default), and on one whose KV cache is small enough to preempt, with offload.

``tool_choice="auto"`` and ``reasoning_content`` need a model that writes tool calls and
``<think>``: a *scripted* model (GPT-2 whose only signal is a one-hot position embedding, with an
LM head that maps each position to the next token of a script) writes exactly the text chosen
for the prompt, once per parser.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Literal

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
pydantic = pytest.importorskip("pydantic")

import torch  # noqa: E402

from acb.models import build_tokenizer  # noqa: E402
from tests.conftest import reference_generate  # noqa: E402
from tests.serve.helpers import check_error_body, raw, tiny_checkpoint  # noqa: E402
from tests.serve.test_openai_server import _serve, chat_ids, decode  # noqa: E402

NAME = "tiny-structured"
# renders the tools and the calls of the history (as real templates do, in their own format)
TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
            "{% if m.tool_calls %} calls:{% for c in m.tool_calls %} {{ c['function']['name'] }}"
            "{{ c['function']['arguments'] | tojson }}{% endfor %}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                                    "metric": {"type": "boolean"}},
                   "required": ["city", "days", "metric"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "what is the weather?"}]


class Inner(pydantic.BaseModel):
    level: Literal["low", "mid", "high"]
    ok: bool


class Answer(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    flag: bool
    kind: Literal["cat", "dog"]
    inner: Inner
    tags: list[Literal["a", "b", "c"]] = pydantic.Field(max_length=3)


def check_weather_args(args: str) -> dict:
    obj = json.loads(args)
    assert set(obj) == {"city", "days", "metric"} and obj["city"] in ("Paris", "Oslo", "Lima")
    assert isinstance(obj["days"], int) and 1 <= obj["days"] <= 7 and isinstance(obj["metric"], bool)
    return obj


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "tiny-structured", TEMPLATE, 1024)


@pytest.fixture(scope="module", params=["async", "preempt-offload"])
def client(request, checkpoint, tmp_path_factory):
    args = {"async": ["--async-batching", "--page-size", "16", "--num-blocks", "256"],
            # 14 blocks of 8 tokens: concurrent requests preempt each other, parked in host memory
            "preempt-offload": ["--page-size", "8", "--num-blocks", "40", "--max-batch-tokens", "64",
                                "--cpu-offload-space", "0.05"]}[request.param]
    for server in _serve(checkpoint, tmp_path_factory, f"structured-{request.param}",
                         ["--served-model-name", NAME, *args]):
        with openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120) as c:
            c.port = server.port  # type: ignore[attr-defined]
            yield c


def test_parse_with_a_pydantic_model(client):
    """``chat.completions.parse(response_format=Model)``: a strict json_schema the output fits;
    streamed deltas add up to the same text under greedy decoding."""
    kw = dict(model=NAME, messages=USER, max_tokens=300, temperature=0)
    r = client.chat.completions.parse(response_format=Answer, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", msg.content
    assert isinstance(msg.parsed, Answer)
    assert msg.parsed == Answer.model_validate_json(msg.content)
    assert json.dumps(json.loads(msg.content), separators=(",", ":"), ensure_ascii=False) == msg.content  # compact
    schema = openai.lib._pydantic.to_strict_json_schema(Answer)
    chunks = list(client.chat.completions.create(
        stream=True, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                             "strict": True}}, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content


def test_regex_choice_and_json_object(client, checkpoint):
    r = client.completions.create(model=NAME, prompt="code:", max_tokens=40, temperature=1.0, seed=3,
                                  extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{2,4}"}})
    assert re.fullmatch(r"[A-Z]{2}-\d{2,4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    choices = ["red", "green", "deep blue"]
    r = client.chat.completions.create(model=NAME, messages=USER, max_tokens=20, n=3, temperature=1.0, seed=5,
                                       extra_body={"structured_outputs": {"choice": choices}})
    assert [c.message.content in choices for c in r.choices] == [True] * 3
    r = client.chat.completions.create(model=NAME, messages=USER, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":  # (an unbounded object may run out of tokens: a prefix then)
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.startswith("{")


def test_named_and_required_tool_calls(client):
    """Forced tool calls work on any model: their arguments fit the tool's schema."""
    kw = dict(model=NAME, messages=USER, max_tokens=120, temperature=0, tools=[WEATHER, TIME])
    r = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check_weather_args(call.function.arguments)
    # streamed: the same call (ids differ)
    chunks = list(client.chat.completions.create(
        stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw))
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        ["tool_calls"]
    # required, one call at most: a call to one of the tools, arguments valid for that tool
    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    if calls[0].function.name == "get_weather":
        check_weather_args(calls[0].function.arguments)
    else:
        assert json.loads(calls[0].function.arguments)["zone"] in ("utc", "cet")


def test_tool_history_is_rendered(client, checkpoint):
    """An assistant message with tool_calls and a tool message are accepted, and the chat
    template renders them (the prompt's token count is the template's)."""
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Oslo", "days": 2, "metric": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
    r = client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER], tool_choice="none",
                                       max_tokens=4, temperature=0)
    rendered = [dict(m) for m in history]
    rendered[1] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "metric": True}}}]}
    assert r.usage.prompt_tokens == len(chat_ids(checkpoint.tok, rendered, tools=[WEATHER]))
    assert r.choices[0].message.tool_calls is None


def test_constrained_and_free_requests_together(client, checkpoint):
    """16 concurrent requests, half constrained: every constrained output is valid, every free
    one equals ``model.generate``."""
    tok, model = checkpoint.tok, checkpoint.model
    prompts = [f"mixed request {i}" for i in range(16)]

    def one(i: int):
        if i % 2:
            return client.completions.create(model=NAME, prompt=prompts[i], max_tokens=30, temperature=0,
                                             extra_body={"structured_outputs": {"regex": r"(ab|cd){1,5}!"}})
        return client.completions.create(model=NAME, prompt=prompts[i], max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    for i, r in enumerate(results):
        text = r.choices[0].text
        if i % 2:
            assert re.fullmatch(r"(ab|cd){1,5}!", text), text
        else:
            assert text == decode(tok, reference_generate(model, tok(prompts[i]).input_ids, 10))


def test_bad_constraints_are_400s(client):
    cases = [
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
        dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}),
        dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}),
        dict(tools=[WEATHER], tool_choice="auto"),  # no --tool-call-parser on this server
        dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
    ]
    for extra in cases:
        body = {"model": NAME, "messages": USER, "max_tokens": 5, **extra.get("extra_body", {}),
                **{k: v for k, v in extra.items() if k != "extra_body"}}
        status, _, data = raw(client.port, "POST", "/v1/chat/completions", body)
        assert status == 400, (extra, data)
        check_error_body(data, status)
    # the server is unaffected
    assert client.chat.completions.create(model=NAME, messages=USER, max_tokens=3).choices


# ------------------------------------------------------------------------- scripted models
def scripted_checkpoint(tmp_path_factory, tok, prompt_len: int, script: str, name: str):
    """GPT-2 that writes ``script`` (then EOS) after any prompt of ``prompt_len`` tokens: the
    blocks are zero (the residual stream is the one-hot position embedding) and the LM head maps
    position ``p`` to the token after it in the script."""
    from transformers import GPT2Config, GPT2LMHeadModel

    ids = tok(script, add_special_tokens=False).input_ids + [tok.eos_token_id]
    n = prompt_len + len(ids) + 8
    cfg = GPT2Config(vocab_size=len(tok), n_positions=n, n_embd=n, n_layer=1, n_head=1, tie_word_embeddings=False,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for ln in [model.transformer.ln_f] + [m for b in model.transformer.h for m in (b.ln_1, b.ln_2)]:
            ln.weight.fill_(1.0)
        model.transformer.wpe.weight.copy_(torch.eye(n))
        for i, t in enumerate(ids):
            model.lm_head.weight[t, prompt_len - 1 + i] = 10.0
    d = tmp_path_factory.mktemp(name)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return SimpleNamespace(dir=d, script=script)


def _scripted_server(tmp_path_factory, script: str, parser: str, reasoning: str | None, name: str):
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    prompt_len = len(chat_ids(tok, USER, tools=[WEATHER]))
    ckpt = scripted_checkpoint(tmp_path_factory, tok, prompt_len, script, name)
    args = ["--served-model-name", NAME, "--tool-call-parser", parser, "--page-size", "16", "--num-blocks", "64"]
    if reasoning:
        args += ["--reasoning-parser", reasoning]
    return _serve(ckpt, tmp_path_factory, name, args)


@pytest.mark.parametrize("parser,reasoning,script", [
    ("hermes", "qwen3", '<think>it asks for weather</think><tool_call>\n{"name": "get_weather", "arguments": '
                        '{"city": "Paris", "days": 3, "metric": true}}\n</tool_call>'),
    ("llama3_json", None, '{"name": "get_weather", "parameters": {"city": "Lima", "days": 1, "metric": false}}'),
])
def test_auto_tool_calls_and_reasoning_from_a_scripted_model(tmp_path_factory, parser, reasoning, script):
    for server in _scripted_server(tmp_path_factory, script, parser, reasoning, f"scripted-{parser}"):
        with openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60) as client:
            kw = dict(model=NAME, messages=USER, tools=[WEATHER], max_tokens=200, temperature=0)
            r = client.chat.completions.create(**kw)  # tool_choice defaults to auto with tools
            c = r.choices[0]
            (call,) = c.message.tool_calls
            expected = json.loads(re.search(r"\{\"city.*?\}", script).group(0))
            assert call.function.name == "get_weather" and json.loads(call.function.arguments) == expected
            assert c.finish_reason == "tool_calls" and c.message.content is None
            extra = c.message.model_extra or {}
            assert extra.get("reasoning_content") == ("it asks for weather" if reasoning else None)
            chunks = list(client.chat.completions.create(stream=True, **kw))
            deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
            streamed = [tc for d in deltas for tc in d.tool_calls or ()]
            assert [t.function.name for t in streamed if t.function.name] == ["get_weather"]
            assert json.loads("".join(t.function.arguments or "" for t in streamed)) == expected
            assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
                ("it asks for weather" if reasoning else "")
            assert "".join(d.content or "" for d in deltas) == ""  # the tags never leak as content
            # tool_choice "none": the same text (the same prompt) is content, not a call
            plain = client.chat.completions.create(tool_choice="none", **kw).choices[0]
            assert plain.message.tool_calls is None and "get_weather" in plain.message.content
            assert plain.finish_reason == "stop"
