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
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from acb.weight_transfer import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT_S, TransferGroup, dtype_name

__all__ = ["PushWeights", "WeightPushError", "WeightPusher", "rollout_func"]


class WeightPushError(RuntimeError):
    """A push that did not land on every server (each server's answer is in the message; a
    server that refused kept its old weights)."""


def _post(
    url: str, body: dict[str, Any] | None, api_key: str | None, timeout: float, method: str = "POST"
) -> dict[str, Any]:
    data = json.dumps(body or {}).encode() if method == "POST" else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return dict(json.loads(resp.read() or b"{}"))
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise WeightPushError(f"{url}: {exc.code}: {detail}") from None


class WeightPusher:
    """Pushes weights to rollout servers (see the module docstring).

    Args:
        servers: the servers' base URLs (``http://host:port``). Each joins the group with its
            own ranks (1, 2, ...: as many as its ``GET /get_world_size`` says, one per replica
            of an ``acb serve --ray``); the trainer is rank 0 and hosts the group's store.
        master_address: the address the servers reach the trainer at.
        master_port: a free port there, for the group's store.
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

    # ------------------------------------------------------------ the group
    def _all(self, path: str, bodies: Sequence[dict[str, Any]], also: Callable[[], Any] | None = None) -> list[Any]:
        """POST ``bodies[i]`` to server ``i``'s ``path`` at once (threads), running ``also`` in
        this thread meanwhile; every answer, or the first error raised after all ended."""
        results: list[Any] = [None] * len(self.servers)

        def call(i: int) -> None:
            try:
                results[i] = _post(self.servers[i] + path, bodies[i], self.api_key, self.timeout_s + 30)
            except Exception as exc:  # noqa: BLE001 - reported below, with the others'
                results[i] = exc

        threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(self.servers))]
        for t in threads:
            t.start()
        try:
            if also is not None:
                also()
        finally:
            for t in threads:
                t.join()
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise WeightPushError("; ".join(str(e) for e in errors))
        return results

    def init(self) -> None:
        """Join the group with every server (each ``POST /init_weight_transfer``); blocks until
        all joined."""
        self.close()
        sizes = self.world_sizes()
        world = 1 + sum(sizes)
        bodies = [
            {
                "master_address": self.master_address,
                "master_port": self.master_port,
                "world_size": world,
                "rank_offset": 1 + sum(sizes[:i]),
                "timeout_s": self.timeout_s,
            }
            for i in range(len(self.servers))
        ]

        def join() -> None:
            self.group = TransferGroup.join(
                self.master_address, self.master_port, world, 0, device=self.device, timeout_s=self.timeout_s
            )

        self._all("/init_weight_transfer", bodies, join)
        self.seq = 0

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

    def push(self, weights: torch.nn.Module | Iterable[tuple[str, torch.Tensor]], version: Any = None) -> Any:
        """Push ``weights`` (a module's parameters and persistent buffers, or ``(name, tensor)``
        pairs) to every server; returns the version they now run.

        Raises:
            WeightPushError: a server refused it (all keep their old weights), or the broadcast
                failed.
        """
        if self.group is None:
            self.init()
        group = self.group
        assert group is not None
        if isinstance(weights, torch.nn.Module):
            from acb.runner.weight_update import weight_targets

            items = list(weight_targets(weights).items())
        else:
            items = list(weights)
        names = [n for n, _ in items]
        tensors = [t.detach() for _, t in items]
        self.seq += 1
        seq = self.seq
        body = {
            "names": names,
            "dtype_names": [dtype_name(t.dtype) for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "weight_version": version,
            "bucket_bytes": self.bucket_bytes,
            "seq": seq,
        }
        refused: list[str] = []

        def broadcast() -> None:
            verdicts = group.verdicts(seq)
            refused.extend(f"rank {r}: {v.removeprefix('error: ')}" for r, v in verdicts.items() if v != "ok")
            group.decide(seq, not refused)
            if not refused:
                with torch.no_grad():
                    group.send(tensors, self.bucket_bytes)

        answers = self._all("/update_weights", [body] * len(self.servers), broadcast)
        self.version = answers[0].get("weight_version")
        return self.version

    def close(self) -> None:
        """Leave the group (each server ``POST /close_weight_transfer``)."""
        group, self.group = self.group, None
        if group is None:
            return
        try:
            self._all("/close_weight_transfer", [{}] * len(self.servers))
        finally:
            group.close()

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _completions(
    servers: Sequence[str], model: str, prompts: list[list[int]], params: dict[str, Any], api_key: str | None
) -> list[dict[str, Any]]:
    """Every prompt's choice from ``/v1/completions``, the prompts spread over the servers."""
    share = [list(range(i, len(prompts), len(servers))) for i in range(len(servers))]
    out: list[Any] = [None] * len(prompts)
    errors: list[Exception] = []

    def call(server: str, idx: list[int]) -> None:
        if not idx:
            return
        body = {"model": model, "prompt": [prompts[i] for i in idx], "return_token_ids": True, **params}
        try:
            answer = _post(server.rstrip("/") + "/v1/completions", body, api_key, 600)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
            return
        for choice in answer["choices"]:
            out[idx[choice["index"]]] = choice

    threads = [threading.Thread(target=call, args=(s, idx), daemon=True) for s, idx in zip(servers, share)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise WeightPushError("; ".join(str(e) for e in errors))
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
        ``rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs"}``.
    """
    urls = [servers] if isinstance(servers, str) else list(servers)

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
        return {
            "prompt_ids": [c["prompt_token_ids"] for c in choices],
            "completion_ids": [c["token_ids"] for c in choices],
            "logprobs": [list(c["logprobs"]["token_logprobs"]) for c in choices],
        }

    return rollouts


class PushWeights:
    """A ``TrainerCallback`` (duck-typed: no transformers import here) that pushes the model's
    weights after every optimizer step, versioned by the step (``state.global_step``)."""

    def __init__(self, pusher: WeightPusher) -> None:
        self.pusher = pusher
        self.pushed: list[Any] = []  # the versions pushed

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):  # every other TrainerCallback event: nothing to do
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            return
        self.pushed.append(self.pusher.push(model, version=state.global_step))
