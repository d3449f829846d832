"""An engine's parts, loaded: a checkpoint's model and tokenizer (:func:`load_pretrained`, what
:meth:`acb.api.base.EngineBase.from_pretrained` builds an engine from), and the model runner
built for a model (:func:`build_runner`, the API's only torch code)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from acb.config import ContinuousBatchingConfig
    from acb.runner.model_runner import ModelRunner
    from acb.text import TokenizerLike

__all__ = ["build_runner", "load_pretrained"]


def build_runner(
    model: PreTrainedModel, config: ContinuousBatchingConfig, runner_cls: type[ModelRunner] | None = None
) -> ModelRunner:
    """The model runner for ``model``: the model checked, the KV cache sized and allocated, the
    decode CUDA graphs captured when enabled (on the model's device).

    Args:
        model: the engine's model.
        config: the engine's config.
        runner_cls: the runner's class (default :class:`acb.runner.model_runner.ModelRunner`).

    Returns:
        The runner, warmed up (closed again if its warm-up failed).
    """
    from acb.runner.model_runner import ModelRunner
    from acb.runner.setup import device_scope, model_device

    with device_scope(model_device(model)):
        runner = (runner_cls or ModelRunner)(model, config)
        try:
            runner.warmup()  # captures the decode CUDA graphs when enabled
        except BaseException:
            runner.close()
            raise
    return runner


def load_pretrained(
    path: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | int | None = None,
    tokenizer: TokenizerLike | None = None,
    **model_kwargs: Any,
) -> tuple[PreTrainedModel, TokenizerLike]:
    """A checkpoint's model (in eval mode) and its tokenizer, from a local directory or a hub id.
    A vision-language checkpoint (one ``AutoModelForImageTextToText`` loads) comes with its
    ``AutoProcessor`` in place of the tokenizer, so chats with images work.

    Args:
        path: the checkpoint folder, or a hub id.
        dtype: the model's dtype (``"auto"``: the checkpoint's).
        device: where the model goes (``"cuda"``, ``"cpu"``...; None: where transformers puts it).
        tokenizer: use this one instead of the checkpoint's.
        **model_kwargs: passed to ``from_pretrained``.

    Returns:
        ``(model, tokenizer)``.

    Raises:
        OSError: ``path`` is no checkpoint folder and the hub (or, with ``HF_HUB_OFFLINE=1``, its
            local cache) does not have it; the message says how to use a local folder.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from acb.model_source import load_processor, vision_checkpoint

    vision = vision_checkpoint(path)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    try:
        model: PreTrainedModel = auto.from_pretrained(path, dtype=dtype, **model_kwargs)
    except OSError as exc:
        if os.path.isdir(path):
            raise
        raise OSError(
            f"cannot load {path!r}: it is not a local folder, and neither the Hugging Face hub nor its "
            f"cache has it ({exc}). Pass a checkpoint folder instead (one save_pretrained wrote, or "
            "`hf download ORG/NAME --local-dir DIR`); without a network, HF_HUB_OFFLINE=1 makes a hub "
            "id fail at once instead of after retries"
        ) from exc
    if device is not None:
        # PreTrainedModel.to is wrapped with functools.wraps(nn.Module.to): mypy sees it unbound
        model = model.to(device)  # type: ignore[arg-type]
    if tokenizer is None:
        if vision:  # its processor: the chat template, the image processor and the tokenizer
            tokenizer = load_processor(path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path)
    model = model.eval()  # type: ignore[no-untyped-call]  # unannotated in transformers; returns the model
    return model, tokenizer
