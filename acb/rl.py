"""The trainer's side of remote rollouts: push a model's weights to ``acb serve`` processes and
generate GRPO rollouts on them, with no vLLM anywhere.

- :class:`WeightPusher` joins a ``torch.distributed`` group with one or more servers started
  with ``acb serve --enable-weight-updates`` (gloo on CPU, NCCL on CUDA; an ``acb serve --ray
  --num-replicas N`` is N ranks, one per replica), and pushes a module's weights to all of them
  at once, in buckets (:mod:`acb.weight_transfer`). An update is
  all-or-nothing: every server checks the names, shapes and dtypes first, and none receives
  unless all agreed.
- :func:`rollout_func` makes the ``rollout_func`` of TRL's ``GRPOTrainer``. It renders each
  prompt with the trainer's processing class, generates on the servers
  (``/v1/completions`` with token-id prompts and ``return_token_ids``), and returns the prompt
  ids, the completion ids and the processed logprobs, which are those of the distribution each
  token was drawn from.
- :class:`PushWeights` is a ``TrainerCallback`` that pushes the weights after each optimizer
  step, versioned by the step.
- A LoRA policy (``GRPOTrainer(peft_config=...)``) pushes its adapter only: ``push(model,
  lora="policy")`` / ``PushWeights(pusher, lora="policy")`` send the active adapter's tensors
  (``get_peft_model_state_dict``) into the servers' adapter ``policy`` (``acb serve --max-loras 1
  --lora-modules policy=PATH``), and ``rollout_func(servers, "policy")`` generates with it.

Usage::

    from acb.rl import PushWeights, WeightPusher, rollout_func

    pusher = WeightPusher(["http://gpu-box:8000"], master_address="trainer-host", master_port=29600)
    trainer = GRPOTrainer(model=model, args=args, reward_funcs=reward, train_dataset=ds,
                          rollout_func=rollout_func(["http://gpu-box:8000"], "my-model"),
                          callbacks=[PushWeights(pusher)])
    pusher.push(model)  # the servers start from the trainer's weights
    trainer.train()

HTTP goes through the standard library; nothing here imports vLLM, TRL or transformers at import
time.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from acb.errors import InvalidRequestError
from acb.weight_transfer import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT_S, TransferGroup, dtype_name, host_store

__all__ = ["PushWeights", "RolloutError", "WeightPushError", "WeightPusher", "rollout_func"]


class WeightPushError(RuntimeError):
    """A push (or a join) that did not land on every server: each server's answer, or the
    trainer's own failure, is in the message (a server that refused kept its old weights).
    ``status`` is the HTTP status when the servers that failed all answered the same one;
    ``statuses`` has each failed server's (``None``: no answer)."""

    def __init__(self, message: str, status: int | None = None, statuses: Sequence[int | None] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.statuses = tuple(statuses) or ((status,) if status is not None else ())


class RolloutError(RuntimeError):
    """A generation on a server failed other than by a refused request (the server's error, or
    no answer); ``status`` is the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _HTTPError(Exception):
    def __init__(self, url: str, status: int, message: str, param: str | None) -> None:
        super().__init__(f"{url}: {status}: {message}")
        self.status, self.message, self.param = status, message, param


def _request(
    url: str, body: dict[str, Any] | None, api_key: str | None, timeout: float, method: str = "POST"
) -> dict[str, Any]:
    """One JSON call; a server's error answer raises :class:`_HTTPError` with its message."""
    data = json.dumps(body or {}).encode() if method == "POST" else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return dict(json.loads(resp.read() or b"{}"))
    except urllib.error.HTTPError as exc:
        detail: Any = exc.read().decode(errors="replace")
        param = None
        try:
            error = json.loads(detail)["error"]
            detail, param = error["message"], error.get("param")
        except (ValueError, KeyError, TypeError):
            pass
        raise _HTTPError(url, exc.code, str(detail), param) from None


def _post(
    url: str, body: dict[str, Any] | None, api_key: str | None, timeout: float, method: str = "POST"
) -> dict[str, Any]:
    try:
        return _request(url, body, api_key, timeout, method)
    except _HTTPError as exc:
        raise WeightPushError(str(exc), exc.status) from None
    except (OSError, ValueError) as exc:  # no answer (refused, reset, timed out), or not JSON
        raise WeightPushError(f"{url}: {type(exc).__name__}: {exc}") from None


def _in_thread(fn: Callable[[], Any], stop: Callable[[], bool], on_late: Callable[[Any], None]) -> Any:
    """``fn()`` in a thread of its own; its result, or ``None`` as soon as ``stop()`` (``fn``'s
    result, if it ever comes, then goes to ``on_late``)."""
    box: dict[str, Any] = {}
    lock = threading.Lock()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            result, box["error"] = None, exc
        with lock:
            box["done"] = True
            late = box.get("gave_up", False)
        if late and result is not None:
            on_late(result)
        box["result"] = result

    t = threading.Thread(target=run, daemon=True)
    t.start()
    while True:
        t.join(0.01)
        with lock:
            if box.get("done"):
                break
            if stop():
                box["gave_up"] = True
                return None
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


class WeightPusher:
    """Pushes weights to rollout servers (see the module docstring).

    A push that fails (a server gone, the trainer stalled past ``timeout_s`` between two buckets,
    another trainer now holding the servers) raises :class:`WeightPushError` and leaves the group:
    the next push joins again (taking the servers back) rather than wait on a group a server
    already closed. A push the servers refused (a wrong name, shape or dtype) keeps the group.

    Args:
        servers: the servers' base URLs (``http://host:port``). Each joins the group with its
            own ranks (1, 2, ...: as many as its ``GET /get_world_size`` says, one per replica
            of an ``acb serve --ray``); the trainer is rank 0 and hosts the group's store.
        master_address: the address the servers reach the trainer at (each server must allow it:
            ``acb serve --weight-transfer-hosts``, loopback by default).
        master_port: a free port there, for the group's store (held until :meth:`close`).
        api_key: the servers' ``--api-key``, if any.
        bucket_bytes: the most bytes broadcast in one call.
        timeout_s: how long a join, a handshake or a broadcast may wait.
        device: where the trainer's side of the group lives (``cuda`` for NCCL).
    """

    def __init__(
        self,
        servers: Sequence[str],
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 29600,
        api_key: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        device: str | torch.device = "cpu",
    ) -> None:
        self.servers = [s.rstrip("/") for s in servers]
        self.master_address, self.master_port = master_address, master_port
        self.api_key = api_key
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.group: TransferGroup | None = None
        self.seq = 0
        self.version: Any = 0
        self._store: Any = None  # the group's TCPStore, hosted here for the pusher's life

    # ------------------------------------------------------------ the group
    def _all(
        self,
        path: str,
        bodies: Sequence[dict[str, Any]],
        also: Callable[[Callable[[], bool]], Any] | None = None,
    ) -> list[Any]:
        """POST ``bodies[i]`` to server ``i``'s ``path`` at once (threads), running
        ``also(failed)`` in this thread meanwhile (``failed()``: whether a server already answered
        with an error, so ``also`` need not wait for what that server will never do); every
        answer, or a :class:`WeightPushError` after all ended (the servers' errors, and
        ``also``'s own)."""
        results: list[Any] = [None] * len(self.servers)
        failed = threading.Event()

        def call(i: int) -> None:
            try:
                results[i] = _post(self.servers[i] + path, bodies[i], self.api_key, self.timeout_s + 30)
            except Exception as exc:  # noqa: BLE001 - reported below, with the others'
                results[i] = exc
                failed.set()

        threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(self.servers))]
        for t in threads:
            t.start()
        own: BaseException | None = None
        try:
            if also is not None:
                also(failed.is_set)
        except Exception as exc:  # noqa: BLE001 - reported with the servers' answers
            own = exc
        finally:
            for t in threads:
                t.join()
        errors = [r for r in results if isinstance(r, Exception)]
        if own is not None:
            said = "; ".join(str(e) for e in errors) or "every server answered"
            raise WeightPushError(
                f"the trainer's side failed: {type(own).__name__}: {own} (the servers: {said})"
            ) from own
        if errors:
            statuses = [getattr(e, "status", None) for e in errors]
            one = statuses[0] if len(set(statuses)) == 1 else None
            raise WeightPushError("; ".join(str(e) for e in errors), one, statuses)
        return results

    def init(self) -> None:
        """Join a new group with every server (each ``POST /init_weight_transfer``: a server
        leaves any other group for this one); blocks until all joined.

        Raises:
            WeightPushError: a server refused or could not join (its answer is in the message).
        """
        self._leave()
        sizes = self.world_sizes()
        world = 1 + sum(sizes)
        group_id = secrets.token_hex(8)
        bodies = [
            {
                "master_address": self.master_address,
                "master_port": self.master_port,
                "world_size": world,
                "rank_offset": 1 + sum(sizes[:i]),
                "timeout_s": self.timeout_s,
                "group_id": group_id,
            }
            for i in range(len(self.servers))
        ]
        if self._store is None:
            try:
                self._store = host_store(self.master_address, self.master_port, timeout_s=self.timeout_s)
            except (RuntimeError, OSError) as exc:
                raise WeightPushError(
                    f"hosting the group's store at {self.master_address}:{self.master_port} failed: {exc}"
                ) from exc
        joined: list[TransferGroup] = []

        def join(failed: Callable[[], bool]) -> None:
            def connect() -> TransferGroup:
                return TransferGroup.join(
                    self.master_address,
                    self.master_port,
                    world,
                    0,
                    group_id=group_id,
                    device=self.device,
                    timeout_s=self.timeout_s,
                    store=self._store,
                )

            # (in a thread: a server that refused never joins, and the wait ends with its answer)
            group = _in_thread(connect, failed, lambda late: late.close())
            if group is not None:
                joined.append(group)

        try:
            self._all("/init_weight_transfer", bodies, join)
        except BaseException:
            for g in joined:
                g.close()
            raise
        self.group, self.seq = joined[0], 0

    def world_sizes(self) -> list[int]:
        """The ranks each server takes in the group (its ``GET /get_world_size``)."""
        out = []
        for url in self.servers:
            answer = _post(url + "/get_world_size", None, self.api_key, self.timeout_s + 30, method="GET")
            size = answer.get("world_size")
            if not isinstance(size, int) or size < 1:
                raise WeightPushError(f"{url}/get_world_size answered {answer!r}")
            out.append(size)
        return out

    def push(
        self,
        weights: torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
        version: Any = None,
        *,
        lora: str | None = None,
    ) -> Any:
        """Push ``weights`` (a module's parameters and persistent buffers, or ``(name, tensor)``
        pairs) to every server (joining first if the pusher is in no group); returns the version
        they now run.

        With ``lora``, only a LoRA adapter's tensors are pushed, into the servers' adapter of that
        name (loaded there with ``acb serve --lora-modules NAME=PATH``): ``weights`` is then a
        ``peft.PeftModel`` (its active adapter, ``get_peft_model_state_dict``) or ``(key, tensor)``
        pairs by PEFT's keys. Each server checks them against its adapter (modules, shapes) before
        anything moves, and swaps them in once no request that started on the adapter is running.

        Raises:
            WeightPushError: a tensor that cannot be sent (a meta tensor: nothing is sent), a
                server refused it (all keep their old weights), or the push failed on the way
                (the group is left; the next push joins again); a ``PeftModel`` without ``lora``.
        """
        names, tensors = _adapter_tensors(weights) if lora is not None else _named_tensors(weights)
        names, tensors, tied = _untied(names, tensors)
        if self.group is None:
            self.init()
        group = self.group
        assert group is not None
        self.seq += 1
        seq = self.seq
        body = {
            "group_id": group.group_id,
            "names": names,
            "dtype_names": [dtype_name(t.dtype) for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "weight_version": version,
            "bucket_bytes": self.bucket_bytes,
            "seq": seq,
        }
        if tied:  # (a tied weight's bytes sent once, under its first name)
            body["tied"] = tied
        if lora is not None:
            body["lora_name"] = lora
        refused: list[str] = []
        ended: list[bool] = []  # [True]: every server gave its verdict and none will receive

        def broadcast(failed: Callable[[], bool]) -> None:
            verdicts = group.verdicts(seq, stop=failed)
            if verdicts is None:  # a server answered before its verdict (not in this group now)
                group.decide(seq, False)  # (the others answer at once, rather than at their timeout)
                return
            refused.extend(f"rank {r}: {v.removeprefix('error: ')}" for r, v in verdicts.items() if v != "ok")
            group.decide(seq, not refused)
            if refused:
                ended.append(True)
                return
            try:
                with torch.no_grad():
                    group.send(tensors, self.bucket_bytes)
            except BaseException:
                group.close()  # (the servers' receive ends now, not at the group's timeout)
                raise

        try:
            answers = self._all("/update_weights", [body] * len(self.servers), broadcast)
        except WeightPushError as exc:
            if not (ended and exc.statuses and all(s in (400, 409) for s in exc.statuses)):
                self._leave()  # (a clean refusal keeps the group; anything else leaves it)
            raise
        except BaseException:  # (interrupted: where the servers stand is not known)
            self._leave()
            raise
        self.version = answers[0].get("weight_version")
        return self.version

    def _leave(self) -> None:
        """Drop this side of the group. The servers are not told: a failed update closed theirs,
        one that left it for another trainer's has nothing to close, and the next join replaces
        whatever is left."""
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def close(self) -> None:
        """Leave the group (each server ``POST /close_weight_transfer``, for this group only: a
        server that joined another trainer's since keeps that one) and stop hosting its store."""
        group, self.group = self.group, None
        try:
            if group is not None:
                self._all("/close_weight_transfer", [{"group_id": group.group_id}] * len(self.servers))
        finally:
            if group is not None:
                group.close()
            self._store = None

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_peft(model: Any) -> bool:
    return isinstance(model, torch.nn.Module) and isinstance(getattr(model, "peft_config", None), dict)


def _adapter_tensors(weights: Any) -> tuple[list[str], list[Any]]:
    """A LoRA push's keys and tensors: a ``PeftModel``'s active adapter by PEFT's keys, or pairs."""
    if _is_peft(weights):
        from peft import get_peft_model_state_dict

        active = weights.active_adapter
        if not isinstance(active, str):
            raise WeightPushError(f"the PeftModel has several active adapters ({active}); push one's tensors as pairs")
        return _named_tensors(list(get_peft_model_state_dict(weights, adapter_name=active).items()))
    if isinstance(weights, torch.nn.Module):
        raise WeightPushError(
            f"a LoRA push takes a peft.PeftModel or (key, tensor) pairs, got a {type(weights).__name__}; nothing sent"
        )
    return _named_tensors(weights)


def _named_tensors(weights: torch.nn.Module | Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], list[Any]]:
    """The names and tensors of a push, checked before anything is sent."""
    if _is_peft(weights):
        raise WeightPushError(
            "a peft.PeftModel: push its adapter with lora=<the servers' adapter name> (acb serve --lora-modules), "
            "or its base model's weights with push(model.get_base_model()); nothing sent"
        )
    if isinstance(weights, torch.nn.Module):
        from acb.runner.weight_update import weight_targets

        items = list(weight_targets(weights).items())
    else:
        items = list(weights)
    names, tensors = [], []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise WeightPushError(f"push needs (name, tensor) pairs; got {type(item).__name__} {str(item)[:80]!r}")
        name, t = item
        if not isinstance(t, torch.Tensor):
            raise WeightPushError(f"{name}: a {type(t).__name__}, not a tensor; nothing sent")
        if t.is_meta:
            raise WeightPushError(
                f"{name} is on the meta device (an offloaded or not yet materialised parameter): it has no "
                "data to send; gather it onto a device first (nothing sent)"
            )
        if t.layout != torch.strided:
            raise WeightPushError(f"{name}: a {t.layout} tensor cannot be sent; make it dense (nothing sent)")
        names.append(name)
        tensors.append(t.detach())
    return names, tensors


def _untied(names: list[str], tensors: list[Any]) -> tuple[list[str], list[Any], dict[str, str]]:
    """A push's tensors with each tied weight once (the same tensor under two names, as a
    module's tied embeddings and LM head): the names and tensors sent, and ``{other name: the
    name sent}`` (each server writes the tensor under both)."""
    first: dict[tuple[Any, ...], str] = {}
    kept_names, kept, tied = [], [], {}
    for name, t in zip(names, tensors):
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in first:
            tied[name] = first[key]
            continue
        first.setdefault(key, name)
        kept_names.append(name)
        kept.append(t)
    return kept_names, kept, tied


def _completions(
    servers: Sequence[str], model: str, prompts: list[list[int]], params: dict[str, Any], api_key: str | None
) -> list[dict[str, Any]]:
    """Every prompt's choice from ``/v1/completions``, the prompts spread over the servers; a
    server's refusal raises what acb raises for it in process (:class:`InvalidRequestError`),
    any other failure :class:`RolloutError`."""
    share = [list(range(i, len(prompts), len(servers))) for i in range(len(servers))]
    out: list[Any] = [None] * len(prompts)
    errors: list[Exception] = []

    def call(server: str, idx: list[int]) -> None:
        if not idx:
            return
        body = {"model": model, "prompt": [prompts[i] for i in idx], "return_token_ids": True, **params}
        try:
            answer = _request(server.rstrip("/") + "/v1/completions", body, api_key, 600)
        except _HTTPError as exc:
            if 400 <= exc.status < 500 and exc.status not in (401, 403, 404, 408, 429):
                errors.append(InvalidRequestError(str(exc), field=exc.param))
            else:
                errors.append(RolloutError(str(exc), exc.status))
            return
        except (OSError, ValueError) as exc:
            errors.append(RolloutError(f"{server}: {type(exc).__name__}: {exc}"))
            return
        for choice in answer["choices"]:
            out[idx[choice["index"]]] = {**choice, "weight_version": answer.get("weight_version")}

    threads = [threading.Thread(target=call, args=(s, idx), daemon=True) for s, idx in zip(servers, share)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def rollout_func(
    servers: str | Sequence[str], model: str, *, api_key: str | None = None, **sampling: Any
) -> Callable[[list[Any], Any], dict[str, Any]]:
    """TRL's ``GRPOTrainer(rollout_func=...)`` generating on ``acb serve`` processes.

    Args:
        servers: the servers' base URLs (prompts are spread over them).
        model: the served model's name.
        api_key: the servers' ``--api-key``, if any.
        sampling: more ``/v1/completions`` fields (``top_k``, ``min_p``, ...); ``max_tokens``,
            ``temperature`` and ``top_p`` default to the trainer's ``max_completion_length``,
            ``temperature`` and ``top_p``.

    Returns:
        ``rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs"}``. Its
        ``weight_versions`` lists, per call, each completion's ``weight_version`` (the version it
        was generated on; a list of ``[version, first token, end]`` spans when an update landed
        while it ran): with ``PushWeights(max_staleness=1)`` the step's or the one before.
    """
    urls = [servers] if isinstance(servers, str) else list(servers)
    versions: list[list[Any]] = []

    def rollouts(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tok = trainer.processing_class
        args = trainer.args
        ids = []
        for p in prompts:
            if isinstance(p, str):
                ids.append(list(tok(text=p)["input_ids"]) if hasattr(tok, "image_processor") else tok(p)["input_ids"])
            else:  # a conversation
                kw = dict(getattr(trainer, "chat_template_kwargs", None) or {})
                rendered = tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, **kw)
                if isinstance(rendered, dict) or hasattr(rendered, "keys"):
                    rendered = rendered["input_ids"]
                ids.append(list(rendered[0] if rendered and isinstance(rendered[0], list) else rendered))
        params = {
            "max_tokens": args.max_completion_length,
            "temperature": getattr(args, "temperature", 1.0),
            "top_p": getattr(args, "top_p", 1.0),
            "logprobs": 0,
            **sampling,
        }
        gen = getattr(args, "generation_kwargs", None) or {}
        if gen.get("do_sample") is False:
            params["temperature"] = 0.0
        choices = _completions(urls, model, ids, params, api_key)
        versions.append([c["weight_version"] for c in choices])
        return {
            "prompt_ids": [c["prompt_token_ids"] for c in choices],
            "completion_ids": [c["token_ids"] for c in choices],
            "logprobs": [list(c["logprobs"]["token_logprobs"]) for c in choices],
        }

    rollouts.weight_versions = versions  # type: ignore[attr-defined]
    return rollouts


class PushWeights:
    """A ``TrainerCallback`` (duck-typed: no transformers import here) that pushes the model's
    weights after every optimizer step, versioned by the step (``state.global_step``). A push that
    fails raises :class:`WeightPushError` out of the step; the pusher has left its group, so the
    next push (a resumed run's) joins again.

    ``lora``: the servers' adapter name, for a LoRA policy (a ``PeftModel``, as ``GRPOTrainer``
    makes with ``peft_config``): only its active adapter's tensors are pushed
    (:meth:`WeightPusher.push`), and ``rollout_func(servers, lora)`` generates with it.

    ``max_staleness`` (TRL's name, from its async GRPO): how many optimizer steps the weights a
    rollout is generated on may lag behind the trainer's. ``0`` (the default): each push ends
    before the step does, so the next batch is generated on the weights just trained. ``1``: the
    push runs in the background while the next batch is generated (on the servers, which keep
    generating while they receive, and swap the new weights in between two of their steps); the
    trainer waits for it only before its next optimizer step changes the weights it is sending,
    and before the next push. A rollout's ``weight_version`` is then the step's or the one before
    (spans of both when the swap landed during it). A failed background push raises at that wait.

    ``push_s``: each push's seconds; ``waited_s``: per step, the seconds the trainer's thread spent
    pushing or waiting for a push (all of ``push_s`` when ``max_staleness=0``)."""

    def __init__(self, pusher: WeightPusher, *, lora: str | None = None, max_staleness: int = 0) -> None:
        if not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness not in (0, 1):
            raise ValueError(
                f"max_staleness must be 0 (generate on the weights just pushed) or 1 (generate the next batch "
                f"on the previous weights while the push is in flight); got {max_staleness!r}"
            )
        self.pusher = pusher
        self.lora = lora
        self.max_staleness = max_staleness
        self.pushed: list[Any] = []  # the versions pushed
        self.push_s: list[float] = []
        self.waited_s: list[float] = []
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None
        self._carry = 0.0  # the seconds this step waited before its optimizer step

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):  # every other TrainerCallback event: nothing to do
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def _push(self, model: Any, version: Any) -> None:
        t0 = time.perf_counter()
        self.pushed.append(self.pusher.push(model, version=version, lora=self.lora))
        self.push_s.append(time.perf_counter() - t0)

    def wait(self) -> float:
        """Wait for the push in flight, if any (re-raising its error); the seconds waited."""
        pending, self._pending = self._pending, None
        if pending is None:
            return 0.0
        t0 = time.perf_counter()
        pending.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
        return time.perf_counter() - t0

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            return
        waited, self._carry = self._carry + self.wait(), 0.0
        if self.max_staleness == 0:
            t0 = time.perf_counter()
            self._push(model, state.global_step)
            self.waited_s.append(waited + time.perf_counter() - t0)
            return
        self.waited_s.append(waited)

        def run() -> None:
            try:
                self._push(model, version)
            except BaseException as exc:  # noqa: BLE001 - raised in the trainer's thread at the next wait
                self._error = exc

        version = state.global_step
        self._pending = threading.Thread(target=run, name="acb-push", daemon=True)
        self._pending.start()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The optimizer is about to change the weights: the push reading them must end first."""
        self._carry += self.wait()  # (this step's: counted at its end)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.wait()
