"""The routes of ``acb serve --enable-weight-updates``: a trainer elsewhere drives the server as
its rollout engine (pause, sleep, weights from disk or broadcast over ``torch.distributed``).

Off unless the server runs with ``--enable-weight-updates``, and behind ``--api-key`` when one is
set. Route and field names follow vLLM's where it has one (SGLang's for the update from disk):

- ``POST /pause`` (``mode``: ``wait`` | ``keep`` | ``abort``, as a query parameter or a JSON
  field; ``abort`` cancels the running requests), ``POST /resume``, ``GET /is_paused``
  (``{"paused": true|false}``), ``POST /sleep``, ``POST /wake_up``;
- ``GET /get_world_size`` (``{"world_size": ...}``): the ranks this server takes in a trainer's
  group (1; ``acb serve --ray``'s ingress sends each route to every replica and answers the
  sum, its replica count: :class:`acb.serve.ingress.FanOut`);
- ``POST /update_weights_from_disk`` (``{"model_path": ..., "weight_version": ...}``): a
  safetensors checkpoint on the server's disk (:meth:`acb.AsyncEngine.load_weights`);
- a distributed update in three calls (:mod:`acb.weight_transfer`): ``POST
  /init_weight_transfer`` (``master_address``, ``master_port``, ``world_size``,
  ``rank_offset``: the server joins the trainer's group, gloo on CPU, NCCL on CUDA), ``POST
  /update_weights`` (``names``, ``dtype_names``, ``shapes``, ``weight_version``,
  ``bucket_bytes``, ``seq``: the trainer broadcasts the tensors, bucketed), ``POST
  /close_weight_transfer``.

Each answers ``{"weight_version": ...}`` where it changes it. A refused update is a 400 naming
what was wrong, and the old weights serve. A broadcast that fails half-way (the trainer gone)
is a 503, and the old weights serve; the group is closed and a new ``/init_weight_transfer`` is
accepted. The routes are clients of the public engine API, as the rest of ``serve/`` is; the
blocking parts (joining the group, receiving, staging) run in worker threads.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from acb.errors import WeightUpdateError
from acb.serve.pipeline import authorize
from acb.serve.protocol import APIError

if TYPE_CHECKING:
    from acb.serve.pipeline import ServerState
    from acb.weight_transfer import TransferGroup

_MODES = {"wait": "wait", "keep": "keep", "abort": "cancel", "cancel": "cancel"}


class _Transfer:
    """The server's side of a trainer's group (one at a time)."""

    def __init__(self) -> None:
        self.group: TransferGroup | None = None
        self.lock = threading.Lock()  # one update (or join, or close) at a time

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        import json

        body = json.loads(raw)
    except ValueError:
        raise APIError(400, "the body must be JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], *, required: bool = True) -> Any:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise APIError(400, f"{name} must be given as a {getattr(kind, '__name__', kind)}", param=name)
    return value


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Add the weight-update routes to ``app`` (``build_app`` does, with
    ``enable_weight_updates``)."""
    engine = state.engine
    transfer = _Transfer()
    state.on_stop.append(transfer.close)

    @app.post("/pause")
    async def pause(request: Request) -> Response:
        authorize(state, request)
        body = await _json(request)
        mode = request.query_params.get("mode") or body.get("mode") or "wait"
        if mode not in _MODES:
            raise APIError(400, f"mode must be one of wait, keep, abort; got {mode!r}", param="mode")
        await engine.pause(_MODES[mode])
        return JSONResponse({"paused": True})

    @app.post("/resume")
    async def resume(request: Request) -> Response:
        authorize(state, request)
        await engine.resume()
        return JSONResponse({"paused": engine.is_paused})

    @app.get("/is_paused")
    async def is_paused(request: Request) -> Response:
        authorize(state, request)
        return JSONResponse({"paused": engine.is_paused})

    @app.get("/get_world_size")
    async def world_size(request: Request) -> Response:
        authorize(state, request)
        return JSONResponse({"world_size": 1})

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        authorize(state, request)
        freed = await engine.sleep()
        return JSONResponse({"sleeping": True, "freed_bytes": int(getattr(freed, "total", 0) or 0)})

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        authorize(state, request)
        await engine.wake_up()
        return JSONResponse({"sleeping": False})

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request) -> Response:
        authorize(state, request)
        body = await _json(request)
        path = _field(body, "model_path", str)
        try:
            version = await engine.load_weights(path, version=body.get("weight_version"))
        except WeightUpdateError as exc:
            raise APIError(400, str(exc), param="model_path") from None
        return JSONResponse({"success": True, "weight_version": version})

    @app.post("/init_weight_transfer")
    async def init_transfer(request: Request) -> Response:
        authorize(state, request)
        body = await _json(request)
        address = _field(body, "master_address", str)
        port = _field(body, "master_port", int)
        world = _field(body, "world_size", int)
        rank = _field(body, "rank_offset", int)
        timeout = float(_field(body, "timeout_s", (int, float), required=False) or 120.0)
        if not 0 < rank < world:
            raise APIError(
                400, f"rank_offset must be in [1, world_size): the trainer is rank 0; got {rank}", param="rank_offset"
            )

        def join() -> None:
            from acb.weight_transfer import TransferGroup

            with transfer.lock:
                transfer.close()  # (a new trainer, or the same one after a failure)
                device = next(engine.model.parameters()).device
                transfer.group = TransferGroup.join(address, port, world, rank, device=device, timeout_s=timeout)

        try:
            await anyio.to_thread.run_sync(join)
        except (RuntimeError, OSError, ValueError) as exc:
            raise APIError(503, f"joining the trainer's group failed: {type(exc).__name__}: {exc}") from None
        return JSONResponse({"success": True, "rank": rank, "world_size": world})

    @app.post("/update_weights")
    async def update(request: Request) -> Response:
        authorize(state, request)
        body = await _json(request)
        names = _field(body, "names", list)
        dtype_names = _field(body, "dtype_names", list)
        shapes = _field(body, "shapes", list)
        seq = _field(body, "seq", int)
        bucket_bytes = _field(body, "bucket_bytes", int, required=False) or (256 << 20)
        if bucket_bytes < 1:
            raise APIError(400, f"bucket_bytes must be >= 1, got {bucket_bytes}", param="bucket_bytes")
        version = body.get("weight_version")
        if not len(names) == len(dtype_names) == len(shapes):
            raise APIError(400, "names, dtype_names and shapes must have one entry per tensor", param="names")

        def receive() -> Any:
            """Check, answer the handshake, receive, stage (a worker thread); the staged update."""
            from acb.runner.weight_update import check_specs, weight_targets
            from acb.weight_transfer import dtype_of

            with transfer.lock:
                group = transfer.group
                if group is None:
                    raise APIError(409, "no weight transfer group: call /init_weight_transfer first")
                error = None
                try:
                    dtypes = [dtype_of(d) for d in dtype_names]
                    check_specs(weight_targets(engine.model), zip(names, [tuple(s) for s in shapes], dtypes))
                except (WeightUpdateError, ValueError, TypeError) as exc:
                    error = str(exc)
                group.verdict(seq, error)
                if error is not None:
                    raise APIError(400, error, param="names")
                if not group.decision(seq):
                    raise APIError(
                        409, "the trainer called the update off (another server refused it); nothing written"
                    )
                try:
                    tensors = list(group.receive([tuple(s) for s in shapes], dtypes, bucket_bytes))
                except Exception as exc:  # noqa: BLE001 - the sender died, or the group broke
                    transfer.close()
                    raise APIError(
                        503,
                        f"receiving the weights failed ({type(exc).__name__}: {exc}); nothing written, the old "
                        "weights serve; call /init_weight_transfer again",
                    ) from None
                return engine.stage_weights(zip(names, tensors))

        staged = await anyio.to_thread.run_sync(receive)
        new = await engine.swap_weights(staged, version)
        return JSONResponse({"success": True, "weight_version": new})

    @app.post("/close_weight_transfer")
    async def close_transfer(request: Request) -> Response:
        authorize(state, request)

        def close() -> None:
            with transfer.lock:
                transfer.close()

        await anyio.to_thread.run_sync(close)
        return JSONResponse({"success": True})
