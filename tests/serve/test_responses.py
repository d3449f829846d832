"""``POST /v1/responses`` (acb/serve/responses.py, issue 29): the Responses API of ``acb serve``,
in a subprocess, driven with the real ``openai`` client (which parses every response and event
against its models, and whose ``responses.stream`` helper checks the events' consistency), and
with raw HTTP for status lines and SSE framing.

One server for the module: a tiny random Llama with a byte-level tokenizer and a chat template
that renders tools, tool calls and tool results (so that the prompt the server renders can be
checked token for token), and opens ``<think>`` when the first message is "think first" (the
server runs ``--reasoning-parser qwen3``, which then reads the whole output as reasoning). Greedy
outputs are checked against ``model.generate`` on the same prompt, rendered here.
"""

from __future__ import annotations

import functools
import json
from typing import Literal

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from tests.conftest import reference_generate
from tests.serve.helpers import check_error_body, raw, tiny_checkpoint
from tests.serve.test_openai_server import SMALL_KV, _serve, decode, sse_events

NAME = "tiny-responses"
THINK = "think first"
TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.tool_calls or [] %} <call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}>"
    "{% endfor %}{% if m.tool_call_id %} [result of {{ m.tool_call_id }} {{ m.name }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if messages[0]['content'] == '" + THINK + "' %}<think>"
    "{% endif %}{% endif %}"
)
LIGHT = {
    "type": "object",
    "properties": {"room": {"type": "string", "enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
    "required": ["room", "on"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "set_light", "description": "Switch a light", "parameters": LIGHT, "strict": True}
# the tool as the server hands it to the chat template (acb.serve.shaping's key order: name,
# parameters, description; the template's tojson keeps the order, so the prompt depends on it)
TOOL_CHAT = {
    "type": "function",
    "function": {"name": "set_light", "parameters": LIGHT, "description": "Switch a light"},
}
# enums and booleans only: whatever a random model prefers, the constrained output ends
PICK = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "tiny-llama-responses", TEMPLATE, 2048)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    yield from _serve(
        checkpoint,
        tmp_path_factory,
        "responses",
        [
            *("--served-model-name", NAME, "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", *SMALL_KV),
            "--enable-weight-updates",  # (test_a_finished_response_carries_its_weight_version)
        ],
    )


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60) as c:
        yield c


def prompt_ids(tok, messages, tools=None) -> list[int]:
    ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy(checkpoint, messages, n: int, tools=None) -> tuple[list[int], list[int]]:
    """The prompt's ids and ``model.generate``'s greedy tokens after it."""
    ids = prompt_ids(checkpoint.tok, messages, tools)
    return ids, reference_generate(checkpoint.model, ids, n)


def ended_by_length(ref: list[int], eos: int, n: int) -> bool:
    return len(ref) == n and ref[-1] != eos


def message_items(r) -> list:
    return [o for o in r.output if o.type == "message"]


# --------------------------------------------------------------------------------------- text
def test_a_finished_response_carries_its_weight_version(server, client, checkpoint):
    """Every response says which weights made it (``docs/guides/rl.md``), a Responses one too, and
    the ``response.completed`` event's. The update loads the very checkpoint the server serves
    (the same weights: the module's other tests are unaffected) under a new version; before it, a
    version no output could carry (a list, the spans' form; a NaN), from disk or pushed by a
    trainer, is refused naming it (a 400), and the server goes on as it was."""
    first = client.responses.create(model=NAME, input="which weights?", max_output_tokens=3, temperature=0)
    version = first.weight_version
    assert isinstance(version, int)
    for bad in ([7, 8], float("nan")):
        body = json.dumps({"model_path": str(checkpoint.dir), "weight_version": bad}).encode()
        status, _, answer = raw(server.port, "POST", "/update_weights_from_disk", body)
        assert status == 400 and "weight_version" in check_error_body(answer, status)["message"]
        assert client.responses.create(model=NAME, input="hi", max_output_tokens=3).weight_version == version
    # a trainer's push: refused at the handshake, before any tensor moves
    from acb.rl import WeightPusher, WeightPushError
    from tests.serve.test_openai_server import _free_port

    pusher = WeightPusher([server.url.removesuffix("/v1")], master_port=_free_port(), timeout_s=60)
    try:
        for bad in ([7, 8], float("nan")):
            with pytest.raises(WeightPushError, match="weight_version") as refused:
                pusher.push(checkpoint.model, version=bad)
            assert refused.value.statuses == (400,)  # (not a 500 after a broadcast for nothing)
    finally:
        pusher.close()
    assert client.responses.create(model=NAME, input="hi", max_output_tokens=3).weight_version == version
    status, _, answer = raw(
        server.port, "POST", "/update_weights_from_disk", {"model_path": str(checkpoint.dir), "weight_version": "v-7"}
    )
    assert status == 200 and json.loads(answer)["weight_version"] == "v-7"
    r = client.responses.create(model=NAME, input="which weights?", max_output_tokens=3, temperature=0)
    assert r.weight_version == "v-7" and r.output_text == first.output_text  # (the same weights)
    events = list(client.responses.create(model=NAME, input="hi", max_output_tokens=3, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.weight_version == "v-7"
    assert all(getattr(e.response, "weight_version", None) is None for e in events[:2])  # (in progress)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.weight_version == "v-7"


def test_plain_input_equals_generate_and_chat(client, checkpoint):
    messages = [{"role": "user", "content": "héllo wörld"}]
    ids, ref = greedy(checkpoint, messages, 12)
    r = client.responses.create(model=NAME, input="héllo wörld", max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.output_text == decode(checkpoint.tok, ref)
    (msg,) = r.output  # no reasoning (no <think>), no calls: one message
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [p.type for p in msg.content] == ["output_text"]
    length = ended_by_length(ref, checkpoint.eos, 12)
    assert r.status == ("incomplete" if length else "completed")
    assert msg.status == r.status
    u = r.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (len(ids), len(ref), len(ids) + len(ref))
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    # the echoed request
    assert r.max_output_tokens == 12 and r.temperature == 0 and r.tools == [] and r.parallel_tool_calls is True
    # the chat endpoint says the same for the same messages
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == r.output_text


def test_instructions_and_message_list(client, checkpoint):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok then"},
        {"role": "user", "content": "second part"},
    ]
    ids, ref = greedy(checkpoint, messages, 10)
    r = client.responses.create(
        model=NAME,
        instructions="be brief",
        temperature=0,
        max_output_tokens=10,
        input=[
            {"role": "user", "content": "first"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok then"}]},
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "second "}, {"type": "input_text", "text": "part"}],
            },
        ],
    )
    assert r.usage.input_tokens == len(ids)  # the server rendered exactly these messages
    assert r.output_text == decode(checkpoint.tok, ref)
    assert r.instructions == "be brief"


def test_max_output_tokens_incomplete(client, checkpoint):
    messages = [{"role": "user", "content": "go on and on"}]
    n = 3
    _, ref = greedy(checkpoint, messages, n)
    if not ended_by_length(ref, checkpoint.eos, n):
        pytest.skip("the random model stops within 3 tokens on this prompt")
    r = client.responses.create(model=NAME, input="go on and on", max_output_tokens=n, temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == n
    assert r.output_text == decode(checkpoint.tok, ref)
    assert message_items(r)[0].status == "incomplete"


# ---------------------------------------------------------------------------------- streaming
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def collapse(types: list[str]) -> list[str]:
    """Event types with runs of the same delta type collapsed into one."""
    out: list[str] = []
    for t in types:
        if not (t.endswith(".delta") and out and out[-1] == t):
            out.append(t)
    return out


def test_stream_events_add_up_to_the_response(client, checkpoint):
    kw = {"model": NAME, "input": "stream this", "max_output_tokens": 16, "temperature": 0}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert collapse(types) == TEXT_EVENTS + [end]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == whole.output_text
    final = events[-1].response
    assert final.status == whole.status and final.output_text == whole.output_text
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"
    assert final.usage.output_tokens == whole.usage.output_tokens
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_stream_sse_framing(server):
    status, headers, body = raw(
        server.port,
        "POST",
        "/v1/responses",
        body={"model": NAME, "input": "raw", "max_output_tokens": 4, "temperature": 0, "stream": True},
    )
    assert status == 200, body
    assert headers["content-type"].startswith("text/event-stream")
    names = [line[len("event:") :].strip() for line in body.decode().splitlines() if line.startswith("event:")]
    docs = [json.loads(e) for e in sse_events(body)]
    assert names == [d["type"] for d in docs]  # each event's name is its data's type
    assert names[-1] in ("response.completed", "response.incomplete")


# --------------------------------------------------------------------------------- reasoning
def test_reasoning_item(client, checkpoint):
    messages = [{"role": "system", "content": THINK}, {"role": "user", "content": "why?"}]
    n = 10
    ids, ref = greedy(checkpoint, messages, n)
    assert ids[-7:] == list(checkpoint.tok("<think>")["input_ids"])
    text = decode(checkpoint.tok, ref)
    assert "</think>" not in text  # a random model does not close it: all of the output is reasoning
    kw = {"model": NAME, "instructions": THINK, "input": "why?", "max_output_tokens": n, "temperature": 0}
    r = client.responses.create(**kw)
    (item,) = r.output  # the reasoning, and no empty message beside it
    assert item.type == "reasoning" and item.id.startswith("rs_")
    assert [c.text for c in item.content] == [text]
    assert r.output_text == ""
    assert r.usage.output_tokens_details.reasoning_tokens == len(ref) == r.usage.output_tokens
    assert item.status == ("incomplete" if ended_by_length(ref, checkpoint.eos, n) else "completed")
    events = list(client.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text
    assert collapse([e.type for e in events])[2:6] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
    ]
    assert events[-1].response.output[0].model_dump()["content"] == [c.model_dump() for c in item.content]


def test_constrained_output_after_an_open_think_is_not_reasoning(client, checkpoint):
    """The template opened ``<think>`` (``qwen3`` then starts in reasoning), but an output
    constrained from its first token is not reasoning: ``text.format`` JSON is the message and a
    forced call is the call, streamed or not; on the chat endpoint too (``content``, or
    ``tool_calls`` with ``finish_reason`` ``tool_calls``, and a null ``reasoning_content``)."""
    ids = prompt_ids(checkpoint.tok, [{"role": "system", "content": THINK}, {"role": "user", "content": "pick"}])
    assert ids[-7:] == list(checkpoint.tok("<think>")["input_ids"])  # the prompt opens the reasoning
    kw = {"model": NAME, "instructions": THINK, "input": "pick", "max_output_tokens": 64, "temperature": 0}
    fmt = {"format": {"type": "json_schema", "name": "pick", "schema": PICK, "strict": True}}
    r = client.responses.create(**kw, text=fmt)
    assert r.status == "completed" and [o.type for o in r.output] == ["message"], r.output
    jsonschema.validate(json.loads(r.output_text), PICK)
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    events = list(client.responses.create(**kw, text=fmt, stream=True))
    assert [e for e in events if "reasoning" in e.type] == []
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    named = {"tools": [TOOL], "tool_choice": {"type": "function", "name": "set_light"}}
    r = client.responses.create(**kw, **named)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"], r.output
    jsonschema.validate(json.loads(r.output[0].arguments), LIGHT)
    events = list(client.responses.create(**kw, **named, stream=True))
    assert events[-1].response.output[0].arguments == r.output[0].arguments
    assert [e for e in events if "reasoning" in e.type or "output_text" in e.type] == []
    # chat completions: the same prompt
    chat = [{"role": "system", "content": THINK}, {"role": "user", "content": "pick"}]
    ckw = {"model": NAME, "messages": chat, "temperature": 0}
    c = client.chat.completions.create(
        **ckw,
        max_completion_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK, "strict": True}},
    ).choices[0]
    assert c.finish_reason == "stop" and c.message.model_extra.get("reasoning_content", "absent") is None
    jsonschema.validate(json.loads(c.message.content), PICK)
    chat_tool = {"type": "function", "function": {"name": "set_light", "parameters": LIGHT}}
    for choice in ({"type": "function", "function": {"name": "set_light"}}, "required"):
        c = client.chat.completions.create(
            **ckw, max_completion_tokens=96, tools=[chat_tool], tool_choice=choice
        ).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert c.message.model_extra.get("reasoning_content", "absent") is None
        (call,) = c.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), LIGHT)
        chunks = list(
            client.chat.completions.create(
                **ckw, max_completion_tokens=96, tools=[chat_tool], tool_choice=choice, stream=True
            )
        )
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == ""
        assert (
            "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or ()) == call.function.arguments
        )


# ------------------------------------------------------------------------------- structured
def test_text_format_json_schema(client):
    kw = {
        "model": NAME,
        "input": "pick one",
        "max_output_tokens": 64,
        "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "pick", "schema": PICK, "strict": True}},
    }
    r = client.responses.create(**kw)
    assert r.status == "completed", r.output_text
    value = json.loads(r.output_text)
    jsonschema.validate(value, PICK)
    assert r.text.format.type == "json_schema" and r.text.format.name == "pick"
    streamed = list(client.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == r.output_text
    # the client's own stream helper (it needs response.completed: a constrained output ends)
    # accumulates the events into the same response
    with client.responses.stream(**kw) as stream:
        got = stream.get_final_response()
    assert got.output_text == r.output_text and got.status == "completed"
    # any JSON object
    obj = client.responses.create(
        model=NAME, input="an object", max_output_tokens=48, temperature=0, text={"format": {"type": "json_object"}}
    )
    if obj.status == "completed":  # a random model may write a long object: then it is cut
        assert isinstance(json.loads(obj.output_text), dict)


def test_responses_parse_pydantic(client):
    r = client.responses.parse(
        model=NAME, input="pick with pydantic", max_output_tokens=64, temperature=0, text_format=Pick
    )
    assert isinstance(r.output_parsed, Pick)
    assert r.output_parsed == Pick.model_validate_json(r.output_text)


# ------------------------------------------------------------------------------------- tools
def test_named_tool_choice_calls_the_function(client):
    kw = {
        "model": NAME,
        "input": "lights please",
        "tools": [TOOL],
        "max_output_tokens": 64,
        "temperature": 0,
        "tool_choice": {"type": "function", "name": "set_light"},
    }
    r = client.responses.create(**kw)
    assert r.status == "completed"
    (call,) = r.output  # a forced call and nothing else
    assert call.type == "function_call" and call.name == "set_light"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), LIGHT)
    assert r.output_text == ""
    assert r.tool_choice.type == "function" and r.tool_choice.name == "set_light"
    assert [t.name for t in r.tools] == ["set_light"] and r.tools[0].parameters == LIGHT
    events = list(client.responses.create(**kw, stream=True))
    assert collapse([e.type for e in events]) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (args,) = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert args == call.arguments  # greedy: the same call
    assert events[-1].response.output[0].arguments == call.arguments


def test_required_tool_choice(client):
    r = client.responses.create(
        model=NAME,
        input="do something",
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=96,
        temperature=0,
    )
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "set_light"
    jsonschema.validate(json.loads(calls[0].arguments), LIGHT)


def test_auto_tools_are_rendered(client, checkpoint):
    """With tools and no tool_choice (auto, the hermes parser) the prompt carries the tools; a
    random model calls none, so the output is the greedy text."""
    messages = [{"role": "user", "content": "maybe call"}]
    ids, ref = greedy(checkpoint, messages, 8, tools=[TOOL_CHAT])
    r = client.responses.create(model=NAME, input="maybe call", tools=[TOOL], max_output_tokens=8, temperature=0)
    assert r.usage.input_tokens == len(ids)
    assert r.output_text == decode(checkpoint.tok, ref)
    assert r.tool_choice == "auto"


def test_function_call_history(client, checkpoint):
    args = {"room": "hall", "on": True}
    messages = [
        {"role": "user", "content": "light the hall"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "set_light", "arguments": args}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "set_light", "content": "done"},
    ]
    ids, ref = greedy(checkpoint, messages, 10, tools=[TOOL_CHAT])
    r = client.responses.create(
        model=NAME,
        tools=[TOOL],
        tool_choice="none",
        max_output_tokens=10,
        temperature=0,
        input=[
            {"role": "user", "content": "light the hall"},
            {"type": "function_call", "call_id": "call_1", "name": "set_light", "arguments": json.dumps(args)},
            {"type": "function_call_output", "call_id": "call_1", "output": "done"},
        ],
    )
    assert r.usage.input_tokens == len(ids)  # the call and its result were rendered as above
    assert r.output_text == decode(checkpoint.tok, ref)
    # a previous response's output items go back in as they came (reasoning items are dropped)
    first = client.responses.create(
        model=NAME,
        input="light the hall",
        tools=[TOOL],
        max_output_tokens=64,
        temperature=0,
        tool_choice={"type": "function", "name": "set_light"},
    )
    call = first.output[0]
    again = client.responses.create(
        model=NAME,
        tools=[TOOL],
        max_output_tokens=4,
        temperature=0,
        input=[
            {"role": "user", "content": "light the hall"},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "done"},
        ],
    )
    hist = [
        messages[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "set_light", "arguments": json.loads(call.arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "name": "set_light", "content": "done"},
    ]
    assert again.usage.input_tokens == len(prompt_ids(checkpoint.tok, hist, [TOOL_CHAT]))


# ------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "bad",
                        "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}},
                    }
                }
            },
            "text.format",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "bad", "schema": "not an object"}}}, "text.format"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input"),
        (
            {
                "tools": [TOOL],
                "tool_choice": {"type": "function", "name": "set_light"},
                "text": {"format": {"type": "json_object"}},
            },
            "tool_choice",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_bad_requests_are_400s(server, client, body, param):
    request = {"model": NAME, "input": "x", **body}
    status, _, data = raw(server.port, "POST", "/v1/responses", body=request)
    assert status == 400, data
    err = check_error_body(data, status)
    assert err["param"] == param, err
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**request)
    assert e.value.status_code == 400


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")


# ------------------------------------------------------------------ in-process: no server needed
def test_input_items_to_chat():
    from acb.serve.responses import input_messages

    chat = input_messages(
        "sys",
        [
            {"role": "user", "content": "q"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": ""},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
        ],
    )
    assert chat == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "let me see",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "two", "tool_call_id": "c2", "name": "g"},
        {"role": "tool", "content": "one", "tool_call_id": "c1", "name": "f"},
    ]


@pytest.mark.parametrize(
    "pieces",
    [["<think>abc</think>hello"], ["<thi", "nk>a", "bc</th", "ink>hel", "lo"], list("<think>abc</think>hello")],
)
def test_stream_items_reasoning_then_message(pieces):
    """The streamed events of a reasoning-then-text output, for any chunking: the reasoning item
    is done before the message begins, and the items equal the non-streamed output."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from acb.serve import shaping
    from acb.serve.responses import _Events, _final_items, _Ids

    ids = _Ids()
    ev = _Events(ids)
    shaper = shaping.OutputShaper(None, "qwen3", "user: q\nassistant:")
    frames = []
    for p in pieces:
        shaped = shaper.feed(p)
        frames += ev.text("reasoning", shaped.reasoning) + ev.text("message", shaped.content)
    shaper.finish()
    items = _final_items(shaper, ids, length=False)
    frames += ev.finish(items)
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(json.loads(f.split("data: ", 1)[1])) for f in frames]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert collapse([e.type for e in events]) == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "abc"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "hello"
    done = [e.item.model_dump(exclude_none=True) for e in events if e.type == "response.output_item.done"]
    whole = shaping.OutputShaper(None, "qwen3", "user: q\nassistant:")
    whole.shape_whole("".join(pieces))
    assert done == [{k: v for k, v in i.items() if v is not None} for i in _final_items(whole, ids, length=False)]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]


@functools.cache
def event_adapter():
    """A pydantic adapter of the API's stream events (the openai client's models)."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    return TypeAdapter(ResponseStreamEvent)


def stream_frames(pieces: list[str], shaper, ids, length: bool) -> list[str]:
    """The events ``acb.serve.responses._stream`` sends for an output arriving as ``pieces``
    (the same calls, in the same order), after ``response.in_progress``."""
    from acb.serve.responses import _Events, _final_items

    ev = _Events(ids)
    frames = []
    for p in pieces:
        if p:
            shaped = shaper.feed(p)
            frames += ev.shaped(shaped.reasoning, shaped.content, shaper.has_reasoning)
    shaper.finish()
    return frames + ev.finish(_final_items(shaper, ids, length))


def check_stream_matches_whole(pieces: list[str], make_shaper, length: bool) -> None:
    """Streamed, ``pieces`` give well-formed events (each one of the API's, numbered in order)
    whose text deltas and done items are the non-streamed response's output, item for item."""
    from acb.serve.responses import _final_items, _Ids

    ids = _Ids()
    frames = stream_frames(pieces, make_shaper(), ids, length)
    events = [event_adapter().validate_python(json.loads(f.split("data: ", 1)[1])) for f in frames]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    whole = make_shaper()
    whole.shape_whole("".join(pieces))
    items = [{k: v for k, v in i.items() if v is not None} for i in _final_items(whole, ids, length)]
    done = [e.item.model_dump(exclude_none=True) for e in events if e.type == "response.output_item.done"]
    assert [{k: v for k, v in i.items() if k != "call_id"} for i in done] == [
        {k: v for k, v in i.items() if k != "call_id"} for i in items
    ]  # (call ids are drawn per call)
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.output_index for e in added] == list(range(len(items)))
    assert [e.item.id for e in added] == [i["id"] for i in items]
    for kind, item_type in (("reasoning_text", "reasoning"), ("output_text", "message")):
        streamed = "".join(e.delta for e in events if e.type == f"response.{kind}.delta")
        texts = [i["content"][0]["text"] for i in items if i["type"] == item_type]
        assert streamed == "".join(texts)


@pytest.mark.parametrize(
    "parser,prompt,text",
    [
        ("deepseek_r1", "user: q\nassistant:", "</think>hi"),
        ("qwen3", "user: q\nassistant:", "<think></think>hi"),
        ("qwen3", "user: q\nassistant:<think>", "</think>hi"),
        ("qwen3", "user: q\nassistant:<think>", "</think>"),
    ],
)
def test_stream_items_of_an_empty_reasoning_section(parser, prompt, text):
    """An empty reasoning section has its (empty) item before the message, streamed as not
    (it used to end the stream with an internal error: the message was open when the reasoning
    item came)."""
    from acb.serve import shaping

    for pieces in ([text], list(text)):
        check_stream_matches_whole(pieces, lambda: shaping.OutputShaper(None, parser, prompt), length=False)


PIECES = [
    "<think>",
    "</think>",
    "<th",
    "ink>",
    "</th",
    "ink",
    ">",
    "ab",
    " ",
    "\n",
    '{"a": 1}',
    "<tool_call>",
    '{"name": "set_light", "arguments": {"room": "hall", "on": true}}',
    "</tool_call>",
    "x",
]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    text=st.lists(st.sampled_from(PIECES), max_size=8).map("".join),
    cuts=st.lists(st.integers(0, 200), max_size=6),
    parser=st.sampled_from([None, "qwen3", "deepseek_r1"]),
    prompt=st.sampled_from(["user: q\nassistant:", "assistant:<think>", "<think>a</think>assistant:"]),
    tools=st.sampled_from(["none", "auto", "named", "required", "format"]),
    length=st.booleans(),
)
def test_stream_items_always_match_the_whole_response(text, cuts, parser, prompt, tools, length):
    """For any output text, chunking, reasoning parser, prompt (opening ``<think>`` or not) and
    tool plan (free, ``auto`` parsing, forced, or another constraint), the streamed events are
    well-formed and add up to the non-streamed response."""
    from acb.serve import shaping

    fn = [{"type": "function", "name": "set_light", "parameters": LIGHT}]
    plan = {
        "none": None,
        "format": None,
        "auto": shaping.plan_tools(fn, "auto", None, "hermes"),
        "named": shaping.plan_tools(fn, {"type": "function", "name": "set_light"}, None, None),
        "required": shaping.plan_tools(fn, "required", None, None),
    }[tools]
    if tools in ("named", "required"):  # a forced call's output is JSON (or cut short)
        text = (
            '{"room": "hall", "on": true}'
            if tools == "named"
            else '[{"name": "set_light", "parameters": {"room": "kitchen", "on": false}}]'
        )[: len(text) + 5]
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    check_stream_matches_whole(
        pieces,
        lambda: shaping.OutputShaper(plan, parser, prompt, constrained=tools in ("named", "required", "format")),
        length,
    )


def test_error_event_is_the_apis():
    from openai.types.responses import ResponseErrorEvent

    from acb.serve.protocol import APIError
    from acb.serve.responses import _Events, _Ids

    ev = _Events(_Ids())
    ev.seq = 7
    frame = ev.error(APIError(500, "boom", type="server_error"))
    head, data = frame.split("\n", 1)
    assert head == "event: error" and frame.endswith("\n\n")
    doc = json.loads(data[len("data: ") :])
    event = ResponseErrorEvent.model_validate(doc)
    assert (event.type, event.sequence_number, event.message, event.code) == ("error", 7, "boom", "server_error")
    # the OpenAI error body, which the openai client raises as an APIError
    assert doc["error"] == {"message": "boom", "type": "server_error", "param": None, "code": None}
