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
refused by :meth:`Loras.add` (remove it first).

An adapter's weights are updated in place by :meth:`Loras.update` (``engine.update_lora``: an RL
trainer pushing its LoRA policy): the new tensors (a PEFT folder, a ``PeftModel``, or the adapter's
tensors by PEFT's names, as ``get_peft_model_state_dict`` gives them, a fused experts' parameters'
(``target_parameters``: ``<experts>[.base_layer].lora_A.weight``) among them) are checked whole against the
loaded adapter before anything changes, then written into the same slot on the engine thread between
two steps. The rule for requests in flight: **the swap waits for them**. It happens at the first
point between two steps where no request that uses the adapter has started (none has a token
computed or sampled); requests that have not started yet run the new weights. So a request's tokens
all come from one set of the adapter's weights. Like a full-weight update, it is versioned (the
engine's ``weight_version``, which every output carries; the other requests running at that point
get a span, as for full weights) and it drops the prefix cache (the adapter's ``uid`` changes too, so
its later requests are salted apart from the old weights' blocks). Under steady traffic on the
adapter the swap may wait long: it gives up after its timeout with nothing changed.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from acb.errors import InvalidRequestError, InvalidRequestTypeError, WeightUpdateError
from acb.lora import LoraAdapter, adapter_uid, expert_factors_with, expert_tensor_shape, load_adapter

if TYPE_CHECKING:
    from concurrent.futures import Future

    from acb.api.ids import RequestIds
    from acb.config import ResolvedConfig
    from acb.core.engine_core import EngineCore

__all__ = ["LoraInfo", "Loras", "adapter_key", "lora_salt"]

EngineCall = Callable[[Callable[["EngineCore"], Any]], "Future[Any]"]  # engine.call

_PRUNE_AT = 4096  # request ids recorded before the ended ones are forgotten
_PEFT_PREFIX = "base_model.model."  # get_peft_model_state_dict's key prefix
_TENSOR_KEY = re.compile(r"^(?P<path>.+)\.lora_(?P<ab>[AB])\.weight$")


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
        self._adapters: dict[str, LoraAdapter] = {}  # name -> its tensors (an update replaces some)
        self._updating: set[str] = set()  # names whose update is under way

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
            now = self._by_name.get(info.name)
            if now is None or now.slot != info.slot:
                raise InvalidRequestError(
                    f"the LoRA adapter {info.name!r} was removed while this request was submitted", "lora"
                )
            if len(self._user_of) >= _PRUNE_AT:
                self._forget_ended()
            for rid in request_ids:  # (an adapter updated since it resolved: the update's, same slot)
                self._user_of[rid] = now

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
                self._adapters[name] = adapter
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
            if name in self._updating:
                raise InvalidRequestError(
                    f"the LoRA adapter {name!r} is being updated; remove it once that ends", "lora"
                )
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
            self._adapters.pop(name, None)
            self._reserved[name] = info.slot  # its slot is not free until the runner let it go
            self._forget_ended()
        try:
            call(lambda core: core.runner.remove_lora(info.slot)).result(timeout)  # type: ignore[attr-defined]
        finally:
            with self._lock:
                self._reserved.pop(name, None)
        return info

    # ------------------------------------------------------------ updates in place
    def _loaded(self, name: Any) -> tuple[LoraInfo, LoraAdapter]:
        if not isinstance(name, str):
            raise InvalidRequestTypeError(f"a LoRA adapter's name must be a str, got {type(name).__name__}", "lora")
        with self._lock:
            info, adapter = self._by_name.get(name), self._adapters.get(name)
            if info is None or adapter is None:
                loaded = ", ".join(sorted(self._by_name)) or "none"
                raise InvalidRequestError(
                    f"no LoRA adapter named {name!r} is loaded (loaded: {loaded}): an update replaces the tensors of "
                    "a loaded adapter; load it first (engine.add_lora, acb serve --lora-modules)",
                    "lora",
                )
            return info, adapter

    def check_update(self, name: str, specs: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> None:
        """Refuse, before any byte moves, an update of adapter ``name`` by tensors whose names,
        shapes or dtypes do not fit it (what a server checks before a trainer broadcasts them).

        Args:
            name: the loaded adapter's name.
            specs: ``(key, shape, dtype)`` per tensor; a key is PEFT's
                (``base_model.model.<module>.lora_A.weight``, as ``get_peft_model_state_dict``
                gives it) or the module's path in the engine's model (``<module>.lora_B.weight``);
                a fused experts' parameter's (``target_parameters``) as PEFT names its
                ``ParamWrapper`` (``<experts>.lora_A.weight``, ``<experts>.base_layer.lora_A.weight``
                for a module's second parameter), of PEFT's shapes ``[r*E, in]`` / ``[out, r*E]``.

        Raises:
            InvalidRequestError: no adapter of that name (field ``lora``).
            WeightUpdateError: each key that names no ``lora_A``/``lora_B`` of the adapter's
                modules, a shape other than the loaded one's, a dtype that is not floating.
        """
        _, adapter = self._loaded(name)
        _plan(adapter, specs)

    def prepare_update(self, name: str, source: Any, model: Any, cfg: ResolvedConfig) -> LoraAdapter:
        """The adapter an update of ``name`` installs, read and checked on this thread (nothing
        changes in the engine).

        Args:
            name: the loaded adapter's name.
            source: its new weights: a PEFT adapter folder or a ``peft.PeftModel`` (a whole
                adapter, read as :meth:`add` reads it: rank at most ``max_lora_rank``, modules the
                model's), ``{key: tensor}`` or ``(key, tensor)`` pairs (some or all of the loaded
                adapter's tensors, same shapes: its config and the others stay), or a
                :class:`~acb.lora.LoraAdapter`.
            model: the engine's model.
            cfg: the engine's resolved config.

        Raises:
            InvalidRequestError: no adapter of that name, or a folder/``PeftModel`` that does not
                fit (field ``lora``).
            WeightUpdateError: tensors that do not fit the loaded adapter (nothing changes).
        """
        _, old = self._loaded(name)
        if isinstance(source, LoraAdapter):
            return source
        if isinstance(source, Mapping) or (
            not isinstance(source, (str, bytes)) and isinstance(source, Iterable) and not hasattr(source, "peft_config")
        ):
            items = list(source.items() if isinstance(source, Mapping) else source)
            for item in items:
                if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                    raise WeightUpdateError(
                        f"LoRA update of {name!r}: expected (key, tensor) pairs, got {str(item)[:80]!r}; nothing changed"
                    )
            plan = _plan(old, [(k, tuple(t.shape), t.dtype) for k, t in items])
            weights = dict(old.weights)
            params = dict(old.params)
            for (_key, t), (path, ab) in zip(items, plan):
                if path not in weights:  # a fused experts' parameter (target_parameters): its factor
                    key, factors = expert_factors_with(old, params, path, ab, t)
                    params[key] = factors
                    continue
                a, b = weights[path]
                new = t.detach().to("cpu", a.dtype).contiguous()
                weights[path] = (new, b) if ab == "A" else (a, new)
            return LoraAdapter(
                name=name,
                rank=old.rank,
                scaling=old.scaling,
                weights=weights,
                uid=_uid(weights, old.scalings, params),
                nbytes=old.nbytes,
                scalings=old.scalings,
                params=params,
                param_paths=old.param_paths,
            )
        return load_adapter(source, model, max_rank=cfg.max_lora_rank, name=name)

    def update(
        self,
        name: str,
        source: Any,
        model: Any,
        cfg: ResolvedConfig,
        call: EngineCall,
        version: Any = None,
        timeout: float | None = None,
    ) -> Any:
        """Replace a loaded adapter's weights in place (same name, same slot), versioned like a
        full-weight update (see the module docstring for the rule on requests in flight).

        Args:
            name: the loaded adapter's name.
            source: its new weights (:meth:`prepare_update`).
            model: the engine's model.
            cfg: the engine's resolved config.
            call: runs a function on the engine thread (``engine.call``).
            version: the engine's new ``weight_version`` (None: the current one plus one).
            timeout: the most seconds to wait for the requests in flight with the adapter (None:
                as long as it takes).

        Returns:
            The version now running.

        Raises:
            InvalidRequestError: no adapter of that name, it is being updated already, or removed
                meanwhile (field ``lora``).
            WeightUpdateError: new weights that do not fit, or a bad version (nothing changed).
            TimeoutError: requests that use the adapter were still running at ``timeout``
                (nothing changed).
        """
        from acb.runner.weight_update import Staged, check_version, version_after

        version = check_version(version)
        adapter = self.prepare_update(name, source, model, cfg)
        with self._lock:
            if name in self._updating:
                raise InvalidRequestError(f"the LoRA adapter {name!r} is being updated already", "lora")
            self._updating.add(name)
        try:
            slot = self._loaded(name)[0].slot
            where = _describe(source) if not isinstance(source, (Mapping, LoraAdapter)) else "tensors"

            def swap(core: EngineCore) -> Any:
                """On the engine thread: the swap, or None while a started request uses the slot."""
                reqs = [*core.scheduler.live.values(), *core.holds.held]
                for req in reqs:
                    for r in req.group.members if req.group is not None else (req,):
                        if r.lora_slot == slot and (r.num_computed_tokens or r.num_generated or r.in_flight):
                            return None
                core.runner.add_lora(slot, adapter)  # type: ignore[attr-defined]  # (checked whole first)
                info = LoraInfo(name, slot, adapter.rank, adapter.uid, adapter.nbytes, where)
                with self._lock:
                    old = self._by_name[name]
                    self._by_name[name], self._adapters[name] = info, adapter
                    self._user_of = {rid: info if used is old else used for rid, used in self._user_of.items()}
                # the version, the spans of the requests running, the prefix cache dropped: a
                # full-weight update's bookkeeping, with no tensor of the model changed
                return core.swap_weights(Staged([], []), version_after(core.weight_version, version))

            deadline = None if timeout is None else time.monotonic() + timeout
            pause = 0.001
            while True:
                with self._lock:
                    now = self._by_name.get(name)
                if now is None or now.slot != slot:
                    raise InvalidRequestError(f"the LoRA adapter {name!r} was removed during its update", "lora")
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0) + 30.0
                done = call(swap).result(left)  # (one check between two steps: the wait is below)
                if done is not None:
                    return done
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"the LoRA adapter {name!r} was still in use by requests in flight after {timeout:g} s: "
                        "an update waits for them (nothing changed); let them finish, or cancel them, and retry"
                    )
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
        finally:
            with self._lock:
                self._updating.discard(name)


def adapter_key(key: str) -> tuple[str, str]:
    """``(module path, "A" | "B")`` of an adapter tensor's key: PEFT's
    (``base_model.model.<path>.lora_A.weight``) or the engine model's path (``<path>.lora_B.weight``).

    Raises:
        ValueError: a key of neither form.
    """
    m = _TENSOR_KEY.match(key)
    if m is None or ".lora_" in m["path"]:
        raise ValueError(
            f"{key!r} is not a LoRA adapter's tensor key (<module>.lora_A.weight or <module>.lora_B.weight, as "
            "peft.get_peft_model_state_dict gives them)"
        )
    return m["path"].removeprefix(_PEFT_PREFIX), m["ab"]


def _plan(adapter: LoraAdapter, specs: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> list[tuple[str, str]]:
    """Each spec's ``(module path, "A" | "B")`` in ``adapter``; every problem at once, else none."""
    problems, out, seen = [], [], set()
    for key, shape, dtype in specs:
        try:
            path, ab = adapter_key(key)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        out.append((path, ab))
        if (path, ab) in seen:
            problems.append(f"{key}: named twice")
        seen.add((path, ab))
        pair = adapter.weights.get(path)
        if pair is not None:
            want = tuple(pair[0 if ab == "A" else 1].shape)
        elif path in adapter.param_paths:  # a fused experts' parameter: PEFT's lora_A [r*E, in] / lora_B [out, r*E]
            want = expert_tensor_shape(adapter, path, ab)
        else:
            modules = sorted([*adapter.weights, *adapter.param_paths])
            have = ", ".join(modules[:4]) + (", ..." if len(modules) > 4 else "")
            problems.append(f"{key}: {path!r} is not one of adapter {adapter.name!r}'s modules ({have})")
            continue
        if tuple(int(d) for d in shape) != want:
            problems.append(
                f"{key}: shape {list(shape)}, the loaded adapter's is {list(want)} (a new rank or new modules: "
                "load it as a new adapter)"
            )
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            problems.append(f"{key}: dtype {dtype} is not a floating dtype")
    if not seen and not problems:
        problems.append("the update names no tensor")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise WeightUpdateError(
            f"LoRA update of {adapter.name!r} refused, nothing changed: " + "; ".join(problems[:10]) + more
        )
    return out


def _uid(
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    scalings: Mapping[str, float],
    params: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]],
) -> bytes:
    """A content hash of an adapter's scalings and tensors (as :func:`acb.lora.load_adapter` makes it)."""
    dtype = next(iter([*(a for a, _ in weights.values()), *(lhs for lhs, _, _ in params.values())])).dtype
    return adapter_uid(weights, scalings, params, dtype)


def _describe(source: Any) -> str:
    """Where an adapter came from, for listings: a folder's path, or the object's type."""
    import os

    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    return type(source).__name__
