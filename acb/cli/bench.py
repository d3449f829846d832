"""``acb bench``: the benchmark workloads (:mod:`acb.bench`) from the command line."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from acb.cli.common import (
    CliError,
)


def add_bench_parser(sub: Any) -> None:
    from acb.bench import ARCHS, SIZES, WORKLOADS

    p = sub.add_parser(
        "bench",
        help="run benchmark workloads side by side with baselines (writes JSON and PNG)",
        description=(
            "Run a named workload (or 'all') on acb and, where they apply, on transformers' continuous "
            "batching and padded model.generate in the same process, then print a table and write "
            "{cpu|gpu}_WORKLOAD.json (+ .png with matplotlib) to --out-dir. 'report' regenerates the "
            "README's results tables from those JSON files."
        ),
    )
    p.add_argument("workload", choices=[*WORKLOADS, "all", "report"], help="what to run")
    p.add_argument(
        "--size",
        choices=list(SIZES),
        default="default",
        help="tiny: seconds, for smoke tests; small: a quick figure on any family (hidden 128, 4 layers; not "
        "for eval or serve; with 'all', the workloads that take it); default: the documented workloads",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument(
        "--arch",
        default="llama",
        metavar="MODEL_TYPE",
        help=f"the benchmark model (random weights, no download): {', '.join(ARCHS)} have sized configs of "
        "their own (llama the default; qwen3_5 a Qwen3.5-shaped hybrid: gated-DeltaNet linear attention, three "
        "layers to one full attention; deepseek_v3 MLA + MoE); any other causal-LM model type of transformers "
        "(gemma3_text, mamba2, jamba, nemotron_h, gptj...) gets the catalogue sweep's tiny config of that "
        "family, every layer kind kept, scaled toward --size where its config allows; results of another "
        "than llama are named {cpu|gpu}_WORKLOAD_ARCH.json",
    )
    p.add_argument(
        "--docs",
        type=int,
        default=None,
        metavar="N",
        help="eval only: time the first N documents of each task (no runs on the first 48, nor the combined "
        "calls); the result is named {cpu|gpu}_eval[_ARCH]_docsN.json",
    )
    p.add_argument("--out-dir", default="benchmarks/results", help="where JSON/PNG go (default: benchmarks/results)")
    p.add_argument("--no-baselines", action="store_true", help="skip the transformers / generate baselines")
    p.add_argument("--no-plot", action="store_true", help="do not write PNG plots")
    p.add_argument(
        "--update-readme",
        metavar="FILE",
        default=None,
        help="rewrite the generated results block(s) of this file afterwards (the repository's is "
        "benchmarks/RESULTS.md)",
    )
    p.set_defaults(func=cmd_bench, _parser=p)


def cmd_bench(args: argparse.Namespace) -> int:
    from acb.bench import SMALL_WORKLOADS, WORKLOADS, check_workload, run_workload
    from acb.bench.report import markdown_for, update_readme
    from acb.errors import UnsupportedModelError

    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise CliError("--device cuda: CUDA is not available")
    every = [w for w in WORKLOADS if args.size != "small" or w in SMALL_WORKLOADS]
    names = [] if args.workload == "report" else (every if args.workload == "all" else [args.workload])
    logging.getLogger("transformers").setLevel(logging.ERROR)
    for name in names:  # refused before anything runs: an unknown model type or size, with the reason
        try:
            check_workload(name, args.size, args.arch, args.device)
        except ValueError as e:
            raise CliError(f"acb bench {name}: {e}") from e
    for name in names:
        print(f"== {name} ({args.size}, {args.device}, {args.arch})", file=sys.stderr, flush=True)
        try:
            doc = run_workload(
                name,
                size=args.size,
                device=args.device,
                out_dir=args.out_dir,
                baselines=not args.no_baselines,
                plot=not args.no_plot,
                arch=args.arch,
                eval_docs=args.docs,
            )
        except UnsupportedModelError as e:  # a family acb refuses: the reason, no traceback
            raise CliError(f"acb bench {name}: {e}") from e
        print(markdown_for(doc))
        print(
            f"wrote {doc['json_path']}"
            + (
                f" and {doc['png_path']}"
                if doc.get("png_path")
                else " (no plot: matplotlib not installed)"
                if not args.no_plot
                else ""
            ),
            file=sys.stderr,
        )
    if args.update_readme:
        for kind in ("cpu", "gpu"):
            if update_readme(args.update_readme, args.out_dir, kind):
                print(f"updated the {kind} results block of {args.update_readme}", file=sys.stderr)
    return 0
