"""This CPU's linear-layer throughput at the offline model's shapes: float32 (MKL), float32 on
oneDNN with packed weights (acb's ``cpu_packed_linears``), and bfloat16.

For each row count M (a decode step's rows up to a full prefill chunk) and each of the 40M
Llama's weight shapes (K x N: q/o 512x512, k/v 512x256, gate/up 512x2048, down 2048x512, LM
head 512x8192), the best GFLOP/s of one call over about 0.3 s (weights hot in cache). Says
whether a bf16 mode could pay off here (it needs AVX512-BF16 or AMX; without them oneDNN
emulates it) and how far tall-skinny decode matmuls fall below the square-matrix peak.
Writes ``benchmarks/results/cpu_matmul.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from acb.bench.common import machine_info, matmul_peak_gflops  # noqa: E402

SHAPES = {"q/o": (512, 512), "k/v": (512, 256), "gate/up": (512, 2048), "down": (2048, 512), "lm_head": (512, 8192)}
ROWS = (16, 64, 128, 512, 2048)


def best_gflops(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 0.3, packed: bool = False) -> float:
    """Best GFLOP/s of ``F.linear`` (MKL for float32), or with ``packed`` of oneDNN on a weight
    reordered once (what acb's ``cpu_packed_linears`` runs)."""
    a, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    if packed:
        p = torch.ops.mkldnn._reorder_linear_weight(w, None)

        def call() -> None:
            torch.ops.mkldnn._linear_pointwise(a, p, None, "none", [], "")
    else:

        def call() -> None:
            torch.nn.functional.linear(a, w)

    call()
    fastest, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        call()
        fastest = min(fastest, time.perf_counter() - t0)
    return 2 * m * k * n / fastest / 1e9


def main() -> None:
    flags = (
        Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0]
        if Path("/proc/cpuinfo").exists()
        else ""
    )
    isa = sorted({f for f in flags.split() if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")})
    sides = {
        "float32": (torch.float32, False),
        "float32, oneDNN packed": (torch.float32, True),
        "bfloat16": (torch.bfloat16, False),
    }
    table = {
        side: {
            f"M={m}": {name: round(best_gflops(m, k, n, dt, packed=pk), 1) for name, (k, n) in SHAPES.items()}
            for m in ROWS
        }
        for side, (dt, pk) in sides.items()
    }
    doc = dict(
        machine=machine_info(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        isa_flags=isa,
        square_peak=matmul_peak_gflops(),
        gflops=table,
    )
    out = ROOT / "benchmarks" / "results" / "cpu_matmul.json"
    out.write_text(json.dumps(doc, indent=2, default=str))
    print(
        f"capability {doc['cpu_capability']}, flags {isa}; square fp32 peak {doc['square_peak']['gflops']:.0f} GFLOP/s"
    )
    for dt, rows in table.items():
        print(dt)
        for m, cols in rows.items():
            print(f"  {m:>7}: " + "  ".join(f"{name} {g:6.1f}" for name, g in cols.items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
