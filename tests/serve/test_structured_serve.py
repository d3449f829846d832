"""Structured outputs, tool calls and reasoning through ``acb serve`` (issue 29), driven by the
real ``openai`` client against ``python -m acb serve`` subprocesses.

A random model has no preferences, so every constrained output must be valid by construction:
``chat.completions.parse`` with pydantic models, regex and choice, named and ``required`` tool
calls whose arguments fit the tool's schema. It all runs twice: on a server with async batching
(the CUDA default) and ``--reasoning-parser deepseek_r1`` (which starts in reasoning: an output
constrained from its first token must still be the content, or the call, never
``reasoning_content``), and on one whose KV cache is small enough to preempt, with offload.

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
jsonschema = pytest.importorskip("jsonschema")

import torch  # noqa: E402

import acb  # noqa: E402
from acb.models import build_tokenizer  # noqa: E402
from tests.conftest import reference_generate  # noqa: E402
from tests.serve.helpers import check_error_body, raw, tiny_checkpoint  # noqa: E402
from tests.serve.test_openai_server import _serve, chat_ids, decode  # noqa: E402

NAME = "tiny-structured"
# renders the tools and the calls of the history (as real templates do, in their own format)
TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
    "{% if m.tool_calls %} calls:{% for c in m.tool_calls %} {{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "days", "metric"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
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
    args = {
        "async": ["--async-batching", "--page-size", "16", "--num-blocks", "256", "--reasoning-parser", "deepseek_r1"],
        # 14 blocks of 8 tokens: concurrent requests preempt each other, parked in host memory
        "preempt-offload": [
            "--page-size",
            "8",
            "--num-blocks",
            "40",
            "--max-batch-tokens",
            "64",
            "--cpu-offload-space",
            "0.05",
        ],
    }[request.param]
    for server in _serve(
        checkpoint, tmp_path_factory, f"structured-{request.param}", ["--served-model-name", NAME, *args]
    ):
        with openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120) as c:
            c.port = server.port  # type: ignore[attr-defined]
            c.reasoning = request.param == "async"  # type: ignore[attr-defined]
            yield c


def no_reasoning(client, message) -> None:
    """A constrained output is never reasoning: ``reasoning_content`` is null where the server has
    a reasoning parser (and absent where it has none)."""
    extra = message.model_extra or {}
    if client.reasoning:
        assert "reasoning_content" in extra and extra["reasoning_content"] is None, extra
    else:
        assert "reasoning_content" not in extra, extra


def streamed_reasoning(chunks) -> str:
    return "".join(
        (ch.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for ch in chunks if ch.choices
    )


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
    no_reasoning(client, msg)
    schema = openai.lib._pydantic.to_strict_json_schema(Answer)
    chunks = list(
        client.chat.completions.create(
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
            **kw,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert streamed_reasoning(chunks) == ""


def test_regex_choice_and_json_object(client, checkpoint):
    r = client.completions.create(
        model=NAME,
        prompt="code:",
        max_tokens=40,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{2,4}"}},
    )
    assert re.fullmatch(r"[A-Z]{2}-\d{2,4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    choices = ["red", "green", "deep blue"]
    r = client.chat.completions.create(
        model=NAME,
        messages=USER,
        max_tokens=20,
        n=3,
        temperature=1.0,
        seed=5,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert [c.message.content in choices for c in r.choices] == [True] * 3
    for c in r.choices:
        no_reasoning(client, c.message)
    r = client.chat.completions.create(
        model=NAME, messages=USER, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
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
    no_reasoning(client, c.message)
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check_weather_args(call.function.arguments)
    # streamed: the same call (ids differ)
    chunks = list(
        client.chat.completions.create(
            stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw
        )
    )
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        "tool_calls"
    ]
    assert (
        streamed_reasoning(chunks) == ""
        and "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ""
    )
    # required, one call at most: a call to one of the tools, arguments valid for that tool
    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    no_reasoning(client, r.choices[0].message)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    if calls[0].function.name == "get_weather":
        check_weather_args(calls[0].function.arguments)
    else:
        assert json.loads(calls[0].function.arguments)["zone"] in ("utc", "cet")


# matches no finite text: an object that must hold itself (the engine refuses it at compile)
ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}


@pytest.mark.parametrize(
    "path,body,param",
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS}}},
            "response_format",
        ),
        ("/v1/chat/completions", {"structured_outputs": {"json": ENDLESS}}, "structured_outputs"),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "e", "parameters": ENDLESS}}],
                "tool_choice": {"type": "function", "function": {"name": "e"}},
            },
            "tools[0].function.parameters",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "e", "parameters": ENDLESS}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": ENDLESS}}}, "text.format"),
        (
            "/v1/responses",
            {
                "tools": [{"type": "function", "name": "e", "parameters": ENDLESS}],
                "tool_choice": {"type": "function", "name": "e"},
            },
            "tools[0].parameters",
        ),
        # refused at submit: min_tokens holds back the end of every output of the constraint
        (
            "/v1/chat/completions",
            {"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 50},
            "structured_outputs",
        ),
        ("/v1/completions", {"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 50}, "structured_outputs"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_constraint_that_can_never_be_met_is_a_400_naming_its_field(client, path, body, param):
    """The engine refuses a constraint no output can meet (at compile, or at submit against
    ``min_tokens``); the server answers 400 naming the field it came from."""
    base = (
        {"messages": USER}
        if path == "/v1/chat/completions"
        else {"prompt": "x"}
        if path == "/v1/completions"
        else {"input": "x"}
    )
    status, _, data = raw(client.port, "POST", path, {"model": NAME, "max_tokens": 100, **base, **body})
    assert status == 400, data
    err = check_error_body(data, status)
    assert err["param"] == param and "never" in err["message"], err


def test_an_output_its_grammar_cannot_continue_ends_as_cut_short(client):
    """``min_tokens`` past the end of a JSON constraint's only output: the engine ends the output
    where its grammar allows nothing more (acb's finish reason ``grammar``, which OpenAI's API
    lacks); the server says ``length`` (cut short before it was complete), streamed or not, and
    the text is what the grammar allowed. Never a 500."""
    kw = dict(
        model=NAME,
        messages=USER,
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": {"json": {"enum": ["ok"]}}, "min_tokens": 20},
    )
    c = client.chat.completions.create(**kw).choices[0]
    assert (c.finish_reason, c.message.content) == ("length", '"ok"')
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == '"ok"'
    r = client.completions.create(
        model=NAME,
        prompt="x",
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": {"json": {"enum": ["ok"]}}, "min_tokens": 20},
    )
    assert (r.choices[0].finish_reason, r.choices[0].text) == ("length", '"ok"')


class Spot(pydantic.BaseModel):
    room: Literal["kitchen", "hall"]


class Lamp(pydantic.BaseModel):
    """Nested models: the tool's parameters carry ``$defs`` and ``$ref`` entries."""

    spot: Spot
    on: bool


def _other_spot() -> type[pydantic.BaseModel]:
    class Spot(pydantic.BaseModel):  # the same definition name as Lamp's, another model
        floor: Literal["ground", "top"]

    class Move(pydantic.BaseModel):
        to: Spot
        via: list[Spot] = pydantic.Field(max_length=2)

    return Move


LAMP = openai.pydantic_function_tool(Lamp)
MOVE = openai.pydantic_function_tool(_other_spot())


def check_call(call_name: str, arguments: str, tools: list[dict]) -> dict:
    """The call names one of ``tools`` and its arguments fit that tool's own schema (its ``$ref`` entries
    resolved in it), not another's."""
    (tool,) = [t for t in tools if t["function"]["name"] == call_name]
    args = json.loads(arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_tools_with_defs_and_refs(client):
    """Tools whose parameters use ``$defs``/``$ref`` (any nested pydantic model), two of them
    defining ``Spot`` differently: ``required`` (one call, then several) and a named choice,
    on chat and on the Responses API; each call's arguments fit its own tool's schema."""
    tools = [LAMP, MOVE]
    assert "$defs" in LAMP["function"]["parameters"] and "$defs" in MOVE["function"]["parameters"]
    kw = dict(model=NAME, messages=USER, max_tokens=200, temperature=0, tools=tools)
    for extra in (
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "Lamp"}}},
        {"tool_choice": {"type": "function", "function": {"name": "Move"}}},
    ):
        r = client.chat.completions.create(**kw, **extra)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (extra, c)
        assert c.message.tool_calls and all(
            check_call(t.function.name, t.function.arguments, tools) for t in c.message.tool_calls
        )
        if extra.get("parallel_tool_calls") is False:
            assert len(c.message.tool_calls) == 1
        if isinstance(extra["tool_choice"], dict):
            assert [t.function.name for t in c.message.tool_calls] == [extra["tool_choice"]["function"]["name"]]
    flat = [
        {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"], "strict": True}
        for t in tools
    ]
    for choice in ("required", {"type": "function", "name": "Move"}):
        r = client.responses.create(
            model=NAME,
            input="what is the weather?",
            tools=flat,
            tool_choice=choice,
            max_output_tokens=200,
            temperature=0,
        )
        assert r.status == "completed", r.output
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and [o.type for o in r.output] == ["function_call"] * len(calls)
        for call in calls:
            check_call(call.name, call.arguments, tools)


def test_required_schema_keeps_each_tools_definitions(checkpoint):
    """In-process: the combined schema of ``required`` accepts a call whose arguments fit its own
    tool's ``Spot`` and refuses one that fits only the other tool's (the clashing names are kept
    apart), through acb's own grammar compiler and matcher."""
    from acb.serve.shaping import plan_tools, required_calls_schema
    from acb.structured import GrammarCompiler, Matcher

    plan = plan_tools([LAMP, MOVE], "required", None, None)
    schema = required_calls_schema(plan.functions, parallel=True)
    assert plan.structured == acb.StructuredOutputs(json=schema)
    tok = checkpoint.tok
    compiler = GrammarCompiler(tok, len(tok))
    try:
        compiled = compiler.compile_now(plan.structured)

        def accepts(value) -> bool:
            matcher = Matcher(compiled)
            ids = tok.encode(json.dumps(value, separators=(",", ":")), add_special_tokens=False)
            return all(matcher.accept(t) for t in ids) and matcher.accept(tok.eos_token_id)

        lamp = {"name": "Lamp", "parameters": {"spot": {"room": "hall"}, "on": True}}
        move = {"name": "Move", "parameters": {"to": {"floor": "top"}, "via": [{"floor": "ground"}]}}
        assert accepts([lamp]) and accepts([move, lamp])
        assert not accepts([{"name": "Lamp", "parameters": {"spot": {"floor": "top"}, "on": True}}])
        assert not accepts([{"name": "Move", "parameters": {"to": {"room": "hall"}, "via": []}}])
        assert not accepts([])
    finally:
        compiler.close()
    # a recursive tool ($ref "#") and a JSON pointer into the tool's own properties stay inside it
    # (properties named like keywords are schemas too; enum and const values are data)
    tree = {
        "type": "object",
        "properties": {
            "leaf": {"type": "boolean"},
            "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1},
            "same": {"$ref": "#/properties/leaf"},
            "enum": {"$ref": "#/properties/leaf"},
            "const": {"const": {"$ref": "#/not/a/schema"}},
        },
        "required": ["leaf", "kids", "same"],
    }
    schema = required_calls_schema(
        plan_tools(
            [{"type": "function", "function": {"name": "t", "parameters": tree}}], "required", None, None
        ).functions,
        parallel=False,
    )
    params = schema["$defs"]["tool0"]["properties"]
    assert params["kids"]["items"] == {"$ref": "#/$defs/tool0"}
    assert params["same"] == params["enum"] == {"$ref": "#/$defs/tool0/properties/leaf"}
    assert params["const"] == {"const": {"$ref": "#/not/a/schema"}}
    assert schema["maxItems"] == 1


def test_constrained_output_on_the_responses_api_is_never_reasoning(client):
    """``text.format`` and forced calls on ``/v1/responses``: the output is the message (or the
    call), with no reasoning item, streamed or not, also where the server's reasoning parser
    (``deepseek_r1``) starts in reasoning."""
    pick = {
        "type": "object",
        "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
        "required": ["kind", "ok"],
        "additionalProperties": False,
    }
    kw = dict(model=NAME, input="what is the weather?", max_output_tokens=64, temperature=0)
    fmt = {"format": {"type": "json_schema", "name": "pick", "schema": pick, "strict": True}}
    r = client.responses.create(**kw, text=fmt)
    assert r.status == "completed" and [o.type for o in r.output] == ["message"], r.output
    jsonschema.validate(json.loads(r.output_text), pick)
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    events = list(client.responses.create(**kw, text=fmt, stream=True))
    assert not [e for e in events if "reasoning" in e.type]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    flat = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    for choice in ({"type": "function", "name": "get_weather"}, "required"):
        kw["max_output_tokens"] = 160
        r = client.responses.create(**kw, tools=[flat], tool_choice=choice)
        assert r.status == "completed" and {o.type for o in r.output} == {"function_call"}, r.output
        check_weather_args(r.output[0].arguments)
        events = list(client.responses.create(**kw, tools=[flat], tool_choice=choice, stream=True))
        assert not [e for e in events if "reasoning" in e.type or "output_text" in e.type]
        assert events[-1].response.output[0].arguments == r.output[0].arguments


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "frobnicate"}}}


@pytest.mark.parametrize(
    "path,body,param",
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
            "response_format",
        ),
        ("/v1/chat/completions", {"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs"),
        (
            "/v1/chat/completions",
            {
                "tools": [WEATHER, {"type": "function", "function": {"name": "bad", "parameters": BAD_SCHEMA}}],
                "tool_choice": {"type": "function", "function": {"name": "bad"}},
            },
            "tools[1].function.parameters",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [WEATHER, {"type": "function", "function": {"name": "bad", "parameters": BAD_SCHEMA}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        (
            "/v1/responses",
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}},
            "text.format",
        ),
        ("/v1/responses", {"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs"),
        (
            "/v1/responses",
            {
                "tools": [{"type": "function", "name": "bad", "parameters": BAD_SCHEMA}],
                "tool_choice": {"type": "function", "name": "bad"},
            },
            "tools[0].parameters",
        ),
        (
            "/v1/responses",
            {"tools": [{"type": "function", "name": "bad", "parameters": BAD_SCHEMA}], "tool_choice": "required"},
            "tools",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_constraint_that_does_not_compile_names_its_field(client, path, body, param):
    """A constraint refused by the grammar compiler is a 400 naming the field it was built from
    (not always ``response_format``), on every endpoint."""
    base = (
        {"messages": USER}
        if path == "/v1/chat/completions"
        else {"prompt": "x"}
        if path == "/v1/completions"
        else {"input": "x"}
    )
    status, _, data = raw(client.port, "POST", path, {"model": NAME, "max_tokens": 5, **base, **body})
    assert status == 400, data
    assert check_error_body(data, status)["param"] == param


def test_a_forced_call_cut_short_is_its_text_streamed_or_not(client):
    """A forced call that ``max_tokens`` cuts short is no call: its text is the content, in the
    stream as in the whole response (the stream used to drop it)."""
    kw = dict(
        model=NAME,
        messages=USER,
        max_tokens=5,
        temperature=0,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None and c.message.content.startswith("{")
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert not [ch for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]


def test_tool_history_is_rendered(client, checkpoint):
    """An assistant message with tool_calls and a tool message are accepted, and the chat
    template renders them (the prompt's token count is the template's)."""
    history = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2, "metric": true}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
    ]
    r = client.chat.completions.create(
        model=NAME, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=4, temperature=0
    )
    rendered = [dict(m) for m in history]
    rendered[1] = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "metric": True}},
            }
        ],
    }
    assert r.usage.prompt_tokens == len(chat_ids(checkpoint.tok, rendered, tools=[WEATHER]))
    assert r.choices[0].message.tool_calls is None


def test_constrained_and_free_requests_together(client, checkpoint):
    """16 concurrent requests, half constrained: every constrained output is valid, every free
    one equals ``model.generate``."""
    tok, model = checkpoint.tok, checkpoint.model
    prompts = [f"mixed request {i}" for i in range(16)]

    def one(i: int):
        if i % 2:
            return client.completions.create(
                model=NAME,
                prompt=prompts[i],
                max_tokens=30,
                temperature=0,
                extra_body={"structured_outputs": {"regex": r"(ab|cd){1,5}!"}},
            )
        return client.completions.create(
            model=NAME, prompt=prompts[i], max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )

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
        body = {
            "model": NAME,
            "messages": USER,
            "max_tokens": 5,
            **extra.get("extra_body", {}),
            **{k: v for k, v in extra.items() if k != "extra_body"},
        }
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
    cfg = GPT2Config(
        vocab_size=len(tok),
        n_positions=n,
        n_embd=n,
        n_layer=1,
        n_head=1,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
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


@pytest.mark.parametrize(
    "parser,reasoning,script",
    [
        (
            "hermes",
            "qwen3",
            '<think>it asks for weather</think><tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "days": 3, "metric": true}}\n</tool_call>',
        ),
        ("llama3_json", None, '{"name": "get_weather", "parameters": {"city": "Lima", "days": 1, "metric": false}}'),
    ],
)
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
            assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == (
                "it asks for weather" if reasoning else ""
            )
            assert "".join(d.content or "" for d in deltas) == ""  # the tags never leak as content
            # tool_choice "none": the same text (the same prompt) is content, not a call
            plain = client.chat.completions.create(tool_choice="none", **kw).choices[0]
            assert plain.message.tool_calls is None and "get_weather" in plain.message.content
            assert plain.finish_reason == "stop"


@pytest.mark.parametrize("reasoning,script", [("deepseek_r1", "</think>hi"), ("qwen3", "<think></think>hi")])
def test_an_empty_reasoning_section_streams_on_the_responses_api(tmp_path_factory, reasoning, script):
    """A reasoning section that is empty (``</think>`` at once where the parser starts in
    reasoning, ``<think></think>`` where it does not): the streamed response ends with
    ``response.completed`` (not an error event), and its items are the non-streamed response's:
    an empty reasoning item, then the message. Chat says the same."""
    for server in _scripted_server(tmp_path_factory, script, "hermes", reasoning, f"empty-{reasoning}"):
        with openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60) as client:
            flat = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
            kw = dict(model=NAME, input=USER[0]["content"], tools=[flat], max_output_tokens=50, temperature=0)
            whole = client.responses.create(**kw)
            assert whole.status == "completed"
            assert [(o.type, [c.text for c in o.content]) for o in whole.output] == [
                ("reasoning", [""]),
                ("message", ["hi"]),
            ]
            events = list(client.responses.create(**kw, stream=True))
            assert events[-1].type == "response.completed", [e.type for e in events][-3:]
            done = [e.item for e in events if e.type == "response.output_item.done"]
            assert [i.model_dump(exclude={"id"}) for i in done] == [o.model_dump(exclude={"id"}) for o in whole.output]
            assert [i.id for i in done] == [o.id for o in events[-1].response.output]
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "hi"
            with client.responses.stream(**kw) as stream:  # the client's own consistency checks
                assert stream.get_final_response().output_text == "hi"
            chat = (
                client.chat.completions.create(model=NAME, messages=USER, tools=[WEATHER], max_tokens=50, temperature=0)
                .choices[0]
                .message
            )
            assert (chat.content, (chat.model_extra or {}).get("reasoning_content")) == ("hi", "")
