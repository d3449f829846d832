"""The server's routes, declared once: :data:`ROUTES`. The app registers each route from here
(:func:`add`, in :mod:`acb.serve.app`, :mod:`acb.serve.responses`, :mod:`acb.serve.weights`), and
``acb serve --ray``'s ingress (:mod:`acb.serve.ingress`) reads the same table to know what a
route needs from it: a generation's prefix key, or a route sent to every replica (a trainer's, a
LoRA adapter's load and unload) and how their answers merge. A new route is one entry here and its
handler.

Plain values, no server stack: the ingress imports this in its own process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "CHAT_COMPLETIONS",
    "CLOSE_WEIGHT_TRANSFER",
    "COMPLETIONS",
    "GET_WORLD_SIZE",
    "HEALTH",
    "INIT_WEIGHT_TRANSFER",
    "IS_PAUSED",
    "LOAD_LORA_ADAPTER",
    "METRICS",
    "MODELS",
    "PAUSE",
    "RESPONSES",
    "RESUME",
    "ROUTES",
    "SLEEP",
    "UNLOAD_LORA_ADAPTER",
    "UPDATE_WEIGHTS",
    "UPDATE_WEIGHTS_FROM_DISK",
    "WAKE_UP",
    "Route",
    "add",
]

# how the ingress makes one answer of a fanned-out route's replica answers (acb.serve.ingress.FanOut):
# "first": the first replica's JSON body; "all_paused": paused when every replica is; "world_size":
# the sum; "text": the first replica's text (a route answered with plain text, vLLM's LoRA routes)
Merge = Literal["first", "all_paused", "world_size", "text"]


@dataclass(frozen=True)
class Route:
    """One route of the app.

    ``path``, ``methods``: as served. ``prompt``: a generation, whose body's prompt (messages,
    prompt or input) makes its prefix key at the ingress. ``trainer``: a route a trainer drives
    (served with ``enable_weight_updates``, :mod:`acb.serve.weights`). ``every_replica``: behind
    ``acb serve --ray``, the ingress sends it to every replica, not one, and answers once all
    did (``ranked``: each replica's body gets its own ``rank_offset``, the body's plus its index;
    ``merge``: how the answers become one when every replica succeeded; else the failures, each
    named).
    """

    path: str
    methods: tuple[str, ...]
    prompt: bool = False
    trainer: bool = False
    every_replica: bool = False
    ranked: bool = False
    merge: Merge = "first"


HEALTH = Route("/health", ("GET",))
METRICS = Route("/metrics", ("GET",))
MODELS = Route("/v1/models", ("GET",))
CHAT_COMPLETIONS = Route("/v1/chat/completions", ("POST",), prompt=True)
COMPLETIONS = Route("/v1/completions", ("POST",), prompt=True)
RESPONSES = Route("/v1/responses", ("POST",), prompt=True)
# LoRA adapters loaded and unloaded while serving (vLLM's routes; acb.serve.loras): always served,
# refused without enable_lora_updates; each replica holds its own adapters, so every one loads it
LOAD_LORA_ADAPTER = Route("/v1/load_lora_adapter", ("POST",), every_replica=True, merge="text")
UNLOAD_LORA_ADAPTER = Route("/v1/unload_lora_adapter", ("POST",), every_replica=True, merge="text")
# a trainer's routes: a pause, a sleep, a weight update must reach every replica
PAUSE = Route("/pause", ("POST",), trainer=True, every_replica=True)
RESUME = Route("/resume", ("POST",), trainer=True, every_replica=True)
IS_PAUSED = Route("/is_paused", ("GET",), trainer=True, every_replica=True, merge="all_paused")
GET_WORLD_SIZE = Route("/get_world_size", ("GET",), trainer=True, every_replica=True, merge="world_size")
SLEEP = Route("/sleep", ("POST",), trainer=True, every_replica=True)
WAKE_UP = Route("/wake_up", ("POST",), trainer=True, every_replica=True)
UPDATE_WEIGHTS_FROM_DISK = Route("/update_weights_from_disk", ("POST",), trainer=True, every_replica=True)
INIT_WEIGHT_TRANSFER = Route("/init_weight_transfer", ("POST",), trainer=True, every_replica=True, ranked=True)
UPDATE_WEIGHTS = Route("/update_weights", ("POST",), trainer=True, every_replica=True)
CLOSE_WEIGHT_TRANSFER = Route("/close_weight_transfer", ("POST",), trainer=True, every_replica=True)

ROUTES: tuple[Route, ...] = (
    HEALTH,
    METRICS,
    MODELS,
    CHAT_COMPLETIONS,
    COMPLETIONS,
    RESPONSES,
    LOAD_LORA_ADAPTER,
    UNLOAD_LORA_ADAPTER,
    PAUSE,
    RESUME,
    IS_PAUSED,
    GET_WORLD_SIZE,
    SLEEP,
    WAKE_UP,
    UPDATE_WEIGHTS_FROM_DISK,
    INIT_WEIGHT_TRANSFER,
    UPDATE_WEIGHTS,
    CLOSE_WEIGHT_TRANSFER,
)


def add(app: Any, route: Route) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator that serves the function as ``route`` on ``app`` (a FastAPI app)::

    @routes.add(app, routes.HEALTH)
    async def health() -> Response: ...
    """

    def register(endpoint: Callable[..., Any]) -> Callable[..., Any]:
        app.add_api_route(route.path, endpoint, methods=list(route.methods))
        return endpoint

    return register
