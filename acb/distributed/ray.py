"""Data-parallel offline inference on Ray Data: one acb engine per actor, rows in, rows out.

When to use it: offline generation over a dataset too large for one device, or one you want
done faster by using several. Ray Data reads the dataset in blocks, hands batches of rows to a
pool of actors, each holding one :class:`acb.Engine` on one device (one per GPU), and streams
the output rows back (or on to a writer) as they are produced, so the dataset never has to fit
in one process. Each engine still batches continuously: a batch's rows are all submitted at
once, and with ``max_concurrent_batches > 1`` the next batch's rows join while the last ones of
the previous batch finish. For one device and a dataset that fits in memory,
:func:`acb.generate_batch` does the same without Ray.

Example (``pip install -e '.[ray]'`` in acb's checkout)::

    import ray
    from acb.distributed.ray import generate_dataset

    ds = ray.data.read_json("prompts.jsonl")          # a "prompt" column: text, token ids or chats
    out = generate_dataset(ds, model="/ckpt/my-model", concurrency=8, batch_size=64,
                           sampling={"max_new_tokens": 256, "temperature": 0.7})
    out.write_parquet("/results/")                    # rows keep their input columns, plus
                                                      # generated_text, generated_token_ids, ...

``generate_dataset`` is ``ds.map_batches(AcbPredictor, compute=ActorPoolStrategy(size=8),
num_gpus=1, batch_size=64, fn_constructor_kwargs=...)``; call ``map_batches`` with
:class:`AcbPredictor` yourself to set anything else Ray Data takes.

On a cluster: start Ray on the nodes (``ray start --head`` on one, ``ray start
--address=HEAD:6379`` on the others), then run the driver script on the head node with
``ray.init(address="auto")`` before building the dataset. Every node needs acb, the same Python
packages, and the checkpoint at ``model`` (a path every node can read, e.g. shared storage, or
a hub id each node can download). Each actor reserves ``num_gpus_per_actor`` GPUs (default 1
when the cluster has GPUs) and runs its engine on ``cuda``, the GPU Ray gave it.

Output columns, added to every input column (a name that is already there is an error):

- ``generated_text`` (str): only when the engine has a tokenizer (always with ``model=``).
- ``generated_token_ids`` (list of int64).
- ``num_prompt_tokens``, ``num_generated_tokens`` (int64).
- ``finish_reason`` (str): ``"stop"``, ``"length"`` (or ``"error"``, below).
- ``logprobs`` (list of float64, the chosen tokens') when ``sampling.logprobs`` is set, and
  ``top_logprobs`` (per token, a list of ``{"token_id", "logprob"}``) when it is > 0;
  ``prompt_logprobs`` / ``prompt_top_logprobs`` likewise for ``sampling.prompt_logprobs``.
- ``error`` (str or null) with ``on_error="row"``.
- the actor's ``"hostname:pid"`` in ``worker_column``, when one is named.

The columns depend only on the predictor's settings, never on a row, so that every block has
the same schema.

What is verified where: the tests (CPU, a local Ray with two one-CPU actors and a tiny model)
check that every output row equals a single in-process ``Engine.generate_batch`` over the same
prompts (token ids, text, chats; numpy and pandas batches), that both actors did work, the
column types, per-row sampling, error rows, and that the engine stops with the predictor.
Placement on GPUs (``num_gpus``, one engine per GPU), multi-node clusters and the speed-up of
several devices need a multi-GPU run and are not covered here.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Union

import numpy as np

try:
    import ray
    import ray.data
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        f"acb.distributed.ray needs Ray Data: pip install -e '.[ray]' in acb's checkout ({exc})"
    ) from None

from acb.api import scoring
from acb.api.engine import Engine
from acb.config import ContinuousBatchingConfig
from acb.errors import RequestFailedError
from acb.outputs import RequestStatus
from acb.sampling_params import SamplingParams, with_overrides

if TYPE_CHECKING:
    import pandas as pd  # type: ignore[import-untyped]  # no stubs in the test install
    import torch

    from acb.api.handles import SyncRequestHandle
    from acb.outputs import GenerationOutput

__all__ = ["AcbPredictor", "generate_dataset"]

logger = logging.getLogger(__name__)

# what map_batches hands the predictor and takes back: batch_format "numpy" or "pandas"
Batch = Union[dict[str, np.ndarray], "pd.DataFrame"]
ModelFactory = Callable[[], tuple[Any, Any]]

_COUNT_COLUMNS = frozenset({"num_prompt_tokens", "num_generated_tokens", "num_cached_tokens"})


class AcbPredictor:
    """A callable class for ``ray.data.Dataset.map_batches``: one :class:`acb.Engine` per actor,
    started when Ray constructs it and kept for the actor's life; each call generates for every
    row of a batch at once (the engine batches them) and returns the batch with the output
    columns added, in the batch's row order.

    Ray builds it from ``fn_constructor_kwargs``:

    Args:
        model: a checkpoint (local directory or hub id), loaded with
            ``acb.Engine.from_pretrained(model, config, dtype=dtype, device=device, **model_kwargs)``.
        model_factory: instead of ``model``, a zero-argument callable returning ``(model,
            tokenizer)`` (tokenizer may be None: token-id prompts only, no ``generated_text``).
            It runs in the actor, so it must pickle (a module-level function, or a
            ``functools.partial`` of one); build the model there, not in the driver.
        config: the engine's :class:`acb.ContinuousBatchingConfig`, or a dict of its fields.
        sampling: :class:`acb.SamplingParams` for every row, or a dict of its fields.
        dtype: the checkpoint's dtype (``"auto"``: as saved). Not applied to ``model_factory``.
        device: where the model runs; default ``"cuda"`` when the actor sees a GPU, else ``"cpu"``.
            Applied to the model of ``model_factory`` too.
        model_kwargs: more keyword arguments for ``from_pretrained`` (``revision``...).
        prompt_column: the column of prompts. A row's prompt is text (needs the tokenizer), a
            list of token ids, or a chat: a list of ``{"role", "content"}`` messages, rendered with
            the tokenizer's chat template (``chat_template_kwargs`` go to it).
        sampling_column: a column of per-row overrides, if the batch has it: a dict of
            :class:`SamplingParams` fields (or null) laid over ``sampling``. Null fields are not
            overrides (Arrow gives every row of a struct column every key).
        on_error: ``"raise"``: a row the engine rejects (empty, too long, bad override) or that
            fails fails the batch, and Ray the job. ``"row"``: such a row gets ``finish_reason``
            ``"error"`` and the message in an ``error`` column; the other rows are unaffected.
        worker_column: if set, a column naming the actor (``"hostname:pid"``) that made each row.
        continuations_column: if set, the predictor scores instead of generating: each row's
            prompt is a context and this column holds its continuations (a list of texts or of
            token-id lists), scored with :meth:`acb.Engine.score_batch` (the prefix cache is read
            and filled across the batch's rows; nothing is sampled). The output columns are then
            ``continuation_logprobs`` (per continuation, its total logprob),
            ``continuation_token_logprobs`` (per continuation, its tokens'), ``continuation_greedy``
            (per continuation, whether greedy decoding would produce it) and ``num_cached_tokens``.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        model_factory: ModelFactory | None = None,
        config: ContinuousBatchingConfig | Mapping[str, Any] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        model_kwargs: Mapping[str, Any] | None = None,
        prompt_column: str = "prompt",
        sampling_column: str = "sampling_params",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        on_error: Literal["raise", "row"] = "raise",
        worker_column: str | None = None,
        continuations_column: str | None = None,
    ) -> None:
        if (model is None) == (model_factory is None):
            raise ValueError("AcbPredictor needs exactly one of model (a checkpoint path) or model_factory")
        if on_error not in ("raise", "row"):
            raise ValueError(f"on_error must be 'raise' or 'row', got {on_error!r}")
        cfg = ContinuousBatchingConfig(**config) if isinstance(config, Mapping) else config
        self.sampling = SamplingParams(**sampling) if isinstance(sampling, Mapping) else sampling or SamplingParams()
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be an acb.SamplingParams or a dict, got {type(self.sampling).__name__}")
        self.prompt_column = prompt_column
        self.sampling_column = sampling_column
        self.chat_template_kwargs = dict(chat_template_kwargs) if chat_template_kwargs else None
        self.on_error = on_error
        self.worker_column = worker_column
        self.continuations_column = continuations_column
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        device = device or _default_device()
        if model is not None:
            engine = Engine.from_pretrained(model, cfg, dtype=dtype, device=device, **(model_kwargs or {}))
        else:
            assert model_factory is not None
            hf_model, tokenizer = model_factory()
            engine = Engine(hf_model.to(device), cfg, tokenizer=tokenizer)
        engine.start()
        self.engine = engine
        # Stops the engine when the predictor is collected (Ray Data drops its actors' UDFs at the
        # end of the operator) or, failing that, at interpreter exit; holds the engine, not self.
        self._stop = weakref.finalize(self, functools.partial(engine.shutdown, timeout=60))
        if (self.sampling.merged_over(engine.defaults).n or 1) > 1:
            self.close()
            raise ValueError("n > 1 is not supported here (one output row per input row): repeat the rows instead")
        self.columns = self._output_columns()
        logger.info("acb engine started in %s on %s", self.worker, device)

    def _output_columns(self) -> list[str]:
        if self.continuations_column is not None:
            cols = ["continuation_logprobs", "continuation_token_logprobs", "continuation_greedy", "num_cached_tokens"]
            if self.on_error == "row":
                cols.append("error")
            if self.worker_column is not None:
                cols.append(self.worker_column)
            return cols
        cols = ["generated_token_ids", "num_prompt_tokens", "num_generated_tokens", "finish_reason"]
        if self.engine.tokenizer is not None:
            cols.insert(0, "generated_text")
        for name, k in (("logprobs", self.sampling.logprobs), ("prompt_logprobs", self.sampling.prompt_logprobs)):
            if k is not None:
                cols.append(name)
                if k > 0:
                    cols.append(name.replace("logprobs", "top_logprobs"))
        if self.on_error == "row":
            cols.append("error")
        if self.worker_column is not None:
            cols.append(self.worker_column)
        return cols

    def close(self) -> None:
        """Stop the engine (cancelling what is still running); the predictor is unusable after.
        Runs by itself when the predictor is collected or the process exits."""
        self._stop()

    def __call__(self, batch: Batch) -> Batch:
        """Generate for every row of ``batch`` (a dict of numpy arrays or a pandas DataFrame);
        returns the same kind of batch with the output columns added."""
        if isinstance(batch, dict):
            names = list(batch)
        elif hasattr(batch, "assign"):
            names = list(batch.columns)
        else:
            raise TypeError(f"AcbPredictor takes batch_format 'numpy' or 'pandas', got a {type(batch).__name__}")
        clash = sorted(set(names) & set(self.columns))
        if clash:
            raise ValueError(f"the batch already has output column(s) {clash}: drop or rename them first")
        if self.prompt_column not in names:
            raise KeyError(f"the batch has no prompt column {self.prompt_column!r} (its columns: {names})")
        prompts = [_plain(p) for p in batch[self.prompt_column]]
        if self.continuations_column is not None:
            if self.continuations_column not in names:
                raise KeyError(
                    f"the batch has no continuations column {self.continuations_column!r} (its columns: {names})"
                )
            columns = self._score(prompts, [_plain(c) for c in batch[self.continuations_column]])
        else:
            overrides = list(batch[self.sampling_column]) if self.sampling_column in names else [None] * len(prompts)
            columns = self._generate(prompts, overrides)
        if isinstance(batch, dict):
            return {**batch, **{name: _column(name, values) for name, values in columns.items()}}
        return batch.assign(**columns)

    def _generate(self, prompts: list[Any], overrides: list[Any]) -> dict[str, list[Any]]:
        """Submit every row, then collect the outputs in row order: the engine runs them together."""
        handles: list[SyncRequestHandle | None] = []
        errors: list[str | None] = [None] * len(prompts)
        outputs: list[GenerationOutput | None] = []
        try:
            for i, (prompt, override) in enumerate(zip(prompts, overrides)):
                try:
                    handles.append(
                        self.engine.submit(
                            prompt, self._row_sampling(override), chat_template_kwargs=self.chat_template_kwargs
                        )
                    )
                except (ValueError, TypeError) as exc:
                    if self.on_error == "raise":
                        raise type(exc)(f"row {i} of the batch: {exc}") from None
                    handles.append(None)
                    errors[i] = f"{type(exc).__name__}: {exc}"
            for i, handle in enumerate(handles):
                if handle is None:
                    outputs.append(None)
                    continue
                try:
                    outputs.append(handle.result())
                except RequestFailedError as exc:  # the engine lives on; EngineDeadError propagates
                    if self.on_error == "raise":
                        raise
                    outputs.append(exc.output)
                    errors[i] = str(exc)
        except BaseException:
            for h in handles:  # the engine outlives this batch; its requests must not
                if h is not None:
                    h.cancel()
            raise
        return self._columns(outputs, errors)

    def _score(self, contexts: list[Any], continuations: list[Any]) -> dict[str, list[Any]]:
        """Score every row's continuations in one ``score_batch`` (rows sharing a prefix meet in
        the cache). With ``on_error="row"`` a row the engine refuses or fails gets an ``error``."""
        items = list(zip(contexts, continuations))
        errors: list[str | None] = [None] * len(items)
        if self.on_error == "row":  # find the rows refused at submit, one by one (rare: the error path)
            for i, item in enumerate(items):
                try:
                    scoring.plan_batch([item], 0, self.engine.tokenizer)
                except (ValueError, TypeError) as exc:
                    errors[i] = f"{type(exc).__name__}: {exc}"
        good = [i for i, e in enumerate(errors) if e is None]
        try:
            outs = self.engine.score_batch([items[i] for i in good], progress_bar=False)
        except (ValueError, TypeError) as exc:
            if self.on_error == "raise":
                raise type(exc)(f"a row of the batch: {exc}") from None
            outs = []  # refused by the engine (vocabulary, length): score the rows alone to name them
            for i in list(good):
                try:
                    outs.extend(self.engine.score_batch([items[i]], progress_bar=False))
                except (ValueError, TypeError) as row_exc:
                    errors[i] = f"{type(row_exc).__name__}: {row_exc}"
                    good.remove(i)
        by_row = dict(zip(good, outs))
        cols: dict[str, list[Any]] = {name: [] for name in self.columns}
        for i in range(len(items)):
            out = by_row.get(i)
            if out is not None and out.status != RequestStatus.FINISHED:
                if self.on_error == "raise":
                    raise RequestFailedError(f"row {i} of the batch: {out.error}")
                errors[i] = out.error or out.status.name
            ok = out is not None and errors[i] is None
            row: dict[str, Any] = dict(
                continuation_logprobs=[c.logprob for c in out.continuations] if ok and out else [],
                continuation_token_logprobs=[list(c.logprobs) for c in out.continuations] if ok and out else [],
                continuation_greedy=[c.greedy for c in out.continuations] if ok and out else [],
                num_cached_tokens=out.num_cached_tokens if out is not None else 0,
                error=errors[i],
            )
            if self.worker_column is not None:
                row[self.worker_column] = self.worker
            for name in self.columns:
                cols[name].append(row[name])
        return cols

    def _row_sampling(self, override: Any) -> SamplingParams:
        if _is_missing(override):
            return self.sampling
        if not isinstance(override, Mapping):
            raise TypeError(
                f"{self.sampling_column!r} must hold dicts of SamplingParams fields, got {type(override).__name__}"
            )
        given = {k: _plain(v) for k, v in override.items() if v is not None}
        params = with_overrides(self.sampling_column, self.sampling, given)
        assert params is not None  # self.sampling is not None
        if (params.n or 1) > 1:
            raise ValueError("n > 1 is not supported here (one output row per input row): repeat the rows instead")
        return params

    def _columns(self, outputs: Sequence[GenerationOutput | None], errors: list[str | None]) -> dict[str, list[Any]]:
        cols: dict[str, list[Any]] = {name: [] for name in self.columns}
        for out, error in zip(outputs, errors):
            if out is None:  # rejected at submit (on_error="row")
                row: dict[str, Any] = dict(
                    generated_text=None,
                    generated_token_ids=[],
                    num_prompt_tokens=0,
                    num_generated_tokens=0,
                    finish_reason="error",
                    logprobs=[],
                    top_logprobs=[],
                    prompt_logprobs=[],
                    prompt_top_logprobs=[],
                )
            else:
                row = dict(
                    generated_text=out.text,
                    generated_token_ids=list(out.generated_tokens),
                    num_prompt_tokens=len(out.prompt_ids),
                    num_generated_tokens=len(out.generated_tokens),
                    finish_reason="error"
                    if error is not None or out.finish_reason is None
                    else out.finish_reason.value,
                    logprobs=list(out.logprobs),
                    top_logprobs=_tops(out.top_logprobs),
                    prompt_logprobs=list(out.prompt_logprobs or []),
                    prompt_top_logprobs=_tops(out.prompt_top_logprobs),
                )
            row["error"] = error
            if self.worker_column is not None:
                row[self.worker_column] = self.worker
            for name in self.columns:
                cols[name].append(row[name])
        return cols


def generate_dataset(
    ds: ray.data.Dataset,
    *,
    model: str | None = None,
    model_factory: ModelFactory | None = None,
    concurrency: int | tuple[int, int] = 1,
    num_gpus_per_actor: float | None = None,
    num_cpus_per_actor: float | None = None,
    batch_size: int = 64,
    batch_format: Literal["numpy", "pandas"] = "numpy",
    max_concurrent_batches: int = 1,
    **predictor_kwargs: Any,
) -> ray.data.Dataset:
    """``ds`` with the output columns of :class:`AcbPredictor` added (lazy, as every Ray Data
    transform: it runs when the result is consumed or written).

    Args:
        concurrency: the number of actors (engines), or ``(min, max)`` for a pool Ray scales.
        num_gpus_per_actor: GPUs each actor reserves. Default: 1 when the Ray cluster (or, before
            ``ray.init``, this machine) has GPUs, else 0.
        num_cpus_per_actor: CPUs each actor reserves. Default: 1 without GPUs (Ray then gives
            torch that many threads), else Ray's default.
        batch_size: rows handed to an engine at once; larger keeps a GPU busier, at the cost of
            memory held by rows in flight.
        max_concurrent_batches: batches each actor works on at once (threads sharing its one
            engine), so that the next batch's rows fill the engine while the previous batch's
            longest rows finish. Values above 1 need a Ray whose ``ActorPoolStrategy`` has
            ``enable_true_multi_threading``.
        predictor_kwargs: the other arguments of :class:`AcbPredictor` (``config``, ``sampling``,
            ``prompt_column``, ``on_error``...).
    """
    if num_gpus_per_actor is None:
        num_gpus_per_actor = 1 if _cluster_has_gpus() else 0
    if num_cpus_per_actor is None and not num_gpus_per_actor:
        num_cpus_per_actor = 1
    if isinstance(concurrency, int):
        pool: dict[str, Any] = {"size": concurrency}
    else:
        pool = {"min_size": concurrency[0], "max_size": concurrency[1]}
    if max_concurrent_batches > 1:
        import inspect

        if "enable_true_multi_threading" not in inspect.signature(ray.data.ActorPoolStrategy).parameters:
            raise ValueError(
                f"max_concurrent_batches > 1 needs a newer Ray than {ray.__version__} "
                "(ActorPoolStrategy(enable_true_multi_threading=...))"
            )
        pool.update(max_concurrent_calls_per_actor=max_concurrent_batches, enable_true_multi_threading=True)
    return ds.map_batches(
        AcbPredictor,
        compute=ray.data.ActorPoolStrategy(**pool),
        batch_size=batch_size,
        batch_format=batch_format,
        fn_constructor_kwargs={"model": model, "model_factory": model_factory, **predictor_kwargs},
        num_gpus=num_gpus_per_actor or None,
        num_cpus=num_cpus_per_actor,
    )


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _cluster_has_gpus() -> bool:
    """Whether the actors can get GPUs: the cluster's resources once Ray is up (the driver may
    run on a node without one), else this machine."""
    if ray.is_initialized():
        return bool(ray.cluster_resources().get("GPU", 0))
    return _default_device() == "cuda"


def _plain(value: Any) -> Any:
    """A value from an Arrow-backed batch as plain Python: numpy arrays (list columns) and
    scalars become lists and Python numbers, recursively, so that chats are lists of dicts and
    sampling overrides pass acb's type checks."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _is_missing(value: Any) -> bool:
    """None, or pandas' missing value in an object column (NaN, ``pd.NA``)."""
    if value is None:
        return True
    if isinstance(value, Mapping):
        return False
    import pandas as pd  # Ray Data depends on it

    flag = pd.isna(value)
    return isinstance(flag, (bool, np.bool_)) and bool(flag)


def _tops(tops: list[list[tuple[int, float]]] | None) -> list[list[dict[str, Any]]]:
    """Top-k alternatives as lists of ``{"token_id", "logprob"}`` (an Arrow list of structs)."""
    return [[{"token_id": t, "logprob": lp} for t, lp in step] for step in tops or []]


def _column(name: str, values: list[Any]) -> np.ndarray:
    """One output column as a numpy array: the counts as int64, the rest in an object array,
    where lists stay Python lists, which Arrow stores as ``list<...>`` (a numpy array per row
    would become a tensor column) and strings as ``string``."""
    if name in _COUNT_COLUMNS:
        return np.asarray(values, dtype=np.int64)
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column
