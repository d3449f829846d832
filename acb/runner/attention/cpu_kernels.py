"""acb's CPU attention kernel over the paged cache (``cpu_kernels.c``): built on first use, called
through ctypes.

The C source is compiled once per machine with the system's C compiler (``$CC``, else ``cc``,
``gcc`` or ``clang``) into acb's cache directory (``$ACB_CACHE_DIR``, else
``$XDG_CACHE_HOME/acb``, else ``~/.cache/acb``), keyed by the source, the compiler's version, the
flags and the machine (its CPU's model and instruction sets: the library is built for
``-march=native``), so a changed source, compiler or CPU builds again. Building takes about a
second. Where no compiler works, :func:`load` says why and the engine keeps the torch backend.

OpenMP: the library is built with ``-fopenmp``; at run time its ``libgomp.so.1`` is the one torch
has already loaded (the same soname), so the kernel's threads are torch's own pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11")
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_PROBLEM: str | None = None
_TRIED = False

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES: list[Any] = [
    _PTR, _I64, _I64,  # q, its token and head strides
    _PTR, _PTR,  # k, v pages
    _PTR, _I64,  # block table, its row stride
    _PTR, _PTR, _PTR,  # row_of, tok_of, len_of
    _PTR,  # pos_of (NULL: len_of - 1)
    _I64, _I64, _I64, _I64, _I64,  # R, H, KVH, D, P
    ctypes.c_float, ctypes.c_float, _I64, _I64,  # scale, softcap, window, chunk
    _PTR,  # sinks
    _PTR, _I64, _I64,  # out, its token and head strides
    ctypes.c_int,  # threads
]  # fmt: skip


def cache_dir() -> Path:
    explicit = os.environ.get("ACB_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "acb"


def _cpu_flags() -> str:
    """This CPU's model and instruction-set flags (Linux): part of the cache key, since the library
    is built for ``-march=native`` and a home directory may be shared by machines with other CPUs
    (one built with AVX-512 would crash on a CPU without it)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "model name"))]
    except OSError:
        return ""
    return "".join(sorted(set(lines)))


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _build(cc: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile into ``target`` (atomically: another process may be building the same); None or why not."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            return (res.stderr or res.stdout).strip().splitlines()[-1] if (res.stderr or res.stdout) else "failed"
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The kernel library (built now if needed), or None when it cannot be built here
    (:func:`problem` says why). Thread-safe; tried once per process."""
    global _LIB, _PROBLEM, _TRIED
    with _LOCK:
        if _TRIED:
            return _LIB
        _TRIED = True
        try:
            _LIB = _load()
        except Exception as exc:  # noqa: BLE001 - any failure means the torch path
            _PROBLEM = f"{type(exc).__name__}: {exc}"
        if _LIB is None:
            logger.info("acb's CPU attention kernel is not available (%s); the torch backend is used", _PROBLEM)
        return _LIB


def problem() -> str | None:
    """Why :func:`load` found no kernel (None when it did, or was not tried)."""
    return _PROBLEM


def _load() -> ctypes.CDLL | None:
    global _PROBLEM
    if platform.system() != "Linux":  # OpenMP from torch's runtime, ELF sonames: Linux only for now
        _PROBLEM = f"not built on {platform.system()}"
        return None
    cc = _compiler()
    if cc is None:
        _PROBLEM = "no C compiler (set CC, or install gcc)"
        return None
    src = SOURCE.read_bytes()
    version = _version(cc)
    last = None
    for flags in (FLAGS + ("-fopenmp",), FLAGS + ("-fopenmp-simd",)):  # threads where OpenMP links, else one
        parts = [src, version.encode(), " ".join(flags).encode(), platform.machine().encode(), _cpu_flags().encode()]
        key = hashlib.sha256(b"\0".join(parts))
        target = cache_dir() / "kernels" / f"cpu_attention-{key.hexdigest()[:16]}.so"
        if not target.exists():
            last = _build(cc, flags, target)
            if last is not None:
                continue
        lib = ctypes.CDLL(str(target))
        fn = lib.acb_paged_attention_f32
        fn.argtypes = _ARGTYPES
        fn.restype = ctypes.c_int
        return lib
    _PROBLEM = f"{cc} failed: {last}"
    return None


def paged_attention(
    q: torch.Tensor,  # [T, H, D] view (any token and head strides; D contiguous)
    k_pages: torch.Tensor,  # [blocks, P, KVH, D] contiguous float32
    v_pages: torch.Tensor,
    block_table: torch.Tensor,  # [B, max_blocks] int64, rows contiguous
    row_of: torch.Tensor,  # [R] int64: each query token's batch row
    tok_of: torch.Tensor,  # [R] int64: its token index in q and out
    len_of: torch.Tensor,  # [R] int64: how many keys it sees (from position 0)
    out: torch.Tensor,  # [T, H, D] (D contiguous): the R tokens' rows are written
    scale: float,
    softcap: float | None,
    window: int | None,
    chunk: int | None,
    sinks: torch.Tensor | None,  # [H] float32 contiguous, or None
    pos_of: torch.Tensor | None = None,  # [R] int64: its position (the window's and chunk's); None: len_of - 1
) -> None:
    """Each of the R query tokens over its keys ``[lo, len_of)`` of its row's pages, in position
    order (``lo``: 0, or where the sliding window or the attention chunk of the token's position
    starts). ``pos_of`` is needed only where a token sees keys past its own position (an image
    whose tokens attend both ways)."""
    lib = _LIB or load()
    if lib is None:
        raise RuntimeError(f"acb's CPU attention kernel is not available: {_PROBLEM}")
    h, d = q.shape[1], q.shape[2]
    profiled = torch.autograd._profiler_enabled()  # then the call is a named range (a ctypes call is no op)
    rec = torch.profiler.record_function("acb::paged_attention") if profiled else None
    if rec is not None:
        rec.__enter__()
    rc = lib.acb_paged_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_pages.data_ptr(), v_pages.data_ptr(),
        block_table.data_ptr(), block_table.stride(0),
        row_of.data_ptr(), tok_of.data_ptr(), len_of.data_ptr(),
        pos_of.data_ptr() if pos_of is not None else None,
        row_of.numel(), h, k_pages.shape[2], d, k_pages.shape[1],
        scale, softcap or 0.0, window or 0, chunk or 0,
        sinks.data_ptr() if sinks is not None else None,
        out.data_ptr(), out.stride(0), out.stride(1),
        torch.get_num_threads(),
    )  # fmt: skip
    if rec is not None:
        rec.__exit__(None, None, None)
    if rc != 0:
        raise MemoryError("acb's CPU attention kernel could not allocate its score buffer")
