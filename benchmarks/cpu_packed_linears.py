"""The oneDNN-packed linears (``cpu_packed_linears``) on CPU: how their route costs, and from which
model size they pay, in one run.

    python benchmarks/cpu_packed_linears.py [--out benchmarks/results/cpu_packed_linears.json]

1. **The route.** ``acb bench``'s default model (a 40M-parameter random Llama, hidden 512, float32)
   on one engine, B = 4 and 16 prompts of 128 tokens, greedy, 48 decode steps timed (a call of
   1 + 48 new tokens less a call of 1, over 48), alternating between the route acb uses (each
   packed ``nn.Linear`` looks at a thread-local table) and the route of before 2026-11-28 (a
   ``TorchFunctionMode`` that sees every torch call of the forward; kept here as the reference).
   Same engine, same packed copies, same tokens (checked).
2. **From which size.** Llamas of hidden 128, 256, 384 (8 layers, intermediate 4x hidden, vocabulary
   8192): two engines on the same model, packed and plain, alternating, B = 2, 4, 16, 64, 32 decode
   steps timed the same way.

Each figure is the best of ``--repeats``; this machine's speed swings by a third between minutes,
so only the ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import acb  # noqa: E402
from acb.bench.common import ModelSpec, acb_greedy, decode_step_ms, machine_info, write_json  # noqa: E402
from acb.models import tiny_model  # noqa: E402
from acb.runner import cpu_linear  # noqa: E402

_LINEAR = torch.nn.functional.linear


class _FunctionModeRoute(TorchFunctionMode):
    """The route of before 2026-11-28: every torch call of the forward passes through here."""

    def __init__(self, table: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.table = table

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func is _LINEAR:
            packed = self.table.get(id(args[1] if len(args) > 1 else kwargs["weight"]))
            if packed is not None and args[0].dtype == torch.float32:
                bias = args[2] if len(args) > 2 else (kwargs or {}).get("bias")
                return torch.ops.mkldnn._linear_pointwise(args[0], packed, bias, "none", [], "")
        return func(*args, **(kwargs or {}))


_ROUTE_ACTIVE = cpu_linear.PackedLinears.active


def _mode_active(self: cpu_linear.PackedLinears, tokens: int) -> contextlib.AbstractContextManager:
    if tokens > self.max_step_tokens or tokens < cpu_linear.MIN_STEP_TOKENS:
        return contextlib.nullcontext()
    self.refresh()

    @contextlib.contextmanager
    def cm() -> Iterator[None]:
        with _FunctionModeRoute(self._table):  # the thread-local table stays unset: the modules' own forward runs
            yield

    return cm()


def route_ab(repeats: int) -> list[dict[str, Any]]:
    spec = ModelSpec(size="default")
    model = spec.build().eval()
    g = torch.Generator().manual_seed(0)
    rows = []
    with acb.Engine(model, acb.ContinuousBatchingConfig(cpu_packed_linears=True)) as eng:
        for b in (4, 16):
            ps = torch.randint(3, spec.vocab, (b, 128), generator=g).tolist()
            acb_greedy(eng, ps, 2)
            ms: dict[str, list[float]] = {"function_mode": [], "module_route": []}
            toks: dict[str, Any] = {}
            try:
                for _ in range(repeats):
                    for name, active in (("function_mode", _mode_active), ("module_route", _ROUTE_ACTIVE)):
                        cpu_linear.PackedLinears.active = active  # type: ignore[method-assign]
                        t, toks[name] = decode_step_ms(lambda k: acb_greedy(eng, ps, k), 48)
                        ms[name].append(t)
            finally:
                cpu_linear.PackedLinears.active = _ROUTE_ACTIVE  # type: ignore[method-assign]
            row = dict(batch=b, **{k: min(v) for k, v in ms.items()}, all_ms=ms)
            row["speedup"] = row["function_mode"] / row["module_route"]
            row["same_tokens"] = toks["function_mode"] == toks["module_route"]
            print(
                f"route B={b}: function mode {row['function_mode']:.2f} ms/step, module route "
                f"{row['module_route']:.2f} ({row['speedup']:.2f}x), same tokens {row['same_tokens']}",
                flush=True,
            )
            rows.append(row)
    return rows


def sizes_ab(repeats: int) -> list[dict[str, Any]]:
    rows = []
    for hidden in (128, 256, 384):
        model = tiny_model(
            "llama",
            seed=0,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=8192,
        ).eval()
        per_layer = cpu_linear.linear_params_per_layer(model)
        g = torch.Generator().manual_seed(0)
        engines = {k: acb.Engine(model, acb.ContinuousBatchingConfig(cpu_packed_linears=k)) for k in (True, False)}
        with engines[True], engines[False]:
            for b in (2, 4, 16, 64):
                ps = torch.randint(3, 8192, (b, 128), generator=g).tolist()
                for e in engines.values():
                    acb_greedy(e, ps, 2)
                ms: dict[bool, list[float]] = {True: [], False: []}
                for _ in range(repeats):
                    for k, e in engines.items():
                        ms[k].append(decode_step_ms(lambda n, e=e: acb_greedy(e, ps, n), 32)[0])
                row = dict(
                    hidden=hidden,
                    linear_params_per_layer=per_layer,
                    batch=b,
                    packed_ms=min(ms[True]),
                    plain_ms=min(ms[False]),
                    all_ms={"packed": ms[True], "plain": ms[False]},
                )
                row["speedup"] = row["plain_ms"] / row["packed_ms"]
                print(
                    f"hidden {hidden} ({per_layer / 1e6:.2f}M per layer) B={b}: packed {row['packed_ms']:.2f}, "
                    f"plain {row['plain_ms']:.2f} ms/step ({row['speedup']:.2f}x)",
                    flush=True,
                )
                rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/cpu_packed_linears.json"))
    args = ap.parse_args()
    out = dict(machine=machine_info("cpu"), route=route_ab(args.repeats), sizes=sizes_ab(args.repeats))
    write_json(args.out, out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
