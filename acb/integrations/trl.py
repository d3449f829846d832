"""TRL's ``GRPOTrainer`` generating its rollouts through acb (``pip install -e ".[trl]"`` in acb's checkout).

TRL's trainer can generate through transformers' continuous batching: with
``GRPOConfig(use_transformers_continuous_batching=True)`` it calls the policy model's
``generate_batch(prompt_ids, generation_config=..., continuous_batching_config=...,
progress_bar=False)`` and reads ``output.generated_tokens`` of each result. :func:`use_acb` points
that method of the trainer's model at one acb engine kept for the trainer's life::

    from trl import GRPOConfig, GRPOTrainer
    from acb.integrations.trl import use_acb

    args = GRPOConfig(..., use_transformers_continuous_batching=True)
    trainer = GRPOTrainer(model=model, args=args, reward_funcs=reward, train_dataset=ds)
    with use_acb(trainer):
        trainer.train()

Between rounds the model trains in place: the engine stays up (no start-up per round), its prefix
cache is dropped when the weights change (detected from the parameters' version counters), the
model's train/eval mode is left as TRL sets it, and with ``sleep=True`` (the default on CUDA) the
KV cache and step buffers are freed after each round so the backward pass has the memory, and
allocated again for the next round. TRL's own argument ``continuous_batching_config`` (a
transformers ``ContinuousBatchingConfig``) sizes the engine, as it would transformers' manager.

Logprobs: TRL's continuous-batching path recomputes the old policy's logprobs itself (logits
divided by the temperature) and takes none from the generator. Code that samples through acb
directly and wants the sampler's own logprobs asks for ``logprobs=0, logprobs_mode="processed"``:
the log-softmax of the logits after the processors (penalties, temperature, top-k/top-p masking),
the distribution each token was drawn from, per token and per sample of ``n``; with neither
top-k nor top-p (nor penalties) that is exactly what a trainer computes from ``logits /
temperature`` on the same weights, so importance ratios start at 1.

To the bit: with ``ContinuousBatchingConfig(batch_invariant=True)`` as ``use_acb``'s config, the
trainer's own per-token logprobs are computed with the engine's fixed-order ops
(:func:`match_sampler`, installed for the trainer's life), so they equal the sampler's exactly;
with remote rollouts (``acb serve --batch-invariant``), call :func:`match_sampler` yourself.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from acb.api.engine import Engine
from acb.config import as_config
from acb.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    from acb.outputs import GenerationOutput

logger = logging.getLogger(__name__)


class AcbRollouts:
    """The ``generate_batch`` that :func:`use_acb` installs on the model: one acb engine, started
    on the first call and kept until :meth:`close` (rebuilt if the model's dtype or device, or
    the continuous-batching config it is called with, changes). A closed object refuses to be
    called or installed again (it would start an engine that nothing stops): call
    :func:`use_acb` again for a new one."""

    def __init__(
        self,
        model: Any,
        config: Any = None,
        *,
        sleep: bool | None = None,
        tokenizer: Any = None,
        structured_outputs: StructuredOutputs | None = None,
    ) -> None:
        self.model = model
        # every rollout's constraint (GRPOConfig.vllm_structured_outputs_regex, which TRL applies
        # only on its vLLM path): acb constrains the transformers path too
        self.structured_outputs = structured_outputs
        self.config = config  # acb's or transformers' config; None: TRL's, from each call
        self.sleep = sleep
        self.tokenizer = tokenizer
        self.engine: Engine | None = None
        self._key: tuple | None = None
        self.calls = 0  # rounds generated (tests and logs read them)
        self.completions = 0
        self._installed = False
        self._closed = False
        self._trainer: Any = None  # a vision-language trainer whose generation this object took over
        self.matched: SamplerMatched | None = None  # the trainer's logprobs as the sampler's (batch_invariant)
        self._lock = threading.Lock()  # close() against a call starting the engine in another thread

    # ------------------------------------------------------------ install
    def install(self) -> AcbRollouts:
        """Shadow the model's ``generate_batch`` with this object (an instance attribute)."""
        self._check_open()
        if "generate_batch" in vars(self.model):
            raise RuntimeError("the model's generate_batch is already replaced (use_acb called twice?)")
        self.model.generate_batch = self
        self._installed = True
        return self

    def take_over_generation(self, trainer: Any) -> AcbRollouts:
        """A vision-language trainer's rollouts through this object: TRL's prompt tokenizing is
        kept (its training forward needs its batched image tensors) and each prompt is also
        processed on its own, as one acb request with its images; TRL's generation step then
        generates these through the engine (a prompt acb has no processed form of, a tool
        turn's, goes to TRL's own generation)."""
        tokenize, generate = trainer._tokenize_prompts, trainer._generate_single_turn
        rows: dict[tuple[int, ...], Any] = {}

        def tokenize_prompts(prompts: list) -> Any:
            prompt_ids, images, fields = tokenize(prompts)
            rows.clear()
            if images is not None:
                from trl.data_utils import prepare_multimodal_messages

                for prompt, ids in zip(prompts, prompt_ids):
                    one = trainer.processing_class.apply_chat_template(
                        conversation=[prepare_multimodal_messages(prompt)],
                        tools=trainer.tools or None,
                        chat_template=trainer.chat_template,
                        add_generation_prompt=True,
                        tokenize=True,
                        return_dict=True,
                        return_tensors="pt",
                        **trainer.chat_template_kwargs,
                    )
                    if one["input_ids"][0].tolist() == list(ids):  # (else TRL's own generation runs it)
                        rows[tuple(ids)] = one
            return prompt_ids, images, fields

        def generate_single_turn(prompt_ids: list, images: Any, fields: Any, *args: Any, **kwargs: Any) -> Any:
            inputs = [rows.get(tuple(ids)) for ids in prompt_ids]
            if images is not None and any(x is None for x, im in zip(inputs, images) if im):
                return generate(prompt_ids, images, fields, *args, **kwargs)
            out = self(
                [x if x is not None else list(ids) for x, ids in zip(inputs, prompt_ids)],
                generation_config=trainer.generation_config,
                progress_bar=False,
            )
            return [list(o.generated_tokens) for o in out.values()], None

        trainer._tokenize_prompts, trainer._generate_single_turn = tokenize_prompts, generate_single_turn
        self._trainer = trainer
        return self

    def close(self) -> None:
        """Stop the engine and give the model its own ``generate_batch`` back (and a trainer its
        own generation); idempotent."""
        with self._lock:
            self._closed = True
            if self._installed:
                if vars(self.model).get("generate_batch") is self:
                    del self.model.generate_batch
                self._installed = False
            trainer, self._trainer = self._trainer, None
            if trainer is not None:
                for name in ("_tokenize_prompts", "_generate_single_turn"):
                    vars(trainer).pop(name, None)
            self._stop_engine()
            if self.matched is not None:  # (after the engine: it gives the model back the attention it found)
                self.matched.close()
                self.matched = None

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "these acb rollouts are closed (their engine is stopped and the model has its own "
                "generate_batch back): call use_acb(...) again for new ones"
            )

    def __enter__(self) -> AcbRollouts:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ rounds
    def __call__(
        self,
        inputs: Any,
        generation_config: Any = None,
        continuous_batching_config: Any = None,
        *,
        progress_bar: bool = True,
        **kwargs: Any,
    ) -> dict[str, GenerationOutput]:
        """transformers' ``model.generate_batch`` signature; returns ``{req_i: GenerationOutput}``
        in input order (``.generated_tokens`` as transformers gives them)."""
        for ignored in ("persistent_manager", "warmup"):
            kwargs.pop(ignored, None)
        with self._lock:
            self._check_open()
            # a call without a config (the user's own) runs on the engine TRL's calls started
            engine = self._engine_for(self.config if self.config is not None else continuous_batching_config)
        engine.set_generation_config(
            generation_config if generation_config is not None else getattr(self.model, "generation_config", None)
        )
        if engine.is_sleeping:
            engine.wake_up()
        if self.structured_outputs is not None:
            kwargs.setdefault("structured_outputs", self.structured_outputs)
        try:
            out = engine.generate_batch(inputs, progress_bar=progress_bar, **kwargs)
        finally:
            if self._sleeps(engine):
                engine.sleep()
        self.calls += 1
        self.completions += len(out)
        return out

    def _sleeps(self, engine: Engine) -> bool:
        return self.sleep if self.sleep is not None else next(self.model.parameters()).is_cuda

    def _engine_for(self, config: Any) -> Engine:
        param = next(self.model.parameters())
        key = (param.dtype, param.device, repr(as_config(config)))
        live = self.engine is not None and self.engine.is_running
        if live and (key == self._key or (config is None and key[:2] == self._key[:2])):  # type: ignore[index]
            return self.engine  # type: ignore[return-value]  # live implies set

        if self.engine is not None:  # TRL cast the model (bf16) or passed another config: rebuild
            logger.info("acb rollouts: the model's dtype/device or the engine config changed; restarting the engine")
            self._stop_engine()
        engine = Engine(self.model, config, tokenizer=self.tokenizer)
        was_training = self.model.training
        engine.start()
        if was_training:
            self.model.train()  # TRL's mode stays TRL's: steps run in eval semantics regardless
        self.engine, self._key = engine, key
        return engine

    def _stop_engine(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            was_training = self.model.training
            engine.shutdown()
            if was_training != self.model.training:
                self.model.train(was_training)


MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


class SamplerMatched:
    """A GRPO trainer's per-token logprobs computed as an acb engine with ``batch_invariant=True``
    computes the sampler's: installed by :func:`match_sampler`, undone by :meth:`close`.

    TRL's ``_get_per_token_logps_and_entropies`` (the old policy's logprobs, the loss's, the
    reference model's) is replaced on the trainer by one that runs the model under
    :func:`acb.runner.batch_invariant.enabled` (acb's fixed-order linears and attention; autograd
    through them), each row's positions from 0 at its first unpadded token (as the engine
    positions a prompt), then ``log_softmax(logits / temperature)`` at the completion tokens. So
    a logprob the trainer computes for a token equals, bit for bit, the one the sampler returned
    for it on the same weights. Text policies only (images, and an MoE's auxiliary loss, are refused)."""

    def __init__(self, trainer: Any) -> None:
        from acb.runner.batch_invariant import enable

        self.trainer = trainer
        self._own = vars(trainer).get("_get_per_token_logps_and_entropies")
        model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
        # on this thread for the trainer's life: activation checkpointing recomputes the forward
        # inside the backward, outside any call of ours, and must run the same ops
        self._on = enable(model)
        trainer._get_per_token_logps_and_entropies = self.per_token_logps_and_entropies

    def close(self) -> None:
        """The trainer's own computation back, and the mode off on this thread (idempotent)."""
        self._on.close()
        if vars(self.trainer).get("_get_per_token_logps_and_entropies") == self.per_token_logps_and_entropies:
            if self._own is None:
                del self.trainer._get_per_token_logps_and_entropies
            else:
                self.trainer._get_per_token_logps_and_entropies = self._own

    def per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        from acb.runner.attention import ATTN_IMPL_NAME as ENGINE_ATTN
        from acb.runner.batch_invariant import ATTN_IMPL_NAME, enabled, token_logprobs

        given = [k for k in MULTIMODAL_KEYS if kwargs.get(k) is not None]
        if given:
            raise ValueError(f"acb's sampler-matched logprobs cover text policies only (this batch has {given})")
        if compute_aux_loss:
            raise ValueError("acb's sampler-matched logprobs do not compute an MoE's auxiliary loss")
        temperature = float(getattr(self.trainer, "temperature", 1.0) or 1.0)
        inner = self.trainer.accelerator.unwrap_model(model) if hasattr(self.trainer, "accelerator") else model
        # the policy attends with acb's fixed-order function since match_sampler (or with the engine's,
        # which falls back to it outside a step); another model (TRL's reference) for this call
        swap = None if inner.config._attn_implementation in (ATTN_IMPL_NAME, ENGINE_ATTN) else inner
        step = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for i in range(0, input_ids.size(0), step):
            ids, mask = input_ids[i : i + step], attention_mask[i : i + step]
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # each row from 0, as the engine
            with enabled(swap):
                logits = model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    use_cache=False,
                    logits_to_keep=logits_to_keep + 1,
                ).logits
            logits = logits[:, :-1][:, -logits_to_keep:]
            rows, vocab = logits.shape[0] * logits.shape[1], logits.shape[-1]
            flat = logits.reshape(rows, vocab)
            logps.append(
                token_logprobs(flat, ids[:, -logits_to_keep:].reshape(rows), temperature).view(ids.size(0), -1)
            )
            if compute_entropy:
                x = flat.float() / torch.tensor([temperature], dtype=torch.float32)[:, None]
                lp = torch.log_softmax(x, dim=-1)
                entropies.append((-(lp.exp() * lp).sum(-1)).view(ids.size(0), -1))
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None


def match_sampler(trainer: Any) -> SamplerMatched:
    """Make a TRL ``GRPOTrainer`` compute its per-token logprobs exactly as an acb engine with
    ``batch_invariant=True`` (``acb serve --batch-invariant``) computes the sampler's
    (:class:`SamplerMatched`). :func:`use_acb` does it itself when its config has
    ``batch_invariant=True``; with remote rollouts (``acb.rl.rollout_func``) call it once on
    the trainer. Returns the installed object (``close()`` undoes it)."""
    if not hasattr(trainer, "_get_per_token_logps_and_entropies"):
        raise TypeError(f"match_sampler needs a TRL GRPO trainer, got {type(trainer).__name__}")
    return SamplerMatched(trainer)


def use_acb(target: Any, config: Any = None, *, sleep: bool | None = None) -> AcbRollouts:
    """Make a TRL trainer (or a model) generate through acb; returns the installed
    :class:`AcbRollouts` (a context manager: leaving it stops the engine and undoes the change).

    ``target``: a ``GRPOTrainer`` built with ``use_transformers_continuous_batching=True``, a
    ``GRPOTrainer`` of a vision-language policy (TRL's own generation path: acb takes it over,
    images included), or the model itself. ``config``: acb's (or transformers') continuous-batching config, overriding
    the one TRL passes. ``sleep``: free the KV cache between rounds (default: on CUDA).
    A trainer's ``GRPOConfig.vllm_structured_outputs_regex`` constrains every rollout (TRL
    itself applies it only when generating with vLLM).
    """
    model = target
    tokenizer = None
    structured = None
    if hasattr(target, "accelerator") and hasattr(target, "model") and getattr(target, "_is_vlm", False):
        # a vision-language policy: TRL refuses continuous batching for it, so acb takes its own
        # generation path instead (the images reach acb's engine, the training forward is TRL's)
        if getattr(target, "use_vllm", False):
            raise ValueError("the trainer generates with vLLM: build it without use_vllm for use_acb to take over")
        model = target.accelerator.unwrap_model(target.model)
        rollouts = AcbRollouts(model, config, sleep=sleep)
        return rollouts.install().take_over_generation(target)
    if hasattr(target, "accelerator") and hasattr(target, "model"):  # a trainer
        if not getattr(target, "use_transformers_continuous_batching", False):
            raise ValueError(
                "the trainer does not generate through continuous batching: build it with "
                "GRPOConfig(use_transformers_continuous_batching=True) for use_acb to take over"
            )
        model = target.accelerator.unwrap_model(target.model)
        tokenizer = getattr(target, "processing_class", None)
        if not hasattr(tokenizer, "decode"):  # a multimodal processor: rollouts are token ids anyway
            tokenizer = None
        regex = getattr(getattr(target, "args", None), "vllm_structured_outputs_regex", None)
        if regex:  # TRL's constrained rollouts, on acb's engine (needs the tokenizer and xgrammar)
            structured = StructuredOutputs(regex=regex)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "generate_batch"):
        raise TypeError(f"use_acb needs a TRL trainer or a transformers model, got {type(target).__name__}")
    rollouts = AcbRollouts(model, config, sleep=sleep, tokenizer=tokenizer, structured_outputs=structured).install()
    if model is not target and config is not None and as_config(config).batch_invariant:
        # the trainer's logprobs computed by the engine's fixed-order ops: the sampler's, bit for bit
        rollouts.matched = match_sampler(target)
    return rollouts
