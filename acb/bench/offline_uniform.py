"""``offline-uniform``: the offline workload with every prompt the same length and every
output the same length (padded ``generate``'s best case: its padding wastes nothing). See
:mod:`acb.bench.offline`."""

from __future__ import annotations

from typing import Any

from acb.bench import offline
from acb.bench.common import ModelSpec


def run(size: str, spec: ModelSpec, baselines: bool = True) -> dict[str, Any]:
    return offline.run(size, spec, baselines=baselines, uniform=True)
