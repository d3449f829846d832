"""Online scale-out on Ray Serve (extra ``ray``): ``acb serve --ray --num-replicas N``, or a
Ray Serve config file for ``serve run`` / ``serve deploy`` (:func:`acb.cli.serve.build_ray_application`).

Two deployments:

- ``AcbEngine`` replicas, each one server built by :func:`acb.serve.build_server` from the
  launcher's :class:`~acb.serve.ServerSettings` (pickled: every ``acb serve`` flag reaches every
  replica), as a plain ``acb serve`` builds its own: telemetry configured (OTLP export,
  ``/metrics``), one :class:`acb.AsyncEngine` (one GPU each on CUDA) and acb serve's own FastAPI
  app around it, whose lifespan runs in the replica (it starts the engine; the replica's
  ``__del__`` runs its shutdown).
- ``AcbIngress`` (no CPU of its own), behind Ray Serve's HTTP proxy: it reads each request's
  body (up to ``--max-body-bytes``), derives its prefix key (a digest of the cache salt and the
  first :data:`~acb.serve.ingress.AFFINITY_CHARS` characters of the chat, prompt or input), and
  forwards the raw request to an engine replica by handle; the replica runs it through its app
  and streams the response back, chunk by chunk (:mod:`acb.serve.ingress`).

Routing (:class:`PrefixAffinityRouter`, Ray Serve's request-router API): a request with a key
prefers the replica its key hashes to (rendezvous hashing over the live replicas: requests that
share a prompt prefix or a ``cache_salt`` meet the replica that holds it in its prefix cache,
and a replica leaving moves only its own keys); the others come next, and Ray Serve takes the
least loaded one with room among a rank. Ray Serve lacked only this key (its prefix-aware
router reads LLM request objects with ``.messages``/``.prompt``; its HTTP proxy routes before
reading a body). The router never fails a request: without a usable key, any replica serves it.

With ``--enable-weight-updates`` (a fixed replica count), the trainer's routes reach every
replica (:class:`acb.serve.ingress.FanOut`): each replica joins the trainer's
``torch.distributed`` group with its own rank, so :class:`acb.rl.WeightPusher` pushes to all of
them in one broadcast. With ``--enable-lora-updates`` (a fixed replica count too: a replica
started later would lack the adapters loaded before it), ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` reach every replica the same way. The ingress addresses a replica by its id (the request's ``replica``,
which the router honours alone) and learns the ids from its own router.

A replica that dies mid-request: the ingress answers an OpenAI error body (503) when nothing
was sent yet, and ends a stream with an SSE error event and ``[DONE]``; Serve replaces the
replica (health checks also fail a replica whose engine died). On SIGINT/SIGTERM the launcher
drains the ingress (``--grace-period``, as a plain ``acb serve`` drains: the requests still
running then end with an OpenAI error), then Serve stops the replicas and the launcher exits 0;
also while Serve is still starting the application (its proxy serves once one replica is up). Each response carries
``x-acb-replica``: the replica that served it.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

from acb.serve.ingress import FanOut, IngressDrain, RoutedRequest, affinity_key, forwarding_app
from acb.serve.launch import Server, build_server
from acb.serve.protocol import APIError
from acb.serve.settings import ServerSettings

try:
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.handle import DeploymentHandle
    from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        f"acb's Ray Serve application needs Ray Serve: pip install -e '.[ray]' in acb's checkout ({exc})"
    ) from None

__all__ = [
    "AcbEngine",
    "AcbIngress",
    "PrefixAffinityRouter",
    "RayStartError",
    "affinity_key",
    "build_application",
    "deployment_options",
    "run",
]

logger = logging.getLogger(__name__)

# a batching engine serves many requests at once: let the proxy send a replica that many (the
# engine's own queue and max_queue_size decide what waits)
DEFAULT_MAX_ONGOING_REQUESTS = 256
APP_NAME = "acb"
FAN_OUT_TIMEOUT_S = 60.0  # how long a fanned-out route waits for every replica to be up and reached


def live_replicas() -> dict[str, tuple[str, ...]]:
    """The replicas each app's router was last told of, in this process (the ingress's: its
    fan-out reads them). Found through ``sys.modules`` at each call: Serve ships the ingress's
    class by value, with copies of the globals (and classes) its methods name, so a module
    global read from there would be a copy, never updated."""
    import sys

    module = sys.modules["acb.distributed.ray_serve"]
    table: dict[str, tuple[str, ...]] = module.__dict__.setdefault("_live_replicas_by_app", {})
    return table


class RayStartError(RuntimeError):
    """Ray or Ray Serve could not start (or reach ``--ray-address``)."""


class PrefixAffinityRouter(RequestRouter):
    """Rendezvous hashing of each request's prefix key over the live replicas: the preferred
    replica first, the others (least loaded first, by Ray Serve) next. A request that names its
    replica (a fanned-out trainer's route) goes there alone, and waits while it is busy."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's hook when the replica set changes: recorded for the ingress's fan-out too."""
        super().update_replicas(replicas)
        live_replicas()[self.app_name] = tuple(r.replica_id.unique_id for r in replicas)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Rank the candidates for one request (never raises: a request Serve cannot route would
        wait forever).

        Args:
            candidate_replicas: the live replicas.
            pending_request: the request (its first argument a :class:`RoutedRequest`).

        Returns:
            The ranks: the key's replica, then the others; or all of them in one rank.
        """
        try:
            if pending_request is not None:
                pending_request.routing_context.should_backoff = True  # all full: back off, not spin
            key = None
            if pending_request is not None and pending_request.args:
                target = getattr(pending_request.args[0], "replica", None)
                if target is not None:  # (none while it is gone: the ingress's time limit answers)
                    return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
                key = getattr(pending_request.args[0], "affinity", None)
            if not key or len(candidate_replicas) < 2:
                return [candidate_replicas]
            ranked = sorted(
                candidate_replicas,
                key=lambda r: hashlib.blake2b(
                    f"{key}\0{r.replica_id.unique_id}".encode("utf-8", "surrogatepass"), digest_size=8
                ).digest(),
            )
            return [[ranked[0]], ranked[1:]]
        except Exception:  # noqa: BLE001 - any replica will do
            logger.exception("acb serve: the prefix-affinity router failed; routing by load")
            return [candidate_replicas]


class AcbEngine:
    """One server built from ``settings`` (a Ray Serve deployment class; see the module
    docstring): :func:`acb.serve.build_server`, its app's lifespan run in the replica."""

    async def __init__(self, settings: ServerSettings) -> None:  # type: ignore[misc]  # (Serve awaits it)
        self.server: Server = build_server(settings)
        rid = getattr(serve.get_replica_context(), "replica_id", None)
        self.replica_id = str(getattr(rid, "unique_id", None) or rid or "replica")
        await self.server.start()  # here, so that the replica is ready (and healthy) once it is built
        self.app = self.server.app

    async def __del__(self) -> None:
        """Serve stops the replica: the app's lifespan shutdown (the engine stops, the render
        threads end), and telemetry exports what it holds."""
        server = getattr(self, "server", None)
        if server is not None:
            await server.stop()

    async def forward(self, req: RoutedRequest) -> AsyncIterator[Any]:  # noqa: C901
        """Run one HTTP request through the app: yields ``(status, headers)``, then body chunks.
        Cancelled (the client left), the app sees a disconnect and cancels the request.

        Args:
            req: the request, as the ingress read it.

        Returns:
            An async iterator of ``(status, headers)`` and then the body's chunks.
        """
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

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": req.method,
            "scheme": "http",
            "path": req.path,
            "raw_path": req.path.encode(),
            "root_path": "",
            "query_string": req.query.encode(),
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in req.headers],
        }
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

    def replica(self) -> str:
        """This replica's id (a call that makes the caller's router learn the replicas)."""
        return self.replica_id

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine died is replaced.

        Raises:
            RuntimeError: the engine died or is not running.
        """
        engine = self.server.engine
        assert engine is not None
        core = engine.core
        if core is not None and core.dead_error is not None:
            raise RuntimeError(f"the engine died: {core.dead_error!r}")
        if not engine.is_running:
            raise RuntimeError("the engine is not running")


def _cancel(stream: Any) -> None:
    stream.cancel()


@serve.ingress()
class AcbIngress:
    """Reads each request and forwards it to an engine replica by handle (see the module docstring)."""

    def __init__(
        self, engines: DeploymentHandle, max_body_bytes: int = 16 << 20, fan_out_replicas: int | None = None
    ) -> None:
        self.engines = engines
        self.max_body_bytes = max_body_bytes
        self.fan_out_replicas = fan_out_replicas  # (--enable-weight-updates: the fixed replica count)
        self.stopping = IngressDrain()

    def __serve_build_asgi_app__(self) -> Any:
        engines = self.engines
        fan_out = None
        if self.fan_out_replicas:
            fan_out = FanOut(self._every_replica, self._send_to_replica)
        return forwarding_app(
            lambda routed: engines.options(stream=True).forward.remote(routed),
            self.max_body_bytes,
            self.stopping,
            _cancel,
            fan_out,
        )

    async def _every_replica(self) -> tuple[str, ...]:
        """Every replica's id once the router knows all of them (a 503 after
        :data:`FAN_OUT_TIMEOUT_S`: a fanned-out route must reach each)."""
        want = self.fan_out_replicas or 1
        app = serve.get_replica_context().app_name
        deadline = asyncio.get_running_loop().time() + FAN_OUT_TIMEOUT_S
        asked = False
        while len(known := live_replicas().get(app, ())) < want:
            if not asked:  # (the router starts, and learns the replicas, with the handle's first call)
                await self.engines.replica.remote()
                asked = True
            if asyncio.get_running_loop().time() > deadline:
                raise APIError(
                    503,
                    f"{len(known)} of {want} engine replicas are up; this route must reach every one",
                    type="server_error",
                )
            await asyncio.sleep(0.1)
        return known

    async def _send_to_replica(self, routed: RoutedRequest) -> tuple[int, bytes]:
        """Run ``routed`` on the replica it names: its status and whole body."""

        async def collect() -> tuple[int, bytes]:
            stream: Any = self.engines.options(stream=True).forward.remote(routed)  # (a response generator)
            head = None
            chunks = []
            async for item in stream:
                if head is None:
                    head = item
                else:
                    chunks.append(item)
            if head is None:
                raise RuntimeError("the replica sent no response")
            return int(head[0]), b"".join(chunks)

        # Outside the incoming request's context: Serve gives a call made in it that request's
        # internal id, and its router fulfils requests by that id, so the second of two calls
        # from one request would wait forever. (An update waits for the trainer's broadcast: the
        # route's own timeouts come first.)
        loop = asyncio.get_running_loop()
        task = contextvars.Context().run(loop.create_task, asyncio.wait_for(collect(), FAN_OUT_TIMEOUT_S + 600))
        return await task

    async def drain(self, grace_period: float) -> int:
        """Stop as a plain ``acb serve`` stops (:meth:`acb.serve.ingress.IngressDrain.drain`).

        Args:
            grace_period: seconds the requests in flight get.

        Returns:
            How many requests were ended at the end of the grace period.
        """
        return await self.stopping.drain(grace_period)

    def hurry(self) -> None:
        """End the grace period now (a second SIGINT/SIGTERM)."""
        self.stopping.expire()


def deployment_options(
    *,
    num_replicas: int | None = None,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    num_gpus: float = 0.0,
    num_cpus: float = 1.0,
    grace_period: float = 30.0,
) -> dict[str, Any]:
    """Ray Serve options of the replicas: a fixed count, or autoscaling between
    ``min_replicas`` and ``max_replicas`` on ongoing requests.

    Args:
        num_replicas: the replicas (the initial count when autoscaling).
        min_replicas: autoscaling's floor.
        max_replicas: autoscaling's ceiling.
        num_gpus: GPUs per replica.
        num_cpus: CPUs per replica.
        grace_period: seconds a replica being stopped gets for its requests in flight.

    Returns:
        The options for ``serve.deployment(...).options``.
    """
    opts: dict[str, Any] = {
        "ray_actor_options": {"num_gpus": num_gpus, "num_cpus": num_cpus},
        "max_ongoing_requests": DEFAULT_MAX_ONGOING_REQUESTS,
        "graceful_shutdown_timeout_s": max(grace_period, 1.0),
        "health_check_period_s": 2.0,
    }
    if min_replicas is not None or max_replicas is not None:
        lo = min_replicas if min_replicas is not None else 1
        opts["autoscaling_config"] = {
            "min_replicas": lo,
            "max_replicas": max(max_replicas or lo, lo),
            "initial_replicas": num_replicas or lo,
            "target_ongoing_requests": 32,
        }
    else:
        opts["num_replicas"] = num_replicas or 1
    return opts


def build_application(
    settings: ServerSettings,
    *,
    num_replicas: int | None = None,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    num_gpus: float = 0.0,
    num_cpus: float = 1.0,
) -> Any:
    """The Ray Serve application: engine replicas built from ``settings`` behind the ingress.

    Args:
        settings: every replica's server settings (``acb serve``'s flags).
        num_replicas: see :func:`deployment_options`.
        min_replicas: see :func:`deployment_options`.
        max_replicas: see :func:`deployment_options`.
        num_gpus: GPUs per replica.
        num_cpus: CPUs per replica.

    Returns:
        The bound application (for ``serve.run``, or a config file's builder).

    Raises:
        ValueError: weight or LoRA updates with autoscaling (a trainer's group has a fixed size; an
            adapter loaded while serving must reach every replica).
    """
    fan_out = None
    if settings.enable_weight_updates:
        if min_replicas is not None or max_replicas is not None:
            raise ValueError(
                "--enable-weight-updates needs a fixed replica count (--num-replicas N): a trainer's "
                "weight-transfer group has one rank per replica; drop --min-replicas/--max-replicas"
            )
        fan_out = num_replicas or 1
    if settings.enable_lora_updates:
        if min_replicas is not None or max_replicas is not None:
            raise ValueError(
                "--enable-lora-updates needs a fixed replica count (--num-replicas N): an adapter loaded "
                "while serving goes to every replica, and one started later would not have it; drop "
                "--min-replicas/--max-replicas (adapters given with --lora-modules load on every replica)"
            )
        fan_out = num_replicas or 1
    opts = deployment_options(
        num_replicas=num_replicas,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        num_gpus=num_gpus,
        num_cpus=num_cpus,
        grace_period=settings.grace_seconds,
    )
    engines = (
        serve.deployment(AcbEngine, name="AcbEngine")
        .options(  # type: ignore[attr-defined]
            request_router_config=RequestRouterConfig(
                request_router_class="acb.distributed.ray_serve:PrefixAffinityRouter"  # type: ignore[arg-type]
            ),
            **opts,
        )
        .bind(settings)
    )
    ingress = serve.deployment(AcbIngress, name="AcbIngress").options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096
    )
    return ingress.bind(engines, settings.max_body_bytes, fan_out)


class _Stopped(BaseException):
    """A signal during Serve's start (a BaseException: no ``except Exception`` on the way swallows it)."""


class _StopSignals:
    """The launcher's SIGINT/SIGTERM handlers, in place from the end of ``ray.init`` on.

    Ray's start-up leaves its own handlers behind: its core worker's crash handler on SIGTERM
    prints a stack trace and the process aborts (exit status -6), with no drain, the streams in
    flight cut. Serve's HTTP proxy answers requests before ``serve.run`` returns (``serve.run``
    waits for every replica; one replica up is enough to serve), so ours must be in place before
    Serve starts. While armed (Serve starting), a signal raises :class:`_Stopped` in the main
    thread, as Ctrl-C's ``KeyboardInterrupt`` would: ``serve.run`` may wait forever (a replica
    that cannot be placed). Later signals are only counted: the first starts the drain, a second
    ends its grace period.
    """

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.got = threading.Event()
        self.armed = False

    def install(self) -> None:
        self.armed = True
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def disarm(self) -> None:
        self.armed = False

    def _on_signal(self, sig: int, frame: Any) -> None:
        self.signals.append(sig)
        self.got.set()
        if self.armed:
            self.armed = False
            raise _Stopped


def _app_ingress() -> DeploymentHandle | None:
    """The application's ingress, if Serve got as far as creating it (a signal during the start)."""
    try:
        return serve.get_app_handle(APP_NAME)
    except Exception:  # noqa: BLE001 - no application (yet): nothing to drain
        return None


def _drain(handle: DeploymentHandle, grace_period: float, stop: _StopSignals) -> None:
    """Drain the ingress (:meth:`AcbIngress.drain`); a second signal ends the grace period."""
    from acb.serve.protocol import DRAIN_FLUSH_S

    drained = handle.drain.remote(grace_period)
    deadline = time.monotonic() + grace_period + DRAIN_FLUSH_S + 30.0  # (an ingress that never answers)
    hurried = False
    while True:
        try:
            drained.result(timeout_s=0.2)
            return
        except TimeoutError:
            if len(stop.signals) > 1 and not hurried:  # a second signal ends the grace period at once
                handle.hurry.remote()
                hurried = True
            if time.monotonic() > deadline:
                logger.warning("acb serve: the ingress did not finish draining; stopping anyway")
                return
        except Exception as exc:  # noqa: BLE001 - the ingress is gone: stop the rest anyway
            logger.warning("acb serve: draining the ingress failed: %r", exc)
            return


def run(app: Any, settings: ServerSettings, *, address: str | None = None, replicas: int = 1) -> None:
    """Serve ``app`` (:func:`build_application`) on a new local Ray, or the cluster at
    ``address``, on the settings' host and port until SIGINT/SIGTERM; then drain the ingress
    (the settings' grace period; a second signal ends it at once) and stop Serve and Ray. What
    ``acb serve --ray`` runs.

    A signal from the end of Ray's start on drains the same way, also before the application is
    ready (Serve's proxy may serve requests while a replica still starts, or cannot be placed);
    one during ``ray.init`` itself meets Ray's own handlers.

    A new local Ray is started whatever an earlier ``ray start`` left in Ray's temp folder (its
    ``ray_current_cluster`` file may name a cluster that is gone).

    Args:
        app: the bound application.
        settings: the server settings (host, port, name, grace period, verbosity).
        address: a Ray cluster to join (None: a new local Ray).
        replicas: the replica count the ready line announces.

    Raises:
        RayStartError: Ray or Serve did not start.
    """
    import ray

    t0 = time.perf_counter()
    host, port = settings.host, settings.port
    try:
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=settings.verbose)
    except Exception as exc:  # noqa: BLE001 - reported as what it is: Ray did not start
        raise RayStartError(
            f"Ray did not start{f' at --ray-address {address}' if address else ''}: {type(exc).__name__}: {exc}"
        ) from None
    stop = _StopSignals()
    try:
        handle: DeploymentHandle | None = None
        try:
            try:
                stop.install()  # (Ray's start-up installed its own: see _StopSignals)
                serve.start(http_options={"host": host, "port": port})
                handle = serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
            finally:
                stop.disarm()
        except _Stopped:
            print("acb serve: stopping before the application was ready: draining the ingress", flush=True)
            handle = _app_ingress()
        except Exception as exc:  # noqa: BLE001
            raise RayStartError(f"Ray Serve did not start the application: {type(exc).__name__}: {exc}") from None
        else:
            gcs = ray.get_runtime_context().gcs_address
            print(
                f"acb serve: {settings.served_name!r} ready at http://{host}:{port} (OpenAI API under /v1) on Ray "
                f"Serve (Ray at {gcs}), {replicas} replica(s), started in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
            while not stop.got.wait(0.2):
                pass
            print("acb serve: stopping: draining the ingress", flush=True)
        if handle is not None:
            _drain(handle, settings.grace_seconds, stop)
    finally:
        serve.shutdown()  # stops the replicas (each runs its app's lifespan shutdown)
        ray.shutdown()
