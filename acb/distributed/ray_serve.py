"""Online scale-out on Ray Serve (extra ``ray``): ``acb serve --ray --num-replicas N``, or a
Ray Serve config file for ``serve run`` / ``serve deploy``.

Each replica is one :class:`acb.AsyncEngine` (one GPU each on CUDA: ``num_gpus=1``) serving
acb serve's own FastAPI app (:func:`acb.serve.app.build_app`: one implementation of the OpenAI
protocol, not two), built inside the replica (``__serve_build_asgi_app__``) around its engine.
Ray Serve's HTTP proxy routes the requests (least outstanding requests among two random
replicas: its default router, which reads each replica's queue), streams SSE chunk by chunk,
health-checks the replicas (:meth:`AcbReplica.check_health`: a dead engine fails it, and Serve
replaces the replica), scales between ``min_replicas`` and ``max_replicas`` on ongoing
requests, and drains a replica (its app's lifespan stops its engine) when it goes away.

Every ``acb serve`` flag reaches every replica: the replica parses the same command line as
plain ``acb serve`` (``argv``), so engine flags, the served name, the parsers and the chat
template options mean the same thing here. Each response carries ``x-acb-replica``: the replica
that served it.

Not here yet: prefix-affinity routing. Ray Serve's HTTP proxy routes before reading a body (its
request routers see the path and headers only), so a prompt's prefix cannot steer an HTTP
request; that takes a two-tier design (an ingress deployment that reads the body and calls the
engine replicas by handle with a prefix key) — see the README's scale-out section.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from typing import Any

try:
    from ray import serve
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(f"acb's Ray Serve application needs Ray Serve: pip install 'acb-batching[ray]' ({exc})") from None

__all__ = ["AcbReplica", "build_application", "deployment_options", "run"]

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


@serve.ingress()
class AcbReplica:
    """One engine and acb serve's app around it (a Ray Serve deployment class; see the module
    docstring). ``argv``: ``acb serve``'s flags (``--model PATH --num-blocks 256 ...``)."""

    def __init__(self, argv: Sequence[str]) -> None:
        import acb
        from acb.cli.common import _check_device, _engine_config, _load_model, _load_tokenizer, _model_name

        args = _namespace(argv)
        self.args = args
        device = _check_device(args.device)
        cfg = _engine_config(args, max_queue_size=args.max_queue_size, seed=args.seed)
        self.model_name = _model_name(args)
        self.engine = acb.AsyncEngine(_load_model(args, device), cfg, tokenizer=_load_tokenizer(args))
        self.engine.start()  # here, so that the replica is ready (and healthy) once it is built
        rid = getattr(serve.get_replica_context(), "replica_id", None)
        self.replica_id = str(getattr(rid, "unique_id", None) or rid or "replica")

    def __serve_build_asgi_app__(self) -> Any:
        import os

        from acb.serve.app import build_app

        args = self.args
        app = build_app(self.engine, self.model_name,
                        api_key=args.api_key if args.api_key is not None else os.environ.get("ACB_API_KEY"),
                        max_body_bytes=args.max_body_bytes, trust_request_chat_template=args.trust_request_chat_template,
                        max_prompts_per_request=args.max_prompts_per_request, grace_period=args.grace_period,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
        replica = self.replica_id

        @app.middleware("http")
        async def tag(request: Any, call_next: Any) -> Any:  # which replica served it (clients, tests)
            response = await call_next(request)
            response.headers["x-acb-replica"] = replica
            return response

        return app

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine died is replaced."""
        core = self.engine.core
        if core is not None and core.dead_error is not None:
            raise RuntimeError(f"the engine died: {core.dead_error!r}")
        if not self.engine.is_running:
            raise RuntimeError("the engine is not running")


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
    deployment = serve.deployment(AcbReplica, name="AcbReplica")
    return deployment.options(**opts).bind(argv)  # type: ignore[attr-defined]  # (serve.deployment's overloads)


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
