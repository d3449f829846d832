"""``acb serve --data-parallel N``: N engine replicas behind one OpenAI-compatible endpoint.

The router process starts N plain ``acb serve`` subprocesses (one engine each, on 127.0.0.1 and
a free port; on CUDA one GPU each via ``CUDA_VISIBLE_DEVICES`` when there are enough), waits for
their ``/health``, then serves the public endpoint and proxies each request to one replica over
HTTP, streaming SSE through unchanged. Replicas are whole ``acb serve`` processes rather than
engines in this process because each engine wants its own Python interpreter (its engine thread
holds the GIL for every step's Python work) and because a replica that dies then takes nothing
else with it.

Routing: each in-flight request is charged an estimate of its tokens (prompt characters / 4,
plus ``max_tokens`` times ``n``) to its replica until it ends. A rendezvous hash of the request's
``cache_salt`` (else of its first :data:`AFFINITY_CHARS` characters of prompt or messages)
picks a preferred replica, so that requests sharing a prefix meet that replica's prefix cache;
it is used unless its outstanding tokens exceed the least-loaded live replica's by more than
``max(AFFINITY_SLACK_TOKENS, AFFINITY_SLACK_RATIO x)``, and then the least-loaded one is.

Failures: a replica whose process exits, or whose connection fails, leaves the rotation at
once; its in-flight requests end with an OpenAI-style error (502 JSON, or an SSE error event in
a stream), new requests go to the others, and with none left the answer is 503. A background
task polls the processes and their ``/health`` every :data:`POLL_INTERVAL` seconds (a replica
whose process still runs comes back once its health does).

Shutdown: on SIGINT/SIGTERM the router answers 503 to new requests and to ``/health`` (the
port stays open), in-flight requests get ``--grace-period`` seconds, and those still running
then end with an OpenAI error (a 503 body, or an SSE error event and ``[DONE]``), as ``acb
serve`` does (:class:`~acb.serve.protocol.Drain`); then the replicas get SIGTERM (SIGKILL after
:data:`REPLICA_STOP_TIMEOUT` s) and the router exits 0.

Bodies the router cannot read (not JSON, nested too deeply, lone UTF-16 surrogates) are routed
with the default estimate and answered by the replica (its 400); any failure of the router's
own is a 500 with an OpenAI error body. Replicas never outlive the router: they are stopped in a ``finally``, and on Linux
they also get SIGTERM from the kernel if the router dies (``PR_SET_PDEATHSIG``).

Why not Ray Serve: it adds a dependency and a cluster layer (a head node, actors, its own
HTTP proxy) that N processes on one machine do not need. On a Ray cluster, the offline answer is
the Ray Data path in :mod:`acb.distributed.ray`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import hashlib
import hmac
import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from acb.serve.protocol import (
    APIError, Drain, DrainMiddleware, ShutdownExpired, install_error_handlers, read_body,
    shutdown_error,
)

logger = logging.getLogger(__name__)

AFFINITY_CHARS = 256  # how much of a prompt names its prefix for affinity
AFFINITY_SLACK_TOKENS = 2048  # the preferred replica may carry this many more outstanding tokens...
AFFINITY_SLACK_RATIO = 1.5  # ...or this many times the least-loaded one's, whichever is more
DEFAULT_MAX_TOKENS = 256  # the estimate for a chat request that names no max_tokens
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's (and acb serve's) default for /v1/completions
POLL_INTERVAL = 1.0
HEALTH_TIMEOUT = 5.0
REPLICA_START_TIMEOUT = 600.0
REPLICA_STOP_TIMEOUT = 10.0  # after the grace period: idle replicas exit in about a second
PARSE_OFF_LOOP_BYTES = 256 << 10  # bodies this large are parsed for routing in a worker thread
_PR_SET_PDEATHSIG = 1
# router-only flags, and those the router hands replicas another way (host, port, key)
_NOT_FORWARDED = {"help", "host", "port", "api_key", "data_parallel", "router_default_max_tokens"}
# upstream headers that describe the upstream connection, not the answer
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "date",
                "server"}


def _import_httpx() -> Any:
    """httpx (or its drop-in successor httpx2, which the ``openai`` client now installs)."""
    for name in ("httpx", "httpx2"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("acb serve --data-parallel needs httpx: pip install httpx")


httpx: Any = _import_httpx()


# ------------------------------------------------------------------ replicas
@dataclass
class Replica:
    """One ``acb serve`` subprocess and the router's books on it (event loop only: no locks)."""

    index: int
    port: int
    proc: subprocess.Popen[bytes] | None = None
    client: Any = None  # httpx.AsyncClient, created in the app's lifespan (on its event loop)
    alive: bool = False
    dead_reason: str | None = None
    outstanding_tokens: int = 0
    in_flight: int = 0
    routed: int = 0
    affinity_hits: int = 0
    failures: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def stats(self) -> dict[str, Any]:
        return {"index": self.index, "port": self.port, "pid": None if self.proc is None else self.proc.pid,
                "alive": self.alive, "dead_reason": self.dead_reason,
                "returncode": None if self.proc is None else self.proc.poll(),
                "outstanding_tokens": self.outstanding_tokens, "in_flight": self.in_flight,
                "routed": self.routed, "affinity_hits": self.affinity_hits, "failures": self.failures}


@dataclass(frozen=True)
class RequestInfo:
    """What routing needs to know about a request body: its affinity key, token estimate, stream flag."""

    key: bytes
    cost: int
    stream: bool

    @classmethod
    def of(cls, body: bytes, *, chat: bool, default_max_tokens: int) -> RequestInfo:
        """Estimated cheaply from the JSON (no tokenizer); a body that is not a JSON object
        gets an empty key and the default cost (the replica answers its 400)."""
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply
            doc = None
        if not isinstance(doc, dict):
            return cls(b"", default_max_tokens, False)
        n_raw = doc.get("n")
        n = n_raw if isinstance(n_raw, int) and n_raw > 0 else 1
        if chat:
            text = _messages_text(doc.get("messages"))
            prompt_tokens, num_prompts = len(text) // 4 + 1, 1
            max_tokens = doc.get("max_completion_tokens")
            if max_tokens is None:
                max_tokens = doc.get("max_tokens")
            if max_tokens is None:
                max_tokens = default_max_tokens
        else:
            text, prompt_tokens, num_prompts = _prompt_text(doc.get("prompt"))
            max_tokens = doc.get("max_tokens", COMPLETIONS_MAX_TOKENS)
            if max_tokens is None:
                max_tokens = default_max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 0:
            max_tokens = default_max_tokens
        salt = doc.get("cache_salt")
        # surrogatepass: JSON may hold lone UTF-16 surrogates ("\\ud800"), which UTF-8 cannot
        key = (("salt:" + salt) if isinstance(salt, str) and salt else text[:AFFINITY_CHARS]).encode(
            "utf-8", "surrogatepass")
        return cls(key, prompt_tokens + max_tokens * n * num_prompts, doc.get("stream") is True)


def _messages_text(messages: Any) -> str:
    """The start of a chat as text (role and content), enough for an affinity key and a length."""
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                              and isinstance(p.get("text"), str))
        parts.append(f"{m.get('role')}: {content if isinstance(content, str) else ''}\n")
    return "".join(parts)


def _prompt_text(prompt: Any) -> tuple[str, int, int]:
    """(the first prompt as text, estimated prompt tokens over all prompts, number of prompts).
    A prompt is text, token ids, or a list of either; nothing deeper is looked into."""
    prompts = prompt if isinstance(prompt, list) and prompt and not all(isinstance(x, int) for x in prompt) \
        else [prompt]
    texts = [_one_prompt_text(p) for p in prompts]
    return texts[0][0], sum(t[1] for t in texts), len(texts)


def _one_prompt_text(prompt: Any) -> tuple[str, int]:
    if isinstance(prompt, str):
        return prompt, len(prompt) // 4 + 1
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        return ",".join(map(str, prompt[:AFFINITY_CHARS // 4])), len(prompt)
    return "", 1


def _rendezvous(key: bytes, replica: Replica) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\x00" + str(replica.index).encode(), digest_size=8).digest(),
                          "big")


def choose(replicas: list[Replica], key: bytes, exclude: Collection[int] = ()) -> tuple[Replica, bool]:
    """The replica for a request with affinity ``key`` (and whether it is the preferred one):
    the preferred replica by rendezvous hashing over the live ones, unless it is loaded past
    the slack over the least-loaded one. Raises :class:`APIError` 503 when none is live."""
    live = [r for r in replicas if r.alive and r.index not in exclude]
    if not live:
        raise APIError(503, "no replica is available", type="server_error", headers={"Retry-After": "1"})
    least = min(live, key=lambda r: (r.outstanding_tokens, r.in_flight, r.index))
    preferred = max(live, key=lambda r: _rendezvous(key, r))
    limit = max(least.outstanding_tokens + AFFINITY_SLACK_TOKENS, least.outstanding_tokens * AFFINITY_SLACK_RATIO)
    if preferred.outstanding_tokens <= limit:
        return preferred, True
    return least, False


# ------------------------------------------------------------------ the router
class Router:
    """The replicas, how to reach them, and the public app that proxies to them."""

    def __init__(self, replicas: list[Replica], *, api_key: str | None, max_body_bytes: int,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, grace_period: float | None = None) -> None:
        self.replicas = replicas
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.default_max_tokens = default_max_tokens
        self.drain = Drain(grace_period)
        self.stopped = False
        self.started = time.monotonic()

    @property
    def closing(self) -> bool:
        return self.drain.closing or self.stopped

    # -------------------------------------------------------------- books
    def mark_dead(self, replica: Replica, reason: str) -> None:
        """Out of the rotation at once (the poller re-admits it if its process still serves)."""
        if replica.alive:
            logger.warning("acb router: replica %d (port %d) out of rotation: %s", replica.index, replica.port, reason)
            print(f"acb serve: replica {replica.index} is out of rotation: {reason}", file=sys.stderr, flush=True)
        replica.alive = False
        replica.dead_reason = reason

    async def poll(self) -> None:
        """Every :data:`POLL_INTERVAL` s: exited processes out; live ones' /health decides the rest."""
        while True:
            for r in self.replicas:
                if r.exited:
                    assert r.proc is not None
                    self.mark_dead(r, f"process exited with {r.proc.returncode}")
                    continue
                try:
                    resp = await r.client.get("/health", timeout=HEALTH_TIMEOUT)
                    ok = resp.status_code == 200
                except httpx.TimeoutException:
                    continue  # busy (a long step can hold its event loop): no verdict; exits are caught above
                except httpx.HTTPError as exc:
                    ok = False
                    self.mark_dead(r, f"health check failed: {type(exc).__name__}")
                if ok and not r.alive:
                    logger.warning("acb router: replica %d is back", r.index)
                    r.alive, r.dead_reason = True, None
                elif not ok and r.alive:
                    self.mark_dead(r, "health check answered non-200")
            await anyio.sleep(POLL_INTERVAL)

    def stats(self) -> dict[str, Any]:
        return {"replicas": [r.stats() for r in self.replicas],
                "live": sum(r.alive for r in self.replicas), "closing": self.closing,
                "uptime_s": round(time.monotonic() - self.started, 3)}

    # -------------------------------------------------------------- requests
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                           type="authentication_error", code="invalid_api_key")

    def upstream_headers(self, request: Request) -> dict[str, str]:
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        for name in ("traceparent", "tracestate", "accept"):
            if name in request.headers:
                headers[name] = request.headers[name]
        if self.api_key is not None:
            headers["authorization"] = f"Bearer {self.api_key}"
        return headers

    async def proxy(self, request: Request, path: str, *, chat: bool) -> Response:
        """Send the request to the chosen replica; a replica that cannot be connected to is
        taken out and the next is tried (nothing was sent), a failure later is a 502."""
        self.authorize(request)
        if self.closing:
            raise APIError(503, "the server is shutting down", type="server_error", headers={"Retry-After": "1"})
        body = await read_body(request, self.max_body_bytes)
        if len(body) >= PARSE_OFF_LOOP_BYTES:  # parsing takes time in proportion: not on the event loop
            info = await anyio.to_thread.run_sync(
                lambda: RequestInfo.of(body, chat=chat, default_max_tokens=self.default_max_tokens))
        else:
            info = RequestInfo.of(body, chat=chat, default_max_tokens=self.default_max_tokens)
        tried: set[int] = set()
        while True:
            replica, hit = choose(self.replicas, info.key, tried)
            replica.outstanding_tokens += info.cost
            replica.in_flight += 1
            upstream_request = replica.client.build_request("POST", path, content=body,
                                                            headers=self.upstream_headers(request))
            try:
                upstream = await self.drain.until_expired(lambda: self._unless_disconnected(
                    request, lambda: replica.client.send(upstream_request, stream=True)))
            except httpx.HTTPError as exc:
                self._release(replica, info.cost)
                replica.failures += 1
                self.mark_dead(replica, f"{type(exc).__name__}: {exc}")
                if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                    tried.add(replica.index)
                    continue
                raise APIError(502, f"replica {replica.index} failed: {type(exc).__name__}",
                               type="server_error") from None
            except BaseException:
                self._release(replica, info.cost)
                raise
            break
        if upstream is None:  # our client left before the replica answered (sending was cancelled)
            self._release(replica, info.cost)
            raise APIError(499, "client disconnected")
        replica.routed += 1
        replica.affinity_hits += hit
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        if info.stream and upstream.status_code == 200:
            return StreamingResponse(self._relay(replica, upstream, info.cost), status_code=200, headers=headers)
        try:
            content = await self.drain.until_expired(lambda: self._unless_disconnected(request, upstream.aread))
        except httpx.HTTPError as exc:
            replica.failures += 1
            self.mark_dead(replica, f"{type(exc).__name__}: {exc}")
            raise APIError(502, f"replica {replica.index} failed mid-request: {type(exc).__name__}",
                           type="server_error") from None
        finally:
            self._release(replica, info.cost)
            await self._close(upstream)
        if content is None:
            raise APIError(499, "client disconnected")
        return Response(content, status_code=upstream.status_code, headers=headers)

    @staticmethod
    async def _close(upstream: Any) -> None:
        """Close the upstream response even in a cancelled task: the replica then sees the
        disconnect and cancels the request, and the pooled connection is not leaked."""
        with anyio.CancelScope(shield=True):
            await upstream.aclose()

    @staticmethod
    def _release(replica: Replica, cost: int) -> None:
        replica.outstanding_tokens -= cost
        replica.in_flight -= 1

    @staticmethod
    async def _unless_disconnected(request: Request, fn: Callable[[], Awaitable[Any]]) -> Any:
        """``await fn()``, or None if our client goes away first: ``fn`` is then cancelled,
        which closes its upstream connection, and the replica cancels the request. (A
        non-streamed answer's headers come only at its end, so sending is watched too.)"""
        result: list[Any] = []
        errors: list[Exception] = []
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                while not await request.is_disconnected():
                    await anyio.sleep(0.05)
                tg.cancel_scope.cancel()

            async def run() -> None:
                try:
                    result.append(await fn())
                except Exception as exc:  # raised below as itself, not in an ExceptionGroup
                    errors.append(exc)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            tg.start_soon(run)
        if errors:
            raise errors[0]
        return result[0] if result else None

    async def _relay(self, replica: Replica, upstream: Any, cost: int) -> AsyncIterator[bytes]:
        """SSE through, whole events at a time, so that a failure mid-event (or the end of the
        grace period) can still end the stream with a well-formed error event and ``[DONE]``."""
        buf = b""
        chunks = upstream.aiter_bytes().__aiter__()
        try:
            while True:
                try:
                    # once the server is stopping, each read may be cut short by the grace period's end
                    chunk = await (self.drain.until_expired(chunks.__anext__) if self.drain.closing
                                   else chunks.__anext__())
                except StopAsyncIteration:
                    break
                buf += chunk
                end = buf.rfind(b"\n\n")
                if end >= 0:
                    yield buf[:end + 2]
                    buf = buf[end + 2:]
            if buf:
                yield buf
        except ShutdownExpired:
            yield shutdown_error().sse().encode()
        except httpx.HTTPError as exc:
            replica.failures += 1
            self.mark_dead(replica, f"{type(exc).__name__}: {exc}")
            err = APIError(502, f"replica {replica.index} failed mid-stream: {type(exc).__name__}",
                           type="server_error")
            yield err.sse().encode()
        finally:  # also when our client went away (the generator is closed or cancelled)
            self._release(replica, cost)
            await self._close(upstream)

    async def metrics_text(self) -> str:
        """Each live replica's exposition with a ``replica`` label, merged family by family, and
        the router's own series."""
        async def fetch(r: Replica) -> str | None:
            try:
                resp = await r.client.get("/metrics", timeout=5.0)
            except httpx.HTTPError:
                return None
            return resp.text if resp.status_code == 200 else None

        texts = await asyncio.gather(*(fetch(r) for r in self.replicas if r.alive))
        families: dict[str, tuple[list[str], list[str]]] = {}
        for r, text in zip([r for r in self.replicas if r.alive], texts):
            if text is not None:
                _merge_exposition(families, text, str(r.index))
        own = [
            ("acb_router_replica_up", "gauge", "1 if the replica is in the rotation", lambda r: int(r.alive)),
            ("acb_router_outstanding_tokens", "gauge", "estimated tokens of the replica's in-flight requests",
             lambda r: r.outstanding_tokens),
            ("acb_router_in_flight_requests", "gauge", "requests in flight on the replica", lambda r: r.in_flight),
            ("acb_router_requests_routed", "counter", "requests sent to the replica", lambda r: r.routed),
            ("acb_router_affinity_hits", "counter", "requests sent to their prefix-affinity replica",
             lambda r: r.affinity_hits),
            ("acb_router_replica_failures", "counter", "requests that failed on the replica", lambda r: r.failures),
        ]
        lines: list[str] = []
        for head, samples in families.values():
            lines += head + samples
        for name, kind, help_text, value in own:
            name += "_total" if kind == "counter" else ""  # as prometheus_client writes counters
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f'{name}{{replica="{r.index}"}} {value(r)}' for r in self.replicas]
        return "\n".join(lines) + "\n"


def _merge_exposition(families: dict[str, tuple[list[str], list[str]]], text: str, replica: str) -> None:
    """Add one Prometheus text exposition to ``families`` (name -> (HELP/TYPE lines, samples)),
    every sample gaining ``replica="..."``: a family's samples stay together, as the format wants."""
    current = ""
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                current = parts[2]
                head = families.setdefault(current, ([], []))[0]
                if not any(h.split(None, 3)[1] == parts[1] for h in head):
                    head.append(line)
            continue
        brace, space = line.find("{"), line.find(" ")
        label = f'replica="{replica}"'
        if 0 <= brace < space or (brace >= 0 and space < 0):
            rest = line[brace + 1:]
            line = line[:brace + 1] + label + ("" if rest.startswith("}") else ",") + rest
        elif space > 0:
            line = line[:space] + "{" + label + "}" + line[space:]
        families.setdefault(current or line.split("{", 1)[0], ([], []))[1].append(line)


def build_app(router: Router) -> FastAPI:
    """The public app: the OpenAI endpoints proxied, plus /health, /metrics, /router/stats."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
        for r in router.replicas:
            r.client = httpx.AsyncClient(base_url=r.url, limits=limits, timeout=timeout)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(router.poll)
                tg.start_soon(router.drain.watch_signals)
                try:
                    yield
                finally:
                    router.stopped = True
                    tg.cancel_scope.cancel()
        finally:
            for r in router.replicas:
                await r.client.aclose()

    app = FastAPI(title="acb router", lifespan=lifespan)
    app.add_middleware(DrainMiddleware, drain=router.drain)

    install_error_handlers(app)  # OpenAI error bodies on every failure path

    @app.get("/health")
    async def health() -> Response:
        live = sum(r.alive for r in router.replicas)
        if live and not router.closing:
            return PlainTextResponse("ok")
        return PlainTextResponse("shutting down" if router.closing else "no replica is up", status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/router/stats")
    async def stats(request: Request) -> dict[str, Any]:
        router.authorize(request)
        return router.stats()

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        router.authorize(request)
        for r in router.replicas:
            if not r.alive:
                continue
            try:
                resp = await r.client.get("/v1/models", headers={} if router.api_key is None else
                                          {"authorization": f"Bearer {router.api_key}"})
            except httpx.HTTPError as exc:
                router.mark_dead(r, f"{type(exc).__name__}: {exc}")
                continue
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"))
        raise APIError(503, "no replica is available", type="server_error", headers={"Retry-After": "1"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.proxy(request, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.proxy(request, "/v1/completions", chat=False)

    return app


# ------------------------------------------------------------------ processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def replica_argv(args: argparse.Namespace) -> list[str]:
    """The ``acb serve`` flags the user gave (those not at their defaults), less the router's
    own and those a replica gets otherwise: each replica runs the same model and engine."""
    parser: argparse.ArgumentParser = args._parser
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in _NOT_FORWARDED:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            flag = action.option_strings[0]
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._StoreTrueAction):
            argv.append(action.option_strings[0])
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def _gpu_assignment(device: str, n: int) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` per replica: one GPU each for ``--device cuda`` with enough GPUs,
    else None (every replica on the given device)."""
    if device != "cuda":
        return [None] * n
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [x.strip() for x in visible.split(",") if x.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    if len(ids) < n:
        print(f"acb serve: {len(ids)} GPU(s) for {n} replicas: all replicas share the device", file=sys.stderr)
        return [None] * n
    chosen: list[str | None] = list(ids[:n])
    return chosen


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the kernel sends the replica SIGTERM when the router dies, even by SIGKILL."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_replicas(args: argparse.Namespace, n: int, api_key: str | None) -> list[Replica]:
    """Start the N ``acb serve`` subprocesses (from this, the main, thread: the parent-death
    signal is tied to the thread that forked)."""
    forwarded = replica_argv(args)
    gpus = _gpu_assignment(args.device, n)
    replicas = []
    for i in range(n):
        port = _free_port()
        env = dict(os.environ)
        env.pop("ACB_API_KEY", None)
        if api_key is not None:
            env["ACB_API_KEY"] = api_key  # not on the command line, where ps would show it
        gpu = gpus[i]
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        cmd = [sys.executable, "-m", "acb", "serve", "--host", "127.0.0.1", "--port", str(port), *forwarded]
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                start_new_session=True,  # the router decides when they stop (no terminal ^C)
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        replicas.append(Replica(index=i, port=port, proc=proc))
    return replicas


def wait_replicas(replicas: list[Replica], timeout: float = REPLICA_START_TIMEOUT) -> None:
    """Until every replica's /health is 200; raises RuntimeError if one exits or time runs out."""
    deadline = time.monotonic() + timeout
    pending = list(replicas)
    while pending:
        for r in list(pending):
            if r.exited:
                assert r.proc is not None
                raise RuntimeError(f"replica {r.index} exited with {r.proc.returncode} while starting")
            try:
                with urllib.request.urlopen(r.url + "/health", timeout=2) as resp:
                    ok = resp.status == 200
            except (OSError, urllib.error.URLError):
                ok = False
            if ok:
                r.alive = True
                pending.remove(r)
        if pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas {[r.index for r in pending]} were not ready after {timeout:.0f} s")
            time.sleep(0.2)


def stop_replicas(replicas: list[Replica], timeout: float = REPLICA_STOP_TIMEOUT) -> None:
    """SIGTERM to every replica, then SIGKILL to those still there after ``timeout`` s."""
    procs = [r.proc for r in replicas if r.proc is not None and r.proc.poll() is None]
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class _Server(uvicorn.Server):
    """uvicorn's server, exiting 0 after a signal-driven drain (uvicorn re-raises the signals
    it caught once it has stopped, which would end the process by SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve_data_parallel(args: argparse.Namespace) -> int:
    """``acb serve --data-parallel N``: start the replicas, serve the router until a signal,
    stop the replicas. 0 after a signal-driven stop, 1 if the replicas did not start."""
    n = args.data_parallel
    api_key = args.api_key if args.api_key is not None else os.environ.get("ACB_API_KEY")
    previous = signal.signal(signal.SIGTERM, _interrupt)  # while starting: SIGTERM stops like ^C
    replicas: list[Replica] = []
    try:
        replicas = start_replicas(args, n, api_key)
        try:
            wait_replicas(replicas)
        except RuntimeError as exc:
            print(f"acb serve: {exc}", file=sys.stderr, flush=True)
            return 1
        signal.signal(signal.SIGTERM, previous)
        router = Router(replicas, api_key=api_key, max_body_bytes=args.max_body_bytes,
                        default_max_tokens=args.router_default_max_tokens, grace_period=args.grace_period)
        config = uvicorn.Config(build_app(router), host=args.host, port=args.port, log_level="warning",
                                timeout_graceful_shutdown=max(1, round(args.grace_period)), access_log=False)
        server = _Server(config)
        pids = " ".join(str(r.proc.pid) for r in replicas if r.proc is not None)

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            print(f"acb serve: {n} replicas (pids {pids}) ready behind http://{args.host}:{args.port} "
                  "(OpenAI API under /v1)", flush=True)

        async def main() -> None:
            task = asyncio.ensure_future(announce())
            try:
                await server.serve()
            finally:
                task.cancel()

        asyncio.run(main())
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_replicas(replicas)
