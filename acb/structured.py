"""Constrained decoding's grammar layer: what a request asks its output to match, compiled, and
matched token by token.

It owns four things, and is the only module that imports xgrammar (lazily; the extra is
``pip install -e '.[structured]'`` in acb's checkout):

- :class:`StructuredOutputs`, the per-request spec, with vLLM's field names (``json``,
  ``json_object``, ``regex``, ``choice``, ``grammar``) and a stable ``key`` for caching.
- :class:`GrammarCompiler`, one per engine (tokenizer + model vocabulary): compiles specs in a few
  worker processes it holds for its life (:func:`serve_compiles`), so that neither the caller's
  event loop nor the engine thread waits, and so that a compile can be stopped: one past the
  budget's time limit (:class:`acb.grammar_budget.GrammarBudget`) is killed with its process, which
  a fresh one replaces, and closing kills the ones compiling without waiting. Specs over the
  budget's static limits are refused before any compile, and so is a grammar no output can meet (it
  matches no text, or the vocabulary has no token to start it). A bounded LRU cache keyed by
  ``spec.key`` shares compiles. The idle workers of a closed compiler stay ready for a while for the
  next compiler of the same vocabulary in this process (:class:`_WorkerPool`): a process that
  builds several engines starts its workers (a fresh interpreter importing torch and xgrammar,
  seconds of CPU each) once.
- :class:`Matcher`, one per request, on the engine thread: advances with each sampled token and
  fills that request's row of the step's token bitmask.
- :func:`allocate_bitmask` / :func:`apply_bitmask`: the bitmask is int32 ``[rows, ceil(V / 32)]``,
  bit ``t % 32`` of word ``t // 32`` set iff token ``t`` is allowed (xgrammar's layout). Matchers
  fill it on the host; :func:`apply_bitmask` sets the masked logits to ``-inf`` on the logits'
  device.

How the engine uses it, per step::

    bitmask = allocate_bitmask(max_rows, vocab_size, pin_memory=True)   # once; host staging
    for row, m in structured_rows:            # the step's one loop over structured requests
        m.fill_mask(bitmask, row)
    apply_bitmask(logits, bitmask[:num_rows], rows)    # async H2D copy from pinned memory
    ... the other logits processors, then sampling ...
    for row, m in structured_rows:
        m.accept(sampled[row])

Dead ends: a row whose mask, less the tokens the later processors never let it sample (stop tokens
that ``min_new_tokens`` holds back, ``-inf`` logit biases: ``SamplingParams.never_sampled``), allows
nothing cannot go on: ``acb.core.grammar_masks.GrammarMasks`` finds it as it fills the step's masks
for the scheduler (:meth:`GrammarCompiler.dead_ends`, which opens that row so the step samples from
finite logits); the engine drops the token sampled there and finishes the request with
``FinishReason.GRAMMAR``. A token the grammar rejects (NaN logits) ends it the same way.

End of a grammar: once the text is complete, the mask allows the stop tokens (the tokenizer's
``eos_token_id`` unless ``stop_token_ids`` is given to the compiler), alone when the grammar cannot
go on, or alongside the tokens that continue it. Sampling a stop token is accepted and terminates
the matcher (:meth:`Matcher.is_terminated`); the engine then finishes the request as it does for any
stop token. A request that reaches its length limit first ends with ``length`` and its text is a
prefix of a match, not a match.

Vocabulary: ``vocab_size`` is the model's (the logits' width), which may exceed ``len(tokenizer)``
(lm_head padded to a multiple of 64 or 128); ids outside the tokenizer, and its special tokens other
than the stop tokens, are never allowed by a mask.

Async batching: the mask of step N+1 depends on the token sampled in N, so a structured request's
row is filled only after ``accept`` of N's token; the other rows do not wait for it.

Against xgrammar 0.2.8, JSON grammars get two rule rewrites (``_JSON_FIXES``, ``_COMPACT_FIXES``):
length-bounded strings admitted raw control characters, and unconstrained values put ``", "``
between items of compact JSON.
"""

from __future__ import annotations

import contextlib
import functools
import json as _json
import os
import queue
import re
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from time import monotonic, perf_counter
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import torch

from acb.errors import EngineNotRunningError, InvalidRequestError
from acb.grammar_budget import GrammarBudget
from acb.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "CacheInfo",
    "CompiledGrammar",
    "GrammarCompiler",
    "Matcher",
    "StructuredOutputs",
    "allocate_bitmask",
    "apply_bitmask",
]


_INSTALL_HINT = "pip install -e '.[structured]' in acb's checkout"


def _xgr() -> ModuleType:
    """xgrammar, imported on first use (sys.modules makes later calls a dict lookup)."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ImportError(f"constrained decoding needs xgrammar: {_INSTALL_HINT} ({exc})") from None
    return xgrammar


# ---------------------------------------------------------------------------------------------
# compiling


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled against one compiler's vocabulary; immutable, shared by every request with the
    same ``spec.key`` (and across threads). Make a :class:`Matcher` per request from it."""

    spec: StructuredOutputs
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    compile_s: float  # wall time of the compile, as the caller's side saw it (a worker process's)
    _handle: xgrammar.CompiledGrammar = field(repr=False)
    # ids the matcher would reject whatever the state (padding beyond the tokenizer, special tokens
    # that are not stop tokens): rejected here without calling xgrammar, which logs a warning each time
    _never: frozenset[int] = field(repr=False)
    # the most tokens (the stop token not counted) any output can have, when the spec bounds it
    # (a choice: its longest UTF-8 byte length; a grammar whose only match is empty: 0); None: unbounded
    # or not known before generating
    max_tokens: int | None = None

    @property
    def memory_bytes(self) -> int:
        """xgrammar's estimate of this grammar's memory (its token-mask cache dominates)."""
        return int(self._handle.memory_size_bytes)

    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar."""
        return Matcher(self)


class CacheInfo(NamedTuple):
    """:meth:`GrammarCompiler.cache_info`, as ``functools.lru_cache``'s: ``misses`` counts compiles."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _xgr_message(exc: BaseException) -> str:
    """xgrammar's message without the ``[hh:mm:ss] /project/cpp/file.cc:123: `` its C++ checks prepend."""
    return _XGR_PREFIX.sub("", str(exc)).strip()


_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder holding acb/

# how long a fresh worker process may take to import xgrammar and read the vocabulary (not part of
# any request's compile budget: a loaded machine takes seconds)
_WORKER_START_S = 300.0


class GrammarCompiler:
    """Compiles :class:`StructuredOutputs` for one tokenizer and model vocabulary; one per engine.

    ``vocab_size`` is the model's: the width of its logits, which may exceed ``len(tokenizer)``.
    ``stop_token_ids`` are the tokens that end a complete match (default: the tokenizer's
    ``eos_token_id``); give the model's generation-config EOS ids when there are several.

    Compiles run in ``workers`` child processes (each with up to ``compile_threads`` xgrammar
    threads), started with the compiler, so that a compile can be stopped: one that runs past
    ``budget.compile_timeout_s`` is killed, its request refused with a ``ValueError`` naming the
    limit, and a fresh process takes its place (a killed compile holds no capacity). A spec over
    ``budget``'s static limits is refused before any compile. A worker sends its compiled grammar
    back serialised (xgrammar's ``serialize_json``); the grammar's matchers run in this process.
    The workers are this compiler's alone while it is open; an earlier compiler's idle ones with
    the same vocabulary, threads and stop tokens are taken ready when there are any.

    Thread-safe: :meth:`submit` and :meth:`compile_now` may be called from any thread. The cache
    holds the ``cache_size`` most recently used grammars (a failed compile is not kept, so a fixed
    spec compiles anew). :meth:`close` kills the workers that are compiling at once, without
    waiting for their compiles, and leaves the idle ones to a later compiler (they exit after
    ``_IDLE_S`` unused).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        *,
        stop_token_ids: Sequence[int] | None = None,
        workers: int = 2,
        compile_threads: int = 4,
        cache_size: int = 256,
        budget: GrammarBudget | None = None,
    ) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive int (the model's logits width), got {vocab_size!r}")
        for name, n in (("workers", workers), ("compile_threads", compile_threads), ("cache_size", cache_size)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
        if budget is not None and not isinstance(budget, GrammarBudget):
            raise TypeError(f"budget must be an acb.grammar_budget.GrammarBudget, got {type(budget).__name__}")
        stops = None if stop_token_ids is None else [int(t) for t in stop_token_ids]
        if stops is not None and (not stops or not all(0 <= t < vocab_size for t in stops)):
            raise ValueError(f"stop_token_ids must be non-empty ids in [0, {vocab_size}), got {stop_token_ids!r}")
        xgr = _xgr()
        # TokenizerInfo decodes the whole vocabulary once (~1 s for 150k tokens); ids in
        # [len(tokenizer), vocab_size) become special tokens, which no mask allows
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        self.vocab_size = vocab_size
        self.stop_token_ids: tuple[int, ...] = tuple(self._info.stop_token_ids)
        if not self.stop_token_ids:
            raise ValueError("the tokenizer has no eos_token_id: pass stop_token_ids")
        self._never = frozenset(self._info.special_token_ids) - frozenset(self.stop_token_ids)
        self.budget = budget if budget is not None else GrammarBudget()
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._hits = 0
        self._misses = 0
        self._closed = False
        # the workers: one parent thread each, which owns one child process at a time
        self._jobs: queue.SimpleQueue[tuple[StructuredOutputs, Future[CompiledGrammar]] | None] = queue.SimpleQueue()
        setup = _WorkerSetup(self._info.serialize_json(), compile_threads, tuple(sorted(self.stop_token_ids)))
        self._workers = [_POOL.take(setup) for _ in range(workers)]
        self._threads = [
            threading.Thread(target=self._serve, args=(w,), name=f"acb-grammar-{i}", daemon=True)
            for i, w in enumerate(self._workers)
        ]
        for t in self._threads:
            t.start()

    def bitmask(self, rows: int) -> torch.Tensor:
        """A host bitmask for ``rows`` rows of this vocabulary, all allowed (:func:`allocate_bitmask`).

        Args:
            rows: how many rows.

        Returns:
            An int32 ``[rows, ceil(vocab_size / 32)]`` CPU tensor, every bit set.
        """
        return allocate_bitmask(rows, self.vocab_size)

    def dead_ends(self, bitmask: torch.Tensor, rows: Sequence[int], excluded: Sequence[Collection[int]]) -> list[int]:
        """The rows of a filled bitmask that allow no token once ``excluded`` ones are taken out:
        a request there cannot continue its grammar (host-side, no device sync).

        Args:
            bitmask: a host bitmask its matchers filled (:meth:`Matcher.fill_mask`).
            rows: the rows to look at.
            excluded: per row, the tokens the other processors can never sample there (stop
                tokens that ``min_new_tokens`` suppresses, ``-inf`` logit biases); may be empty.

        Returns:
            The rows (among ``rows``) with nothing left to sample; they are set to allow every
            token, so that the step samples something there (to be dropped), never from a row
            of ``-inf`` only.
        """
        if not rows:
            return []
        index = torch.as_tensor(list(rows), dtype=torch.long)
        words = bitmask.index_select(0, index)  # [len(rows), W] copies: the bitmask stays as filled
        for k, ex in enumerate(excluded):
            for t in ex:
                if 0 <= t < self.vocab_size:
                    w, b = divmod(int(t), 32)
                    v = int(words[k, w]) & ~(1 << b)
                    words[k, w] = v - (1 << 32) if v >= 1 << 31 else v
        empty = ~words.ne(0).any(dim=1)
        dead = [rows[k] for k in empty.nonzero().flatten().tolist()]
        if dead:
            bitmask[dead] = -1
        return dead

    def submit(self, spec: StructuredOutputs) -> Future[CompiledGrammar]:
        """The compiled grammar for ``spec``, as a future (``asyncio.wrap_future`` to await it).

        A cached or in-flight compile of the same ``spec.key`` is shared: every caller gets the same
        future and so the same :class:`CompiledGrammar`. A spec that cannot compile (xgrammar's
        message), that matches no text with this vocabulary, or whose compile runs past the
        budget's time limit fails the future with a ``ValueError``; a compile cut off by
        :meth:`close` fails it with :class:`acb.errors.EngineNotRunningError`.

        Args:
            spec: what the output must match.

        Returns:
            The future of its :class:`CompiledGrammar`.

        Raises:
            ValueError: the spec is over the budget's static limits (checked before compiling).
            TypeError: ``spec`` is not a :class:`StructuredOutputs`.
            EngineNotRunningError: the compiler is closed.
        """
        if not isinstance(spec, StructuredOutputs):
            raise TypeError(f"spec must be a StructuredOutputs, got {type(spec).__name__}")
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                self._hits += 1
                return fut
        self.budget.check(spec)  # (outside the lock: a big spec's check should not hold up cache hits)
        with self._lock:
            if self._closed:
                raise EngineNotRunningError("the grammar compiler is closed (the engine stopped)")
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                self._hits += 1
                return fut
            self._misses += 1
            fut = Future()
            self._cache[spec.key] = fut
            while len(self._cache) > self._cache_size:
                # holders of an evicted future keep it; only later submits compile again
                self._cache.popitem(last=False)
            self._jobs.put((spec, fut))
        fut.add_done_callback(functools.partial(self._forget_failure, spec.key))
        return fut

    def compile_now(self, spec: StructuredOutputs, timeout: float | None = None) -> CompiledGrammar:
        """:meth:`submit` and wait (blocks the calling thread): for validating a spec at submit time.

        Args:
            spec: what the output must match.
            timeout: seconds to wait (None: until the compile ends, at most the budget's limit
                once it runs).

        Returns:
            The :class:`CompiledGrammar`.

        Raises:
            ValueError: the spec is over the budget, cannot compile, matches no text with this
                vocabulary, or its compile ran past the time limit.
            TimeoutError: ``timeout`` passed first (the compile goes on and stays cached).
            EngineNotRunningError: the compiler was closed.
        """
        return self.submit(spec).result(timeout)

    def cache_info(self) -> CacheInfo:
        """The cache's counters (``misses`` counts compiles started)."""
        with self._lock:
            return CacheInfo(self._hits, self._misses, self._cache_size, len(self._cache))

    def close(self) -> None:
        """Kill the worker processes that are compiling now, and fail every compile not done yet
        with :class:`acb.errors.EngineNotRunningError`. Never waits for a compile; idempotent. The
        idle workers go back to the process's pool, ready for the next compiler."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for w in self._workers:
            w.interrupt()  # a parent thread waiting on its compile sees the pipe close, and ends
        closed = EngineNotRunningError(
            "the grammar compiler was closed (the engine stopped) before the constraint compiled"
        )
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                _fail(job[1], closed)
        for _ in self._threads:
            self._jobs.put(None)

    def _forget_failure(self, key: str, fut: Future[CompiledGrammar]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]

    def _serve(self, worker: _Worker) -> None:
        """A parent thread: starts its worker process (unless it came ready from the pool), then
        hands it queued compiles, one at a time; at the end gives it back to the pool."""
        try:
            self._serve_jobs(worker)
        finally:
            _POOL.give_back(worker)

    def _serve_jobs(self, worker: _Worker) -> None:
        with contextlib.suppress(EngineNotRunningError):  # (closed before it started: the loop ends)
            worker.start()
        while True:
            job = self._jobs.get()
            if job is None or self._closed:
                if job is not None:
                    _fail(job[1], EngineNotRunningError("the grammar compiler was closed (the engine stopped)"))
                return
            spec, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self._run(worker, spec))
            except BaseException as exc:  # noqa: BLE001 - every failure is the future's, never this thread's end
                fut.set_exception(
                    exc
                    if not self._closed
                    else EngineNotRunningError(
                        f"the grammar compiler was closed (the engine stopped) before the {spec.kind} constraint compiled"
                    )
                )

    def _run(self, worker: _Worker, spec: StructuredOutputs) -> CompiledGrammar:
        limit = self.budget.compile_timeout_s
        t0 = perf_counter()
        reply = worker.compile(spec, limit)
        if reply is None:
            raise InvalidRequestError(
                f"compiling the {spec.kind} constraint took longer than {limit:g} s, the limit "
                "(ContinuousBatchingConfig.grammar_compile_timeout_s); it was stopped",
                "structured_outputs",
            )
        ok, text, max_tokens = reply
        if not ok:
            raise InvalidRequestError(text, "structured_outputs")
        # (xgrammar releases the GIL while it reads the grammar back: other threads go on)
        handle = _xgr().CompiledGrammar.deserialize_json(text, self._info)
        return CompiledGrammar(
            spec=spec,
            vocab_size=self.vocab_size,
            stop_token_ids=self.stop_token_ids,
            compile_s=perf_counter() - t0,
            _handle=handle,
            _never=self._never,
            max_tokens=max_tokens,
        )


def _fail(fut: Future[CompiledGrammar], exc: BaseException) -> None:
    with contextlib.suppress(InvalidStateError):  # (done already: a result, or cancelled)
        fut.set_exception(exc)


class _WorkerSetup(NamedTuple):
    """What a worker process needs: the vocabulary (xgrammar's ``TokenizerInfo`` as JSON), its
    thread count, and the stop tokens (to tell which first tokens continue a grammar). Equal
    setups can share a worker (:class:`_WorkerPool`)."""

    info_json: str
    threads: int
    stop_token_ids: tuple[int, ...]


def _worker_env() -> dict[str, str]:
    """A worker's environment, from this process's as it is now."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # a worker never needs a device
    # the worker imports acb from where this process did (a checkout on sys.path, say)
    env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


class _Worker:
    """One compile worker process (``python -c "...serve_compiles(...)"``: a fresh interpreter, so
    nothing of the parent's threads or devices is inherited), replaced when it dies or a compile
    runs past its limit. Held by one compiler's parent thread at a time (:class:`_WorkerPool` lends
    it); :meth:`interrupt` may come from any thread."""

    def __init__(self, setup: _WorkerSetup, launch: tuple[str, str]) -> None:
        self.setup = setup
        self.launch = launch  # (interpreter, PYTHONPATH): a worker is lent only where a fresh one would run the same
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._send: Connection | None = None
        self._recv: Connection | None = None
        self._ready = False  # the process has the setup, and said so
        self._busy = False  # in compile(): sending, compiling, or (re)starting for a job
        self._closing = False  # its holder closed: no new job; interrupt() killed a running one
        self._killed = False  # killed for good: never started again, never lent again

    def start(self) -> None:
        """Spawn the process now, unless it runs (it imports xgrammar meanwhile)."""
        if self._proc is None:
            self._start()

    def alive(self) -> bool:
        """Whether it can be lent again: its process runs and was never killed for good."""
        with self._lock:
            return not self._killed and self._proc is not None and self._proc.poll() is None

    def _start(self) -> None:
        """Spawn the process (it imports xgrammar meanwhile); the setup is sent with the first job.
        The spawn happens on the pool's thread: on Linux the process dies with the thread that
        spawned it (:func:`serve_compiles`), so that must be one that lives as long as this process."""
        with self._lock:
            if self._killed:
                raise EngineNotRunningError("the grammar compiler was closed (the engine stopped)")
        jobs_r, jobs_w = os.pipe()
        results_r, results_w = os.pipe()
        argv = [
            sys.executable,
            "-c",
            f"import acb.structured as s; s.serve_compiles({jobs_r}, {results_w}, {os.getpid()})",
        ]
        try:
            # its own session: a terminal's Ctrl-C is the parent's to handle; the worker ends
            # when the parent's end of the pipe closes
            proc = _POOL.spawn(
                lambda: subprocess.Popen(
                    argv,
                    pass_fds=(jobs_r, results_w),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    env=_worker_env(),
                    start_new_session=True,
                )
            )
        except BaseException:
            os.close(jobs_w)
            os.close(results_r)
            raise
        finally:
            os.close(jobs_r)
            os.close(results_w)
        with self._lock:
            self._proc = proc
            self._send = Connection(jobs_w, readable=False)
            self._recv = Connection(results_r, writable=False)
            self._ready = False
            killed = self._killed
        if killed:  # (killed for good while it was spawned: it never runs a job)
            self._stop_process()
            raise EngineNotRunningError("the grammar compiler was closed (the engine stopped)")

    def compile(self, spec: StructuredOutputs, limit: float | None) -> tuple[bool, str, int | None] | None:
        """Compile in the process: ``(ok, serialised grammar or error message, max tokens)``,
        or ``None`` when ``limit`` seconds passed first (the process is then killed and replaced)."""
        with self._lock:
            if self._closing or self._killed:
                raise EngineNotRunningError("the grammar compiler was closed (the engine stopped)")
            self._busy = True
        try:
            return self._compile(spec, limit)
        finally:
            with self._lock:
                self._busy = False

    def _compile(self, spec: StructuredOutputs, limit: float | None) -> tuple[bool, str, int | None] | None:
        if self._proc is None or self._proc.poll() is not None:
            self._restart()
        send, recv, proc = self._send, self._recv, self._proc
        assert send is not None and recv is not None and proc is not None  # (_start set them)
        try:
            if not self._ready:  # the first job waits for the import (not part of its budget)
                self._ready = self._wait_ready(send, recv, proc)
            send.send_bytes(_json.dumps(spec.to_dict()).encode())
            if not recv.poll(limit):
                self._restart()
                return None
            reply = recv.recv_bytes()
        except (EOFError, OSError):
            code = proc.wait()
            if self._killed:
                raise EngineNotRunningError("the grammar compiler was closed (the engine stopped)") from None
            self._restart()
            raise InvalidRequestError(
                f"the grammar compile worker died (exit code {code}) compiling the {spec.kind} constraint",
                "structured_outputs",
            ) from None
        head, body = reply[:1], reply[1:]
        if head == b"+":
            meta, _, text = body.partition(b"\n")
            return True, text.decode(), _json.loads(meta)["max_tokens"]
        return False, body.decode(), None

    def _wait_ready(self, send: Connection, recv: Connection, proc: subprocess.Popen[bytes]) -> bool:
        """Send the setup and wait for the worker's ``ready``; a worker that cannot start is a
        RuntimeError (the server's fault, not the spec's), and is replaced."""
        setup = self.setup
        try:
            send.send_bytes(_json.dumps({"threads": setup.threads, "stops": list(setup.stop_token_ids)}).encode())
            send.send_bytes(setup.info_json.encode())
            if recv.poll(_WORKER_START_S) and recv.recv_bytes() == b"ready":
                return True
            why = f"did not start within {_WORKER_START_S:g} s"
        except (EOFError, OSError):
            if self._killed:
                raise EngineNotRunningError("the grammar compiler was closed (the engine stopped)") from None
            why = f"exited with code {proc.wait()} as it started (its error is on stderr)"
        self._restart()
        raise RuntimeError(f"the grammar compile worker {why}")

    def _restart(self) -> None:
        self._stop_process()
        self._start()

    def _stop_process(self) -> None:
        with self._lock:
            proc, send, recv = self._proc, self._send, self._recv
            self._proc = self._send = self._recv = None
        for conn in (send, recv):
            if conn is not None:
                conn.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)  # (a killed process exits at once; this only reaps it)

    def interrupt(self) -> None:
        """Its holder closes: refuse further jobs, and kill the process for good if a job is
        running (the compile waiting on it sees EOF); an idle one is left to be given back."""
        with self._lock:
            self._closing = True
            if self._busy:
                self._killed = True
            proc = self._proc if self._busy else None
        if proc is not None and proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2)  # (a killed process exits at once: this only reaps it)

    def reopen(self) -> None:
        """Lent to a new holder (which has not closed)."""
        with self._lock:
            self._closing = False

    def kill(self) -> None:
        """Kill the process for good (an idle worker the pool ends)."""
        with self._lock:
            self._killed = True
        self._stop_process()


# how long a worker that a closed compiler gave back stays ready for the next compiler, and how
# many such idle workers the process keeps (the oldest go first)
_IDLE_S = 600.0
_MAX_IDLE = 4


class _WorkerPool:
    """The compile worker processes of this process, lent to its compilers: a compiler holds
    ``workers`` of them while it is open, and gives back those still running when it closes
    (ready: the interpreter started, xgrammar imported, the vocabulary read); a later compiler with
    an equal :class:`_WorkerSetup` takes them instead of starting fresh ones, which cost seconds of
    CPU each. A worker killed for good (closed mid-compile) or dead is never lent again; one
    killed for a time limit was replaced by its holder, and goes back running. At most
    ``_MAX_IDLE`` idle workers are kept, each for ``_IDLE_S`` at most.

    Every worker process is spawned by the pool's one thread, which lives as long as this process:
    on Linux a worker dies with the thread that spawned it (``PR_SET_PDEATHSIG``), so a worker
    outlives the compiler that started it but never the process.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[tuple[float, _Worker]] = []  # (given back at, worker), oldest first
        # spawns for the thread to run; None: look at the idle workers' times again
        self._requests: queue.SimpleQueue[
            tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def after_fork(self) -> None:
        """In a forked child: the parent's thread and workers are not this process's (the
        inherited pipe ends close with their objects); start afresh."""
        self._reset()

    def take(self, setup: _WorkerSetup) -> _Worker:
        """An idle running worker of ``setup`` (the one given back last), or a new one not started yet."""
        launch = (sys.executable, _worker_env()["PYTHONPATH"])
        with self._lock:
            for i in reversed(range(len(self._idle))):
                w = self._idle[i][1]
                if w.setup == setup and w.launch == launch and w.alive():
                    del self._idle[i]
                    w.reopen()
                    return w
        return _Worker(setup, launch)

    def give_back(self, worker: _Worker) -> None:
        """A closed compiler's worker: kept idle if it runs, else done with."""
        if not worker.alive():
            worker.kill()  # (reaps it, if it was left running)
            return
        with self._lock:
            self._idle.append((monotonic(), worker))
            evicted = self._idle[:-_MAX_IDLE]
            del self._idle[:-_MAX_IDLE]
        for _, w in evicted:
            w.kill()
        self._wake()
        self._requests.put(None)  # (its idle time starts now)

    def spawn(self, popen: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        """Run ``popen`` on the pool's thread, and wait for its process."""
        fut: Future[subprocess.Popen[bytes]] = Future()
        self._requests.put((popen, fut))
        self._wake()
        return fut.result()

    def _wake(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="acb-grammar-workers", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        """The pool's thread: spawns the worker processes, and ends idle ones past ``_IDLE_S``."""
        while True:
            with self._lock:
                oldest = self._idle[0][0] if self._idle else None
            wait = None if oldest is None else max(0.0, oldest + _IDLE_S - monotonic())
            try:
                request = self._requests.get(timeout=wait)
            except queue.Empty:
                request = None
            if request is not None:
                popen, fut = request
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(popen())
                    except BaseException as exc:  # noqa: BLE001 - the spawner's to raise, never this thread's end
                        fut.set_exception(exc)
            with self._lock:
                now = monotonic()
                expired = [w for t, w in self._idle if now - t >= _IDLE_S]
                self._idle = [(t, w) for t, w in self._idle if now - t < _IDLE_S]
            for w in expired:
                with contextlib.suppress(OSError):  # (whatever ending one costs, this thread goes on: it spawns)
                    w.kill()


_POOL = _WorkerPool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.after_fork)


def serve_compiles(jobs_fd: int, results_fd: int, parent_pid: int | None = None) -> None:
    """A compile worker process's loop (what :class:`GrammarCompiler` starts; not for direct use).

    Reads its setup (thread count, stop tokens, the vocabulary as xgrammar's JSON), says
    ``ready``, then compiles each spec it is sent and sends back ``+{"max_tokens": ...}\\n`` and
    the serialised grammar, or ``-`` and the error message. Ends when the parent closes the pipe,
    and on Linux also when the parent thread that started it ends (the pool's, which lives as long
    as the parent process), however the parent ended (a SIGKILLed server leaves no worker
    compiling for minutes: the pipe is only read between jobs).

    Args:
        jobs_fd: the pipe the parent writes to.
        results_fd: the pipe the parent reads from.
        parent_pid: the parent's pid (the worker exits at once if it is already gone).
    """
    _die_with_parent(parent_pid)
    jobs = Connection(jobs_fd, writable=False)
    results = Connection(results_fd, readable=False)
    xgr = _xgr()
    setup = _json.loads(jobs.recv_bytes())
    info = xgr.TokenizerInfo.deserialize_json(jobs.recv_bytes().decode())
    compiler = xgr.GrammarCompiler(info, max_threads=setup["threads"], cache_enabled=False)
    stops = frozenset(setup["stops"])
    results.send_bytes(b"ready")
    while True:
        try:
            spec = StructuredOutputs(**_json.loads(jobs.recv_bytes()))
        except (EOFError, OSError):  # the parent closed the pipe (or died): done
            return
        try:
            handle = _compile_spec(compiler, spec)
            max_tokens = _check_startable(handle, spec, info, stops)
            reply = b"+" + _json.dumps({"max_tokens": max_tokens}).encode() + b"\n" + handle.serialize_json().encode()
        except ValueError as exc:
            reply = b"-" + str(exc).encode()
        try:
            results.send_bytes(reply)
        except OSError:
            return


def _die_with_parent(parent_pid: int | None) -> None:
    """Linux: have the kernel SIGKILL this process when the thread that spawned it ends
    (``PR_SET_PDEATHSIG``); elsewhere the worker ends when its pipe closes, between jobs."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:  # it died before the prctl took hold
        os._exit(0)


def _compile_spec(xc: xgrammar.GrammarCompiler, spec: StructuredOutputs) -> xgrammar.CompiledGrammar:
    """The one place a spec's kind becomes an xgrammar call."""
    payload = spec.key.split("|", 2)[2]  # the regex or grammar text, or the canonical schema
    try:
        if spec.kind == "json" or spec.kind == "json_object":
            # json_object is the schema {"type":"object"} not in strict mode (strict mode would
            # allow only the properties it declares: none)
            if spec.kind == "json":
                schema, strict = payload, True
            else:
                schema, strict = '{"type":"object"}', False
            return xc.compile_grammar(_json_grammar(schema, strict, spec.whitespace_flexible))
        if spec.kind == "regex":
            return xc.compile_regex(payload)
        if spec.kind == "choice":
            return xc.compile_grammar(_choice_ebnf(spec.choice or ()))
        return xc.compile_grammar(payload)
    except RuntimeError as exc:  # xgrammar's parse/convert errors are RuntimeErrors from C++
        message = _xgr_message(exc)
        if "Circular $ref chain with no schema content" in message:
            # xgrammar >= 0.2.9 refuses a schema that only refers to itself while converting it
            # (0.2.8 compiled it to a grammar that matches nothing, refused below): the same answer
            raise InvalidRequestError(
                f"the {spec.kind} constraint can never be met: {_NO_TEXT}", "structured_outputs"
            ) from None
        raise InvalidRequestError(
            f"cannot compile the {spec.kind} constraint: {message}", "structured_outputs"
        ) from None


def _check_startable(
    handle: xgrammar.CompiledGrammar, spec: StructuredOutputs, info: xgrammar.TokenizerInfo, stops: frozenset[int]
) -> int | None:
    """Refuse a grammar no output can follow with this vocabulary, and bound its outputs' length.

    Returns:
        The most tokens an output can have before its stop token, when known (a choice: its
        longest byte length, as every token the mask allows is at least one byte; a grammar
        whose only match is the empty text: 0), else None.

    Raises:
        ValueError: the first mask allows no token: the grammar matches no text at all (e.g. a
            schema that only refers to itself), or this vocabulary has no token it can start with.
    """
    if not _productive(str(handle.grammar)):
        raise InvalidRequestError(f"the {spec.kind} constraint can never be met: {_NO_TEXT}", "structured_outputs")
    first = _first_tokens(handle, info.vocab_size)
    if not first:
        raise InvalidRequestError(
            f"the {spec.kind} constraint can never be met: {_why_no_start(handle)}", "structured_outputs"
        )
    if all(t in stops for t in first):
        return 0
    if spec.kind == "choice":
        return max(len(c.encode()) for c in spec.choice or ())
    return None


_NO_TEXT = (
    "it matches no text at all (e.g. a JSON schema, or a grammar rule, that can only be completed by "
    "itself, or contradictory bounds)"
)

# xgrammar's printed EBNF (``str(Grammar)``: one normalised rule a line), in tokens: a rule's head,
# literals and character classes (terminals), calls such as Regex(...) (terminals), lookaheads
# (skipped: they match nothing themselves), repetition counts, and names
_EBNF_TOKEN = re.compile(
    r"""
    (?P<head>^[A-Za-z_][\w.-]*\s*::=)
  | (?P<lit>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<look>\(=)
  | (?P<call>[A-Za-z_]\w*\()
  | (?P<count>\{\s*(?P<min>\d+)\s*,\s*-?\d+\s*\})
  | (?P<name>[A-Za-z_][\w.-]*)
  | (?P<open>\()
  | (?P<close>\))
  | (?P<bar>\|)
  | (?P<other>[*+?])
  | \s+
""",
    re.VERBOSE | re.MULTILINE,
)


def _productive(ebnf: str) -> bool:
    """Whether the ``root`` rule of xgrammar's printed grammar derives some finite text: a rule is
    productive once one of its alternatives needs only productive rules (terminals need nothing;
    neither does an item counted ``{0, n}``, ``*`` or ``?``). Each parenthesised group is a rule of
    its own, so alternatives nested in a sequence are weighed as such. Text this parser does not
    follow gives no verdict (True): only a sure "never" refuses a grammar.
    """
    rules: dict[str, list[list[str]]] = {}  # rule -> its alternatives -> the rules each needs
    for line in ebnf.splitlines():
        if line.strip() and not _read_rule(line, rules):
            return True
    if "root" not in rules:
        return True
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alternatives in rules.items():
            if name not in productive and any(
                all(n in productive or n not in rules for n in alt) for alt in alternatives
            ):
                productive.add(name)
                changed = True
    return "root" in productive


def _read_rule(line: str, rules: dict[str, list[list[str]]]) -> bool:
    """Add the rule ``name ::= body`` of one printed line (and one rule per group in it) to
    ``rules``; False when the line is not of the form this reader knows."""
    head = _EBNF_TOKEN.match(line)
    if head is None or head.lastgroup != "head":
        return False
    name = line[: head.end()].split("::=")[0].strip()
    groups = 0
    # open groups: (rule name, finished alternatives, the current alternative's needs)
    stack: list[tuple[str, list[list[str]], list[str]]] = [(name, [], [])]
    last_needs = False  # whether the item just read is a rule the current alternative needs
    skip = 0  # parentheses still open inside a lookahead or a call (their content is no item)
    for m in _EBNF_TOKEN.finditer(line, head.end()):
        kind = m.lastgroup
        if skip:
            if kind in ("open", "look", "call"):
                skip += 1
            elif kind == "close":
                skip -= 1
            continue
        cur = stack[-1][2]
        if kind in ("call", "look"):  # Regex(...) and the like: a terminal; a lookahead: no item
            skip, last_needs = 1, False
        elif kind in ("lit", "cls"):
            last_needs = False
        elif kind == "name":
            cur.append(m.group())
            last_needs = True
        elif kind == "open":
            groups += 1
            stack.append((f"{name}#{groups}", [], []))
            last_needs = False
        elif kind == "close":
            if len(stack) < 2:
                return False
            group, alts, inner = stack.pop()
            rules[group] = [*alts, inner]
            stack[-1][2].append(group)
            last_needs = True
        elif kind == "bar":
            stack[-1][1].append(cur)
            stack[-1] = (stack[-1][0], stack[-1][1], [])
            last_needs = False
        elif kind in ("count", "other"):
            optional = m.group() in "*?" if kind == "other" else int(m.group("min")) == 0
            if optional and last_needs:
                cur.pop()
            last_needs = False
        elif kind is None:  # whitespace
            continue
        else:
            return False
    if len(stack) != 1 or skip:
        return False
    rules[name] = [*stack[0][1], stack[0][2]]
    return True


def _first_tokens(handle: xgrammar.CompiledGrammar, vocab_size: int) -> list[int]:
    """The ids a fresh matcher of ``handle`` allows."""
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(handle).fill_next_token_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def _why_no_start(handle: xgrammar.CompiledGrammar) -> str:
    """Whether a grammar that allows no first token matches no text at all or only lacks tokens:
    the same grammar against one token per byte tells them apart."""
    xgr = _xgr()
    byte_info = xgr.TokenizerInfo(
        [bytes([b]) for b in range(256)] + [b"</s>"], vocab_type=xgr.VocabType.RAW, stop_token_ids=[256]
    )
    byte_compiler = xgr.GrammarCompiler(byte_info, max_threads=1, cache_enabled=False)
    try:
        by_bytes = byte_compiler.compile_grammar(handle.grammar)
    except RuntimeError:
        return "no token of the vocabulary can start it"
    starts = [b for b in _first_tokens(by_bytes, 257) if b < 256]
    if not starts:
        return _NO_TEXT
    shown = ", ".join(repr(bytes([b]).decode("latin-1")) for b in starts[:8]) + (", ..." if len(starts) > 8 else "")
    return (
        f"the tokenizer's vocabulary has no token that starts it (an output must start with one of the bytes {shown})"
    )


def _json_grammar(schema: str, strict: bool, flexible: bool) -> xgrammar.Grammar:
    xgr = _xgr()
    if flexible:
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=True, strict_mode=strict)
    else:
        # compact: (",", ":") separators; xgrammar's default without any_whitespace is (", ", ": ")
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"), strict_mode=strict)
    # Work around two xgrammar 0.2.8 bugs by rewriting rules of its printed EBNF (str(Grammar)
    # is its own printer, which from_ebnf reads back); an xgrammar without them has no match.
    text = str(grammar)
    fixed = text
    for bad, good in _JSON_FIXES if flexible else _JSON_FIXES + _COMPACT_FIXES:
        fixed = fixed.replace(bad, good)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


# A length-bounded string (minLength/maxLength) takes its characters from [^"\\\r\n]: raw control
# characters, which json.loads rejects, get in; the class of unbounded strings excludes them.
_JSON_FIXES = ((r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]"),)
# The rules for an unconstrained value ({}, a bare object or array, json_object) ignore the
# separators and put ", " between items, even in compact JSON.
_COMPACT_FIXES = (
    ('basic_array_items ::= ((", " basic_any))', 'basic_array_items ::= (("," basic_any))'),
    (
        'basic_object_properties ::= ((", " basic_string ":" basic_any))',
        'basic_object_properties ::= (("," basic_string ":" basic_any))',
    ),
)


def _choice_ebnf(choice: Sequence[str]) -> str:
    """``root ::= "a" | "b"``: xgrammar's EBNF string literals take JSON's escapes (quotes,
    backslashes, control characters); other characters go in as UTF-8."""
    return "root ::= " + " | ".join(_json.dumps(c, ensure_ascii=False) for c in choice)


# ---------------------------------------------------------------------------------------------
# matching


class Matcher:
    """One request's position in its grammar; wraps xgrammar's ``GrammarMatcher``.

    Not thread-safe: a matcher belongs to the engine thread (its compiled grammar may be shared).
    Every call is host-side work, no device sync. Its state is a function of the tokens accepted
    since the last :meth:`reset`, so :meth:`replay` rebuilds it from a request's generated tokens
    (a request preempted by recompute keeps its matcher: the state does not live in the KV cache).
    """

    __slots__ = ("_compiled", "_m", "_num_tokens")

    def __init__(self, compiled: CompiledGrammar) -> None:
        self._compiled = compiled
        self._m: xgrammar.GrammarMatcher = _xgr().GrammarMatcher(compiled._handle)
        self._num_tokens = 0

    @property
    def compiled(self) -> CompiledGrammar:
        return self._compiled

    @property
    def num_tokens(self) -> int:
        """Tokens accepted since the last reset (the stop token included): how far rollback reaches."""
        return self._num_tokens

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; ``True`` if the grammar allows it.

        ``False`` leaves the state unchanged: the token was outside the mask (or the vocabulary), or
        the matcher has terminated. A stop token is accepted only where the text is complete, and
        then terminates the matcher.
        """
        if (
            not 0 <= token_id < self._compiled.vocab_size
            or token_id in self._compiled._never
            or self._m.is_terminated()
        ):
            return False  # answered here: xgrammar would log a warning to stderr for each
        if self._m.accept_token(token_id):
            self._num_tokens += 1
            return True
        return False

    def replay(self, token_ids: Sequence[int]) -> None:
        """Reset, then accept ``token_ids`` in order: rebuilds the state after e.g. a preemption.

        Raises ``ValueError`` at the first token the grammar rejects; the matcher then holds the
        tokens before it.
        """
        self.reset()
        for i, t in enumerate(token_ids):
            if not self.accept(int(t)):
                raise ValueError(f"token {i} (id {t}) of the replayed tokens does not follow the grammar")

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write this matcher's allowed next tokens into ``bitmask[row]`` (host-side only).

        ``bitmask`` is a CPU int32 tensor from :func:`allocate_bitmask` for the compiler's
        ``vocab_size`` (xgrammar writes through its host pointer; copy it to the device afterwards,
        or let :func:`apply_bitmask` do so). The state does not change. Returns whether the row
        masks anything: ``False`` means every token is allowed and applying it can be skipped.
        A terminated matcher allows only the stop tokens (a request that ended in the step being
        sampled may still have a row in the next one).
        """
        if bitmask.device.type != "cpu" or bitmask.dtype != torch.int32:
            raise ValueError(f"bitmask must be a CPU int32 tensor, got {bitmask.dtype} on {bitmask.device}")
        if bitmask.dim() != 2 or bitmask.shape[1] * 32 < self._compiled.vocab_size:
            raise ValueError(
                f"bitmask must be [rows, >= {_words(self._compiled.vocab_size)}], got {list(bitmask.shape)}"
            )
        if self._m.is_terminated():
            words = bitmask[row]
            words.zero_()
            for t in self._compiled.stop_token_ids:
                w, b = divmod(t, 32)
                v = int(words[w]) | (1 << b)
                words[w] = v - (1 << 32) if v >= 1 << 31 else v  # bit 31 is the int32 sign bit
            return True
        return bool(self._m.fill_next_token_bitmask(bitmask, row))

    def is_terminated(self) -> bool:
        """Whether a stop token has been accepted: the request's output is complete."""
        return bool(self._m.is_terminated())

    def is_completed(self) -> bool:
        """Whether the tokens so far form a full match (a stop token may come next)."""
        return bool(self._m.is_completed())

    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens (the stop token too, which un-terminates).

        xgrammar keeps the whole history, so any ``k <= num_tokens`` works; more is a ValueError.
        """
        if not 0 <= k <= self._num_tokens:
            raise ValueError(f"cannot roll back {k} tokens: {self._num_tokens} accepted since the reset")
        if k:
            self._m.rollback(k)
            self._num_tokens -= k

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._m.reset()
        self._num_tokens = 0

    def fork(self) -> Matcher:
        """An independent copy of this state (e.g. for the n samples of one prompt)."""
        new = Matcher.__new__(Matcher)
        new._compiled = self._compiled
        new._m = self._m.fork()
        new._num_tokens = self._num_tokens
        return new


# ---------------------------------------------------------------------------------------------
# bitmasks


def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A host bitmask: int32 ``[rows, ceil(vocab_size / 32)]`` with every bit set (all allowed), so
    rows no matcher fills mask nothing. ``pin_memory`` for an asynchronous copy to the GPU."""
    if rows < 0 or vocab_size <= 0:
        raise ValueError(f"need rows >= 0 and vocab_size > 0, got {rows}, {vocab_size}")
    return torch.full((rows, _words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows_index: Sequence[int] | torch.Tensor | None = None
) -> None:
    """Set ``logits[r, t] = -inf`` in place where bit ``t`` of ``bitmask[r]`` is clear.

    ``logits``: ``[rows, V]`` on any device, ``V`` the compiler's ``vocab_size``; ``bitmask``:
    ``[>= rows, >= ceil(V / 32)]`` int32, row ``r`` for logits row ``r``. ``rows_index`` limits the
    masking to those rows (the structured requests of a mixed batch); ``None`` masks every row.
    A host bitmask is copied to the logits' device first (non-blocking: no sync from pinned memory).

    Kernels: on CUDA, xgrammar's Triton kernel (one launch; no sync); on CPU, xgrammar's C++ loop
    over the rows (float32/16 and bfloat16; the logits are written through their host pointer, so
    this runs synchronously on the calling thread). Other devices or dtypes, or Triton missing,
    take a plain torch path (unpacks the bits: a few small kernels).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got {list(logits.shape)}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be int32 [rows, words], got {bitmask.dtype} {list(bitmask.shape)}")
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:
        # a narrower mask would leave the trailing (padding) logits unmasked: refuse, never guess
        raise ValueError(
            f"bitmask covers {bitmask.shape[1] * 32} tokens but the logits have {vocab}: "
            "allocate it for the model's vocab_size"
        )
    if rows_index is None and bitmask.shape[0] < logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} logits rows")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    dev = logits.device.type
    if dev == "cpu" and logits.dtype in _KERNEL_DTYPES:
        rows = (
            rows_index.tolist()
            if isinstance(rows_index, torch.Tensor)
            else None
            if rows_index is None
            else [int(r) for r in rows_index]
        )
        if rows == []:
            return
        _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows, backend="cpu")
        return
    if dev == "cuda" and logits.dtype in _KERNEL_DTYPES and logits.stride(1) == 1 and bitmask.stride(1) == 1:
        try:
            import triton  # noqa: F401  (xgrammar's CUDA path is a Triton kernel)
        except ImportError:
            pass
        else:
            rows_t = (
                None
                if rows_index is None
                else (rows_index if isinstance(rows_index, torch.Tensor) else list(map(int, rows_index)))
            )
            if rows_t is not None and len(rows_t) == 0:
                return
            _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows_t, backend="triton")
            return
    _apply_bitmask_torch(logits, bitmask, rows_index)


def _apply_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows_index: Sequence[int] | torch.Tensor | None
) -> None:
    vocab = logits.shape[1]
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    if rows_index is None:
        words = bitmask[: logits.shape[0]]
    else:
        rows_index = torch.as_tensor(rows_index, dtype=torch.long, device=logits.device)
        words = bitmask[rows_index]
    # [n, W] -> [n, W, 32] -> [n, W * 32]; >> on int32 is arithmetic, but & 1 keeps just the bit
    allowed = ((words.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab].bool()
    if rows_index is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows_index] = logits[rows_index].masked_fill(~allowed, float("-inf"))
