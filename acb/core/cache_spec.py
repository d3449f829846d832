"""What each kind of layer costs the cache and how its cache is reused (plain Python: no torch).

A model's cache is a :class:`CacheLayout`: one :class:`LayerKindSpec` per kind of layer it has
(paged attention K/V, the MLA latent, an indexer's keys, state layers, attention on the model's
own cache objects, the whole model on its own caches, image embeddings). Each spec says what
one token and one request cost it, how a prefix is reused (:class:`PrefixRule`) and what a
preempted request keeps (:class:`Offload`), and why where it cannot. The layout takes the
strictest rule of its kinds: that is what the model gets. The runner builds it
(:mod:`acb.runner.kinds`, the registry of kinds) and the engine reports it
(``engine.runner.layout``; the table in ``docs/memory.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PrefixRule(str, Enum):
    """How a cached prefix resumes a request, strictest last."""

    CHAIN = "chain"  # every block of a hit holds its pages (paged K/V, the latent, index keys)
    SNAPSHOT = "snapshot"  # the hit's last block also carries a snapshot (state layers, own caches)
    NONE = "none"  # no prefix caching for the model (``why`` says why)


class Offload(str, Enum):
    """What a preempted request keeps, strictest last."""

    PAGES = "pages"  # its blocks go to host blocks
    ROW = "row"  # and its row of state to a host row
    NONE = "none"  # nothing: it is recomputed


_PREFIX_ORDER = (PrefixRule.CHAIN, PrefixRule.SNAPSHOT, PrefixRule.NONE)
_OFFLOAD_ORDER = (Offload.PAGES, Offload.ROW, Offload.NONE)


@dataclass(frozen=True)
class LayerKindSpec:
    """One kind of layer of a model, and what its cache costs."""

    name: str  # "attention", "latent", "index keys", "state", "unpaged", "own cache runner", "images"
    layers: tuple[int, ...]  # the model's layer indices it serves (empty: the whole model)
    page_bytes_per_token: int = 0  # in the KV pages
    row_bytes: int = 0  # held per running request outside the pages (a row of state)
    token_bytes: int = 0  # per token outside the pages (the model's own caches, measured)
    snapshot_bytes: int = 0  # one snapshot for the prefix cache (0: takes none, or varies with length)
    reserved_bytes: int = 0  # set aside once (image embeddings)
    prefix: PrefixRule = PrefixRule.CHAIN
    offload: Offload = Offload.PAGES
    why: str = ""  # why prefix caching or offload is weaker than CHAIN / PAGES


@dataclass(frozen=True)
class CacheLayout:
    """A model's layer kinds; the strictest rule of them is the model's."""

    kinds: tuple[LayerKindSpec, ...]

    def kind(self, name: str) -> LayerKindSpec | None:
        return next((k for k in self.kinds if k.name == name), None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.kinds)

    @property
    def page_bytes_per_token(self) -> int:
        return sum(k.page_bytes_per_token for k in self.kinds)

    @property
    def row_bytes(self) -> int:
        return sum(k.row_bytes for k in self.kinds)

    @property
    def prefix_rule(self) -> PrefixRule:
        return max((k.prefix for k in self.kinds), key=_PREFIX_ORDER.index, default=PrefixRule.CHAIN)

    @property
    def offload(self) -> Offload:
        return max((k.offload for k in self.kinds), key=_OFFLOAD_ORDER.index, default=Offload.PAGES)

    @property
    def why(self) -> str:
        """The reasons the kinds give for a weaker rule, joined."""
        return "; ".join(f"{k.name}: {k.why}" for k in self.kinds if k.why)

    def bytes_per_request(self, tokens: int) -> int:
        """What one request of ``tokens`` tokens holds: its pages, its rows, its own caches."""
        return tokens * (self.page_bytes_per_token + sum(k.token_bytes for k in self.kinds)) + self.row_bytes

    def table(self) -> list[dict[str, object]]:
        """One row per kind (the figures of ``docs/memory.md``)."""
        return [
            {
                "kind": k.name,
                "layers": len(k.layers),
                "page bytes/token": k.page_bytes_per_token,
                "row bytes": k.row_bytes,
                "own bytes/token": k.token_bytes,
                "snapshot bytes": k.snapshot_bytes,
                "prefix": k.prefix.value,
                "offload": k.offload.value,
            }
            for k in self.kinds
        ]
