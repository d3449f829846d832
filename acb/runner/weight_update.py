"""Weight updates from elsewhere: named tensors checked whole against the model, staged, then
swapped in between two engine steps.

An update is atomic. :func:`check_specs` and :func:`stage` check every name, shape and dtype
against the model before anything is written. The tensors are staged: copied to the model's
device and dtype, apart from the weights, off the engine thread (a receiver fills them, or a
checkpoint is read into them). Only then does :meth:`Staged.swap` copy them into the weights, on
the engine thread, between two steps, under ``torch.no_grad`` (or, for a receiver's buffers on
CPU, rebinds the weights to them: :class:`Borrowed`). A bad update leaves the weights as
they were and raises :class:`WeightUpdateError` naming what was wrong:

- an unknown name, a shape that differs, a dtype of another kind (an integer for a float);
- a checkpoint that does not read;
- a sender that died half-way.

Names are the model's own (``model.named_parameters()`` and its persistent buffers, tied
weights under each of their names), or the checkpoint's, as ``save_pretrained`` writes them:
transformers keeps the original checkpoint layout on disk (Mixtral's and Qwen3-MoE's experts one
tensor each, LLaVA's ``language_model.model.*``) and converts it when it loads.
:func:`model_names` does the same conversion with transformers' own machinery for the model's
class (its checkpoint conversion mapping: the renamings and the converters that merge per-expert
tensors), so whatever ``from_pretrained`` loads into the model, an update loads too. A floating
dtype other than the weight's is cast: a trainer in float32 may update a server in bfloat16.

The swap is the runner's (``ModelRunner.swap_weights``, which calls :meth:`Staged.swap`); the
engine core asks for it (``EngineCore.swap_weights``), then drops its prefix cache and whatever the
runner derived from the weights (the packed CPU linears), and gives the new version to the requests
that go on under it.
"""

from __future__ import annotations

import copy
import operator
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from acb.errors import WeightUpdateError

__all__ = [
    "Borrowed",
    "Staged",
    "WeightUpdateError",
    "check_specs",
    "check_version",
    "model_names",
    "read_checkpoint",
    "stage",
    "storage_ptrs",
    "weight_targets",
]


def weight_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What an update may write: every parameter (tied ones under each of their names) and
    persistent buffer, by the model's own names."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    for module_name, module in model.named_modules(remove_duplicate=False):
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in skip:
                out[f"{module_name}.{name}" if module_name else name] = buf
    return out


def _kind(dtype: torch.dtype) -> str:
    return "float" if dtype.is_floating_point else "complex" if dtype.is_complex else str(dtype)


def check_specs(targets: dict[str, torch.Tensor], specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
    """Refuse an update, before any byte of it moves, whose names, shapes or dtypes do not fit.

    Raises:
        WeightUpdateError: listing every problem (the first ten, and how many more).
    """
    problems = []
    seen = set()
    for name, shape, dtype in specs:
        if name in seen:
            problems.append(f"{name}: named twice")
        seen.add(name)
        target = targets.get(name)
        if target is None:
            problems.append(f"{name}: the model has no such parameter or buffer")
        elif tuple(shape) != tuple(target.shape):
            problems.append(f"{name}: shape {tuple(shape)}, the model's is {tuple(target.shape)}")
        elif _kind(dtype) != _kind(target.dtype):
            problems.append(f"{name}: dtype {dtype}, the model's is {target.dtype}")
    if not seen:
        problems.append("the update names no tensor")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise WeightUpdateError("weight update refused, nothing written: " + "; ".join(problems[:10]) + more)


@dataclass
class Staged:
    """An update's tensors, checked and staged on the model's device and dtype (a :class:`Borrowed`
    one's in the dtype received: :meth:`swap` casts)."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (the weight, its new value)
    names: list[str]
    # the weights take the values' storage (``weight.data = value``) instead of a copy of them:
    # only a :class:`Borrowed` update whose every value fits as it is, on CPU (:func:`stage`)
    rebind: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.pairs)

    def swap(self) -> None:
        """Put the new values in the weights (engine thread, between two steps): a copy into each,
        or, when :attr:`rebind`, each weight's data rebound to its value (the same objects, a tied
        weight's names one object; the values' owner must not write them again)."""
        with torch.no_grad():
            if self.rebind:
                for weight, value in self.pairs:
                    weight.data = value
                return
            for weight, value in self.pairs:
                weight.copy_(value)


def model_names(
    model: torch.nn.Module, items: list[tuple[str, torch.Tensor]], targets: dict[str, torch.Tensor] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """``items`` under the model's own names: a name the model has is kept; any other is converted
    as ``from_pretrained`` converts a checkpoint's keys for the model's class (transformers'
    ``get_model_conversion_mapping``: its renamings, then at most one converter, which may merge
    several checkpoint tensors into one weight, e.g. a layer's per-expert ``w1``/``w3`` into its
    fused ``gate_up_proj``). A name that maps to nothing the model has is kept as it is, for
    :func:`check_specs` to name.

    Raises:
        WeightUpdateError: a converter that cannot merge what the checkpoint gives (a missing
            expert, mismatched shapes).
    """
    if targets is None:
        targets = weight_targets(model)
    if all(name in targets for name, _ in items):
        return items  # (the model's own names: a trainer's push, a state dict)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:  # (a transformers without conversion mappings keeps checkpoint names)
        return items
    if not isinstance(model, PreTrainedModel):
        return items
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = model.base_model_prefix or None  # (a base model's checkpoint into a head model, and back)
    out: list[tuple[str, torch.Tensor]] = []
    merging: dict[str, Any] = {}  # the first target's name -> its converter, collecting its tensors
    # in natural key order, as transformers collects them: experts 0, 1, ..., 10 stack in that order
    for name, tensor in sorted(items, key=lambda kv: dot_natural_key(kv[0])):
        if name in targets:
            out.append((name, tensor))
            continue
        renamed, pattern = rename_source_key(name, renamings, converters, prefix, targets)
        if renamed not in targets:
            out.append((name, tensor))  # (unknown: refused under the name the caller gave)
        elif pattern is None:
            out.append((renamed, tensor))
        else:
            converter = merging.get(renamed)
            if converter is None:
                converter = merging[renamed] = copy.deepcopy(by_pattern[pattern])
            ready: Future[torch.Tensor] = Future()  # (what transformers' loading collects: futures)
            ready.set_result(tensor)
            converter.add_tensor(renamed, name, pattern, ready)
    for first, converter in merging.items():
        sources = sorted({s for group in converter.layer_targets.values() for s in group}, key=dot_natural_key)
        try:
            made = converter.convert(first, model=model, config=getattr(model, "config", None))
        except Exception as exc:  # noqa: BLE001 - transformers' ops raise what torch raises
            raise WeightUpdateError(
                f"weight update refused, nothing written: {first}: cannot make it from the checkpoint's "
                f"{', '.join(sources[:4])}{' ...' if len(sources) > 4 else ''} ({type(exc).__name__}: {exc})"
            ) from None
        for target, value in made.items():
            out.append((target, value[0] if isinstance(value, list) else value))
    return out


class Borrowed(list[tuple[str, torch.Tensor]]):
    """``(name, tensor)`` pairs whose tensors their owner leaves untouched until the update is
    swapped in (a receiver's buffers): :func:`stage` keeps those on the weight's device as they
    are, rather than copy them; the swap's one copy casts another float dtype (a trainer's
    bfloat16 into a server's float32) as the staging copy would have.

    On CPU, when every tensor already has its weight's dtype, shape and device, the swap copies
    nothing: the weights are rebound to the tensors (:attr:`Staged.rebind`), which from then on
    are the weights', so their owner must not write them again while a weight uses their storage
    (the transfer group receives the next update into other buffers: see ``busy`` in
    :meth:`acb.weight_transfer.TransferGroup.receive`). Not on CUDA (the decode graphs hold the
    weights' addresses), nor for a value of another dtype (cast by the copy), nor where two
    weights would share one value or one weight's storage holds another's."""


def stage(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> Staged:
    """Check then stage ``(name, tensor)`` pairs (copies: the caller may reuse its tensors; a
    :class:`Borrowed` list's tensors already in the weight's dtype and device are kept as they
    are, not copied, even in another float dtype: the swap casts). Names are the model's or its checkpoint's (:func:`model_names`).

    Raises:
        WeightUpdateError: a name, shape or dtype that does not fit (nothing staged).
    """
    borrowed = isinstance(named, Borrowed)
    targets = weight_targets(model)
    items = [(name, t if isinstance(t, torch.Tensor) else torch.as_tensor(t)) for name, t in named]
    items = model_names(model, items, targets)
    check_specs(targets, ((n, tuple(t.shape), t.dtype) for n, t in items))
    pairs = []
    written: dict[int, torch.Tensor] = {}  # id(weight) -> its value: a tied weight written once
    for name, tensor in items:
        target = targets[name]
        if written.get(id(target)) is tensor:
            continue  # (the same value under a tied weight's other name)
        written[id(target)] = tensor
        if borrowed and tensor.device == target.device:
            value = tensor.detach()  # (read once, by the swap's copy, which casts a float dtype)
        else:
            value = torch.empty_like(target)
            value.copy_(tensor.detach())
        pairs.append((target, value))
    return Staged(pairs, [n for n, _ in items], rebind=borrowed and _rebinds(pairs))


def _rebinds(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether a borrowed update's weights can take its values' storage as they are: on CPU, each
    value of its weight's dtype and shape; no two weights (a tied one is one object) overlapping
    in memory, as views of one tensor would (a rebind would part them), and no two values (one
    value under two weights' names: a rebind would join them); disjoint parts of one storage, as
    a rebound update's are, are fine."""
    for weight, value in pairs:
        if weight.device.type != "cpu" or value.device != weight.device:
            return False
        if value.dtype != weight.dtype or value.shape != weight.shape:
            return False
    return bool(pairs) and _apart([w for w, _ in pairs]) and _apart([v for _, v in pairs])


def _apart(tensors: list[torch.Tensor]) -> bool:
    """Whether no two of ``tensors`` overlap in memory (parts of one storage may: disjoint ones)."""
    spans = []
    for t in tensors:
        if t.numel():
            start = t.storage_offset() * t.element_size()
            last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
            spans.append((t.untyped_storage().data_ptr(), start, start + (last + 1) * t.element_size()))
    spans.sort()
    return all(
        ptr != next_ptr or next_start >= end for (ptr, _, end), (next_ptr, next_start, _) in zip(spans, spans[1:])
    )


def storage_ptrs(model: torch.nn.Module) -> set[int]:
    """The addresses of the storages the model's weights (parameters and buffers) use: what a
    receiver must not write into while they serve (a rebound update's buffers)."""
    return {t.untyped_storage().data_ptr() for t in weight_targets(model).values()}


def read_checkpoint(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors checkpoint directory (or one ``.safetensors`` file), by name.

    Raises:
        WeightUpdateError: no such path, no safetensors file in it, or one that does not read.
    """
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise WeightUpdateError(f"weight update refused, nothing written: no such checkpoint {path!r}")
    if not files:
        raise WeightUpdateError(f"weight update refused, nothing written: no .safetensors file in {path!r}")
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise WeightUpdateError(f"weight update refused, nothing written: {file}: {exc}") from None


MAX_VERSION_CHARS = 256  # a str version's length, at most (every response carries it)


def check_version(version: Any) -> Any:
    """The version an update is given, checked before anything moves: None (the current one plus
    one), an int (not a bool; numpy's and torch's integer scalars are taken as ints) in the
    signed 64-bit range, or a non-empty str of at most :data:`MAX_VERSION_CHARS` characters that
    encodes as UTF-8. Every output carries it (``weight_version``, in every response of the
    server), so it must be a plain JSON value: a float (NaN) or a list (the form outputs give the
    versions of an update that landed while they ran) would break them.

    Returns:
        The version (an integer scalar as an ``int``).

    Raises:
        WeightUpdateError: naming ``weight_version`` and what is wrong (nothing written).
    """
    refused = "weight update refused, nothing written: its version (weight_version) must be"
    if version is None or isinstance(version, str):
        if version is not None:
            if not 0 < len(version) <= MAX_VERSION_CHARS:
                raise WeightUpdateError(
                    f"{refused} a non-empty str of at most {MAX_VERSION_CHARS} characters; got {len(version)}"
                )
            try:
                version.encode("utf-8")
            except UnicodeEncodeError:
                raise WeightUpdateError(f"{refused} text that encodes as UTF-8; got {version!r}") from None
        return version
    if not isinstance(version, (bool, float, complex)) and hasattr(version, "__index__"):
        try:
            version = operator.index(version)  # (a numpy or torch integer scalar)
        except TypeError:
            pass
    if isinstance(version, int) and not isinstance(version, bool):
        if not -(2**63) <= version < 2**63:
            raise WeightUpdateError(f"{refused} an int in the signed 64-bit range; got {version}")
        return version
    note = (
        " (a list is how an output reports the versions of an update that landed while it ran, not a version)"
        if isinstance(version, (list, tuple))
        else ""
    )
    shown = repr(version)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise WeightUpdateError(f"{refused} an int or a str; got {type(version).__name__} {shown}{note}")


def version_after(current: Any, given: Any) -> Any:
    """The version an update brings: the one given, else the current one plus one (an int)."""
    if given is not None:
        return given
    return current + 1 if isinstance(current, int) else 1
