"""Issue 36 ("grammar compilation is a denial of service") at the HTTP level: three real ``acb
serve`` processes on a tiny checkpoint (started together, one per test), driven by the real
``openai`` client.

- a server on the default flags refuses the reported schema (``pattern: a{1,30000}``, over
  a minute of xgrammar's time) at once: a 400 whose ``param`` is ``response_format`` and whose
  message names the limit, ``grammar_max_repetition``;
- with the repetition limit raised and a 3 s time limit, two clients' slow schemas are stopped at
  the time limit (400s naming ``grammar_compile_timeout_s``) while a third client's small
  ``choice`` constraint, sent while both slow compiles hold the compile workers, is answered;
- SIGTERM while a compile runs (time limit 600 s, grace period 1 s): the server exits 0 promptly,
  the client gets an error response, and no compile worker outlives the server.

The budget is set with ``acb serve``'s own flags (``--grammar-max-repetition``,
``--grammar-compile-timeout-s``). That a compile is running is seen from outside: the server's
compile workers (child processes running ``acb.structured.serve_compiles``) use CPU only while
they compile.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")

from tests.conftest import HANG_GUARD, wait_until  # noqa: E402
from tests.serve.helpers import tiny_checkpoint  # noqa: E402
from tests.serve.test_openai_server import Server  # noqa: E402

if not os.path.isdir("/proc/self/task"):
    pytest.skip("the compile workers are watched through Linux's /proc", allow_module_level=True)

NAME = "tiny-budget"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
ARGS = ["--served-model-name", NAME, "--page-size", "16", "--num-blocks", "64"]
USER = [{"role": "user", "content": "pick one"}]
SLOW = {"type": "string", "pattern": "a{1,30000}"}  # the schema
TIME_LIMIT = 3.0  # the second server's grammar_compile_timeout_s
STARVED = 45.0  # seconds a small constrained request may wait behind slow compiles: fails, not hangs
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def slow_schema(n: int) -> dict:
    """A schema as slow as the issue's (``a{1,n}``); distinct ``n``: distinct compiles, never one
    shared (cached) compile."""
    return {**SLOW, "pattern": f"a{{1,{n}}}"}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def client_of(server, timeout: float = HANG_GUARD):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# the compile workers, seen from outside


def compile_workers(server_pid: int) -> dict[int, float]:
    """The server's grammar compile workers (its child processes that run
    ``acb.structured.serve_compiles``): pid -> CPU seconds used so far."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2 :].split()  # from the state (the stat's 3rd field) on
            if int(fields[1]) != server_pid:  # the parent's pid
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"serve_compiles" not in f.read():
                    continue
        except (OSError, ValueError, IndexError):  # (a process that ended meanwhile)
            continue
        out[int(entry)] = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
    return out


def idle_workers(server, n: int = 2) -> dict[int, float]:
    """The ``n`` compile workers once none of them uses CPU (started, xgrammar imported, waiting
    for a job) for 0.5 s: their CPU seconds then."""
    last: dict = {"cpu": None, "since": 0.0}

    def idle() -> bool:
        cpu = compile_workers(server.proc.pid)
        now = time.monotonic()
        if len(cpu) != n or cpu != last["cpu"]:
            last.update(cpu=cpu, since=now)
            return False
        return now - last["since"] >= 0.5

    wait_until(idle, f"{n} idle compile workers")
    return last["cpu"]


def wait_compiling(server, baseline: dict[int, float]) -> None:
    """Wait until every worker of ``baseline`` (idle then) has used 0.1 s of CPU more: each holds
    a compile."""

    def compiling() -> bool:
        cpu = compile_workers(server.proc.pid)
        return all(pid in cpu and cpu[pid] >= t + 0.1 for pid, t in baseline.items())

    wait_until(compiling, f"compiles running in workers {sorted(baseline)}")


def warm_up(client) -> None:
    """A small constrained request: the first one builds the server's grammar compiler (which
    starts its workers)."""
    r = client.chat.completions.create(
        model=NAME, messages=USER, max_tokens=4, temperature=0, extra_body={"structured_outputs": {"regex": "[0-9]"}}
    )
    assert r.choices[0].message.content.isdigit(), r


def refused(client, schema: dict) -> openai.BadRequestError:
    """Send ``schema`` as a chat's ``response_format``; the 400 it must get."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=USER, max_tokens=8, response_format=json_schema(schema))
    return info.value


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "tiny-budget", TEMPLATE, 256)


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    """The module's three servers, started together (their startups overlap); each test waits
    for its own. Stopped with SIGTERM at the end (each must exit 0), but for ``sigterm``, which
    its test stops."""
    logs = tmp_path_factory.mktemp("serve-logs")
    started: list[Server] = []
    try:
        # plain `acb serve` on the default flags (the default compile budget)
        started.append(Server(checkpoint.dir, ARGS, logs / "default.log"))
        # the schema let through the static limit; every compile stopped at 3 s
        limited = ["--grammar-max-repetition", str(10**6), "--grammar-compile-timeout-s", str(TIME_LIMIT)]
        started.append(Server(checkpoint.dir, [*ARGS, *limited], logs / "time-limit.log"))
        # let through, and no compile stopped before 10 minutes; a grace period of 1 s
        patient = ["--grammar-max-repetition", str(10**6), "--grammar-compile-timeout-s", "600", "--grace-period", "1"]
        started.append(Server(checkpoint.dir, [*ARGS, *patient], logs / "sigterm.log"))
        yield SimpleNamespace(default=started[0], limited=started[1], sigterm=started[2])
    finally:
        running = [s for s in started if not s.signalled]
        for s in running:  # (all signalled first: they stop together)
            s.terminate()
        rcs = [(s.wait_exit(30), s) for s in running]
        for s in started:
            s.stop()  # (closes the logs: each has exited by now)
    for rc, s in rcs:
        assert rc == 0, f"acb serve exited with {rc} on SIGTERM:\n{s.tail()}"


@pytest.fixture(scope="module")
def default_server(servers):
    servers.default.wait_ready()
    return servers.default


@pytest.fixture(scope="module")
def limited_server(servers):
    servers.limited.wait_ready()
    return servers.limited


# ---------------------------------------------------------------------------------------------
# tests


def test_reported_schema_is_refused_on_the_default_flags(default_server):
    """The issue's schema is a 400 naming the static limit, before any compile: with the limit
    gone it would instead wait the default 10 s time limit and name that one."""
    with client_of(default_server) as client:
        t0 = time.monotonic()
        err = refused(client, SLOW)
        took = time.monotonic() - t0
    assert err.status_code == 400 and err.param == "response_format", (err.status_code, err.body)
    assert err.type == "invalid_request_error", err.body
    msg = err.body["message"] if isinstance(err.body, dict) else str(err.body)
    assert msg.startswith("response_format: "), msg
    assert "more than 1000 characters" in msg and "ContinuousBatchingConfig.grammar_max_repetition" in msg, msg
    assert "grammar_compile_timeout_s" not in msg, msg
    assert took < 9, f"the refusal took {took:.1f} s: was the schema compiled?"


def test_slow_compiles_are_stopped_and_starve_no_one(limited_server):
    """Two clients' slow schemas (distinct, so two compiles) hold both compile workers; a third
    client's ``choice`` request, sent while they do, is answered (once a worker is free: the slow
    ones are stopped at the time limit), and the slow ones get 400s naming the time limit."""
    with client_of(limited_server) as a, client_of(limited_server) as b, client_of(limited_server) as c:
        warm_up(c)
        workers = idle_workers(limited_server)
        with ThreadPoolExecutor(2) as pool:
            slow = [pool.submit(refused, a, slow_schema(30000)), pool.submit(refused, b, slow_schema(30001))]
            wait_compiling(limited_server, workers)
            assert not any(f.done() for f in slow), [f.result() for f in slow if f.done()]
            # its wait: until a slow compile is stopped (3 s) and the worker replaced (a fresh
            # process: ~3 s on a loaded 2-core machine), not until a slow one ends (minutes)
            r = c.with_options(timeout=STARVED).chat.completions.create(
                model=NAME,
                messages=USER,
                max_tokens=10,
                temperature=1.0,
                seed=1,
                extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
            )
            errors = [f.result(HANG_GUARD) for f in slow]
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop", r
    for err in errors:
        msg = err.body["message"] if isinstance(err.body, dict) else str(err.body)
        assert err.status_code == 400 and err.param == "response_format", (err.status_code, err.body)
        assert msg.startswith("response_format: "), msg
        assert f"took longer than {TIME_LIMIT:g} s" in msg and "grammar_compile_timeout_s" in msg, msg


def test_sigterm_during_a_compile_exits_promptly(servers):
    """SIGTERM while a compile runs (time limit 600 s, grace period 1 s): exit 0 within 60 s, the
    client gets an error response (no hang), and the compile's worker is gone with the server."""
    server = servers.sigterm
    server.wait_ready()
    with client_of(server) as client:
        warm_up(client)
        workers = idle_workers(server)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                client.chat.completions.create,
                model=NAME,
                messages=USER,
                max_tokens=8,
                response_format=json_schema(SLOW),
            )
            wait_until(
                lambda: any(compile_workers(server.proc.pid).get(pid, 0.0) >= t + 0.1 for pid, t in workers.items()),
                "the slow compile running",
            )
            assert not pending.done(), pending.result()
            server.terminate()
            rc = server.wait_exit(60)  # (fails past 60 s)
            with pytest.raises(openai.APIError) as info:
                pending.result(HANG_GUARD)
    assert rc == 0, server.tail()
    err = info.value
    assert isinstance(err, openai.APIStatusError) and err.status_code == 503, (type(err), err)
    # (an orphaned worker would go on compiling for a minute, its parent now init)
    wait_until(lambda: all(_gone(pid) for pid in workers), "the compile workers gone", timeout=10)


def _gone(pid: int) -> bool:
    """No such process, or one that ended (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2 :].split()[0] in ("Z", "X")
