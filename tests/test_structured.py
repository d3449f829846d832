"""acb.structured on the tiny byte-level tokenizer (259 ids) with a padded model vocabulary (300).

The "model" is random logits (seeded) plus a fixed preference for closing tokens, sampled greedily
from the masked logits: it wanders through whatever the grammar allows, and ends.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("xgrammar")

from acb.grammar_budget import GrammarBudget
from acb.models import build_tokenizer
from acb.structured import (
    GrammarCompiler,
    Matcher,
    StructuredOutputs,
    allocate_bitmask,
    apply_bitmask,
)
from tests.conftest import wait_until

V = 300  # > len(tokenizer) == 259, and not a multiple of 32: both paddings are exercised
EOS = 2

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "extra": {},  # any JSON value
    },
    "required": ["name", "age", "ok"],
}
REGEX = r"[a-z]{2,5}-\d{3}(\.[0-9]{1,4})?"
CHOICE = ["red", "reddish", "dark red", 'quo"te', "back\\slash", "new\nline", "é"]
GRAMMAR = """
root ::= expr
expr ::= term (("+" | "*") term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
"""


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    c = GrammarCompiler(tok, V)
    yield c
    c.close()


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _bias(tok) -> torch.Tensor:
    b = torch.zeros(V)
    for ch in '"}]':
        b[ids(tok, ch)[0]] += 2.5
    b[EOS] += 2.5
    return b


def generate(tok, matcher: Matcher, seed: int, limit: int = 400) -> list[int]:
    """Greedy from masked random logits until the matcher terminates (returns the tokens before
    the stop token) or ``limit`` tokens."""
    g = torch.Generator().manual_seed(seed)
    bias = _bias(tok)
    bitmask = allocate_bitmask(1, V)
    out: list[int] = []
    while len(out) < limit and not matcher.is_terminated():
        matcher.fill_mask(bitmask, 0)
        logits = torch.randn(1, V, generator=g) + bias
        apply_bitmask(logits, bitmask)
        t = int(logits.argmax())
        assert matcher.accept(t), f"sampled token {t} was allowed by the mask but rejected"
        out.append(t)
    assert matcher.is_terminated(), f"no termination within {limit} tokens: {tok.decode(out)!r}"
    assert out[-1] == EOS
    return out[:-1]


def outside_strings(text: str) -> str:
    """The characters of JSON text that are not inside string literals."""
    out, in_str, esc = [], False, False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        else:
            out.append(ch)
    return "".join(out)


def allowed(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    words = bitmask[row].tolist()
    return {t for t in range(V) if (words[t // 32] >> (t % 32)) & 1}


def check_schema(value: object) -> None:
    """SCHEMA, checked by hand."""
    assert isinstance(value, dict)
    assert set(value) <= set(SCHEMA["properties"]) and {"name", "age", "ok"} <= set(value)
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120
    assert isinstance(value["ok"], bool)
    if "tags" in value:
        assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
        assert all(t in ("a", "b c") for t in value["tags"])
    # properties come in the schema's order
    order = list(SCHEMA["properties"])
    assert list(value) == sorted(value, key=order.index)


# ---------------------------------------------------------------------------------------------
# each kind, generated


@pytest.mark.parametrize("seed", range(6))
def test_json_schema(tok, compiler, seed):
    text = tok.decode(generate(tok, compiler.compile_now(StructuredOutputs(json=SCHEMA)).matcher(), seed))
    check_schema(json.loads(text))
    assert not re.search(r"\s", outside_strings(text)), text


@pytest.mark.parametrize("seed", range(6))
def test_json_object_compact(tok, compiler, seed):
    text = tok.decode(generate(tok, compiler.compile_now(StructuredOutputs(json_object=True)).matcher(), seed))
    assert isinstance(json.loads(text), dict)
    assert not re.search(r"\s", outside_strings(text)), text


def test_json_whitespace_flexible(tok, compiler):
    spaced = '{ "a" : [1 , {"b":null} ] ,\n\t"c":"x y" }'
    flexible = compiler.compile_now(StructuredOutputs(json_object=True, whitespace_flexible=True)).matcher()
    flexible.replay(ids(tok, spaced) + [EOS])
    assert flexible.is_terminated()
    compact = compiler.compile_now(StructuredOutputs(json_object=True)).matcher()
    with pytest.raises(ValueError, match="does not follow the grammar"):
        compact.replay(ids(tok, spaced))
    # where JSON allows whitespace, the compact mask has none of it and the flexible mask has all
    ws = {ids(tok, c)[0] for c in " \t\n\r"}
    for prefix in ["{", '{"a"', '{"a":', '{"a":1', '{"a":[1', '{"a":[1,']:
        masks = []
        for m in (compact, flexible):
            m.replay(ids(tok, prefix))
            bm = allocate_bitmask(1, V)
            m.fill_mask(bm, 0)
            masks.append(allowed(bm))
        assert not masks[0] & ws, prefix
        assert ws <= masks[1], prefix
    # and flexible output parses
    for seed in range(4):
        m = compiler.compile_now(StructuredOutputs(json=SCHEMA, whitespace_flexible=True)).matcher()
        check_schema(json.loads(tok.decode(generate(tok, m, seed))))


@pytest.mark.parametrize("seed", range(6))
def test_regex(tok, compiler, seed):
    text = tok.decode(generate(tok, compiler.compile_now(StructuredOutputs(regex=REGEX)).matcher(), seed))
    assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("seed", range(8))
def test_choice(tok, compiler, seed):
    text = tok.decode(generate(tok, compiler.compile_now(StructuredOutputs(choice=CHOICE)).matcher(), seed))
    assert text in CHOICE


def test_choice_escapes(tok, compiler):
    """Every alternative, special characters and prefixes of another included, is accepted as is."""
    compiled = compiler.compile_now(StructuredOutputs(choice=CHOICE))
    for c in CHOICE:
        m = compiled.matcher()
        m.replay(ids(tok, c) + [EOS])
        assert m.is_terminated()
    m = compiled.matcher()
    with pytest.raises(ValueError):
        m.replay(ids(tok, "re d"))


@pytest.mark.parametrize("seed", range(6))
def test_grammar(tok, compiler, seed):
    text = tok.decode(generate(tok, compiler.compile_now(StructuredOutputs(grammar=GRAMMAR)).matcher(), seed))
    assert re.fullmatch(r"[0-9+*()]+", text), text
    tree = ast.parse(text, mode="eval")  # balanced, well formed
    assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Mult)) for n in ast.walk(tree))


# ---------------------------------------------------------------------------------------------
# matcher state: rollback, reset, replay, termination


def _mask(m: Matcher) -> set[int]:
    bm = allocate_bitmask(1, V)
    m.fill_mask(bm, 0)
    return allowed(bm)


def test_rollback_reset_replay_rebuild_state(tok, compiler):
    compiled = compiler.compile_now(StructuredOutputs(json=SCHEMA))
    tokens = generate(tok, compiled.matcher(), seed=3) + [EOS]
    # the mask after each prefix, from a matcher driven forward once
    m = compiled.matcher()
    masks = [_mask(m)]
    for t in tokens[:-1]:
        assert m.accept(t)
        masks.append(_mask(m))
    assert m.accept(tokens[-1]) and m.is_terminated() and m.num_tokens == len(tokens)
    assert not m.accept(tokens[0])  # nothing after termination
    assert _mask(m) == {EOS}  # a terminated matcher's row allows only the stop token
    # rolling back the stop token un-terminates; further back, the masks are the forward ones
    m.rollback(1)
    assert not m.is_terminated() and m.is_completed()
    for k in (1, 5, len(tokens) // 2):
        n = m.num_tokens
        m.rollback(k)
        assert m.num_tokens == n - k and _mask(m) == masks[n - k]
        for t in tokens[n - k : n]:
            assert m.accept(t)
    with pytest.raises(ValueError, match="cannot roll back"):
        m.rollback(m.num_tokens + 1)
    # reset + replay of any prefix rebuilds the same state (a preempted request, recomputed)
    for n in (0, 1, 7, len(tokens) - 1):
        m.reset()
        assert m.num_tokens == 0 and _mask(m) == masks[0]
        m.replay(tokens[:n])
        assert _mask(m) == masks[n]
    fresh = compiled.matcher()
    fresh.replay(tokens)
    assert fresh.is_terminated()
    # fork: an independent copy
    m.replay(tokens[:5])
    f = m.fork()
    assert f.accept(tokens[5]) and f.num_tokens == 6 and m.num_tokens == 5 and _mask(m) == masks[5]
    # a replay that leaves the grammar says where, and keeps the prefix before it
    with pytest.raises(ValueError, match=r"token 1 \(id"):
        m.replay([tokens[0], ids(tok, "]")[0]])
    assert m.num_tokens == 1


def test_eos_only_at_a_complete_match(tok, compiler):
    m = compiler.compile_now(StructuredOutputs(regex="ab+")).matcher()
    assert EOS not in _mask(m) and not m.accept(EOS)
    assert m.accept(ids(tok, "a")[0])
    assert EOS not in _mask(m)
    assert m.accept(ids(tok, "b")[0]) and m.is_completed() and not m.is_terminated()
    assert _mask(m) == {EOS, ids(tok, "b")[0]}  # may stop or go on
    assert m.accept(EOS) and m.is_terminated()


def test_out_of_vocabulary_and_special_ids_are_rejected(tok, compiler):
    m = compiler.compile_now(StructuredOutputs(json_object=True)).matcher()
    for t in (-1, V, V + 5, 0, 1, 259, V - 1):  # outside, <pad>, <s>, padding ids
        assert not m.accept(t)
    assert m.num_tokens == 0


# ---------------------------------------------------------------------------------------------
# the mask is exact


@pytest.mark.parametrize(
    "spec, prefix",
    [
        (StructuredOutputs(json=SCHEMA), ""),
        (StructuredOutputs(json=SCHEMA), '{"name":"ab'),
        (StructuredOutputs(json=SCHEMA), '{"name":"","age":1'),
        (StructuredOutputs(json=SCHEMA), '{"name":"","age":12,"ok":true,"extra":[1,{"x":'),
        (StructuredOutputs(json_object=True, whitespace_flexible=True), '{"a": [1, '),
        (StructuredOutputs(regex=REGEX), "ab-12"),
        (StructuredOutputs(regex=REGEX), "ab-123"),
        (StructuredOutputs(choice=CHOICE), "red"),
        (StructuredOutputs(grammar=GRAMMAR), "(1+2"),
    ],
    ids=lambda v: v.kind if isinstance(v, StructuredOutputs) else repr(v),
)
def test_mask_is_exact(tok, compiler, spec, prefix):
    """Token t is allowed by the mask iff accept(t) succeeds on a copy of the state: over every id
    of the padded vocabulary."""
    m = compiler.compile_now(spec).matcher()
    m.replay(ids(tok, prefix))
    mask = _mask(m)
    accepted = {t for t in range(V) if m.fork().accept(t)}
    assert mask == accepted
    assert mask and all(t < len(tok) for t in mask)  # never a padding id


# ---------------------------------------------------------------------------------------------
# compile errors and spec validation


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutputs(regex="a(b"), "cannot compile the regex constraint: .*parenthesis is not closed"),
        (StructuredOutputs(json={"type": "nope"}), 'cannot compile the json constraint: Unsupported type "nope"'),
        (StructuredOutputs(grammar='root ::= "a" |'), "cannot compile the grammar constraint: EBNF parser error"),
        (StructuredOutputs(grammar='start ::= "a"'), 'The root rule with name "root" is not found'),
    ],
)
def test_bad_constraint_raises_value_error_with_xgrammars_message(compiler, spec, message):
    with pytest.raises(ValueError, match=message) as info:
        compiler.compile_now(spec)
    assert "/project/cpp" not in str(info.value)  # the C++ file:line prefix is dropped
    # a failure is not cached: the future fails again, from a new compile
    before = compiler.cache_info()
    with pytest.raises(ValueError, match=message):
        compiler.submit(spec).result()
    assert compiler.cache_info().misses == before.misses + 1


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        ({}, ValueError, "exactly one of .* got none"),
        ({"regex": "a", "choice": ["a"]}, ValueError, "got regex, choice"),
        ({"json_object": True, "json": {}}, ValueError, "got json, json_object"),
        ({"json_object": 1}, TypeError, "json_object must be a bool"),
        ({"json": "{not json"}, ValueError, "json is not valid JSON text"),
        ({"json": "[1]"}, ValueError, "must be a JSON schema object"),
        ({"json": 3}, TypeError, "json must be a JSON schema"),
        ({"json": {"a": float("nan")}}, ValueError, "not JSON-serialisable"),
        ({"regex": ""}, ValueError, "regex must not be empty"),
        ({"regex": 3}, TypeError, "regex must be a str"),
        ({"grammar": "  "}, ValueError, "grammar must not be empty"),
        ({"choice": "red"}, TypeError, "choice must be a sequence of strings"),
        ({"choice": []}, ValueError, "at least one string"),
        ({"choice": ["a", 1]}, TypeError, "strings only"),
        ({"regex": "a", "whitespace_flexible": True}, ValueError, "whitespace_flexible applies to json"),
        ({"json_object": True, "whitespace_flexible": "yes"}, TypeError, "whitespace_flexible must be a bool"),
    ],
)
def test_spec_validation(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        StructuredOutputs(**kwargs)


@pytest.mark.parametrize("as_text", [False, True])
def test_deep_schema_is_a_value_error_naming_depth_and_limit(as_text):
    """Issue 36: a schema nested ~400 levels raised RecursionError while being canonicalised."""
    from acb.structured_outputs import MAX_SCHEMA_DEPTH

    levels = 400  # each level is an object schema holding a "properties" map: 2 JSON containers
    if as_text:  # built as text: json.dumps itself would recurse
        schema: object = '{"type":"object","properties":{"a":' * levels + "{}" + "}}" * levels
    else:
        schema = {}
        for _ in range(levels):
            schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(ValueError, match=rf"nests {2 * levels + 1} levels deep .* limit of {MAX_SCHEMA_DEPTH}"):
        StructuredOutputs(json=schema)
    # one level under the limit is a spec, and compiles
    ok: dict = {}
    for _ in range(MAX_SCHEMA_DEPTH - 1):
        ok = {"type": "array", "items": ok}
    assert StructuredOutputs(json=ok).kind == "json"
    with pytest.raises(ValueError, match=f"nests {MAX_SCHEMA_DEPTH + 1} levels"):
        StructuredOutputs(json={"type": "array", "items": ok})
    # a self-containing dict is no JSON: refused, not a hang or a RecursionError
    loop: dict = {"type": "object"}
    loop["properties"] = {"a": loop}
    with pytest.raises(ValueError, match="contains itself"):
        StructuredOutputs(json=loop)


def test_spec_key():
    a = StructuredOutputs(json={"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputs(json='{"properties": {"x": {"type": "integer"}}, "required": ["x"], "type": "object"}')
    assert a.key == b.key and a == b and hash(a) == hash(b)
    assert a.kind == "json"
    assert StructuredOutputs(json=a.json, whitespace_flexible=True).key != a.key
    # the order of "properties" is the order of the output's keys, so it stays in the key
    two = {"type": "object", "properties": {"x": {}, "y": {}}}
    swapped = {"type": "object", "properties": {"y": {}, "x": {}}}
    assert StructuredOutputs(json=two).key != StructuredOutputs(json=swapped).key
    c = StructuredOutputs(choice=["a", "b"])
    assert c.choice == ("a", "b") and c == StructuredOutputs(choice=("a", "b"))
    assert c != StructuredOutputs(regex="a|b") and c != "choice"


# ---------------------------------------------------------------------------------------------
# the cache


def test_cache_shares_compiles(tok):
    c = GrammarCompiler(tok, V, cache_size=2)
    try:
        s1 = StructuredOutputs(json=SCHEMA)
        first = c.submit(s1).result()
        again = c.submit(StructuredOutputs(json=json.dumps(SCHEMA))).result()
        assert again is first
        assert c.cache_info().misses == 1 and c.cache_info().hits == 1
        # concurrent submits of one new key: one compile, one object
        s2 = StructuredOutputs(grammar=GRAMMAR)
        results, barrier = [], threading.Barrier(8)

        def worker():
            barrier.wait()
            results.append(c.submit(s2).result())

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 8 and all(r is results[0] for r in results)
        assert c.cache_info().misses == 2
        # bounded LRU: s1 was used least recently, a third key evicts it
        c.compile_now(StructuredOutputs(regex=REGEX))
        assert c.cache_info().currsize == 2
        assert c.compile_now(s2) is results[0]
        before = c.cache_info().misses
        assert c.compile_now(s1) is not first
        assert c.cache_info().misses == before + 1
        assert first.compile_s > 0 and first.memory_bytes > 0
    finally:
        c.close()


# ---------------------------------------------------------------------------------------------
# the compile budget (issue 36)

# over a minute of xgrammar 0.2.8's time on this vocabulary (its JSON-schema patterns are quadratic
# in a count); let through only by a raised repetition limit
SLOW = [StructuredOutputs(json={"type": "string", "pattern": f"a{{1,{30000 + i}}}"}) for i in range(3)]
HANG_GUARD = 300  # seconds: only so that a regression fails instead of hanging


def test_over_budget_specs_are_refused_before_any_compile(tok):
    c = GrammarCompiler(tok, V)
    try:
        before = c.cache_info()
        with pytest.raises(ValueError, match="grammar_max_repetition"):
            c.submit(SLOW[0])
        with pytest.raises(ValueError, match="grammar_max_repetition"):
            c.compile_now(SLOW[0])
        assert c.cache_info() == before  # nothing compiled, nothing cached
    finally:
        c.close()


def test_slow_compiles_are_stopped_at_the_time_limit_and_starve_no_one(tok):
    """Two compiles that would hold both workers for minutes are stopped at the limit, and a
    small spec submitted behind them is answered; the killed workers are replaced."""
    c = GrammarCompiler(tok, V, workers=2, budget=GrammarBudget(max_repetition=10**6, compile_timeout_s=1.0))
    try:
        slow = [c.submit(s) for s in SLOW[:2]]
        small = c.submit(StructuredOutputs(choice=["yes", "no"]))
        assert small.result(HANG_GUARD).matcher().accept(ids(tok, "y")[0])
        for f in slow:
            with pytest.raises(
                ValueError,
                match=r"compiling the json constraint took longer than 1 s, the limit "
                r"\(ContinuousBatchingConfig\.grammar_compile_timeout_s\)",
            ):
                f.result(HANG_GUARD)
        # a refusal is not cached: the same spec is compiled (and refused) again
        with pytest.raises(ValueError, match="took longer than"):
            c.compile_now(SLOW[0], timeout=HANG_GUARD)
        assert c.compile_now(StructuredOutputs(regex=REGEX), timeout=HANG_GUARD).matcher() is not None
    finally:
        c.close()


def test_close_does_not_wait_for_running_compiles(tok):
    """Closing (an engine stopping, a server's SIGTERM) kills the workers: the compiles running
    and queued fail with EngineNotRunningError, and close returns without waiting for them."""
    from acb.errors import EngineNotRunningError

    c = GrammarCompiler(tok, V, workers=2, budget=GrammarBudget(max_repetition=10**6, compile_timeout_s=600))
    futures = [c.submit(s) for s in SLOW]  # two run, one waits
    wait_until(lambda: all(f.running() for f in futures[:2]), "both workers compiling")
    pids = [w._proc.pid for w in c._workers if w._proc is not None]
    closer = threading.Thread(target=c.close)
    closer.start()
    closer.join(HANG_GUARD)
    assert not closer.is_alive()
    for f in futures:
        with pytest.raises(EngineNotRunningError, match="closed"):
            f.result(HANG_GUARD)
    with pytest.raises(EngineNotRunningError, match="closed"):
        c.submit(StructuredOutputs(regex="b"))
    for pid in pids:  # the processes are gone (killed and reaped)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    c.close()  # idempotent


def test_a_closed_compilers_idle_workers_serve_the_next_one(tok):
    """Closing gives the idle workers back to the process's pool, running: the next compiler of the
    same vocabulary takes them instead of starting fresh interpreters. The worker that was
    compiling is killed at close and never lent again."""
    from acb import structured
    from acb.errors import EngineNotRunningError

    a = GrammarCompiler(tok, V, workers=2, budget=GrammarBudget(max_repetition=10**6, compile_timeout_s=600))
    a.compile_now(StructuredOutputs(choice=["x"]), timeout=HANG_GUARD)
    slow = a.submit(SLOW[0])
    wait_until(lambda: any(w._busy for w in a._workers), "a worker compiling the slow spec")
    busy = next(w for w in a._workers if w._busy)
    idle = next(w for w in a._workers if w is not busy)
    # (the other worker's process may still be spawning: once seen, in a whole-suite run)
    wait_until(idle.alive, "the idle worker's process running")
    killed_pid, idle_pid = busy._proc.pid, idle._proc.pid
    a.close()
    with pytest.raises(EngineNotRunningError, match="closed"):
        slow.result(HANG_GUARD)
    wait_until(lambda: any(w is idle for _, w in structured._POOL._idle), "the idle worker given back")
    with pytest.raises(ProcessLookupError):
        os.kill(killed_pid, 0)
    b = GrammarCompiler(tok, V, workers=2)
    try:
        assert idle in b._workers and idle._proc.pid == idle_pid
        assert busy not in b._workers
        assert b.compile_now(StructuredOutputs(choice=["y"]), timeout=HANG_GUARD).matcher() is not None
    finally:
        b.close()


ORPHAN = """
import sys
from acb.grammar_budget import GrammarBudget
from acb.models import build_tokenizer
from acb.structured import GrammarCompiler, StructuredOutputs
from tests.conftest import wait_until

c = GrammarCompiler(build_tokenizer(), 300, workers=1, budget=GrammarBudget(max_repetition=10**6, compile_timeout_s=600))
fut = c.submit(StructuredOutputs(json={"type": "string", "pattern": "a{1,30000}"}))
wait_until(lambda: c._workers[0]._ready, "the worker started (the job is sent next)")
print(c._workers[0]._proc.pid, flush=True)
sys.stdin.read()  # until the test kills this process
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_parent_leaves_no_worker_compiling():
    """A server SIGKILLed mid-compile (no close()): its worker, compiling a schema that takes
    minutes, dies with it instead of compiling on as an orphan (the pipe is read only between
    jobs, so only the kernel can end it)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHAN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=root
    )
    try:
        worker = int(proc.stdout.readline())

        def cpu_seconds() -> float:
            with open(f"/proc/{worker}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

        started = cpu_seconds()
        wait_until(lambda: cpu_seconds() >= started + 1.0, "the worker compiling (a second of CPU used)")
        proc.kill()
        proc.wait(HANG_GUARD)

        def gone() -> bool:
            try:
                with open(f"/proc/{worker}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
            except OSError:
                return True

        wait_until(gone, "the orphaned compile worker gone", timeout=30)
    finally:
        proc.kill()


def test_a_worker_that_dies_fails_only_its_compile(tok):
    c = GrammarCompiler(tok, V, workers=1, budget=GrammarBudget(max_repetition=10**6, compile_timeout_s=600))
    try:
        c.compile_now(StructuredOutputs(choice=["ready"]), timeout=HANG_GUARD)  # the worker has started
        fut = c.submit(SLOW[0])
        wait_until(fut.running, "the worker took the job")
        # (whether the worker is reading the job or compiling it, it dies with it)
        os.kill(c._workers[0]._proc.pid, signal.SIGKILL)
        with pytest.raises(ValueError, match=r"the grammar compile worker died \(exit code -9\) compiling the json"):
            fut.result(HANG_GUARD)
        assert c.compile_now(StructuredOutputs(choice=["ok"]), timeout=HANG_GUARD).matcher() is not None
    finally:
        c.close()


def test_a_worker_that_cannot_start_is_a_runtime_error_not_the_specs(tok, monkeypatch):
    import shutil

    monkeypatch.setattr(sys, "executable", shutil.which("false"))  # every worker exits at once
    c = GrammarCompiler(tok, V, workers=1)
    try:
        with pytest.raises(RuntimeError, match=r"the grammar compile worker exited with code 1 as it started"):
            c.compile_now(StructuredOutputs(choice=["a"]), timeout=HANG_GUARD)
    finally:
        c.close()


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputs(json={"$ref": "#"}),
        StructuredOutputs(json={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        # every prefix can go on, but nothing ever ends: refused by the grammar's shape, not its first mask
        StructuredOutputs(
            json={
                "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
                "$ref": "#/$defs/n",
            }
        ),
        StructuredOutputs(grammar='root ::= "a" root'),
        StructuredOutputs(grammar='root ::= x{2,3}\nx ::= "x" x'),
        StructuredOutputs(grammar='root ::= (a "b") | c\na ::= "x" a\nc ::= [a-z] c'),
    ],
)
def test_grammars_that_match_no_text_are_refused(compiler, spec):
    with pytest.raises(ValueError, match=f"the {spec.kind} constraint can never be met: it matches no text at all"):
        compiler.compile_now(spec)


@pytest.mark.parametrize(
    "spec, max_tokens",
    [
        (StructuredOutputs(grammar='root ::= "a" root | "b"'), None),  # recursion with a way out
        (StructuredOutputs(grammar='root ::= x{0,3} "y"\nx ::= "x" x'), None),  # the dead rule is optional
        (
            StructuredOutputs(
                json={
                    "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                    "$ref": "#/$defs/n",
                }
            ),
            None,
        ),  # a linked list: "next" is optional
        (StructuredOutputs(choice=["no", "é", "yes"]), 3),  # bytes: every token is at least one
        (StructuredOutputs(grammar='root ::= ""'), 0),
    ],
)
def test_grammars_with_a_way_out_compile_with_their_length_bound(compiler, spec, max_tokens):
    assert compiler.compile_now(spec).max_tokens == max_tokens


def test_dead_ends_of_a_filled_bitmask(tok, compiler):
    m = compiler.compile_now(StructuredOutputs(choice=["ab"])).matcher()
    a, b = ids(tok, "a")[0], ids(tok, "b")[0]
    bitmask = compiler.bitmask(3)
    m.fill_mask(bitmask, 0)  # "a" only
    assert m.accept(a)
    m.fill_mask(bitmask, 1)  # "b" only
    assert m.accept(b)
    m.fill_mask(bitmask, 2)  # the stop token only
    before = bitmask.clone()
    assert compiler.dead_ends(bitmask, [0, 1, 2], [(), (), ()]) == []
    assert torch.equal(bitmask, before)  # nothing changed where something is left
    # -inf biases / min_new_tokens take out the only tokens of rows 1 and 2: those rows are dead, and
    # opened (every token allowed) so that the step samples from finite logits there
    assert compiler.dead_ends(bitmask, [0, 1, 2], [(b,), (b, 7), (EOS,)]) == [1, 2]
    assert torch.equal(bitmask[0], before[0]) and bool((bitmask[1:] == -1).all())
    assert compiler.dead_ends(bitmask, [], []) == []


def test_compiler_arguments(tok):
    with pytest.raises(ValueError, match="vocab_size"):
        GrammarCompiler(tok, 0)
    with pytest.raises(ValueError, match="stop_token_ids"):
        GrammarCompiler(tok, V, stop_token_ids=[V])
    with pytest.raises(ValueError, match="cache_size"):
        GrammarCompiler(tok, V, cache_size=0)
    c = GrammarCompiler(tok, V, stop_token_ids=[EOS, 1])
    try:
        assert set(c.stop_token_ids) == {EOS, 1}
        m = c.compile_now(StructuredOutputs(choice=["x"])).matcher()
        assert m.accept(ids(tok, "x")[0]) and _mask(m) == {1, EOS}
        with pytest.raises(TypeError, match="StructuredOutputs"):
            c.submit({"regex": "a"})  # type: ignore[arg-type]
    finally:
        c.close()


def test_missing_xgrammar_names_the_extra(monkeypatch):
    from acb import structured

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[structured\]' in acb's checkout"):
        structured._xgr()


# ---------------------------------------------------------------------------------------------
# bitmasks


def test_bitmask_padding_and_rows(tok, compiler):
    bm = allocate_bitmask(3, V)
    assert bm.shape == (3, 10) and bm.dtype == torch.int32 and bool((bm == -1).all())
    m = compiler.compile_now(StructuredOutputs(json_object=True)).matcher()
    assert m.fill_mask(bm, 1)
    logits = torch.randn(3, V)
    before = logits.clone()
    apply_bitmask(logits, bm, [1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
    assert finite == allowed(bm, 1) == {ids(tok, "{")[0]}
    # the padding ids (beyond the tokenizer) are masked whatever the state
    assert all(not (bm[1, t // 32] >> (t % 32)) & 1 for t in range(len(tok), V))
    # a tensor rows_index, all rows, and an empty one
    for rows in (torch.tensor([1]), None):
        out = before.clone()
        apply_bitmask(out, bm, rows)
        assert torch.equal(out, logits)
    out = before.clone()
    apply_bitmask(out, bm, [])
    assert torch.equal(out, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_apply_bitmask_kernel_matches_torch_path(dtype):
    from acb.structured import _apply_bitmask_torch

    g = torch.Generator().manual_seed(0)
    bm = torch.randint(-(2**31), 2**31 - 1, (4, 10), dtype=torch.int32, generator=g)
    logits = torch.randn(4, V, generator=g).to(dtype)
    for rows in (None, [0, 2]):
        a, b = logits.clone(), logits.clone()
        apply_bitmask(a, bm, rows)  # xgrammar's CPU kernel for float32/16 and bfloat16
        _apply_bitmask_torch(b, bm, rows)
        assert torch.equal(a, b)
        expect = logits.clone()
        for r in range(4) if rows is None else rows:
            for t in range(V):
                if not (int(bm[r, t // 32]) >> (t % 32)) & 1:
                    expect[r, t] = float("-inf")
        assert torch.equal(a, expect)


def test_bitmask_shape_errors(compiler):
    m = compiler.compile_now(StructuredOutputs(regex="a")).matcher()
    with pytest.raises(ValueError, match="bitmask covers 256 tokens but the logits have 300"):
        apply_bitmask(torch.zeros(1, V), allocate_bitmask(1, 256))
    with pytest.raises(ValueError, match="bitmask must be"):
        m.fill_mask(allocate_bitmask(1, 256), 0)
    with pytest.raises(ValueError, match="CPU int32"):
        m.fill_mask(torch.zeros(1, 10, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="rows for 2 logits rows"):
        apply_bitmask(torch.zeros(2, V), allocate_bitmask(1, V))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_apply_bitmask_cuda_matches_cpu(compiler, tok):
    g = torch.Generator().manual_seed(1)
    bm = torch.randint(-(2**31), 2**31 - 1, (4, 10), dtype=torch.int32, generator=g).pin_memory()
    logits = torch.randn(4, V, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (None, [1, 3], torch.tensor([1, 3], device="cuda")):
            cpu, gpu = logits.to(dtype), logits.to(dtype).cuda()
            apply_bitmask(cpu, bm, None if rows is None else [1, 3])
            apply_bitmask(gpu, bm, rows)  # host bitmask: copied over by apply_bitmask
            assert torch.equal(gpu.cpu(), cpu)


# ---------------------------------------------------------------------------------------------
# cost


def test_fill_mask_cost(tok, compiler):
    """Measured, not asserted: fill_mask per call along a JSON-schema generation (run with -s)."""
    compiled = compiler.compile_now(StructuredOutputs(json=SCHEMA))
    tokens = generate(tok, compiled.matcher(), seed=1)
    m = compiled.matcher()
    bm = allocate_bitmask(1, V)
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        m.fill_mask(bm, 0)
        times.append(time.perf_counter() - t0)
        assert m.accept(t)
    times.sort()
    print(
        f"\nfill_mask, JSON schema, vocab {V}: {len(times)} calls, median {times[len(times) // 2] * 1e6:.1f} us, "
        f"p90 {times[int(len(times) * 0.9)] * 1e6:.1f} us, max {times[-1] * 1e6:.1f} us; "
        f"compile {compiled.compile_s * 1e3:.1f} ms"
    )
