"""The model-output parsers of ``acb serve`` (issue 29): acb/serve/reasoning.py and
acb/serve/tool_parsers.py. Pure text in, no engine.

Expected values are built from the pieces a test text is made of (the reasoning and content
strings, the call objects and their ``json.dumps``), never copied from a run. Every case is
checked whole and streamed: split at every position, one character at a time, and in random
chunks (fixed seeds); a fuzz test compares the two ways on random mixtures of tags, partial
tags, JSON and text.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")  # acb.serve's __init__ needs the serve extra

from acb.serve.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
)
from acb.serve.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    filter_tool_calls,
    new_tool_call_id,
    tool_names,
)

ID_RE = re.compile(r"call_[A-Za-z0-9]{24}")


def chunkings(text: str, seed: int = 0, n_random: int = 25) -> Iterator[list[str]]:
    """The whole text; every split in two; one character at a time; random chunks."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(n_random):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in itertools.pairwise(bounds)]


# ---------------------------------------------------------------------------- reasoning

R = "Let me see: 2 < 3 and </thin is no tag, nor <think without its bracket.\nSo"
C = "\n\nThe answer is <b>4</b>."


def reasoning_cases() -> list[tuple[str, bool, str | None, str]]:
    """(text, starts_in_reasoning, expected reasoning, expected content)."""
    return [
        (f"<think>{R}</think>{C}", False, R, C),
        (f"<think>{R}</think>{C}", True, R, C),  # a template-opened block the model reopens
        (f" \n\t<think>{R}</think>{C}", False, R, C),  # whitespace before the tag is dropped
        (f"{R}</think>{C}", True, R, C),
        (f"  {R}</think>{C}", True, f"  {R}", C),  # but kept when no tag follows it
        (C, False, None, C),  # no tags at all
        (C, True, C, ""),  # never closed: all reasoning
        (f"<think>{R}", False, R, ""),  # cut off inside reasoning
        (f"<think></think>{C}", False, "", C),
        (f"</think>{C}", True, "", C),
        (f"</think>{C}", False, None, f"</think>{C}"),
        (f"Intro <think>{R}</think>{C}", False, None, f"Intro <think>{R}</think>{C}"),  # not at the start
        (f"<think>{R}</think>{C}<think>x</think>", False, R, f"{C}<think>x</think>"),  # first close only
        (f"{R}<think>{R}</think>{C}", True, f"{R}<think>{R}", C),
        ("<thin", False, None, "<thin"),
        ("<thin", True, "<thin", ""),
        ("  <think", False, None, "  <think"),
        ("  ", False, None, "  "),
        ("  ", True, "  ", ""),
        ("", False, None, ""),
        ("", True, "", ""),
        ("<think>", False, "", ""),
        (f"<think>{R}</thi", False, f"{R}</thi", ""),  # a cut-off close tag is reasoning text
    ]


def stream_reasoning(parser: ReasoningParser, chunks: list[str]) -> tuple[str | None, str]:
    reasoning, content = [], []
    for chunk in chunks:
        r, c = parser.feed(chunk)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    reasoning.append(r)
    content.append(c)
    return ("".join(reasoning) if parser.has_reasoning else None), "".join(content)


@pytest.mark.parametrize(("text", "starts", "reasoning", "content"), reasoning_cases())
def test_reasoning_split_and_every_chunking(text: str, starts: bool, reasoning: str | None, content: str) -> None:
    assert ReasoningParser(starts_in_reasoning=starts).split(text) == (reasoning, content)
    for chunks in chunkings(text):
        assert stream_reasoning(ReasoningParser(starts_in_reasoning=starts), chunks) == (reasoning, content), chunks


def test_reasoning_streaming_holds_back_only_possible_tags() -> None:
    p = ReasoningParser()
    assert p.feed("<th") == ("", "")
    assert not p.has_reasoning
    assert p.feed("ink>Hm") == ("Hm", "")
    assert p.has_reasoning
    assert p.feed("m</thi") == ("m", "")  # "</thi" may be the close tag
    assert p.feed("nk>An") == ("", "An")
    assert p.feed("swer</think>") == ("", "swer</think>")  # content now: no more tags
    assert p.finish() == ("", "")

    p = ReasoningParser(starts_in_reasoning=True)
    assert p.feed("abc</") == ("abc", "")
    assert p.feed("x<") == ("</x", "")  # "</x" is no tag: released; "<" may start one
    assert p.feed("/think") == ("", "")
    assert p.finish() == ("</think", "")

    p = ReasoningParser()
    assert p.feed("\n") == ("", "")  # leading whitespace: a <think> may follow
    assert p.feed("Hello") == ("", "\nHello")
    assert p.feed(" <think>") == ("", " <think>")
    assert p.finish() == ("", "")
    assert not p.has_reasoning


def test_reasoning_parser_is_single_use() -> None:
    p = ReasoningParser()
    p.feed("x")
    p.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        p.feed("y")
    with pytest.raises(RuntimeError, match="twice"):
        p.finish()


def test_reasoning_registry_and_defaults() -> None:
    assert REASONING_PARSERS == {"deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser}
    text = f"{R}</think>{C}"
    # deepseek_r1 takes tagless output as reasoning (R1's template opens the block); qwen3 as content
    assert REASONING_PARSERS["deepseek_r1"]().split(text) == (R, C)
    assert REASONING_PARSERS["qwen3"]().split(text) == (None, text)
    assert REASONING_PARSERS["deepseek_r1"](starts_in_reasoning=False).split(text) == (None, text)
    assert REASONING_PARSERS["qwen3"](starts_in_reasoning=True).split(text) == (R, C)


@pytest.mark.parametrize(
    ("prompt", "deepseek", "qwen3"),
    [
        ("<|im_start|>assistant\n<think>\n", True, True),  # the template opened the block
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False, False),  # enable_thinking=False
        ("<think>old</think>answer<|im_start|>assistant\n", False, False),  # a closed block of the history
        ("<think>old</think>answer<|im_start|>assistant\n<think>", True, True),
        ("<|im_start|>assistant\n", True, False),  # no tag: the class default
    ],
)
def test_reasoning_for_prompt(prompt: str, deepseek: bool, qwen3: bool) -> None:
    d = DeepSeekR1ReasoningParser.for_prompt(prompt)
    q = Qwen3ReasoningParser.for_prompt(prompt)
    assert type(d) is DeepSeekR1ReasoningParser and type(q) is Qwen3ReasoningParser
    assert (d.starts_in_reasoning, q.starts_in_reasoning) == (deepseek, qwen3)
    assert d.has_reasoning == deepseek


REASONING_PIECES = ["<think>", "</think>", "<th", "ink>", "</", "think", "k>", " ", "\n", "a", "<", ">", "/"]


@pytest.mark.parametrize("starts", [False, True])
def test_reasoning_fuzz_whole_equals_streamed(starts: bool) -> None:
    rng = random.Random(1234 + starts)
    for _ in range(400):
        text = "".join(rng.choice(REASONING_PIECES) for _ in range(rng.randint(0, 10)))
        whole = ReasoningParser(starts_in_reasoning=starts).split(text)
        reasoning, content = whole
        if reasoning is None:
            assert content == text
        else:  # no text lost but the tags consumed: at most one of each
            assert len(reasoning) + len(content) >= len(text.strip()) - len("<think>") - len("</think>")
            assert content in text and reasoning in text
        for chunks in chunkings(text, seed=len(text), n_random=5):
            assert stream_reasoning(ReasoningParser(starts_in_reasoning=starts), chunks) == whole, (text, chunks)


# ---------------------------------------------------------------------------- tool calls

A = {"name": "get_weather", "arguments": {"city": "Zürich 東京", "unit": "c"}}
# braces, quotes, backslashes and a tag-like text inside strings; nesting; null
B = {"name": "search", "arguments": {"q": 'a } tricky { "string" \\ <tool_call', "n": [1, {"k": None}], "o": {}}}
E = {"name": "noop", "arguments": {}}
Q = {"name": "quote", "arguments": {"s": 'say "}" and \\'}}  # an escaped quote before a brace; a final backslash


def expect(*objs: dict[str, object]) -> list[tuple[str, str]]:
    """(name, arguments) of the calls the objects stand for, from the objects themselves."""
    out = []
    for obj in objs:
        args = obj["arguments"] if "arguments" in obj else obj["parameters"]
        if isinstance(args, str):
            args = json.loads(args)
        out.append((str(obj["name"]), json.dumps(args, ensure_ascii=False)))
    return out


def hermes(obj: object, pad: str = "\n", ascii_only: bool = True) -> str:
    return f"<tool_call>{pad}{json.dumps(obj, ensure_ascii=ascii_only)}{pad}</tool_call>"


def llama(obj: dict[str, object]) -> str:
    return json.dumps({"name": obj["name"], "parameters": obj["arguments"]})


BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'

# (text, tool_names, expected content, expected calls)
HERMES_CASES: list[tuple[str, frozenset[str] | None, str | None, list[tuple[str, str]]]] = [
    (hermes(A), None, None, expect(A)),
    (hermes(A, pad="", ascii_only=False), None, None, expect(A)),
    ("Let me check.\n\n" + hermes(A), None, "Let me check.", expect(A)),
    (hermes(A) + "\n" + hermes(B) + "\n" + hermes(E) + "\n", None, None, expect(A, B, E)),
    (hermes(A) + hermes(B), None, None, expect(A, B)),
    (hermes(Q) + hermes(A), None, None, expect(Q, A)),
    ("Calling:" + hermes(A) + "\n\nDone, see above. \n", None, "Calling:Done, see above. \n", expect(A)),
    (
        "No tools here: <tool or </tool_call> or <tool_calls>.",
        None,
        "No tools here: <tool or </tool_call> or <tool_calls>.",
        [],
    ),
    ("", None, None, []),
    (" \n", None, " \n", []),
    # malformed: the text stays content, verbatim, whitespace and tags included
    ("Before \n" + BAD_JSON + " after", None, "Before \n" + BAD_JSON + " after", []),
    (BAD_JSON + "\n" + hermes(A) + "\n", None, BAD_JSON, expect(A)),
    (hermes(A) + "\n" + BAD_JSON, None, BAD_JSON, expect(A)),
    ("<tool_call>[1, 2]</tool_call>", None, "<tool_call>[1, 2]</tool_call>", []),
    (
        "x <tool_call>" + json.dumps({"name": "a"}) + "</tool_call>",
        None,
        "x <tool_call>" + json.dumps({"name": "a"}) + "</tool_call>",
        [],
    ),  # no arguments
    (
        hermes({"name": "a", "arguments": {}, "parameters": {}}),
        None,
        hermes({"name": "a", "arguments": {}, "parameters": {}}),
        [],
    ),  # both
    (hermes({"name": "a", "arguments": {}, "extra": 1}), None, hermes({"name": "a", "arguments": {}, "extra": 1}), []),
    (hermes({"name": "", "arguments": {}}), None, hermes({"name": "", "arguments": {}}), []),
    (hermes({"name": "a", "arguments": [1]}), None, hermes({"name": "a", "arguments": [1]}), []),
    (hermes({"name": "a", "arguments": "not json"}), None, hermes({"name": "a", "arguments": "not json"}), []),
    # accepted variants
    (hermes({"name": "a", "parameters": {"x": 1}}), None, None, expect({"name": "a", "parameters": {"x": 1}})),
    (hermes({"name": "a", "arguments": '{"x": 1}'}), None, None, expect({"name": "a", "arguments": '{"x": 1}'})),
    (hermes({"type": "function", "name": "a", "arguments": {}}), None, None, expect({"name": "a", "arguments": {}})),
    # left open at the end: a call if its JSON is complete, content if it was cut off
    ("ok <tool_call>\n" + json.dumps(A) + "\n", None, "ok", expect(A)),
    ("ok <tool_call>\n" + json.dumps(A)[:20], None, "ok <tool_call>\n" + json.dumps(A)[:20], []),
    ("ok <tool_call>", None, "ok <tool_call>", []),
    # unknown tools stay content
    (hermes(A) + "\n" + hermes(B), frozenset({"get_weather"}), hermes(B), expect(A)),
    ("Hi " + hermes(B) + " " + hermes(A), frozenset({"get_weather"}), "Hi " + hermes(B), expect(A)),
    (hermes(A), frozenset(), hermes(A), []),
]

LLAMA_CASES: list[tuple[str, frozenset[str] | None, str | None, list[tuple[str, str]]]] = [
    (llama(A), None, None, expect(A)),
    (llama(Q) + ";" + llama(A), None, None, expect(Q, A)),
    (json.dumps({"name": "get_weather", "arguments": A["arguments"]}), None, None, expect(A)),
    ("<|python_tag|>" + llama(A) + "; " + llama(B), None, None, expect(A, B)),
    (" \n<|python_tag|> " + llama(A) + ";" + llama(B) + " ;\n" + llama(E) + ";\n", None, None, expect(A, B, E)),
    ("The weather is nice.", None, "The weather is nice.", []),
    ('  Hello {"name": "x"}', None, '  Hello {"name": "x"}', []),
    (' {"answer": 42}', None, ' {"answer": 42}', []),  # JSON, but not a call
    ('<|python_tag|>brave_search.call(query="x")', None, '<|python_tag|>brave_search.call(query="x")', []),
    (llama(A)[:30], None, llama(A)[:30], []),  # cut off
    ("<|python_tag|>", None, "<|python_tag|>", []),
    ("<|python", None, "<|python", []),
    ("", None, None, []),
    ("  ", None, "  ", []),
    # after a call, a failure leaves the rest (from the failing point) as content
    (llama(A) + "; {bad", None, "{bad", expect(A)),
    (llama(A) + " and that is all", None, "and that is all", expect(A)),
    (llama(A) + ";\n[1]", None, "[1]", expect(A)),
    (llama(A) + "; " + llama(B) + ";", frozenset({"get_weather"}), llama(B) + ";", expect(A)),
    (llama(B), frozenset({"get_weather"}), llama(B), []),
]


def stream_tools(parser: ToolParser, chunks: list[str]) -> tuple[str, list[ToolCallDelta]]:
    content, deltas = [], []
    for chunk in chunks:
        c, d = parser.feed(chunk)
        content.append(c)
        deltas.extend(d)
    c, d = parser.finish()
    content.append(c)
    deltas.extend(d)
    return "".join(content), deltas


def assemble(deltas: list[ToolCallDelta]) -> list[tuple[str, str]]:
    """The calls a client builds from the deltas (OpenAI's rules), checking their shape."""
    calls: list[list[str]] = []
    for d in deltas:
        if d.index == len(calls):  # a new call: id and name on its first delta
            assert d.id is not None and ID_RE.fullmatch(d.id) and d.name
            calls.append([d.name, d.arguments])
        else:
            assert d.index == len(calls) - 1 and d.id is None and d.name is None
            calls[-1][1] += d.arguments
    return [(name, args) for name, args in calls]


def check_tool_case(
    cls: type[ToolParser], text: str, names: frozenset[str] | None, content: str | None, calls: list[tuple[str, str]]
) -> None:
    got_content, got_calls = cls(tool_names=names).extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(ID_RE.fullmatch(c.id) for c in got_calls)
    for chunks in chunkings(text):
        parser = cls(tool_names=names)
        streamed, deltas = stream_tools(parser, chunks)
        assert (streamed, assemble(deltas)) == (content or "", calls), chunks
        assert [d.id for d in deltas if d.id is not None] == [c.id for c in parser.tool_calls]
        assert [(c.name, c.arguments) for c in parser.tool_calls] == calls


@pytest.mark.parametrize(("text", "names", "content", "calls"), HERMES_CASES)
def test_hermes_whole_and_every_chunking(
    text: str, names: frozenset[str] | None, content: str | None, calls: list[tuple[str, str]]
) -> None:
    check_tool_case(HermesToolParser, text, names, content, calls)


@pytest.mark.parametrize(("text", "names", "content", "calls"), LLAMA_CASES)
def test_llama3_json_whole_and_every_chunking(
    text: str, names: frozenset[str] | None, content: str | None, calls: list[tuple[str, str]]
) -> None:
    check_tool_case(Llama3JsonToolParser, text, names, content, calls)


def test_arguments_keep_non_ascii_and_order() -> None:
    [call] = HermesToolParser().extract(hermes({"name": "f", "arguments": {"z": "é", "a": 1}}))[1]
    assert call.arguments == '{"z": "é", "a": 1}'
    assert json.loads(call.arguments) == {"z": "é", "a": 1}


def test_hermes_streaming_holds_back_only_possible_tags() -> None:
    p = HermesToolParser()
    assert p.feed("Hello") == ("Hello", [])
    assert p.feed(" <tool") == ("", [])  # a possible tag, and the blank before it
    assert p.feed("box") == (" <toolbox", [])
    assert p.feed(" and\n") == (" and", [])
    assert p.feed("<tool_call>") == ("", [])
    body = json.dumps(A)
    assert p.feed(body[:10]) == ("", [])
    assert p.feed(body[10:] + "\n</tool_") == ("", [])
    content, [delta] = p.feed("call>\n\n")
    assert content == ""
    assert (delta.index, delta.name, delta.arguments) == (0, "get_weather", expect(A)[0][1])
    assert delta.id == p.tool_calls[0].id
    assert p.feed("\n<tool_call>" + json.dumps(B) + "</tool_call>The end") == (
        "The end",
        [ToolCallDelta(index=1, id=p.tool_calls[1].id, name="search", arguments=expect(B)[0][1])],
    )
    assert p.feed(".") == (".", [])
    assert p.finish() == ("", [])


def test_hermes_malformed_call_released_at_its_close() -> None:
    p = HermesToolParser()
    assert p.feed('a <tool_call>{"name": ') == ("a", [])
    assert p.feed("oops}") == ("", [])
    assert p.feed("</tool_call> b") == (' <tool_call>{"name": oops}</tool_call> b', [])
    assert p.finish() == ("", [])
    assert p.tool_calls == []


def test_llama3_json_streaming() -> None:
    p = Llama3JsonToolParser()
    assert p.feed("  ") == ("", [])
    assert p.feed("<|python_") == ("", [])
    assert p.feed("tag|>") == ("", [])
    assert p.feed(llama(A)[:-1]) == ("", [])
    content, [first] = p.feed("}; ")
    assert content == "" and (first.index, first.name, first.arguments) == (0, "get_weather", expect(A)[0][1])
    content, [second] = p.feed(llama(E))
    assert content == "" and (second.index, second.name, second.arguments) == (1, "noop", "{}")
    assert p.feed(" and more") == ("and more", [])
    assert p.feed(" text {") == (" text {", [])  # content from now on: passed straight through
    assert p.finish() == ("", [])

    p = Llama3JsonToolParser()
    assert p.feed(" ") == ("", [])
    assert p.feed("Hello") == (" Hello", [])
    assert p.feed(' {"name": "a", "parameters": {}}') == (' {"name": "a", "parameters": {}}', [])
    assert p.finish() == ("", [])


def test_tool_parser_is_single_use() -> None:
    p = HermesToolParser()
    p.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        p.feed("x")
    with pytest.raises(RuntimeError, match="twice"):
        p.finish()


def test_deeply_nested_json_is_not_a_crash() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    text = '<tool_call>{"name": "a", "arguments": {"x": ' + deep + "}}</tool_call>"
    assert HermesToolParser().extract(text) == (text, [])
    assert stream_tools(HermesToolParser(), [text]) == (text, [])
    text = '{"name": "a", "parameters": {"x": ' + deep + "}}"
    assert Llama3JsonToolParser().extract(text) == (text, [])
    assert stream_tools(Llama3JsonToolParser(), [text]) == (text, [])


TOOL_PIECES = [
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "_call>",
    "</",
    "<|python_tag|>",
    "<|py",
    "\n",
    " ",
    ";",
    "text",
    "{",
    "}",
    '"',
    "\\",
    "[1]",
    json.dumps(A),
    json.dumps(E),
    llama(B),
    llama(E),
    '{"name": "a", ',
]


@pytest.mark.parametrize("cls", [HermesToolParser, Llama3JsonToolParser])
@pytest.mark.parametrize("names", [None, frozenset({"noop", "search"})])
def test_tool_fuzz_whole_equals_streamed(cls: type[ToolParser], names: frozenset[str] | None) -> None:
    rng = random.Random(99)
    for _ in range(300):
        text = "".join(rng.choice(TOOL_PIECES) for _ in range(rng.randint(0, 9)))
        content, calls = cls(tool_names=names).extract(text)
        expected = (content or "", [(c.name, c.arguments) for c in calls])
        for chunks in chunkings(text, seed=len(text), n_random=4):
            streamed, deltas = stream_tools(cls(tool_names=names), chunks)
            assert (streamed, assemble(deltas)) == expected, (text, chunks)


def test_registry() -> None:
    assert TOOL_PARSERS == {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def test_ids_and_openai_shapes() -> None:
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(ID_RE.fullmatch(i) for i in ids)
    call = ToolCall(id="call_x", name="f", arguments='{"a": 1}')
    assert call.to_openai() == {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    with pytest.raises(AttributeError):
        call.name = "g"  # type: ignore[misc]
    first = ToolCallDelta(index=2, id="call_x", name="f", arguments="")
    assert first.to_openai() == {
        "index": 2,
        "id": "call_x",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    more = ToolCallDelta(index=2, id=None, name=None, arguments='{"a"')
    assert more.to_openai() == {"index": 2, "function": {"arguments": '{"a"'}}


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "name": "search", "parameters": {}},  # the Responses API's flat shape
    {"type": "web_search_preview"},
    {"type": "function", "function": {"description": "no name"}},
    {"function": {"name": "implicit_function_type"}},
]


def test_tool_names() -> None:
    assert tool_names(TOOLS) == {"get_weather", "search", "implicit_function_type"}
    assert tool_names([]) == frozenset()


def test_filter_tool_calls() -> None:
    calls = [
        ToolCall(id=new_tool_call_id(), name=n, arguments="{}")
        for n in ("get_weather", "made_up", "search", "get_weather", "web_search_preview")
    ]
    known, unknown = filter_tool_calls(calls, TOOLS)
    assert known == [calls[0], calls[2], calls[3]]
    assert unknown == [calls[1], calls[4]]
    assert filter_tool_calls(calls, []) == ([], calls)


def test_parsers_chain_reasoning_then_tools() -> None:
    """The server's order: the reasoning parser's content deltas go to the tool parser."""
    text = f"{R}</think>\n\nChecking." + hermes(A)
    reasoning = Qwen3ReasoningParser.for_prompt("<|im_start|>assistant\n<think>\n")
    tools = HermesToolParser(tool_names={"get_weather"})
    thought, content, deltas = [], [], []
    for ch in text:
        r, c = reasoning.feed(ch)
        thought.append(r)
        tc, d = tools.feed(c)
        content.append(tc)
        deltas.extend(d)
    r, c = reasoning.finish()
    thought.append(r)
    for tc, d in (tools.feed(c), tools.finish()):
        content.append(tc)
        deltas.extend(d)
    assert "".join(thought) == R
    assert "".join(content) == "\n\nChecking."
    assert assemble(deltas) == expect(A)


# ------------------------------------------------------------------- the shaper (acb.serve.shaping)
@pytest.mark.parametrize(
    "parser,prompt", [("deepseek_r1", "user: q\nassistant:"), ("qwen3", "user: q\nassistant:<think>\n")]
)
@pytest.mark.parametrize("choice", ["format", "named", "required", "auto"])
def test_constrained_output_is_never_reasoning(parser: str, prompt: str, choice: str) -> None:
    """An output constrained from its first token, where the parser would start in reasoning
    (deepseek_r1's default; a prompt that opened ``<think>``): a response format's JSON is the
    content verbatim, a forced call is the call, whole or streamed. Not even a ``<think>`` or a
    ``<tool_call>`` inside it (a regex or a schema may allow them) is parsed."""
    from acb.serve.shaping import OutputShaper, plan_tools

    fn = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plan = {
        "format": None,
        "auto": plan_tools(fn, "auto", None, "hermes"),
        "named": plan_tools(fn, {"type": "function", "function": {"name": "f"}}, None, None),
        "required": plan_tools(fn, "required", None, None),
    }[choice]
    args = {"s": '<think>x</think> <tool_call>{"name": "f", "arguments": {}}</tool_call>'}
    text = json.dumps([{"name": "f", "parameters": args}] if choice == "required" else args)
    assert REASONING_PARSERS[parser].for_prompt(prompt).starts_in_reasoning  # (what the shaper must override)
    for chunks in chunkings(text, n_random=3):
        shaper = OutputShaper(plan, parser, prompt, constrained=True)
        streamed = [shaper.feed(c) for c in chunks] + [shaper.finish()]
        assert "".join(s.reasoning for s in streamed) == "" and not shaper.has_reasoning
        msg = shaper.message()
        assert msg["reasoning_content"] is None
        if choice in ("named", "required"):
            assert msg["content"] is None and shaper.finish_reason("stop") == "tool_calls"
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
                ("f", args)
            ]
            assert "".join(d.arguments for s in streamed for d in s.tool_calls) == json.dumps(args)
        else:
            assert (msg["content"], "tool_calls" in msg) == (text, False)
            assert "".join(s.content for s in streamed) == text
    # unconstrained, the same parser does read the text as reasoning (the test can tell)
    free = OutputShaper(None, parser, prompt)
    free.shape_whole(text)
    assert free.has_reasoning and free.content != text


@pytest.mark.parametrize(
    "choice,text",
    [
        ("required", "[1, 2]"),
        ("required", "[]"),
        ("required", '[{"name": "f"}]'),
        ("required", '{"name"'),
        ("named", "12"),
        ("named", '{"a": '),
        ("named", "[]"),
    ],
)
def test_forced_output_that_is_no_call_is_content(choice: str, text: str) -> None:
    """A forced call's output that is not (yet) a call of the constraint's shape: cut short by
    max_tokens or by a dead end of its grammar (the engine's finish reason ``grammar``). The text
    is the content, streamed too (a chat stream used to drop it), there are no calls, and
    nothing raises."""
    from acb.serve.shaping import OutputShaper, plan_tools

    fn = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plan = plan_tools(
        fn, "required" if choice == "required" else {"type": "function", "function": {"name": "f"}}, None, None
    )
    for chunks in chunkings(text, n_random=2):
        shaper = OutputShaper(plan, None, "", constrained=True)
        streamed = [shaper.feed(c) for c in chunks] + [shaper.finish()]
        assert [d for s in streamed for d in s.tool_calls] == []
        assert "".join(s.content for s in streamed) == text  # streamed as it is whole
        assert shaper.message() == {"role": "assistant", "content": text}
        assert shaper.finish_reason("length") == "length"
