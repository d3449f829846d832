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
SIZES = ("tiny", "small", "default")
# the workloads with a "small" size (a quick figure on any family; eval and serve have their own shapes)
SMALL_WORKLOADS = ("offline", "offline-uniform", "shared-prefix", "online", "overhead")


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


def check_workload(name: str, size: str, arch: str, device: str = "cpu") -> ModelSpec:
    """The model spec of a run, or ``ValueError`` (what and why) for an unknown workload or size, an
    unknown model type, or a family whose config does not build a model that runs."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    if size not in SIZES or (size == "small" and name not in SMALL_WORKLOADS):
        sizes = SIZES if name in SMALL_WORKLOADS else tuple(s for s in SIZES if s != "small")
        raise ValueError(f"unknown size {size!r} for {name}; choose from {sizes}")
    spec = ModelSpec(size=size, device=device, arch=arch)
    spec.config()
    return spec


def acb_refusal(model: Any) -> str | None:
    """Why acb refuses ``model`` (its start checks' ``UnsupportedModelError``), or None: an engine
    is started on it and shut down."""
    from acb.api.engine import Engine
    from acb.config import ContinuousBatchingConfig
    from acb.errors import UnsupportedModelError

    try:
        engine = Engine(model, ContinuousBatchingConfig(num_blocks=16, page_size=16))
        engine.start()
        engine.shutdown()
    except UnsupportedModelError as e:
        return str(e)
    return None


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

    ``arch`` is the benchmark model's architecture: one of :data:`acb.bench.common.ARCHS` (sized
    configs of their own), or any causal-LM model type of transformers (the catalogue sweep's tiny
    config of that family, scaled toward the size: :mod:`acb.bench.families`); a result of another
    than the Llama is named ``{kind}_{workload}_{arch}``. Before anything runs: ``ValueError``
    (:func:`check_workload`) for an unknown model type or one whose config does not build, and
    ``acb.UnsupportedModelError`` for one acb refuses, with its reason.
    ``eval_docs``: the eval bench on the first that many documents of each task
    (:func:`acb.bench.eval.run`'s ``docs``; named ``..._docs{N}``)."""
    spec = check_workload(name, size, arch, device)
    machine = machine_info(device)
    model = spec.build()
    if arch not in ARCHS:
        why = acb_refusal(model)
        if why is not None:
            from acb.errors import UnsupportedModelError

            raise UnsupportedModelError(f"acb cannot run model type {arch!r}: {why}")
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
