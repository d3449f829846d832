"""Checkpoint names round trip: what ``save_pretrained`` writes, ``load_weights`` loads, for every
model class the catalogue sweep builds (``tests/test_model_sweep.py``'s sample: the architectures
acb claims and a deterministic sample of the others) and every tiny vision-language model.

transformers 5 saves the original checkpoint layout (Mixtral's experts one tensor each, LLaVA's
``language_model.model.*``) and converts it in ``from_pretrained``; acb's weight updates convert it
the same way (:func:`acb.runner.weight_update.model_names`). Each case saves a tiny random model,
loads the folder into a copy whose weights all differ, and checks every parameter and persistent
buffer equals the saved model's, exactly. No engine is started (the round trip is the staging's:
``tests/api/test_weight_updates.py`` loads such folders into running engines). About 10 s for the
whole sample on one core.
"""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path

import pytest
import torch

from acb.errors import WeightUpdateError
from acb.runner.weight_update import read_checkpoint, stage, weight_targets
from tests.test_model_sweep import ms, sampled_types
from tests.vlm_models import ARCHS, tiny_vlm


def _round_trip(model: torch.nn.Module, folder: Path) -> None:
    """``model`` saved to ``folder``, loaded into a copy with other weights: equal, exactly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a tiny config's generation settings)
        model.save_pretrained(folder)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    stage(other, read_checkpoint(folder)).swap()
    saved, loaded = weight_targets(model), weight_targets(other)
    assert saved.keys() == loaded.keys()
    differ = [n for n, t in saved.items() if not torch.equal(t, loaded[n])]
    assert not differ, f"{len(differ)} of {len(saved)} tensors differ after the round trip: {differ[:5]}"


@pytest.mark.parametrize("model_type", sampled_types())
def test_save_pretrained_loads_back_for_every_swept_model(model_type: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        cfg = ms.tiny_config(model_type)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    except Exception as exc:  # noqa: BLE001 - the sweep reports these as "cannot build" too
        pytest.skip(f"the sweep cannot build {model_type}: {type(exc).__name__}: {exc}")
    _round_trip(model, tmp_path / "ckpt")


@pytest.mark.parametrize("arch", ARCHS)
def test_save_pretrained_loads_back_for_every_vision_language_model(arch: str, tmp_path: Path) -> None:
    model, _ = tiny_vlm(arch)
    _round_trip(model, tmp_path / "ckpt")


def test_a_checkpoint_missing_an_expert_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    """A merge that cannot be made (one expert's ``w1`` missing) names the fused weight and the
    checkpoint tensors it came from; no weight changes."""
    from safetensors.torch import save_file

    cfg = ms.tiny_config("mixtral")
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    saved.save_pretrained(tmp_path / "full")
    tensors = dict(read_checkpoint(tmp_path / "full"))
    dropped = next(n for n in sorted(tensors) if n.endswith("experts.1.w1.weight"))
    del tensors[dropped]
    save_file(tensors, str(tmp_path / "part.safetensors"))
    other = copy.deepcopy(saved)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    before = {n: t.clone() for n, t in weight_targets(other).items()}
    layer = dropped.split(".block_sparse_moe.")[0]
    with pytest.raises(WeightUpdateError, match=rf"{layer}\.mlp\.experts\.gate_up_proj: cannot make it"):
        stage(other, read_checkpoint(tmp_path / "part.safetensors"))
    assert all(torch.equal(t, before[n]) for n, t in weight_targets(other).items())
