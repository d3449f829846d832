"""The HTTP side of ``acb serve --ray``'s ingress (:mod:`acb.distributed.ray_serve`): an ASGI app
that reads each request's body (up to the server's limit), derives its prefix key, and forwards
it to an engine replica, streaming the replica's response back.

Every request gets an answer: a body over the limit a 413 (reading stops there); a replica that
fails an OpenAI error body (before the response began) or an SSE error event then ``[DONE]``
(during a stream); any failure of the ingress itself a 500 OpenAI error body. Whatever the body
holds (no JSON, the wrong types, JSON nested too deep, text that cannot be encoded), the prefix
key is a plain hex digest or None: such a request is forwarded like any other, and the replica's
app answers it as a plain ``acb serve`` does (a 400). A request may name its own key in the
``x-acb-affinity`` header (requests with the same value meet on one replica: a conversation
whose prefix changes, or a scraper of ``/metrics`` visiting each replica).

What a route needs from the ingress is read from the app's own route table
(:data:`acb.serve.routes.ROUTES`), never listed here: a generation's prompt makes its prefix key
(:data:`PROMPT_PATHS`), and the routes marked ``every_replica`` (:data:`FAN_OUT_ROUTES`: those a
trainer drives, ``acb serve --enable-weight-updates``, and the LoRA adapters' load and unload,
``--enable-lora-updates``) go to every replica, not one (:class:`FanOut`): a pause, a sleep, a
weight update or an adapter reaches each; in ``/init_weight_transfer`` each replica joins the
trainer's group with its own rank (the body's ``rank_offset`` plus its index, replicas in a fixed
order), and ``GET /get_world_size`` answers the sum of the replicas' own (one rank each), so the
trainer sizes the group. The answer is the replicas' common one (the route's ``merge``: a JSON
body, or a plain text such as vLLM's ``Success: ...`` of the LoRA routes) once every replica
succeeded, else the failures of those that failed, each named, and how many succeeded (nothing
is undone on those: an adapter loaded on some replicas is unloaded, or loaded on the rest, by
the caller). Any other path is forwarded as it is (the replica's app answers it, a 404 included).

On SIGINT/SIGTERM the launcher calls :meth:`IngressDrain.drain`, as a plain ``acb serve``'s
:class:`~acb.serve.protocol.Drain` runs: new requests and ``/health`` get 503, requests in flight
get the grace period, and those still running then end with the server-shutdown error (a 503
body; a stream: an error event, then ``[DONE]``), their replica requests cancelled.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from acb.serve.protocol import DRAIN_FLUSH_S, APIError, internal_error, read_body, shutdown_error
from acb.serve.routes import HEALTH, ROUTES, Route

__all__ = [
    "AFFINITY_CHARS",
    "AFFINITY_HEADER",
    "FAN_OUT_ROUTES",
    "FanOut",
    "IngressDrain",
    "PROMPT_PATHS",
    "RoutedRequest",
    "affinity_key",
    "forwarding_app",
]

logger = logging.getLogger(__name__)

AFFINITY_CHARS = 256  # characters of a prompt that make its prefix key
AFFINITY_HEADER = "x-acb-affinity"  # a request's own routing key, instead of its prompt's


@dataclass(frozen=True)
class RoutedRequest:
    """An HTTP request as the ingress hands it to an engine replica (``affinity``: its prefix key,
    a hex digest; ``replica``: the one replica it must reach, for a fanned-out route)."""

    affinity: str | None
    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    replica: str | None = None


def affinity_key(path: str, body: bytes) -> str | None:
    """The prefix key of an OpenAI request: a digest of its ``cache_salt`` and the first
    :data:`AFFINITY_CHARS` characters of its messages, prompt or input. Never raises.

    Args:
        path: the request's path.
        body: the request's body.

    Returns:
        A hex digest, or None (not a generation, or a body the replica will refuse).
    """
    if path.rstrip("/") not in PROMPT_PATHS:
        return None
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict):
            return None
        if "messages" in doc:
            messages = doc["messages"]
            if not isinstance(messages, list):
                return None
            text = "".join(f"{m.get('role')}:{m.get('content')}\n" for m in messages if isinstance(m, dict))
        elif "prompt" in doc:
            text = json.dumps(doc["prompt"])
        else:
            text = f"{doc.get('instructions')}\n{json.dumps(doc.get('input'))}"
        return _digest(f"{doc.get('cache_salt') or ''}\0{text[:AFFINITY_CHARS]}")
    except Exception:  # noqa: BLE001 - JSON nested too deep, odd types: no key; the replica answers
        return None


def _digest(key: str) -> str:
    # (a lone surrogate, valid JSON, has no UTF-8: surrogatepass keeps it in the digest)
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class IngressDrain:
    """The ingress's stop: :meth:`drain` closes it (503 for new requests), gives requests in
    flight the grace period, then ends the rest (:attr:`expired`)."""

    def __init__(self) -> None:
        self.closing = False
        self.in_flight = 0
        self._expired: asyncio.Future[None] | None = None

    @property
    def expired(self) -> asyncio.Future[None]:
        """Done once the grace period is over (created in the running loop on first use)."""
        if self._expired is None:
            self._expired = asyncio.get_running_loop().create_future()
        return self._expired

    async def drain(self, grace_period: float) -> int:
        """Close, wait up to ``grace_period`` seconds for the requests in flight, end the rest.

        Args:
            grace_period: seconds the requests in flight get.

        Returns:
            How many requests had to be ended (0: all finished in time).
        """
        self.closing = True
        logger.warning("acb serve: stopping; %d request(s) in flight get %s s", self.in_flight, grace_period)
        deadline = time.monotonic() + grace_period
        while self.in_flight and time.monotonic() < deadline and not self.expired.done():
            await asyncio.sleep(0.05)
        ended = self.in_flight
        if ended:
            logger.warning("acb serve: the grace period is over; ending %d request(s)", ended)
        self.expire()
        deadline = time.monotonic() + DRAIN_FLUSH_S
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return ended

    def expire(self) -> None:
        """End the grace period now (a second signal)."""
        self.closing = True
        if not self.expired.done():
            self.expired.set_result(None)


# what the ingress does by route, read from the app's own table (acb.serve.routes): a trainer's
# routes and the LoRA routes reach every replica; a generation's prompt makes its prefix key
FAN_OUT_ROUTES: Mapping[str, Route] = {r.path: r for r in ROUTES if r.every_replica}
PROMPT_PATHS = frozenset(r.path for r in ROUTES if r.prompt)


class FanOut:
    """Sends a route marked ``every_replica`` to every replica and merges their answers (see the
    module docstring).

    Args:
        replicas: ``await replicas()`` gives every replica's id once all are up (raises
            :class:`~acb.serve.protocol.APIError` when they are not).
        send: ``await send(routed)`` runs ``routed`` on the replica it names: its status and body.
    """

    def __init__(
        self,
        replicas: Callable[[], Awaitable[Sequence[str]]],
        send: Callable[[RoutedRequest], Awaitable[tuple[int, bytes]]],
    ) -> None:
        self.replicas = replicas
        self.send = send

    async def __call__(self, routed: RoutedRequest) -> tuple[int, dict[str, Any] | str]:
        """One fanned-out request: its status and body (JSON, or the text of a ``"text"`` route's
        success)."""
        path = routed.path.rstrip("/")
        route = FAN_OUT_ROUTES.get(path) or Route(path, (routed.method,), every_replica=True)
        ids = sorted(await self.replicas())
        bodies = [routed.body] * len(ids)
        if route.ranked:
            bodies = _ranked(routed.body, len(ids))
        answers = await asyncio.gather(
            *(self.send(replace(routed, replica=r, body=b)) for r, b in zip(ids, bodies)), return_exceptions=True
        )
        return _merge(route, ids, answers)


def _ranked(body: bytes, n: int) -> list[bytes]:
    """A ranked route's body (``/init_weight_transfer``'s) for each of ``n`` replicas: replica
    ``i`` joins with ``rank_offset + i``. A body that is not that route's JSON goes unchanged
    (each replica refuses it as a plain server does)."""
    try:
        doc = json.loads(body)
        offset = doc["rank_offset"]
        if not isinstance(offset, int) or isinstance(offset, bool):
            raise TypeError
    except Exception:  # noqa: BLE001 - the replicas answer it
        return [body] * n
    return [json.dumps({**doc, "rank_offset": offset + i}).encode() for i in range(n)]


def _merge(route: Route, ids: Sequence[str], answers: Sequence[Any]) -> tuple[int, dict[str, Any] | str]:
    """The replicas' answers as one: as the route's ``merge`` says when all succeeded (the first
    replica's body, or its text; ``/is_paused``: paused when every replica is;
    ``/get_world_size``: the sum), else the failures, each named, under the most telling status
    (a refusal before the 409 it caused elsewhere, a 4xx before a 5xx)."""
    failed: list[tuple[int, str]] = []
    bodies: list[dict[str, Any]] = []
    texts: list[str] = []
    for rid, answer in zip(ids, answers):
        if isinstance(answer, BaseException):
            failed.append((503, f"replica {rid}: {type(answer).__name__}: {answer}"))
            continue
        status, raw = answer
        if status == 200 and route.merge == "text":
            texts.append(raw.decode(errors="replace"))
            continue
        try:
            doc = json.loads(raw) if raw else {}
        except ValueError:
            doc = {"error": {"message": raw[:200].decode(errors="replace")}}
        if status == 200 and isinstance(doc, dict):
            bodies.append(doc)
            continue
        message = doc.get("error", {}).get("message") if isinstance(doc, dict) else None
        failed.append((status, f"replica {rid}: {message or raw[:200].decode(errors='replace')}"))
    if not failed:
        if route.merge == "text":
            return 200, texts[0] if texts else ""
        if route.merge == "world_size":  # (each replica answered it: its API key checked there)
            return 200, {"world_size": sum(int(b.get("world_size", 0)) for b in bodies)}
        out = dict(bodies[0]) if bodies else {}
        if route.merge == "all_paused":
            out["paused"] = all(b.get("paused") for b in bodies)
        out["replicas"] = len(ids)
        return 200, out
    status = min(failed, key=lambda f: (f[0] == 409, f[0] >= 500, f[0]))[0]
    message = "; ".join(m for _, m in failed)
    if len(failed) < len(ids):
        message += f" ({len(ids) - len(failed)} of {len(ids)} replicas succeeded)"
    err = APIError(status, message, type="server_error" if status >= 500 else "invalid_request_error")
    return status, err.body()


class _ShutdownExpired(Exception):
    pass


def _json_error(err: APIError) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def forwarding_app(
    call: Callable[[RoutedRequest], Any],
    max_body_bytes: int,
    drain: IngressDrain | None = None,
    cancel: Callable[[Any], Any] | None = None,
    fan_out: FanOut | None = None,
) -> Any:
    """The ingress app.

    Args:
        call: ``call(routed)`` gives an async iterator of ``(status, headers)`` and then body
            chunks (a replica's :meth:`AcbEngine.forward`).
        max_body_bytes: the largest body read; past it, a 413 (the rest is not read).
        drain: the ingress's :class:`IngressDrain` (a fresh one by default).
        cancel: ``cancel(stream)`` stops a forwarded request in its replica (a request ended by
            the drain); may block, so it runs in a thread.

    Returns:
        The ASGI app.
    """
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route as StarletteRoute

    limit = max_body_bytes
    draining = drain if drain is not None else IngressDrain()

    async def stop(stream: Any) -> None:
        if cancel is not None:
            try:
                await asyncio.to_thread(cancel, stream)
            except Exception:  # noqa: BLE001 - best effort: Serve stops the replicas next
                logger.debug("acb serve: cancelling a forwarded request failed", exc_info=True)

    async def next_item(stream: Any) -> Any:
        """The stream's next item, or :class:`_ShutdownExpired` once the grace period is over."""
        expired = draining.expired
        if expired.done():
            await stop(stream)
            raise _ShutdownExpired
        item = asyncio.ensure_future(stream.__anext__())
        await asyncio.wait({item, expired}, return_when=asyncio.FIRST_COMPLETED)
        if item.done():
            return item.result()
        item.cancel()
        await stop(stream)
        raise _ShutdownExpired

    async def forward(request: Any) -> Any:
        if draining.closing:
            if request.url.path == HEALTH.path:
                return PlainTextResponse("shutting down", status_code=503)
            return _json_error(
                APIError(503, "the server is shutting down", type="server_error", headers={"Retry-After": "1"})
            )
        body = await read_body(request, limit)
        named = request.headers.get(AFFINITY_HEADER)  # the client's own key: a session, a scraper's pick
        key = _digest(named) if named else affinity_key(request.url.path, body)
        routed = RoutedRequest(
            key, request.method, request.url.path, request.url.query, tuple(request.headers.items()), body
        )
        if fan_out is not None and request.url.path.rstrip("/") in FAN_OUT_ROUTES:
            from starlette.responses import JSONResponse

            status, doc = await fan_out(routed)
            if isinstance(doc, str):
                return PlainTextResponse(doc, status_code=status)
            return JSONResponse(doc, status_code=status)
        stream: Any = call(routed)  # (a DeploymentResponseGenerator)
        try:
            status, headers = await next_item(stream)
        except StopAsyncIteration:
            return _json_error(APIError(500, "the engine replica sent no response", type="server_error"))
        except _ShutdownExpired:
            return _json_error(shutdown_error())
        except Exception as exc:  # noqa: BLE001 - the replica died (or failed) before answering
            return _json_error(
                APIError(503, f"the engine replica failed: {type(exc).__name__}: {exc}", type="server_error")
            )
        sse = any(k.lower() == "content-type" and "text/event-stream" in v for k, v in headers)

        async def chunks() -> AsyncIterator[bytes]:
            while True:
                try:
                    chunk = await next_item(stream)
                except StopAsyncIteration:
                    return
                except _ShutdownExpired:
                    if sse:
                        yield shutdown_error().sse().encode()
                    return
                except Exception as exc:  # noqa: BLE001 - the replica died mid-response
                    if sse:
                        err = {
                            "error": {
                                "message": f"the engine replica failed: {type(exc).__name__}",
                                "type": "server_error",
                                "param": None,
                                "code": "replica_failed",
                            }
                        }
                        yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
                    return
                yield chunk

        keep = [(k, v) for k, v in headers if k.lower() not in ("content-length", "transfer-encoding")]
        response = StreamingResponse(chunks(), status_code=status)
        response.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in keep]
        return response

    async def answer(request: Any) -> Any:
        try:
            return await forward(request)
        except APIError as err:  # a body over the limit
            return _json_error(err)
        except Exception as exc:  # noqa: BLE001 - whatever failed here, the client gets an answer
            logger.exception("acb serve: the ingress failed a request")
            return _json_error(internal_error(exc))

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
    app = Starlette(routes=[StarletteRoute("/{path:path}", answer, methods=methods)])
    return _Counting(app, draining)


class _Counting:
    """ASGI middleware: counts the drain's requests in flight, from arrival to the last byte."""

    def __init__(self, app: Any, drain: IngressDrain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
