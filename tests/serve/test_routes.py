"""acb/serve/routes.py: the app's routes are declared once, and ``acb serve --ray``'s ingress
(acb/serve/ingress.py) reads the same table: the app serves exactly the table's routes (a
trainer's with ``enable_weight_updates``), and the ingress, driven over ASGI with stand-in
replicas (no Ray), sends every route marked ``every_replica`` (a trainer's, the LoRA adapters'
load and unload) to every replica and every other route to one, a generation with its prompt's
prefix key, without a list of paths of its own; a fanned-out route answers once every replica
succeeded, in the route's form (JSON, or the LoRA routes' text), else with each failure named."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import acb  # noqa: E402
from acb.models import build_tokenizer, tiny_model  # noqa: E402
from acb.serve import ingress, routes  # noqa: E402
from acb.serve.app import build_app  # noqa: E402
from acb.serve.settings import ServerSettings  # noqa: E402


def _served(app) -> set[tuple[str, str]]:
    from fastapi.routing import APIRoute

    return {(r.path, m) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}


def _declared(trainer: bool) -> set[tuple[str, str]]:
    return {(r.path, m) for r in routes.ROUTES if trainer or not r.trainer for m in r.methods}


def test_the_app_serves_the_routes_it_declares():
    tok = build_tokenizer()
    engine = acb.AsyncEngine(tiny_model("llama", vocab_size=len(tok)), acb.ContinuousBatchingConfig(), tokenizer=tok)
    plain = build_app(engine, ServerSettings(name="m"))
    assert _served(plain) == _declared(trainer=False)
    trainer = build_app(engine, ServerSettings(name="m", enable_weight_updates=True))
    assert _served(trainer) == _declared(trainer=True)
    for app in (plain, trainer):
        app.state.acb.render_pool.close()  # (never started)


def _body(route: routes.Route) -> bytes:
    if route.path == routes.CHAT_COMPLETIONS.path:
        return json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    if route.path == routes.RESPONSES.path:
        return json.dumps({"input": "hi"}).encode()
    return json.dumps({"prompt": "hi", "rank_offset": 1}).encode()


def test_the_ingress_forwards_each_declared_route_as_the_table_says():
    one: list[ingress.RoutedRequest] = []  # requests sent to one replica
    every: list[ingress.RoutedRequest] = []  # requests sent to each replica by the fan-out

    def call(routed):
        one.append(routed)

        async def stream():
            yield 200, [("content-type", "application/json")]
            yield b"{}"

        return stream()

    async def replicas():
        return ["r-1", "r-0"]

    async def send(routed):
        every.append(routed)
        if routed.path in (routes.LOAD_LORA_ADAPTER.path, routes.UNLOAD_LORA_ADAPTER.path):
            return 200, f"Success: {routed.replica}".encode()  # (a replica answers these with vLLM's text)
        return 200, b'{"world_size": 1, "paused": true}'

    app = ingress.forwarding_app(call, 1 << 20, fan_out=ingress.FanOut(replicas, send))

    async def drive() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as c:
            for route in routes.ROUTES:
                for method in route.methods:
                    one.clear()
                    every.clear()
                    r = await c.request(method, route.path, content=_body(route))
                    assert r.status_code == 200, (route, r.text)
                    if route.every_replica:
                        assert not one and sorted(x.replica for x in every) == ["r-0", "r-1"], route
                        ranks = sorted(json.loads(x.body)["rank_offset"] for x in every)
                        assert ranks == ([1, 2] if route.ranked else [1, 1]), route
                        if route.merge == "text":  # the first replica's text, as text
                            assert r.text == "Success: r-0" and r.headers["content-type"].startswith("text/plain")
                        else:
                            assert r.headers["content-type"] == "application/json", route
                    else:
                        assert not every and len(one) == 1 and one[0].path == route.path, route
                        assert (one[0].affinity is not None) == route.prompt, route
            # any other path goes to one replica as it is (its app answers: a 404)
            one.clear()
            await c.get("/no/such/route")
            assert [x.path for x in one] == ["/no/such/route"] and one[0].affinity is None

    asyncio.run(drive())
    assert ingress.FAN_OUT_ROUTES.keys() == {r.path for r in routes.ROUTES if r.every_replica}
    # a trainer's routes and the LoRA adapters' reach every replica
    assert all(r.every_replica for r in routes.ROUTES if r.trainer)
    assert {routes.LOAD_LORA_ADAPTER.path, routes.UNLOAD_LORA_ADAPTER.path} <= ingress.FAN_OUT_ROUTES.keys()


def test_a_lora_route_answers_once_every_replica_did():
    """``POST /v1/load_lora_adapter`` through the ingress: every replica's success is vLLM's text
    once; a replica that refuses (or died) makes the answer its refusal, the replica named, and
    says how many loaded it."""
    answers: dict[str, tuple[int, bytes] | Exception] = {}

    async def replicas():
        return ["r-1", "r-0", "r-2"]

    async def send(routed):
        answer = answers[routed.replica]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def call(routed):  # (nothing goes to one replica here)
        raise AssertionError(routed)

    app = ingress.forwarding_app(call, 1 << 20, fan_out=ingress.FanOut(replicas, send))
    ok = (200, b"Success: LoRA adapter 'a' added successfully.")
    full = (400, json.dumps({"error": {"message": "all 1 LoRA slots are taken (b; max_loras=1)"}}).encode())
    body = {"lora_name": "a", "lora_path": "/adapters/a"}

    async def post(path: str = routes.LOAD_LORA_ADAPTER.path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as c:
            return await c.post(path, json=body)

    answers.update({"r-0": ok, "r-1": ok, "r-2": ok})
    r = asyncio.run(post())
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'a' added successfully.")
    answers["r-1"] = full
    r = asyncio.run(post())
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "replica r-1: all 1 LoRA slots are taken" in message, r.text
    assert "2 of 3 replicas succeeded" in message
    answers.update({"r-1": ok, "r-2": RuntimeError("actor died")})
    r = asyncio.run(post(routes.UNLOAD_LORA_ADAPTER.path))
    assert r.status_code == 503 and "replica r-2: RuntimeError: actor died" in r.json()["error"]["message"]


def test_the_ingress_lists_no_route_of_its_own():
    """The ingress's source names no route path: what it knows of routes comes from the table."""
    tree = ast.parse(Path(ingress.__file__).read_text())
    paths = {r.path for r in routes.ROUTES}
    named = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert not [s for s in named if s in paths or s.rstrip("/").endswith(tuple(paths))]
