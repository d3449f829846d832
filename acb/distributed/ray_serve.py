"""Online scale-out on Ray Serve (extra ``ray``): ``acb serve --ray --num-replicas N``, or a
Ray Serve config file for ``serve run`` / ``serve deploy``.

Two deployments:

- ``AcbEngine`` replicas, each one :class:`acb.AsyncEngine` (one GPU each on CUDA) with acb
  serve's own FastAPI app around it (:func:`acb.serve.app.build_app`: one implementation of the
  OpenAI protocol, not two), built inside the replica. Every ``acb serve`` flag reaches every
  replica: they parse the same command line (``argv``).
- ``AcbIngress`` (no CPU of its own), behind Ray Serve's HTTP proxy: it reads each request's
  body, derives its prefix key (the cache salt and the first :data:`AFFINITY_CHARS` characters of
  the chat, prompt or input), and forwards the raw request to an engine replica by handle; the
  replica runs it through its app and streams the response back, chunk by chunk.

Routing (:class:`PrefixAffinityRouter`, Ray Serve's request-router API): a request with a key
prefers the replica its key hashes to (rendezvous hashing over the live replicas: requests that
share a prompt prefix or a ``cache_salt`` meet the replica that holds it in its prefix cache,
and a replica leaving moves only its own keys); the others come next, and Ray Serve takes the
least loaded one with room among a rank. Ray Serve lacked only this key (its prefix-aware
router reads LLM request objects with ``.messages``/``.prompt``; its HTTP proxy routes before
reading a body).

A replica that dies mid-request: the ingress answers an OpenAI error body (503) when nothing
was sent yet, and ends a stream with an SSE error event and ``[DONE]``; Serve replaces the
replica (health checks also fail a replica whose engine died). On SIGTERM Serve drains the
replicas. Each response carries ``x-acb-replica``: the replica that served it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import shlex
from collections.abc import AsyncIterator, MutableMapping, Sequence
from typing import Any

from acb.serve.ingress import RoutedRequest, affinity_key

try:
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.handle import DeploymentHandle
    from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(f"acb's Ray Serve application needs Ray Serve: pip install 'acb-batching[ray]' ({exc})") from None

__all__ = ["AcbEngine", "AcbIngress", "PrefixAffinityRouter", "affinity_key", "build_application",
           "deployment_options", "run"]

# a batching engine serves many requests at once: let the proxy send a replica that many (the
# engine's own queue and max_queue_size decide what waits)
DEFAULT_MAX_ONGOING_REQUESTS = 256


def _namespace(argv: Sequence[str]) -> argparse.Namespace:
    """``acb serve``'s parsed flags for this command line (the CLI's own parser); bad flags are a
    ``ValueError`` with argparse's message (not its exit)."""
    import contextlib
    import io

    from acb.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(["serve", *argv])
    except SystemExit:
        raise ValueError(f"acb serve flags {list(argv)!r}: {err.getvalue().strip().splitlines()[-1]}") from None


class PrefixAffinityRouter(RequestRouter):
    """Rendezvous hashing of each request's prefix key over the live replicas: the preferred
    replica first, the others (least loaded first, by Ray Serve) next."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: back off, not spin
        key = None
        if pending_request is not None and pending_request.args:
            key = getattr(pending_request.args[0], "affinity", None)
        if not key or len(candidate_replicas) < 2:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=lambda r: hashlib.blake2b(
            f"{key}\0{r.replica_id.unique_id}".encode(), digest_size=8).digest())
        return [[ranked[0]], ranked[1:]]


class AcbEngine:
    """One engine and acb serve's app around it (a Ray Serve deployment class; see the module
    docstring). ``argv``: ``acb serve``'s flags (``--model PATH --num-blocks 256 ...``)."""

    def __init__(self, argv: Sequence[str]) -> None:

        import acb
        from acb.cli.common import _check_device, _engine_config, _load_model, _load_tokenizer, _model_name
        from acb.cli.serve import app_options
        from acb.serve.app import build_app

        args = _namespace(argv)
        device = _check_device(args.device)
        cfg = _engine_config(args, max_queue_size=args.max_queue_size, seed=args.seed)
        self.engine = acb.AsyncEngine(_load_model(args, device), cfg, tokenizer=_load_tokenizer(args))
        self.engine.start()  # here, so that the replica is ready (and healthy) once it is built
        rid = getattr(serve.get_replica_context(), "replica_id", None)
        self.replica_id = str(getattr(rid, "unique_id", None) or rid or "replica")
        self.app = build_app(self.engine, _model_name(args), **app_options(args))
        # (the app's lifespan starts the engine and watches signals in a plain `acb serve`; here
        # the replica started the engine, and Serve handles the signals and the drain)
        self.app.state.acb.ready = True

    async def forward(self, req: RoutedRequest) -> AsyncIterator[Any]:  # noqa: C901
        """Run one HTTP request through the app: yields ``(status, headers)``, then body chunks.
        Cancelled (the client left), the app sees a disconnect and cancels the request."""
        sent = asyncio.Queue()  # type: asyncio.Queue[dict[str, Any]]
        gone = asyncio.Event()
        body_read = False

        async def receive() -> dict[str, Any]:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            await sent.put(dict(message))

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": req.method,
                 "scheme": "http", "path": req.path, "raw_path": req.path.encode(), "root_path": "",
                 "query_string": req.query.encode(), "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
                 "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in req.headers]}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        try:
            while True:
                get = asyncio.ensure_future(sent.get())
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    task.result()  # (the app ended without finishing its response: raises, or returns)
                    return
                msg = get.result()
                if msg["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg.get("headers", [])]
                    yield (msg["status"], [*headers, ("x-acb-replica", self.replica_id)])
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield msg["body"]
                    if not msg.get("more_body"):
                        return
        finally:
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(task, 5)
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the response is over either way
                    task.cancel()

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine died is replaced."""
        core = self.engine.core
        if core is not None and core.dead_error is not None:
            raise RuntimeError(f"the engine died: {core.dead_error!r}")
        if not self.engine.is_running:
            raise RuntimeError("the engine is not running")


@serve.ingress()
class AcbIngress:
    """Reads each request and forwards it to an engine replica by handle (see the module docstring)."""

    def __init__(self, engines: DeploymentHandle, max_body_bytes: int = 16 << 20) -> None:
        self.engines = engines
        self.max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self) -> Any:
        from acb.serve.ingress import forwarding_app

        engines = self.engines
        return forwarding_app(lambda routed: engines.options(stream=True).forward.remote(routed), self.max_body_bytes)


def deployment_options(*, num_replicas: int | None = None, min_replicas: int | None = None,
                       max_replicas: int | None = None, num_gpus: float = 0.0, num_cpus: float = 1.0,
                       grace_period: float = 30.0) -> dict[str, Any]:
    """Ray Serve options of the replicas: a fixed count, or autoscaling between
    ``min_replicas`` and ``max_replicas`` on ongoing requests."""
    opts: dict[str, Any] = {
        "ray_actor_options": {"num_gpus": num_gpus, "num_cpus": num_cpus},
        "max_ongoing_requests": DEFAULT_MAX_ONGOING_REQUESTS,
        "graceful_shutdown_timeout_s": max(grace_period, 1.0),
        "health_check_period_s": 2.0,
    }
    if min_replicas is not None or max_replicas is not None:
        lo = min_replicas if min_replicas is not None else 1
        opts["autoscaling_config"] = {"min_replicas": lo, "max_replicas": max(max_replicas or lo, lo),
                                      "initial_replicas": num_replicas or lo, "target_ongoing_requests": 32}
    else:
        opts["num_replicas"] = num_replicas or 1
    return opts


def build_application(args: dict[str, Any]) -> Any:
    """The Ray Serve application (a builder for ``serve run`` / ``serve deploy``): ``args`` are
    ``argv`` (``acb serve``'s flags, a string or a list) and optional ``num_replicas``,
    ``min_replicas``, ``max_replicas``, ``num_gpus``, ``num_cpus``::

        applications:
          - name: acb
            route_prefix: /
            import_path: acb.distributed.ray_serve:build_application
            args: {argv: "--model /models/qwen3 --max-batch-tokens 4096", num_replicas: 2, num_gpus: 1}
    """
    argv = args.get("argv", [])
    argv = shlex.split(argv) if isinstance(argv, str) else list(argv)
    parsed = _namespace(argv)  # refuse bad flags here, before any replica starts
    opts = deployment_options(num_replicas=args.get("num_replicas"), min_replicas=args.get("min_replicas"),
                              max_replicas=args.get("max_replicas"), num_gpus=float(args.get("num_gpus", 0.0)),
                              num_cpus=float(args.get("num_cpus", 1.0)), grace_period=parsed.grace_period)
    engines = serve.deployment(AcbEngine, name="AcbEngine").options(  # type: ignore[attr-defined]
        request_router_config=RequestRouterConfig(
            request_router_class="acb.distributed.ray_serve:PrefixAffinityRouter"),  # type: ignore[arg-type]
        **opts).bind(argv)
    ingress = serve.deployment(AcbIngress, name="AcbIngress").options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    return ingress.bind(engines, parsed.max_body_bytes)


def run(app_args: dict[str, Any], *, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
        name: str = "acb", verbose: bool = False) -> None:
    """Serve :func:`build_application` (``app_args``) on a local Ray, or the cluster at
    ``address``, on ``host:port`` until SIGINT/SIGTERM; then Serve drains the replicas (their
    ``--grace-period``) and stops them. What ``acb serve --ray`` runs."""
    import signal
    import threading
    import time

    import ray

    t0 = time.perf_counter()
    app = build_application(app_args)  # the flags are checked before Ray starts
    ray.init(address=address, include_dashboard=False, log_to_driver=verbose, ignore_reinit_error=True)
    stop = threading.Event()
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name="acb", route_prefix="/", blocking=False)
        for sig in (signal.SIGINT, signal.SIGTERM):  # (after Ray's start-up, which installs its own)
            signal.signal(sig, lambda *_: stop.set())
        n = app_args.get("num_replicas") or app_args.get("min_replicas") or 1
        print(f"acb serve: {name!r} ready at http://{host}:{port} (OpenAI API under /v1) on Ray Serve, {n} "
              f"replica(s), started in {time.perf_counter() - t0:.1f} s", flush=True)
        while not stop.wait(0.2):
            pass
        print("acb serve: stopping: draining the replicas", flush=True)
    finally:
        serve.shutdown()  # drains the replicas (graceful_shutdown_timeout_s: --grace-period) and stops them
        ray.shutdown()
