"""``acb bench``: named workloads measured side by side with baselines run in the same process.

Workloads: ``offline``, ``offline-uniform``, ``shared-prefix``, ``online``, ``overhead``, ``serve``, ``eval`` (see each module). Each run
writes ``{kind}_{workload}.json`` (machine, device, versions, settings, figures) and a PNG
(with matplotlib, ``pip install -e ".[bench]"``) to the output folder; ``report`` regenerates
the README tables from those files.

The workloads live in the package so that ``acb bench`` runs from an install; the one-off
scripts (GPU check, kernel compile, sampler and compile benchmarks) and the results live in
``benchmarks/`` of the repository.
"""

from __future__ import annotations

import os
from typing import Any

from acb.bench.common import ARCHS, ModelSpec, machine_info, write_json

WORKLOADS = ("offline", "offline-uniform", "shared-prefix", "online", "overhead", "serve", "eval")


def _module(name: str) -> Any:
    from acb.bench import eval as eval_
    from acb.bench import offline, offline_uniform, online, overhead, serve, shared_prefix

    return {
        "offline": offline,
        "offline-uniform": offline_uniform,
        "shared-prefix": shared_prefix,
        "online": online,
        "overhead": overhead,
        "serve": serve,
        "eval": eval_,
    }[name]


def run_workload(
    name: str,
    size: str = "default",
    device: str = "cpu",
    out_dir: str | None = None,
    baselines: bool = True,
    plot: bool = True,
    arch: str = "llama",
    eval_docs: int | None = None,
) -> dict[str, Any]:
    """Run one workload; returns the JSON document (also written to ``out_dir`` when given).

    ``arch`` (:data:`acb.bench.common.ARCHS`) is the benchmark model's architecture; a result of
    another than the Llama is named ``{kind}_{workload}_{arch}``. ``eval_docs``: the eval bench on the first
    that many documents of each task (:func:`acb.bench.eval.run`'s ``docs``; named ``..._docs{N}``)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHS}")
    spec = ModelSpec(size=size, device=device, arch=arch)
    machine = machine_info(device)
    model = spec.build()
    doc: dict[str, Any] = {"size": size, "machine": machine, "model": spec.describe(model)}
    del model
    options = {"docs": eval_docs} if name == "eval" and eval_docs is not None else {}
    doc["result"] = _module(name).run(size, spec, baselines=baselines, **options)
    if "model" in doc["result"]:  # a workload that runs its own checkpoint describes it
        doc["model"] = doc["result"].pop("model")
    if out_dir is not None:
        kind = "gpu" if device.startswith("cuda") else "cpu"
        stem = os.path.join(
            out_dir,
            f"{kind}_{name}"
            + ("" if arch == "llama" else f"_{arch}")
            + ("" if size == "default" else f"_{size}")
            + (f"_docs{options['docs']}" if options else ""),
        )
        write_json(stem + ".json", doc)
        doc["json_path"] = stem + ".json"
        if plot:
            from acb.bench.report import plot as make_plot

            doc["png_path"] = make_plot(doc, stem + ".png")
    return doc
