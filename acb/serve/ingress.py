"""The HTTP side of ``acb serve --ray``'s ingress (:mod:`acb.distributed.ray_serve`): an ASGI app
that reads each request's body, derives its prefix key, and forwards it to an engine replica,
streaming the replica's response back; a replica that fails mid-request gives an OpenAI error
body (before the response began) or an SSE error event (during a stream)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["AFFINITY_CHARS", "RoutedRequest", "affinity_key", "forwarding_app"]

AFFINITY_CHARS = 256  # characters of a prompt that make its prefix key


@dataclass(frozen=True)
class RoutedRequest:
    """An HTTP request as the ingress hands it to an engine replica (``affinity``: its prefix key)."""

    affinity: str | None
    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


def affinity_key(path: str, body: bytes) -> str | None:
    """The prefix key of an OpenAI request: its ``cache_salt`` and the first
    :data:`AFFINITY_CHARS` characters of its messages, prompt or input (None: not a generation)."""
    if not path.rstrip("/").endswith(("/chat/completions", "/completions", "/responses")):
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    if "messages" in doc:
        text = "".join(f"{m.get('role')}:{m.get('content')}\n" for m in doc["messages"] if isinstance(m, dict))
    elif "prompt" in doc:
        text = json.dumps(doc["prompt"])
    else:
        text = f"{doc.get('instructions')}\n{json.dumps(doc.get('input'))}"
    return f"{doc.get('cache_salt') or ''}\0{text[:AFFINITY_CHARS]}"


def forwarding_app(call: Callable[[RoutedRequest], Any], max_body_bytes: int) -> Any:
    """The ingress app: each request goes to ``call(routed)``, an async iterator of
    ``(status, headers)`` and then body chunks (a replica's :meth:`AcbEngine.forward`)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    limit = max_body_bytes

    def error(status: int, message: str, kind: str = "server_error") -> Any:
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                            status_code=status)

    async def forward(request: Any) -> Any:
        body = await request.body()
        if len(body) > limit:
            return error(413, f"the request body is over {limit} bytes", "invalid_request_error")
        routed = RoutedRequest(affinity_key(request.url.path, body), request.method, request.url.path,
                               request.url.query, tuple(request.headers.items()), body)
        stream: Any = call(routed)  # (a DeploymentResponseGenerator)
        try:
            status, headers = await stream.__anext__()
        except StopAsyncIteration:
            return error(500, "the engine replica sent no response")
        except Exception as exc:  # noqa: BLE001 - the replica died (or failed) before answering
            return error(503, f"the engine replica failed: {type(exc).__name__}: {exc}")
        sse = any(k.lower() == "content-type" and "text/event-stream" in v for k, v in headers)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as exc:  # noqa: BLE001 - the replica died mid-response
                if sse:
                    err = {"error": {"message": f"the engine replica failed: {type(exc).__name__}",
                                     "type": "server_error", "param": None, "code": "replica_failed"}}
                    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()

        keep = [(k, v) for k, v in headers if k.lower() not in ("content-length", "transfer-encoding")]
        response = StreamingResponse(chunks(), status_code=status)
        response.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in keep]
        return response

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])
