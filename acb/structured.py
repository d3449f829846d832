"""Constrained decoding's grammar layer: what a request asks its output to match, compiled, and
matched token by token.

It owns four things, and is the only module that imports xgrammar (lazily: ``pip install
'acb-batching[structured]'``):

- :class:`StructuredOutputs`, the per-request spec, with vLLM's field names (``json``,
  ``json_object``, ``regex``, ``choice``, ``grammar``) and a stable ``key`` for caching.
- :class:`GrammarCompiler`, one per engine (tokenizer + model vocabulary): compiles specs on its own
  small thread pool (xgrammar releases the GIL while compiling, so neither the caller's event loop
  nor the engine thread waits), with a bounded LRU cache keyed by ``spec.key``.
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
        if not m.accept(sampled[row]): fail the request (the mask was not applied)

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

import functools
import json as _json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from time import perf_counter
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import torch

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


_INSTALL_HINT = "pip install 'acb-batching[structured]'"


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
    compile_s: float  # wall time of the compile, on the compiler's thread
    _handle: xgrammar.CompiledGrammar = field(repr=False)
    # ids the matcher would reject whatever the state (padding beyond the tokenizer, special tokens
    # that are not stop tokens): rejected here without calling xgrammar, which logs a warning each time
    _never: frozenset[int] = field(repr=False)

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


class GrammarCompiler:
    """Compiles :class:`StructuredOutputs` for one tokenizer and model vocabulary; one per engine.

    ``vocab_size`` is the model's: the width of its logits, which may exceed ``len(tokenizer)``.
    ``stop_token_ids`` are the tokens that end a complete match (default: the tokenizer's
    ``eos_token_id``); give the model's generation-config EOS ids when there are several.

    Thread-safe: :meth:`submit` and :meth:`compile_now` may be called from any thread. Compiles run
    on ``workers`` threads of its own, each using up to ``compile_threads`` xgrammar threads.
    The cache holds the ``cache_size`` most recently used grammars (a failed compile is not kept,
    so a fixed spec compiles anew). :meth:`close` stops the pool.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, *,
                 stop_token_ids: Sequence[int] | None = None, workers: int = 2, compile_threads: int = 4,
                 cache_size: int = 256) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive int (the model's logits width), got {vocab_size!r}")
        for name, n in (("workers", workers), ("compile_threads", compile_threads), ("cache_size", cache_size)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
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
        # xgrammar's own cache is off: ours is keyed by the spec and shares in-flight compiles
        self._xgr_compiler = xgr.GrammarCompiler(self._info, max_threads=compile_threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="acb-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._hits = 0
        self._misses = 0

    def bitmask(self, rows: int) -> torch.Tensor:
        """A host bitmask for ``rows`` rows of this vocabulary, all allowed (:func:`allocate_bitmask`)."""
        return allocate_bitmask(rows, self.vocab_size)

    def submit(self, spec: StructuredOutputs) -> Future[CompiledGrammar]:
        """The compiled grammar for ``spec``, as a future (``asyncio.wrap_future`` to await it).

        A cached or in-flight compile of the same ``spec.key`` is shared: every caller gets the same
        future and so the same :class:`CompiledGrammar`. A spec that cannot compile fails the future
        with a ``ValueError`` carrying xgrammar's message.
        """
        if not isinstance(spec, StructuredOutputs):
            raise TypeError(f"spec must be a StructuredOutputs, got {type(spec).__name__}")
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                self._hits += 1
                return fut
            self._misses += 1
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = fut
            while len(self._cache) > self._cache_size:
                # holders of an evicted future keep it; only later submits compile again
                self._cache.popitem(last=False)
        fut.add_done_callback(functools.partial(self._forget_failure, spec.key))
        return fut

    def compile_now(self, spec: StructuredOutputs, timeout: float | None = None) -> CompiledGrammar:
        """:meth:`submit` and wait (blocks the calling thread): for validating a spec at submit time.

        Raises ``ValueError`` (xgrammar's message) if it cannot compile, ``TimeoutError`` after
        ``timeout`` seconds (the compile goes on and stays cached)."""
        return self.submit(spec).result(timeout)

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, self._cache_size, len(self._cache))

    def close(self) -> None:
        """Stops the compile threads after the compiles already running; queued ones are cancelled."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _forget_failure(self, key: str, fut: Future[CompiledGrammar]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """On a pool thread: the one place a spec's kind becomes an xgrammar call."""
        xc = self._xgr_compiler
        t0 = perf_counter()
        try:
            if spec.kind == "json" or spec.kind == "json_object":
                # json_object is the schema {"type":"object"} not in strict mode (strict mode would
                # allow only the properties it declares: none)
                if spec.kind == "json":
                    schema, strict = spec.key.split("|", 2)[2], True  # the canonical text
                else:
                    schema, strict = '{"type":"object"}', False
                handle = xc.compile_grammar(self._json_grammar(schema, strict, spec.whitespace_flexible))
            elif spec.kind == "regex":
                handle = xc.compile_regex(spec.regex)
            elif spec.kind == "choice":
                handle = xc.compile_grammar(_choice_ebnf(spec.choice or ()))
            else:
                handle = xc.compile_grammar(spec.grammar)
        except RuntimeError as exc:  # xgrammar's parse/convert errors are RuntimeErrors from C++
            raise ValueError(f"cannot compile the {spec.kind} constraint: {_xgr_message(exc)}") from None
        return CompiledGrammar(spec=spec, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids,
                               compile_s=perf_counter() - t0, _handle=handle, _never=self._never)

    def _json_grammar(self, schema: str, strict: bool, flexible: bool) -> xgrammar.Grammar:
        xgr = _xgr()
        if flexible:
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=True, strict_mode=strict)
        else:
            # compact: (",", ":") separators; xgrammar's default without any_whitespace is (", ", ": ")
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"),
                                                   strict_mode=strict)
        # Work around two xgrammar 0.2.8 bugs by rewriting rules of its printed EBNF (str(Grammar)
        # is its own printer, which from_ebnf reads back); an xgrammar without them has no match.
        text = str(grammar)
        fixed = text
        for bad, good in _JSON_FIXES if flexible else _JSON_FIXES + _COMPACT_FIXES:
            fixed = fixed.replace(bad, good)
        return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


# A length-bounded string (minLength/maxLength) takes its characters from [^"\\\r\n]: raw control
# characters, which json.loads rejects, get in; the class of unbounded strings excludes them.
_JSON_FIXES = ((r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]'),)
# The rules for an unconstrained value ({}, a bare object or array, json_object) ignore the
# separators and put ", " between items, even in compact JSON.
_COMPACT_FIXES = (('basic_array_items ::= ((", " basic_any))', 'basic_array_items ::= (("," basic_any))'),
                  ('basic_object_properties ::= ((", " basic_string ":" basic_any))',
                   'basic_object_properties ::= (("," basic_string ":" basic_any))'))


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
        if not 0 <= token_id < self._compiled.vocab_size or token_id in self._compiled._never \
                or self._m.is_terminated():
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
            raise ValueError(f"bitmask must be [rows, >= {_words(self._compiled.vocab_size)}], "
                             f"got {list(bitmask.shape)}")
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


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows_index: Sequence[int] | torch.Tensor | None = None) -> None:
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
        raise ValueError(f"bitmask covers {bitmask.shape[1] * 32} tokens but the logits have {vocab}: "
                         "allocate it for the model's vocab_size")
    if rows_index is None and bitmask.shape[0] < logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} logits rows")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    dev = logits.device.type
    if dev == "cpu" and logits.dtype in _KERNEL_DTYPES:
        rows = rows_index.tolist() if isinstance(rows_index, torch.Tensor) else \
            None if rows_index is None else [int(r) for r in rows_index]
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
            rows_t = None if rows_index is None else (
                rows_index if isinstance(rows_index, torch.Tensor) else list(map(int, rows_index)))
            if rows_t is not None and len(rows_t) == 0:
                return
            _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows_t,
                                               backend="triton")
            return
    _apply_bitmask_torch(logits, bitmask, rows_index)


def _apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor,
                         rows_index: Sequence[int] | torch.Tensor | None) -> None:
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
