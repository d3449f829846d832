"""What the GRPO integration tests share: a tiny CPU run that saves and reports nothing, and the
remote tests' eight arithmetic questions (imports trl and datasets: callers have checked both)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def grpo_config(out_dir: Path, **overrides: Any) -> Any:
    """``trl.GRPOConfig`` for a two-step run of groups of four on CPU; ``overrides`` as given."""
    from trl import GRPOConfig

    fields: dict[str, Any] = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_steps=2,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        seed=0,
        learning_rate=0.05,
    )
    fields.update(overrides)
    return GRPOConfig(**fields)


def questions() -> Any:
    """Eight prompts ``question i: i plus 2i?`` as a ``datasets.Dataset``."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": f"question {i}: {i} plus {2 * i}?"} for i in range(8)])
