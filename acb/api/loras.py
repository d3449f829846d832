"""The engine's LoRA adapters by name: :class:`Loras` (``engine.loras``), the API's registry.

An adapter is loaded on the caller's thread (:func:`acb.lora.load_adapter`: a PEFT folder or a
``PeftModel``'s adapter, checked against the model and ``max_lora_rank``), given a free slot
(``1..max_loras``; slot 0 is the base model), and installed in the runner's stacked buffers on the
engine thread between two steps (``runner.add_lora(slot, adapter)`` through ``engine.call``).
From then on a submit names it (``lora="name"``): the input processor resolves the name
(:meth:`Loras.resolve`: an unknown one is an :class:`~acb.errors.InvalidRequestError` with field
``lora``) into the request's ``lora_slot`` and appends the adapter's content hash to its prefix-cache
salt, so that no cached block is shared across adapters, or with the base model; the submit
(:meth:`acb.api.submissions.Submissions.open`) records which request ids use it
(:meth:`Loras.attach`).

An adapter in use is never taken away: :meth:`Loras.remove` refuses while a live request (one
whose ids are still claimed in ``engine.ids``: queued at the gate, in the inbox, running, parked
by a pause) was submitted with it, and a submit that resolved an adapter removed before its ids
were claimed is refused at :meth:`Loras.attach`. Both happen under one lock, so a slot is never
freed (and given to another adapter) under a request that reads it. A name already loaded is
refused by :meth:`Loras.add` (remove it first): a request's adapter never changes under it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from acb.errors import InvalidRequestError, InvalidRequestTypeError
from acb.lora import load_adapter

if TYPE_CHECKING:
    from concurrent.futures import Future

    from acb.api.ids import RequestIds
    from acb.config import ResolvedConfig
    from acb.core.engine_core import EngineCore

__all__ = ["LoraInfo", "Loras", "lora_salt"]

EngineCall = Callable[[Callable[["EngineCore"], Any]], "Future[Any]"]  # engine.call

_PRUNE_AT = 4096  # request ids recorded before the ended ones are forgotten


@dataclass(frozen=True, eq=False)
class LoraInfo:
    """One loaded adapter (what :meth:`Loras.list` returns; the registry's entry)."""

    name: str
    slot: int  # its place in the runner's stacked buffers (1..max_loras)
    rank: int  # its r
    uid: bytes  # the content hash of its config and tensors (salts the prefix cache)
    nbytes: int  # its tensors' bytes
    source: str  # the folder it was read from, or ``"PeftModel"``


def lora_salt(cache_salt: str | None, lora: LoraInfo | None) -> str | None:
    """The prefix-cache salt of a request: the caller's salt, with its adapter's content hash
    appended (no block is shared across adapters, nor between an adapter and the base model).

    Args:
        cache_salt: the caller's salt, if any.
        lora: the request's adapter, if any.
    """
    if lora is None:
        return cache_salt or None
    return f"{cache_salt or ''}\x00lora:{lora.uid.hex()}"


class Loras:
    """The adapters an engine holds, by name (see the module docstring).

    It holds names and slots only (the input processor reads it, and reaches no engine through it);
    :meth:`add` and :meth:`remove` are given what they need of the engine.

    Args:
        ids: the engine's live request ids (who may still read an adapter's slot).
    """

    def __init__(self, ids: RequestIds) -> None:
        self._ids = ids
        self._lock = threading.Lock()
        self._by_name: dict[str, LoraInfo] = {}
        self._reserved: dict[str, int] = {}  # names being added -> their slot, until installed
        self._user_of: dict[str, LoraInfo] = {}  # request id -> the adapter it was submitted with

    # ------------------------------------------------------------ submits
    def resolve(self, name: Any) -> LoraInfo | None:
        """The adapter a submit names (None: the base model).

        Raises:
            InvalidRequestTypeError: not a str.
            InvalidRequestError: no adapter of that name is loaded.
        """
        if name is None:
            return None
        if not isinstance(name, str):
            raise InvalidRequestTypeError(
                f"lora must be an adapter's name (a str) or None, got {type(name).__name__}", "lora"
            )
        info = self._by_name.get(name)
        if info is None:
            loaded = ", ".join(sorted(self._by_name)) or "none"
            raise InvalidRequestError(
                f"no LoRA adapter named {name!r} is loaded (loaded: {loaded}); add it with engine.add_lora", "lora"
            )
        return info

    def attach(self, info: LoraInfo | None, request_ids: Sequence[str]) -> None:
        """Record that a submit's ids (claimed just now) use ``info``; refuse it if the adapter
        was removed since the submit resolved it.

        Raises:
            InvalidRequestError: the adapter was removed (field ``lora``).
        """
        if info is None and not self._user_of:
            return
        with self._lock:
            if info is None:  # an id reused without an adapter: forget what it used before
                for rid in request_ids:
                    self._user_of.pop(rid, None)
                return
            if self._by_name.get(info.name) is not info:
                raise InvalidRequestError(
                    f"the LoRA adapter {info.name!r} was removed while this request was submitted", "lora"
                )
            if len(self._user_of) >= _PRUNE_AT:
                self._forget_ended()
            for rid in request_ids:
                self._user_of[rid] = info

    def _forget_ended(self) -> None:
        live = self._ids.live
        self._user_of = {rid: info for rid, info in self._user_of.items() if rid in live}

    # ------------------------------------------------------------ adapters
    def list(self) -> list[LoraInfo]:
        """The loaded adapters, by slot."""
        with self._lock:
            return sorted(self._by_name.values(), key=lambda i: i.slot)

    def add(
        self, name: str, source: Any, model: Any, cfg: ResolvedConfig, call: EngineCall, timeout: float | None = None
    ) -> LoraInfo:
        """Load an adapter on this thread and install it in a free slot between two steps.

        Args:
            name: what submits call it (``lora=name``; the server's ``model``).
            source: a PEFT adapter folder (``adapter_config.json`` and its weights), or a
                ``peft.PeftModel`` (its active adapter).
            model: the engine's model (what the adapter's target modules are checked against).
            cfg: the engine's resolved config (``max_loras``, ``max_lora_rank``).
            call: runs a function on the engine thread (``engine.call``).
            timeout: the most seconds to wait for the engine thread to install it.

        Returns:
            The adapter's :class:`LoraInfo`.

        Raises:
            InvalidRequestError: LoRA is off (``max_loras=0``), every slot is taken, the name is
                loaded already, or the adapter does not fit the model (a rank over
                ``max_lora_rank``, a target module the model does not have, an option acb does not
                run; :func:`acb.lora.load_adapter`'s refusals), each with field ``lora``.
        """
        if not isinstance(name, str) or not name:
            raise InvalidRequestTypeError(f"a LoRA adapter's name must be a non-empty str, got {name!r}", "lora")
        max_loras = cfg.max_loras
        if max_loras <= 0:
            raise InvalidRequestError(
                "LoRA adapters are off in this engine (max_loras=0): start it with "
                "ContinuousBatchingConfig(max_loras=N) (acb serve --max-loras N) to hold N adapters at once",
                "lora",
            )
        with self._lock:
            if name in self._by_name or name in self._reserved:
                raise InvalidRequestError(
                    f"a LoRA adapter named {name!r} is already loaded; remove_lora({name!r}) first to replace it",
                    "lora",
                )
            taken = {i.slot for i in self._by_name.values()} | set(self._reserved.values())
            slot = next((s for s in range(1, max_loras + 1) if s not in taken), None)
            if slot is None:
                raise InvalidRequestError(
                    f"all {max_loras} LoRA slots are taken ({', '.join(sorted(self._by_name))}; max_loras={max_loras}): "
                    "remove one, or start the engine with a larger max_loras",
                    "lora",
                )
            self._reserved[name] = slot
        try:
            adapter = load_adapter(source, model, max_rank=cfg.max_lora_rank, name=name)
            call(lambda core: core.runner.add_lora(slot, adapter)).result(timeout)  # type: ignore[attr-defined]
            info = LoraInfo(name, slot, adapter.rank, adapter.uid, adapter.nbytes, _describe(source))
            with self._lock:
                self._by_name[name] = info
        finally:
            with self._lock:
                self._reserved.pop(name, None)
        return info

    def remove(self, name: str, call: EngineCall, timeout: float | None = None) -> LoraInfo:
        """Take an adapter out of its slot (between two steps), once no live request uses it.

        Args:
            name: the adapter's name.
            call: runs a function on the engine thread (``engine.call``).
            timeout: the most seconds to wait for the engine thread.

        Returns:
            The removed adapter's :class:`LoraInfo`.

        Raises:
            InvalidRequestError: no adapter of that name, or live requests use it (field ``lora``).
        """
        with self._lock:
            info = self.resolve(name)
            assert info is not None  # (a name was given)
            live = self._ids.live
            users = sorted(rid for rid, used in self._user_of.items() if used is info and rid in live)
            if users:
                shown = ", ".join(users[:5]) + (", ..." if len(users) > 5 else "")
                raise InvalidRequestError(
                    f"the LoRA adapter {name!r} is in use by {len(users)} live request(s) ({shown}): "
                    "wait for them to end, or cancel them, before removing it",
                    "lora",
                )
            del self._by_name[name]  # no submit resolves it from now on
            self._reserved[name] = info.slot  # its slot is not free until the runner let it go
            self._forget_ended()
        try:
            call(lambda core: core.runner.remove_lora(info.slot)).result(timeout)  # type: ignore[attr-defined]
        finally:
            with self._lock:
                self._reserved.pop(name, None)
        return info


def _describe(source: Any) -> str:
    """Where an adapter came from, for listings: a folder's path, or the object's type."""
    import os

    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    return type(source).__name__
