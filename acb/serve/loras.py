"""LoRA adapters in ``acb serve``: each loaded adapter is a model of its own name, whose requests
run the served model with that adapter (the engine's :mod:`acb.api.loras`; the request's ``model``
selects it in :func:`acb.serve.pipeline.parse`, and ``GET /v1/models`` lists it with ``parent`` =
the served name).

- ``--lora-modules name=PATH ...`` (``ServerSettings.lora_modules``) are loaded once the engine
  starts, before ``/health`` says ready (:func:`load_modules`); one that does not load stops the
  server's start.
- ``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and ``POST
  /v1/unload_lora_adapter`` (``{"lora_name"}``): vLLM's routes, names and bodies; answered with
  vLLM's text on success. They read a folder on the server's disk, so they are refused (404,
  saying why) unless the server runs with ``--enable-lora-updates``, and sit behind the API key.
  An adapter in use by a live request is not unloaded (400); an unknown name is a 404.
"""

from __future__ import annotations

from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from acb.errors import EngineDeadError, EngineNotRunningError
from acb.serve import routes
from acb.serve.pipeline import ServerState, authorize, check_ready, validated
from acb.serve.protocol import APIError, read_body

__all__ = ["LoadLoraAdapterRequest", "UnloadLoraAdapterRequest", "add_routes", "load_modules"]

M = TypeVar("M", bound=BaseModel)


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body of ``/v1/load_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of that name; acb refuses a loaded name


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's body of ``/v1/unload_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; acb finds the adapter by its name


async def load_modules(state: ServerState) -> None:
    """Load ``settings.lora_modules`` into the started engine (the server is not ready before).

    Raises:
        RuntimeError: an adapter did not load (named, with why), or one is named as the served model.
    """
    for name, path in state.settings.lora_modules:
        if name == state.model_name:
            raise RuntimeError(f"--lora-modules {name}={path}: {name!r} is the served model's own name")
        try:
            await state.engine.add_lora(name, path)
        except ValueError as exc:
            raise RuntimeError(f"--lora-modules {name}={path}: {exc}") from None


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Serve the two routes on ``app`` (refused without ``settings.enable_lora_updates``)."""

    @routes.add(app, routes.LOAD_LORA_ADAPTER)
    async def load_lora_adapter(request: Request) -> Response:
        body = await _body(state, request, LoadLoraAdapterRequest)
        if body.lora_name == state.model_name:
            raise APIError(400, f"{body.lora_name!r} is the served model's own name", param="lora_name")
        if body.load_inplace:
            raise APIError(
                400,
                "load_inplace is not supported: unload the adapter, then load it again",
                param="load_inplace",
            )
        try:
            await state.engine.add_lora(body.lora_name, body.lora_path)
        except (EngineDeadError, EngineNotRunningError) as exc:
            raise APIError(503, str(exc), type="server_error") from None
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @routes.add(app, routes.UNLOAD_LORA_ADAPTER)
    async def unload_lora_adapter(request: Request) -> Response:
        body = await _body(state, request, UnloadLoraAdapterRequest)
        if all(info.name != body.lora_name for info in state.engine.list_loras()):
            raise APIError(
                404, f"the LoRA adapter {body.lora_name!r} cannot be found", param="lora_name", code="not_found"
            )
        try:
            await state.engine.remove_lora(body.lora_name)
        except (EngineDeadError, EngineNotRunningError) as exc:
            raise APIError(503, str(exc), type="server_error") from None
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _body(state: ServerState, request: Request, schema: type[M]) -> M:
    """A LoRA route's body: authorized, the routes enabled, the engine ready, the body valid."""
    authorize(state, request)
    if not state.settings.enable_lora_updates:
        raise APIError(
            404,
            f"{request.url.path}: loading and unloading LoRA adapters is off on this server "
            "(start acb serve with --enable-lora-updates)",
            code="not_found",
        )
    check_ready(state)
    return validated(await read_body(request, state.settings.max_body_bytes), schema)
