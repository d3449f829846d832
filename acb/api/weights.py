"""Weight updates at the API: an update's tensors checked and staged on the caller's thread
(:func:`stage_weights`, :func:`stage_checkpoint`), then swapped in by the engine thread between two
steps (:func:`swap`). The engines' ``update_weights``, ``load_weights`` and ``swap_weights`` are
these, blocking or awaited."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Future

    import torch

    from acb.core.engine_core import EngineCore

__all__ = ["stage_checkpoint", "stage_weights", "swap"]


def stage_weights(model: torch.nn.Module, named_tensors: Any) -> Any:
    """An update's tensors checked and staged (:func:`acb.runner.weight_update.stage`): the
    caller's thread does the copying, the engine thread only the swap.

    Args:
        model: the engine's model.
        named_tensors: ``{name: tensor}`` or ``(name, tensor)`` pairs, by the model's own names.

    Returns:
        The staged update (:class:`acb.runner.weight_update.Staged`), for :func:`swap`.

    Raises:
        WeightUpdateError: a name, shape or dtype that does not fit (nothing written).
        RuntimeError: the model is sharded over tensor-parallel ranks.
    """
    from acb.runner.tp_sync import tp_size_of
    from acb.runner.weight_update import stage

    if tp_size_of(model) > 1:
        raise RuntimeError("weight updates are not supported under tensor parallel yet")
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    return stage(model, items)


def stage_checkpoint(model: torch.nn.Module, path: Any) -> Any:
    """:func:`stage_weights` for a safetensors checkpoint (a directory or one file).

    Args:
        model: the engine's model.
        path: the checkpoint, on local disk.

    Returns:
        The staged update.

    Raises:
        WeightUpdateError: a checkpoint that does not read, or a tensor that does not fit.
    """
    from acb.runner.weight_update import read_checkpoint

    return stage_weights(model, read_checkpoint(path))


def swap(live_core: Callable[[], EngineCore], staged: Any, version: Any) -> Future[Any]:
    """Swap a staged update in, on the engine thread between two steps.

    Args:
        live_core: the engine's running core (asked for once the version is checked).
        staged: what :func:`stage_weights` or :func:`stage_checkpoint` returned.
        version: the new version (None: the current one plus one).

    Returns:
        A future of the version now running.

    Raises:
        WeightUpdateError: a version that is not a JSON scalar (nothing written).
    """
    from acb.runner.weight_update import check_version, version_after

    version = check_version(version)  # (every facade's update comes through here)
    return live_core().call(lambda core: core.swap_weights(staged, version_after(core.weight_version, version)))
