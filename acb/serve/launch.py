"""One way to start a server: :class:`~acb.serve.settings.ServerSettings` (built once, from ``acb
serve``'s flags or in code) and :func:`build_server`, which turns them into a :class:`Server`
(:func:`run`: build it and serve HTTP, in one call).

Every server goes through :func:`build_server`: a plain ``acb serve`` (which then serves HTTP
with uvicorn, :meth:`Server.run`), its ``torchrun`` followers (whose server is following the
leader's steps), and each Ray Serve replica (:mod:`acb.distributed.ray_serve`, which receives the
settings, pickled, and runs the app inside the replica: :meth:`Server.start` and
:meth:`Server.stop` run the app's lifespan there). So each of them configures telemetry (OTLP
export, ``/metrics``), loads the model, builds the engine and the app, and starts and stops them
the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

try:
    import uvicorn
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(f"acb serve needs the serve extra: pip install -e '.[serve]' in acb's checkout ({exc})") from None

from acb import telemetry
from acb.api.async_engine import AsyncEngine
from acb.distributed.tp import follow, is_tp_follower
from acb.serve.app import build_app
from acb.serve.settings import ServerSettings

__all__ = ["Server", "build_server", "run"]


class Server:
    """A server built from :class:`~acb.serve.settings.ServerSettings` (:func:`build_server`): its ``engine``, its
    ``app`` and its ``telemetry``; or, on a tensor-parallel follower rank, what it follows
    (``follower``: true, and no app).

    Run it one of two ways: :meth:`run` serves HTTP on the settings' host and port until
    SIGINT/SIGTERM (``acb serve``); :meth:`start` and :meth:`stop` run the app's lifespan in the
    caller's event loop, for a host that brings its own HTTP front (a Ray Serve replica), which
    then calls the ``app`` as ASGI.
    """

    def __init__(
        self,
        settings: ServerSettings,
        engine: AsyncEngine | None,
        tel: telemetry.Telemetry,
        follower: tuple[Any, Any, Any] | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.telemetry = tel
        self.follower = follower is not None
        self._follow = follower
        self._announce: Callable[[], None] | None = None
        self._ready: asyncio.Event | None = None
        self._lifespan: _Lifespan | None = None
        self.app: Any = None
        if engine is not None:
            self.app = build_app(engine, settings, on_ready=self._on_ready, telemetry=tel)

    def _on_ready(self) -> None:
        if self._announce is not None:
            self._announce()
        if self._ready is not None:
            self._ready.set()

    def run(self) -> None:
        """Serve HTTP on the settings' host and port until SIGINT/SIGTERM; then stop accepting,
        give requests in flight the grace period (the rest end with an OpenAI error) and stop the
        engine. A follower rank runs the leader's steps until the leader stops instead.

        Raises:
            RuntimeError: a tensor-parallel engine died (follower rank).
        """
        if self._follow is not None:
            try:
                follow(*self._follow)
            finally:
                self.telemetry.shutdown()
            return
        s = self.settings

        def announce() -> None:
            print(f"acb serve: {s.served_name!r} ready at http://{s.host}:{s.port} (OpenAI API under /v1)", flush=True)

        self._announce = announce
        _serve_http(self.app, s.host, s.port, s.grace_seconds, self.telemetry)

    async def start(self) -> None:
        """Run the app's lifespan startup in this event loop and wait until the engine runs
        (``/health`` is then 200): what a host with its own HTTP front calls before its first
        request.

        Raises:
            RuntimeError: the app failed to start (its engine did not start), or this is a
                follower rank.
        """
        if self.app is None:
            raise RuntimeError("a tensor-parallel follower rank serves no app")
        self._ready = asyncio.Event()
        self._lifespan = _Lifespan(self.app)
        await self._lifespan.startup()
        ready = asyncio.ensure_future(self._ready.wait())
        await asyncio.wait({ready, self._lifespan.task}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            raise RuntimeError(f"the server stopped while starting: {self._lifespan.failure()}")

    async def stop(self) -> None:
        """Run the app's lifespan shutdown (the engine stops, its render threads end) and export
        what telemetry holds. Safe to call more than once."""
        try:
            if self._lifespan is not None:
                lifespan, self._lifespan = self._lifespan, None
                await lifespan.shutdown()
        finally:
            await asyncio.to_thread(self.telemetry.shutdown)


def build_server(settings: ServerSettings) -> Server:
    """The server ``settings`` describe: telemetry configured (OTLP export when asked for, and
    ``/metrics``), the model and tokenizer loaded, the engine and the app built (the app's
    lifespan starts the engine). Under ``torchrun``, a follower rank gets a server that follows
    the leader's steps.

    Args:
        settings: the server's settings.

    Returns:
        The :class:`Server`, not running yet (:meth:`Server.run` or :meth:`Server.start`).

    Raises:
        ValueError: the model cannot be loaded, or a setting is refused.
    """
    if settings.verbose:
        logging.getLogger("acb").setLevel(logging.INFO)
    settings.model.check()
    device = settings.model.torch_device()
    tel = _configure_telemetry(settings)
    try:
        if settings.model.path is None:
            print(
                "acb serve: no --model: serving the embedded random-weight model (its text is meaningless) as "
                f"{settings.served_name!r}",
                file=sys.stderr,
                flush=True,
            )
        tokenizer = settings.model.load_tokenizer("acb serve")
        model = settings.model.load_model(device)
        if is_tp_follower(model):  # torchrun: rank 0 serves HTTP, the other ranks run its steps
            return Server(settings, None, tel, follower=(model, settings.engine, tokenizer))
        engine = AsyncEngine(model, settings.engine, tokenizer=tokenizer)
        return Server(settings, engine, tel)
    except BaseException:
        tel.shutdown()
        raise


def run(settings: ServerSettings, engine: AsyncEngine | None = None) -> None:
    """Serve HTTP on the settings' host and port until SIGINT/SIGTERM; then stop accepting, give
    requests in flight the grace period (the rest end with an OpenAI error) and stop the engine:
    ``build_server(settings).run()``, or, with ``engine`` (built in code, not started: the app
    starts it), that engine served with the settings' app, telemetry and address (their model and
    engine fields are not read).

    Args:
        settings: the server's settings.
        engine: an engine built in code, instead of the one ``settings`` describe.

    Raises:
        ValueError: the model cannot be loaded, or a setting is refused.
        RuntimeError: a tensor-parallel engine died (follower rank).
    """
    if engine is None:
        build_server(settings).run()
        return
    tel = _configure_telemetry(settings)
    try:
        server = Server(settings, engine, tel)
    except BaseException:
        tel.shutdown()
        raise
    server.run()


def _configure_telemetry(settings: ServerSettings) -> telemetry.Telemetry:
    t = settings.telemetry
    return telemetry.configure(t.otlp_endpoint, t.otlp_protocol, prometheus=True, capture_content=t.capture_content)


def _serve_http(app: Any, host: str, port: int, grace_period: float, tel: telemetry.Telemetry) -> None:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=max(1, round(grace_period)),
        access_log=False,
    )
    try:
        _UvicornServer(config).run()
    finally:
        tel.shutdown()  # export what is left


class _UvicornServer(uvicorn.Server):
    """uvicorn's server, exiting 0 after a signal-driven drain: uvicorn re-raises the signals it
    caught once it has stopped (so the process would die by SIGTERM); acb's drain is the
    intended end of the process."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


class _Lifespan:
    """An ASGI app's lifespan, driven by hand (what uvicorn does for an app it serves)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._to_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._from_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.task: asyncio.Future[Any] = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        async def send(message: MutableMapping[str, Any]) -> None:
            await self._from_app.put(dict(message))

        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        await self.app(scope, self._to_app.get, send)

    def failure(self) -> str:
        """What ended the lifespan early, in words."""
        if not self.task.done():
            return "still running"
        if self.task.cancelled():
            return "cancelled"
        exc = self.task.exception()
        return "it ended" if exc is None else f"{type(exc).__name__}: {exc}"

    async def _step(self, kind: str) -> None:
        await self._to_app.put({"type": f"lifespan.{kind}"})
        got = asyncio.ensure_future(self._from_app.get())
        await asyncio.wait({got, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if not got.done():
            got.cancel()
            raise RuntimeError(f"the app's lifespan {kind} failed: {self.failure()}")
        message = got.result()
        if message["type"] != f"lifespan.{kind}.complete":
            raise RuntimeError(f"the app's lifespan {kind} failed: {message.get('message') or message['type']}")

    async def startup(self) -> None:
        await self._step("startup")

    async def shutdown(self) -> None:
        await self._step("shutdown")
        await self.task
