"""The server's routes, declared once: :data:`ROUTES`. The app registers each route from here
(:func:`add`, in :mod:`acb.serve.app`, :mod:`acb.serve.responses`, :mod:`acb.serve.weights`), and
``acb serve --ray``'s ingress (:mod:`acb.serve.ingress`) reads the same table to know what a
route needs from it: a generation's prefix key, or a trainer's route sent to every replica. A new
route is one entry here and its handler.

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
# "first": the first replica's body; "all_paused": paused when every replica is; "world_size": the sum
Merge = Literal["first", "all_paused", "world_size"]


@dataclass(frozen=True)
class Route:
    """One route of the app.

    ``path``, ``methods``: as served. ``prompt``: a generation, whose body's prompt (messages,
    prompt or input) makes its prefix key at the ingress. ``trainer``: a route a trainer drives
    (served with ``enable_weight_updates``, :mod:`acb.serve.weights`), which the ingress sends
    to every replica (``ranked``: each replica's body gets its own ``rank_offset``, the body's
    plus its index; ``merge``: how the answers become one).
    """

    path: str
    methods: tuple[str, ...]
    prompt: bool = False
    trainer: bool = False
    ranked: bool = False
    merge: Merge = "first"


HEALTH = Route("/health", ("GET",))
METRICS = Route("/metrics", ("GET",))
MODELS = Route("/v1/models", ("GET",))
CHAT_COMPLETIONS = Route("/v1/chat/completions", ("POST",), prompt=True)
COMPLETIONS = Route("/v1/completions", ("POST",), prompt=True)
RESPONSES = Route("/v1/responses", ("POST",), prompt=True)
# LoRA adapters loaded and unloaded while serving (vLLM's routes; acb.serve.loras): always served,
# refused without enable_lora_updates
LOAD_LORA_ADAPTER = Route("/v1/load_lora_adapter", ("POST",))
UNLOAD_LORA_ADAPTER = Route("/v1/unload_lora_adapter", ("POST",))
PAUSE = Route("/pause", ("POST",), trainer=True)
RESUME = Route("/resume", ("POST",), trainer=True)
IS_PAUSED = Route("/is_paused", ("GET",), trainer=True, merge="all_paused")
GET_WORLD_SIZE = Route("/get_world_size", ("GET",), trainer=True, merge="world_size")
SLEEP = Route("/sleep", ("POST",), trainer=True)
WAKE_UP = Route("/wake_up", ("POST",), trainer=True)
UPDATE_WEIGHTS_FROM_DISK = Route("/update_weights_from_disk", ("POST",), trainer=True)
INIT_WEIGHT_TRANSFER = Route("/init_weight_transfer", ("POST",), trainer=True, ranked=True)
UPDATE_WEIGHTS = Route("/update_weights", ("POST",), trainer=True)
CLOSE_WEIGHT_TRANSFER = Route("/close_weight_transfer", ("POST",), trainer=True)

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
