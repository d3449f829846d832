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
  ``rank_offset``, optional ``timeout_s`` and ``group_id``: the server leaves any group it was
  in and joins the trainer's, gloo on CPU, NCCL on CUDA; it answers the ``group_id``), ``POST
  /update_weights`` (``group_id``, ``names``, ``dtype_names``, ``shapes``, ``weight_version``,
  ``bucket_bytes``, ``seq``, optional ``tied``: ``{name: name sent}`` for a tied weight whose bytes
  are sent once, and ``lora_name`` to update a loaded LoRA adapter's tensors only: the
  names are PEFT's keys, as ``get_peft_model_state_dict`` gives them, checked against that adapter's
  modules and shapes, :meth:`acb.AsyncEngine.update_lora`; the trainer broadcasts the tensors,
  bucketed: the server receives each bucket straight into its group's receive buffers, reused by
  a later update, and the staged update is views of them; it keeps generating meanwhile, and
  swaps the update in between two engine steps: on CPU, where every tensor came in the weight's
  dtype, by rebinding the weights to those views (no copy; the next update is received into the
  group's other set of buffers), else by one copy into the weights; the answer's ``swap`` says
  which, ``"rebind"`` or ``"copy"``), ``POST
  /close_weight_transfer`` (with a ``group_id``: only if that is still the server's group).

Each answers ``{"weight_version": ...}`` where it changes it. A refused update is a 400 naming
what was wrong, and the old weights serve. An update for a group the server is not in (it left
it for another trainer's, or closed it after a failure) is a 409, and nothing is written. A
broadcast that fails half-way (the trainer gone, or stalled past the group's timeout) is a 503,
and the old weights serve; the group is closed and a new ``/init_weight_transfer`` is accepted.

The server connects only to the trainer addresses its operator allowed (``--weight-transfer-hosts``,
:func:`resolve_trainer`: loopback by default); anything else is a 403 before any connection. The
routes replace the served weights: behind ``--api-key`` when the port is reachable by others.
The routes are clients of the public engine API, as the rest of ``serve/`` is; the blocking parts
(joining the group, receiving, staging) run in worker threads.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from acb.errors import WeightUpdateError
from acb.serve import routes
from acb.serve.pipeline import authorize
from acb.serve.protocol import APIError
from acb.weight_transfer import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    LOOPBACK_HOSTS,
    MAX_TIMEOUT_S,
    MAX_WORLD_SIZE,
    TransferGroup,
    check_group_id,
    dtype_of,
)

if TYPE_CHECKING:
    from acb.serve.pipeline import ServerState

logger = logging.getLogger(__name__)

_MODES = {"wait": "wait", "keep": "keep", "abort": "cancel", "cancel": "cancel"}


def resolve_trainer(address: str, port: int, allowed: Sequence[str]) -> str:
    """The IP address to reach the trainer at ``address`` through, if the operator allows it.

    Args:
        address: the trainer's ``master_address`` (a host name or an IP address).
        port: its ``master_port``.
        allowed: the operator's ``--weight-transfer-hosts``: IP addresses, networks
            (``10.0.0.0/8``), host names (allowing the addresses they resolve to), or ``*``
            (anywhere).

    Returns:
        The address to connect to: one ``address`` resolved to, checked (so that a second
        lookup cannot lead elsewhere), or ``address`` itself when anything is allowed.

    Raises:
        APIError: 400 when ``address`` does not resolve; 403 when an address it resolves to is
            not allowed.
    """
    if "*" in allowed:
        return address
    try:
        found = [str(info[4][0]) for info in socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)]
    except (OSError, UnicodeError) as exc:
        raise APIError(400, f"master_address {address!r} does not resolve: {exc}", param="master_address") from None
    networks, names = [], []
    for entry in allowed:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            names.append(entry)
    for name in names:  # a host name allows what it resolves to now
        try:
            networks += [
                ipaddress.ip_network(str(i[4][0])) for i in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            ]
        except (OSError, UnicodeError, ValueError):
            continue

    def ip(a: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        got = ipaddress.ip_address(a.split("%")[0])  # (a scoped IPv6 address: its scope dropped)
        mapped = getattr(got, "ipv4_mapped", None)
        return mapped if mapped is not None else got

    refused = [a for a in found if not any(ip(a) in n for n in networks)]
    if refused or not found:
        raise APIError(
            403,
            f"this server does not connect to master_address {address!r} ({', '.join(refused or found)}): it is "
            f"not among its --weight-transfer-hosts ({' '.join(allowed) or 'none'}; loopback by default); "
            "its operator can allow it with --weight-transfer-hosts",
            param="master_address",
        )
    return found[0]


class _Transfer:
    """The server's side of a trainer's group (one at a time)."""

    def __init__(self) -> None:
        self.group: TransferGroup | None = None
        self.lock = threading.Lock()  # one update (or join, or close) at a time
        self.timeout_s = DEFAULT_TIMEOUT_S  # the group's: also how long an adapter's swap waits

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


def add_routes(app: FastAPI, state: ServerState, allowed_hosts: Sequence[str] = LOOPBACK_HOSTS) -> None:
    """Add the weight-update routes to ``app`` (``build_app`` does, with
    ``enable_weight_updates``). ``allowed_hosts``: where ``/init_weight_transfer`` may make the
    server connect (:func:`resolve_trainer`)."""
    engine = state.engine
    transfer = _Transfer()
    state.on_stop.append(transfer.close)

    @routes.add(app, routes.PAUSE)
    async def pause(request: Request) -> Response:
        authorize(state, request)
        body = await _json(request)
        mode = request.query_params.get("mode") or body.get("mode") or "wait"
        if mode not in _MODES:
            raise APIError(400, f"mode must be one of wait, keep, abort; got {mode!r}", param="mode")
        await engine.pause(_MODES[mode])
        return JSONResponse({"paused": True})

    @routes.add(app, routes.RESUME)
    async def resume(request: Request) -> Response:
        authorize(state, request)
        await engine.resume()
        return JSONResponse({"paused": engine.is_paused})

    @routes.add(app, routes.IS_PAUSED)
    async def is_paused(request: Request) -> Response:
        authorize(state, request)
        return JSONResponse({"paused": engine.is_paused})

    @routes.add(app, routes.GET_WORLD_SIZE)
    async def world_size(request: Request) -> Response:
        authorize(state, request)
        return JSONResponse({"world_size": 1})

    @routes.add(app, routes.SLEEP)
    async def sleep(request: Request) -> Response:
        authorize(state, request)
        freed = await engine.sleep()
        return JSONResponse({"sleeping": True, "freed_bytes": int(getattr(freed, "total", 0) or 0)})

    @routes.add(app, routes.WAKE_UP)
    async def wake_up(request: Request) -> Response:
        authorize(state, request)
        await engine.wake_up()
        return JSONResponse({"sleeping": False})

    @routes.add(app, routes.UPDATE_WEIGHTS_FROM_DISK)
    async def update_from_disk(request: Request) -> Response:
        authorize(state, request)
        body = await _json(request)
        path = _field(body, "model_path", str)
        try:
            version = await engine.load_weights(path, version=body.get("weight_version"))
        except WeightUpdateError as exc:
            raise APIError(400, str(exc), param="model_path") from None
        return JSONResponse({"success": True, "weight_version": version})

    @routes.add(app, routes.INIT_WEIGHT_TRANSFER)
    async def init_transfer(request: Request) -> Response:
        authorize(state, request)
        body = await _json(request)
        address = _field(body, "master_address", str)
        port = _field(body, "master_port", int)
        world = _field(body, "world_size", int)
        rank = _field(body, "rank_offset", int)
        timeout = _field(body, "timeout_s", (int, float), required=False)
        timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
        group_id = _field(body, "group_id", str, required=False) or secrets.token_hex(8)
        if not address or len(address) > 253:
            raise APIError(400, "master_address must be a host name or an IP address", param="master_address")
        if not 0 < port < 65536:
            raise APIError(400, f"master_port must be in [1, 65535], got {port}", param="master_port")
        if not 2 <= world <= MAX_WORLD_SIZE:
            raise APIError(
                400,
                f"world_size must be in [2, {MAX_WORLD_SIZE}] (the trainer and its servers), got {world}",
                param="world_size",
            )
        if not 0 < rank < world:
            raise APIError(
                400, f"rank_offset must be in [1, world_size): the trainer is rank 0; got {rank}", param="rank_offset"
            )
        if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT_S):
            raise APIError(
                400, f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout}", param="timeout_s"
            )
        try:
            check_group_id(group_id)
        except ValueError as exc:
            raise APIError(400, str(exc), param="group_id") from None

        def join() -> None:
            # (before the lock: a refused call leaves the current trainer's group alone)
            target = resolve_trainer(address, port, allowed_hosts)
            with transfer.lock:
                transfer.close()  # (a new trainer, or the same one after a failure)
                device = next(engine.model.parameters()).device
                transfer.group = TransferGroup.join(
                    target, port, world, rank, group_id=group_id, device=device, timeout_s=timeout
                )
                transfer.timeout_s = timeout

        try:
            await anyio.to_thread.run_sync(join)
        except (RuntimeError, OSError, ValueError, TypeError, OverflowError) as exc:
            raise APIError(503, f"joining the trainer's group failed: {type(exc).__name__}: {exc}") from None
        return JSONResponse({"success": True, "rank": rank, "world_size": world, "group_id": group_id})

    @routes.add(app, routes.UPDATE_WEIGHTS)
    async def update(request: Request) -> Response:
        authorize(state, request)
        body = await _json(request)
        names = _field(body, "names", list)
        dtype_names = _field(body, "dtype_names", list)
        shapes = _field(body, "shapes", list)
        seq = _field(body, "seq", int)
        bucket_bytes = _field(body, "bucket_bytes", int, required=False) or DEFAULT_BUCKET_BYTES
        if bucket_bytes < 1:
            raise APIError(400, f"bucket_bytes must be >= 1, got {bucket_bytes}", param="bucket_bytes")
        version = body.get("weight_version")
        if not len(names) == len(dtype_names) == len(shapes):
            raise APIError(400, "names, dtype_names and shapes must have one entry per tensor", param="names")
        for field, items in (("names", names), ("dtype_names", dtype_names)):
            if not all(isinstance(x, str) for x in items):
                raise APIError(400, f"{field} must be a list of strings", param=field)
        if not all(
            isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)
            for s in shapes
        ):
            raise APIError(400, "shapes must be a list of lists of sizes (integers >= 0)", param="shapes")
        group_id = _field(body, "group_id", str)  # (the group the trainer pushes on: /init_weight_transfer's)
        tied = _field(body, "tied", dict, required=False) or {}  # {another name: the name sent}: one tensor
        index = {n: i for i, n in enumerate(names)}
        if not all(isinstance(k, str) and v in index for k, v in tied.items()):
            raise APIError(400, "tied must map names to names among the update's names", param="tied")
        lora_name = _field(body, "lora_name", str, required=False)  # (an adapter's tensors only)

        def receive() -> Any:
            """Check, answer the handshake, receive, stage and swap in (a worker thread): the version
            now served; for an adapter, its staged update."""
            from acb.runner.weight_update import Borrowed, check_specs, check_version, storage_ptrs, weight_targets

            with transfer.lock:
                group = transfer.group
                if group is None:
                    raise APIError(
                        409,
                        f"no weight transfer group (group {group_id} is not this server's): call "
                        "/init_weight_transfer first; nothing written",
                    )
                if group.group_id != group_id:
                    raise APIError(
                        409,
                        f"this server left group {group_id}: another trainer joined it to group {group.group_id} "
                        "with /init_weight_transfer since; nothing written, its weights are not this update's. "
                        "Call /init_weight_transfer again to take the server back",
                    )
                error = None
                try:
                    check_version(version)  # (one no output could carry: refused before any byte moves)
                    dtypes = [dtype_of(d) for d in dtype_names]
                    specs = list(zip(names, [tuple(s) for s in shapes], dtypes))
                    specs += [(k, specs[index[v]][1], specs[index[v]][2]) for k, v in tied.items()]
                    if lora_name is not None:
                        engine.loras.check_update(lora_name, specs)
                    else:
                        check_specs(weight_targets(engine.model), specs)
                except (WeightUpdateError, ValueError, TypeError) as exc:
                    error = str(exc)
                try:
                    group.verdict(seq, error)
                    go = error is None and group.decision(seq)
                except Exception as exc:  # noqa: BLE001 - the trainer's store gone, or its decision late
                    transfer.close()
                    raise APIError(
                        503,
                        f"the trainer did not answer the handshake ({type(exc).__name__}: {exc}); nothing written, "
                        "the old weights serve; call /init_weight_transfer again",
                    ) from None
                if error is not None:
                    raise APIError(400, error, param="names")
                if not go:
                    raise APIError(
                        409, "the trainer called the update off (another server refused it); nothing written"
                    )
                t0 = time.perf_counter()
                try:
                    # (never into the buffers an earlier update's weights were rebound to)
                    busy = storage_ptrs(engine.model)
                    tensors = list(group.receive([tuple(s) for s in shapes], dtypes, bucket_bytes, busy=busy))
                except Exception as exc:  # noqa: BLE001 - the sender died, or the group broke
                    transfer.close()
                    raise APIError(
                        503,
                        f"receiving the weights failed ({type(exc).__name__}: {exc}); nothing written, the old "
                        "weights serve; call /init_weight_transfer again",
                    ) from None
                received = time.perf_counter() - t0
                if lora_name is not None:  # (checked whole against the loaded adapter)
                    # copied off the group's buffers, which the next update reuses (the adapter
                    # may keep a tensor as it is when its dtype is the adapter's)
                    owned = [t.clone() for t in tensors]
                    return engine.loras.prepare_update(
                        lora_name,
                        list(zip(names, owned)) + [(k, owned[index[v]]) for k, v in tied.items()],
                        engine.model,
                        engine.config,
                    )
                # the tensors are views of the group's receive buffers, which a later update
                # reuses: staged as they are (no copy), and swapped in before the lock is let go
                # (on CPU the weights are rebound to them where they fit: no copy at all; the
                # group then receives the next update into its other set)
                pairs = list(zip(names, tensors)) + [(k, tensors[index[v]]) for k, v in tied.items()]
                staged = engine.stage_weights(Borrowed(pairs))
                t1 = time.perf_counter()
                new = anyio.from_thread.run(engine.swap_weights, staged, version)
                logger.info(
                    "weights %r: %.1f MB received in %.3f s (%.2f GB/s), staged in %.3f s, %s in %.3f s",
                    new,
                    staged.nbytes / 1e6,
                    received,
                    staged.nbytes / 1e9 / max(received, 1e-9),
                    t1 - t0 - received,
                    "rebound" if staged.rebind else "copied",
                    time.perf_counter() - t1,
                )
                return new, "rebind" if staged.rebind else "copy"

        # (receive, stage and swap run in a worker thread: the engine keeps generating meanwhile,
        # and pauses only for the swap itself, between two of its steps)
        done = await anyio.to_thread.run_sync(receive)
        if lora_name is None:  # (swap: how the weights took it, "rebind" (no copy) or "copy")
            return JSONResponse({"success": True, "weight_version": done[0], "swap": done[1]})
        try:
            new = await engine.update_lora(lora_name, done, version=version, timeout=transfer.timeout_s)
        except TimeoutError as exc:
            raise APIError(503, str(exc)) from None
        except ValueError as exc:  # (removed or updated meanwhile: InvalidRequestError)
            raise APIError(409, f"{exc}; nothing written", param="lora_name") from None
        return JSONResponse({"success": True, "weight_version": new, "lora_name": lora_name})

    @routes.add(app, routes.CLOSE_WEIGHT_TRANSFER)
    async def close_transfer(request: Request) -> Response:
        authorize(state, request)
        body = await _json(request)
        group_id = _field(body, "group_id", str, required=False)

        def close() -> bool:
            with transfer.lock:
                if transfer.group is None or group_id is not None and transfer.group.group_id != group_id:
                    return False  # (a trainer leaving a group the server already left: another's stays)
                transfer.close()
                return True

        closed = await anyio.to_thread.run_sync(close)
        return JSONResponse({"success": True, "closed": closed})
