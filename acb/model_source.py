"""Where a command's model comes from: a local checkpoint or the embedded random-weight model, its
dtype and device, loaded as one process or tensor-parallel under ``torchrun``.

What ``acb generate`` and every server (``acb serve``, its torchrun followers, each Ray Serve
replica) share to turn flags into a model and a tokenizer. A :class:`ModelSource` is a small
frozen value, so that it travels (pickled) to the process that loads it. Its errors are
``ValueError`` with the flag's name in the message, which the CLI reports as usage errors.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_MODEL_NAME", "DTYPES", "ModelSource", "under_torchrun"]

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MODEL_NAME = "acb-default"


@dataclass(frozen=True)
class ModelSource:
    """A model to load: ``path`` (a local checkpoint directory with its tokenizer; None: the
    embedded random-weight model), ``dtype`` (one of :data:`DTYPES`) and ``device`` (``cpu``,
    ``cuda``, ``cuda:1``, ...). ``progress``: show transformers' loading bars."""

    path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    progress: bool = False

    @property
    def default_name(self) -> str:
        """The model's name when none is given: the checkpoint directory's name, or acb-default."""
        return os.path.basename(os.path.normpath(self.path)) if self.path else DEFAULT_MODEL_NAME

    def check(self) -> None:
        """Refuse what cannot load before anything heavy starts.

        Raises:
            ValueError: the path is not a directory, or the dtype is unknown.
        """
        if self.path is not None and not os.path.isdir(self.path):
            raise ValueError(f"--model: not a local checkpoint directory: {self.path}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def torch_device(self) -> Any:
        """The device as a ``torch.device``, checked.

        Returns:
            The ``torch.device``.

        Raises:
            ValueError: the device is malformed, or CUDA is asked for and absent.
        """
        import torch

        try:
            dev = torch.device(self.device)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"--device: {exc}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: CUDA is not available")
        return dev

    def load_tokenizer(self, command: str = "acb") -> Any:
        """The tokenizer: the checkpoint's, or the embedded one (given a plain chat template).

        Args:
            command: how a warning names the program (a checkpoint without a tokenizer).

        Returns:
            The tokenizer, or None when the checkpoint has none (a warning says so on stderr).
        """
        if self.path is None:
            from acb.models import build_tokenizer

            return build_tokenizer()  # (its chat template is acb.models.CHAT_TEMPLATE)
        from transformers import AutoTokenizer

        try:
            if vision_checkpoint(self.path):  # its processor: chat template, image processor, tokenizer
                return load_processor(self.path, local_files_only=True)
            return AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except Exception as exc:  # a checkpoint without a tokenizer can still run prompt_ids
            print(
                f"{command}: warning: no tokenizer loaded from {self.path} ({type(exc).__name__}: {exc}); "
                "text prompts are rejected and outputs have text=null",
                file=sys.stderr,
            )
            return None

    def load_model(self, device: Any = None) -> Any:
        """The model in eval mode on ``device`` (default: :meth:`torch_device`); under
        ``torchrun`` with several processes, loaded tensor-parallel (``tp_plan="auto"``).

        Args:
            device: the ``torch.device`` to load on, when already checked.

        Returns:
            The ``PreTrainedModel``.

        Raises:
            ValueError: the checkpoint cannot be loaded, or the device is bad.
        """
        import torch

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
        if under_torchrun():
            return _load_tp_model(self.path, dtype)
        device = self.torch_device() if device is None else device
        if self.path is None:
            from acb.models import default_model

            model = default_model(dtype=dtype)
        else:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            bars_were_on = hf_logging.is_progress_bar_enabled()
            if not self.progress:
                hf_logging.disable_progress_bar()
            auto: Any = AutoModelForCausalLM
            if vision_checkpoint(self.path):
                from transformers import AutoModelForImageTextToText as auto
            try:
                model = auto.from_pretrained(self.path, dtype=dtype, local_files_only=True)
            except Exception as exc:
                raise ValueError(f"--model: cannot load {self.path}: {type(exc).__name__}: {exc}") from None
            finally:
                if bars_were_on:
                    hf_logging.enable_progress_bar()
        return model.to(device).eval()


def vision_checkpoint(path: str, **kwargs: Any) -> bool:
    """A vision-language checkpoint: a model type ``AutoModelForImageTextToText`` loads, with a
    vision config (loaded with it, and with its processor, so that requests may carry images)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    try:
        cfg = AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError):
        return False  # (loading the model says what is wrong)
    return (
        cfg.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and getattr(cfg, "vision_config", None) is not None
    )


def load_processor(path: str, **kwargs: Any) -> Any:
    """A vision-language checkpoint's processor (``AutoProcessor``). Without torchvision, a
    processor that also has a video processor (Qwen-VL's, LLaVA-OneVision's, InternVL's) is built
    without it: acb takes images, not videos, and never needs torchvision."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, **kwargs)
    except (ImportError, ValueError, OSError, TypeError) as exc:
        first = exc
    import json

    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import processor_class_from_name
    from transformers.utils import cached_file

    cls_name, template = None, None
    for name in ("processor_config.json", "preprocessor_config.json", "chat_template.json", "chat_template.jinja"):
        try:
            file = cached_file(path, name, _raise_exceptions_for_missing_entries=False, **kwargs)
        except (OSError, ValueError):
            continue
        if not file:
            continue
        with open(file) as f:
            if name.endswith(".jinja"):
                template = template or f.read()
                continue
            data = json.load(f)
        cls_name = cls_name or data.get("processor_class")
        template = template or data.get("chat_template")
    if cls_name is None:
        raise first
    cls = processor_class_from_name(cls_name)
    parts: dict[str, Any] = {
        "image_processor": AutoImageProcessor.from_pretrained(path, use_fast=False, **kwargs),
        "tokenizer": AutoTokenizer.from_pretrained(path, **kwargs),
    }
    if "video_processor" in getattr(cls, "get_attributes", lambda: [])():
        parts["video_processor"] = None
    template = template or getattr(parts["tokenizer"], "chat_template", None)
    if template is not None:
        parts["chat_template"] = template
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def lenient(self: Any, name: str, arg: Any) -> Any:  # (None: the video processor left out)
        return None if arg is None else check(self, name, arg)

    ProcessorMixin.check_argument_for_proper_class = lenient  # type: ignore[method-assign]
    try:
        return cls(**parts)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check  # type: ignore[method-assign]


def under_torchrun() -> bool:
    """Launched by ``torchrun`` with more than one process: the model is loaded tensor-parallel.

    Returns:
        Whether ``WORLD_SIZE`` > 1 and ``LOCAL_RANK`` is set.
    """
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ


def _load_tp_model(path: str | None, dtype: Any) -> Any:
    """Under torchrun: ``from_pretrained(..., tp_plan="auto")`` (the embedded model is saved to a
    temporary directory first: every rank builds the same seeded weights)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    with tempfile.TemporaryDirectory() as tmp:
        if path is None:
            from acb.models import default_model

            default_model(dtype=dtype).save_pretrained(tmp)
            path = tmp
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto"), local_files_only=True
            )
        except Exception as exc:
            raise ValueError(f"--model: cannot load {path} tensor-parallel: {type(exc).__name__}: {exc}") from None
    return model.eval()
