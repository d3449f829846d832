"""lm-evaluation-harness model ``"acb"``: lm-eval's requests run through one acb :class:`~acb.Engine`.

Importing this module registers the model with lm-eval (extra ``eval``: ``pip install -e
".[eval]"`` in acb's checkout)::

    import lm_eval
    import acb.integrations.lm_eval  # noqa: F401 - registers "acb" (and "acb-multimodal", below)

    results = lm_eval.simple_evaluate(model="acb", model_args="pretrained=PATH,dtype=bfloat16",
                                      tasks=["hellaswag"], device="cuda")

lm-eval has no plug-in mechanism for models defined outside its tree, so its own ``lm_eval``
command does not know ``--model acb``. This module's ``main`` is that command with the model
registered first; it takes lm-eval's arguments unchanged (without ``--device``: ``cuda`` when
available, else ``cpu``)::

    python -m acb.integrations.lm_eval --model acb --model_args pretrained=PATH --tasks hellaswag --device cuda

What the three request types become:

- ``loglikelihood`` (multiple choice): the continuations of each context scored through
  :meth:`acb.Engine.score_batch`, all contexts at once, sorted so that shared prefixes meet in
  the prefix cache; a continuation's logprobs are summed, and it is greedy when each of its
  tokens is the top-1 alternative. Tokenization, the empty-context case and the left truncation are
  lm-eval's own (``TemplateLM``) and those of its ``hf`` backend, so the numbers match it; a
  context that is not empty but encodes to no tokens (whitespace alone, with a tokenizer that
  adds no BOS) is refused with a ``ValueError``, where ``hf`` fails an assertion.
- ``loglikelihood_rolling`` (perplexity): lm-eval's rolling windows, scored as above.
- ``generate_until``: one request per context with the task's stop strings; the text is decoded
  and cut before the first stop string as the ``hf`` backend does.

The context window is ``hf``'s: lm-eval's own resolution from the model's config and tokenizer
(``resolve_max_length``: ``max_position_embeddings`` and kin, else 2,048), at most the engine's
``max_model_len`` (a KV cache too small for it cuts it, with a warning). A scored window of
``max_length + 1`` tokens takes ``max_length`` positions, as ``hf``'s forward does: its last token is
scored, never fed.

A PEFT adapter: ``peft=ADAPTER`` as for lm-eval's ``hf`` (``--model_args
pretrained=BASE,peft=ADAPTER``): a LoRA adapter folder (``save_pretrained``'s; a hub id is fetched
at ``revision``) on top of the base model. The engine is started with room for one adapter
(``max_loras=1`` and ``max_lora_rank`` the adapter's rank, unless the model arguments set them),
the adapter is installed with :meth:`acb.Engine.add_lora`, and every request (``loglikelihood``,
``loglikelihood_rolling``, ``generate_until``) runs with it, so the numbers are those of ``hf``'s
``PeftModel``. As ``hf``, the model's embeddings are resized to the tokenizer's length first when the
two differ (a checkpoint loaded from a path). ``delta`` (weights added to the base) is refused.

``loglikelihood`` runs on the engine's scoring requests (:meth:`acb.Engine.score_batch`): the
continuations of one context are one item (one-token choices come from one forward of the
context), the prefix cache is read for every context (a task's few-shot preamble is computed
once per engine, not once per document), and the LM head runs only on the scored rows.

Images: model ``"acb-multimodal"``
----------------------------------

:class:`AcbMultimodalLM` runs lm-eval's tasks with images (a task's ``doc_to_image``) on a
vision-language model, as lm-eval's own ``hf-multimodal`` backend does and with its model
arguments (``image_token_id``/``image_string``, ``interleave``, ``max_images``,
``convert_img_format``, ``min_pixels``/``max_pixels``, ``image_width``/``image_height``/
``image_max_side``), plus :class:`AcbLM`'s::

    results = lm_eval.simple_evaluate(model="acb-multimodal", model_args="pretrained=PATH",
                                      tasks=["mmmu_val"], device="cuda")
    # or a model object and its processor
    results = lm_eval.simple_evaluate(model="acb-multimodal",
                                      model_args={"pretrained": model, "processor": processor}, ...)

A checkpoint is loaded with ``AutoModelForImageTextToText`` and its processor with
:func:`acb.model_source.load_processor`; the processor's tokenizer is lm-eval's tokenizer. A
request with images (lm-eval hands them over as ``{"visual": [images]}`` after the request's own
arguments) is made what ``hf-multimodal`` makes of it, one request at a time: the images resized
and cut to ``max_images``, each ``<image>`` in the text replaced by the model's image token
string (unless a chat template rendered the text: then the processor's template placed image
parts where the placeholders were), and ``processor(text=..., images=...)``; its ``input_ids``
and pixel tensors go to the engine as one processed prompt. So:

- ``generate_until``: greedy (or sampled) generation with the task's stop strings and
  ``max_gen_toks``, the text cut as ``hf-multimodal`` cuts it; a context longer than the
  window is cut from the left, and refused where that would cut an image's tokens.
- ``loglikelihood`` (multiple choice): ``hf-multimodal``'s pair encoding (the context and the
  whole text processed with the images, the continuation the tokens past the context's), scored
  on the processed context through :meth:`acb.Engine.score_batch`; ``hf-multimodal`` itself
  refuses these requests ("not yet tested").
- ``loglikelihood_rolling`` with images is refused, as by ``hf-multimodal``.

Requests without images take :class:`AcbLM`'s text path. The command line takes ``--model
acb-multimodal`` too.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any, TypeVar

from tqdm.auto import tqdm

from acb.api.engine import Engine
from acb.api.loading import load_pretrained
from acb.config import ContinuousBatchingConfig
from acb.outputs import RequestStatus
from acb.sampling_params import SamplingParams

try:
    # lm_eval.models registers the built-in backends (lazily), which lm-eval itself only does while
    # its model registry is empty: importing it before "acb" is registered keeps "hf" & co. findable
    importlib.import_module("lm_eval.models")
    from lm_eval.api.model import TemplateLM  # type: ignore[import-untyped]
    from lm_eval.api.registry import model_registry  # type: ignore[import-untyped]
    from lm_eval.models.utils import (  # type: ignore[import-untyped]
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
        replace_placeholders,
        resize_image,
        resolve_max_length,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "acb.integrations.lm_eval needs lm-evaluation-harness: pip install -e '.[eval]' (in acb's checkout)"
    ) from exc

if TYPE_CHECKING:
    from collections.abc import Hashable, Sequence

    import torch
    from lm_eval.api.instance import Instance  # type: ignore[import-untyped]
    from transformers import PreTrainedModel

    from acb.api.handles import SyncRequestHandle
    from acb.outputs import GenerationOutput
    from acb.text import TokenizerLike

logger = logging.getLogger(__name__)

# lm-eval's image placeholder in a multimodal task's text (hf-multimodal's DEFAULT_IMAGE_PLACEHOLDER)
DEFAULT_IMAGE_PLACEHOLDER = "<image>"

# lm-eval generation keywords that map one to one onto SamplingParams fields
_SAMPLING_KEYS = frozenset(
    {"top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "min_new_tokens"}
)
_ENGINE_KEYS = frozenset(f.name for f in fields(ContinuousBatchingConfig) if f.init)

# the name the ``peft`` adapter is loaded under in the engine
PEFT_ADAPTER = "peft"

_T = TypeVar("_T")
_K = TypeVar("_K", bound="Hashable")
# loglikelihood request as TemplateLM hands it over: ((context, continuation) or None, context ids, continuation ids)
_TokenRequest = tuple["tuple[str, str] | None", list[int], list[int]]


class AcbLM(TemplateLM):
    """lm-eval model backed by one acb engine, started here and kept for the object's life.

    Args:
        pretrained: a checkpoint (local directory or hub id), loaded with ``Engine.from_pretrained``,
            or a ``PreTrainedModel`` already built (``dtype``, ``device``, ``revision`` and
            ``trust_remote_code`` then do not apply, as with lm-eval's ``hf``).
        tokenizer: a tokenizer, or where to load one from; default: ``pretrained``'s (for a
            model object, its ``name_or_path``).
        dtype: ``"auto"`` (the checkpoint's), ``"bfloat16"``, ``"float16"``, ``"float32"`` or a
            ``torch.dtype``.
        device: where the model goes; default ``cuda`` when available, else ``cpu``.
        max_length: the context window of ``loglikelihood`` and ``generate_until``; default
            ``hf``'s (see the module docstring), at most the engine's ``max_model_len``.
        max_gen_toks: generated tokens when a task does not say (lm-eval's default, 256).
        add_bos_token, prefix_token_id: as for lm-eval's ``hf`` (tokenization of the inputs; the
            token an empty context is replaced by, default BOS, else EOS).
        chat_template_args: keyword arguments of the tokenizer's ``apply_chat_template``.
        batch_size, max_batch_size: accepted because lm-eval passes them; acb schedules its own
            batches (``max_batch_tokens``, ``max_requests_per_batch``).
        peft: a LoRA adapter every request runs with, as lm-eval's ``hf`` takes it: the folder
            PEFT's ``save_pretrained`` wrote (or a hub id, fetched at ``revision``; or a
            ``peft.PeftModel``, its active adapter). The engine gets ``max_loras=1`` and the
            adapter's rank as ``max_lora_rank`` unless these are given (see the module docstring).
        delta: refused (``hf``'s delta weights; acb does not add weights to a model).
        engine_settings: fields of :class:`acb.ContinuousBatchingConfig` (``num_blocks``,
            ``max_batch_tokens``, ``use_async_batching``, ``max_model_len``, ...).

    ``close()`` (or leaving a ``with`` block) stops the engine; so does garbage collection of an
    object that was not closed, and the interpreter's exit.
    """

    def __init__(
        self,
        pretrained: str | PreTrainedModel,
        tokenizer: str | TokenizerLike | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        revision: str | None = None,
        trust_remote_code: bool = False,
        chat_template_args: dict[str, Any] | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        peft: str | os.PathLike[str] | Any = None,
        delta: str | None = None,
        **engine_settings: Any,
    ) -> None:
        super().__init__()
        unknown = sorted(set(engine_settings) - _ENGINE_KEYS)
        if unknown:
            raise TypeError(
                f"AcbLM got unknown argument(s) {unknown}: the model arguments are AcbLM's own "
                "and the fields of acb.ContinuousBatchingConfig"
            )
        if delta is not None:
            raise ValueError(
                "Cannot use both 'peft' and 'delta' options at the same time (as lm-eval's hf)"
                if peft is not None
                else f"delta={delta!r}: acb does not add delta weights to a model; add them to the checkpoint "
                "and pass that as pretrained (a LoRA adapter is taken as peft=...)"
            )
        if batch_size not in (None, 1, "1") or max_batch_size is not None:
            logger.info(
                "acb schedules its own batches: batch_size=%s / max_batch_size=%s have no effect "
                "(set max_batch_tokens or max_requests_per_batch instead)",
                batch_size,
                max_batch_size,
            )
        hub_kwargs: dict[str, Any] = {"revision": revision} if revision is not None else {}
        self.peft = peft
        self._peft_source = None if peft is None else _adapter_source(peft, revision)
        if self._peft_source is not None:
            engine_settings = _lora_settings(engine_settings, self._peft_source)
        config = ContinuousBatchingConfig(**engine_settings)
        if trust_remote_code:
            hub_kwargs["trust_remote_code"] = True
        if isinstance(pretrained, str):
            dtype, device = _placement(dtype, device)
        engine, tok = self._make_engine(pretrained, tokenizer, config, dtype, device, hub_kwargs)
        self.engine = engine
        self.tokenizer = tok
        engine.start()
        # stops the engine thread when this object is closed, collected, or at exit; it holds the
        # engine only, so it does not keep this object alive
        self._finalizer = weakref.finalize(self, engine.shutdown)
        # the adapter every request runs with (None: the base model)
        self._lora: str | None = None
        if self._peft_source is not None:
            try:
                engine.add_lora(PEFT_ADAPTER, self._peft_source)
            except BaseException:
                self.close()
                raise
            self._lora = PEFT_ADAPTER
        limit = engine.config.max_model_len
        if max_length is not None and not 0 < max_length <= limit:
            self.close()
            raise ValueError(
                f"max_length={max_length}: acb can score a window of at most {limit} tokens with "
                f"this engine (its max_model_len)"
            )
        if max_length is None:
            max_length = resolve_max_length(engine.model.config, tok)  # what hf's window is
            if max_length > limit:
                logger.warning(
                    "the context window is %d tokens (the engine's max_model_len), not the model's %d: "
                    "the KV cache is too small for a whole window",
                    limit,
                    max_length,
                )
                max_length = limit
        self._max_length = max_length
        self._max_gen_toks = max_gen_toks
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.chat_template_args = dict(chat_template_args or {})
        self._device = engine.config.device

    def _make_engine(
        self,
        pretrained: str | PreTrainedModel,
        tokenizer: Any,
        config: ContinuousBatchingConfig,
        dtype: str | torch.dtype,
        device: str | None,
        hub_kwargs: dict[str, Any],
    ) -> tuple[Engine, Any]:
        """The engine (not started) and the tokenizer lm-eval's text goes through."""
        tok = _load_tokenizer(tokenizer, pretrained, hub_kwargs)
        if not isinstance(pretrained, str):
            return Engine(pretrained, config, tokenizer=tok), tok
        if self._peft_source is None:
            engine = Engine.from_pretrained(pretrained, config, dtype=dtype, device=device, tokenizer=tok, **hub_kwargs)
            return engine, tok
        model, _ = load_pretrained(pretrained, dtype=dtype, device=device, tokenizer=tok, **hub_kwargs)
        # as hf does before it applies an adapter: the embeddings resized to the tokenizer's length
        # (a vocabulary padded past the tokenizer's loses its extra rows, which changes every logprob)
        vocab = getattr(getattr(model.config, "text_config", model.config), "vocab_size", None)
        if vocab is not None and vocab != len(tok):
            logger.info(
                "peft: resizing the model's embeddings from %d to the tokenizer's %d rows (as hf)", vocab, len(tok)
            )
            model.resize_token_embeddings(len(tok))
        return Engine(model, config, getattr(model, "generation_config", None), tokenizer=tok), tok

    # ------------------------------------------------------------------ life
    def close(self) -> None:
        """Stop the engine (cancelling whatever still runs); idempotent."""
        self._finalizer()

    def __enter__(self) -> AcbLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------- properties
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records in the results' ``config``: the model and the engine's settings."""
        model = self.engine.model
        return {
            "model_num_parameters": sum(p.numel() for p in model.parameters()),
            "model_dtype": str(next(model.parameters()).dtype),
            "acb_engine": asdict(self.engine.config),
            **(
                {"peft": str(self.peft) if isinstance(self.peft, (str, os.PathLike)) else "PeftModel"}
                if self._lora
                else {}
            ),
        }

    # --------------------------------------------------------------- tokens
    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs: Any
    ) -> list[int]:
        """Token ids of ``string`` as lm-eval's ``hf`` makes them: the tokenizer's special tokens
        (or ``add_bos_token``), none when the string already starts with the prefix token."""
        special: dict[str, bool] = {}
        if add_special_tokens is not None:
            special["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            special["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None:
            prefix = self.tokenizer.decode(self.prefix_token_id)
            if prefix and string.startswith(prefix):
                special["add_special_tokens"] = False
        ids: list[int] = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat as one prompt string, rendered by the tokenizer's template (as ``hf``: retried
        without the system message when the template rejects it)."""
        from jinja2.exceptions import TemplateError

        def render(chat: list[dict[str, str]]) -> str:
            return str(
                self.tokenizer.apply_chat_template(
                    chat,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=not add_generation_prompt,
                    **self.chat_template_args,
                )
            )

        try:
            return render(chat_history)
        except TemplateError:
            logger.warning("the chat template failed; retrying without the system message")
            return render([m for m in chat_history if m["role"] != "system"])

    # ------------------------------------------------------------- requests
    def _loglikelihood_tokens(
        self, requests: list[_TokenRequest], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Score every continuation through the engine's scoring requests, all at once: the
        continuations of one context are one :meth:`acb.Engine.score` item (its one-token choices
        a single forward of the context), and the items go in sorted by tokens, so that contexts
        sharing a prefix (a task's few-shot preamble) meet in the prefix cache and it is computed
        once. Each pair is the window ``hf`` scores: context and continuation cut from the left to
        ``max_length + 1`` tokens (the last one is scored, never fed)."""
        items: dict[tuple[int, ...], dict[tuple[int, ...], None]] = {}  # context -> its continuations
        keys = []
        for request_str, ctx, cont in requests:
            if not ctx:
                # TemplateLM puts the prefix token before an empty context ("") only; a context that
                # is not empty but encodes to nothing (whitespace alone, which _encode_pair moves into
                # the continuation) comes here bare, and hf asserts on it: refuse it as hf does
                # rather than score the continuation without its first token
                context = repr(request_str[0]) if request_str is not None else "of a rolling window"
                raise ValueError(
                    f"loglikelihood: the context {context} encodes to no tokens, so the "
                    "continuation's first token has nothing to be scored after (lm-eval's hf "
                    "backend refuses it too; only an empty context gets the prefix token)"
                )
            if not cont:
                raise ValueError("loglikelihood: the continuation encodes to no tokens")
            if len(cont) > self.max_length:
                raise ValueError(
                    f"loglikelihood: a continuation of {len(cont)} tokens does not fit the "
                    f"context window of {self.max_length} tokens"
                )
            window = (ctx + cont)[-(self.max_length + 1) :]
            key = (tuple(window[: len(window) - len(cont)]), tuple(cont))
            items.setdefault(key[0], {})[key[1]] = None
            keys.append(key)
        scored = self._score({c: (list(c), conts) for c, conts in items.items()}, disable_tqdm)
        results = []
        for (request_str, _, _), key in zip(requests, keys):
            if request_str is not None:  # rolling windows are cached per document, by the caller
                self.cache_hook.add_partial("loglikelihood", request_str, scored[key])
            results.append(scored[key])
        return results

    def _score(
        self, items: dict[_K, tuple[Any, dict[tuple[int, ...], None]]], disable_tqdm: bool
    ) -> dict[tuple[_K, tuple[int, ...]], tuple[float, bool]]:
        """Score every item (key: its context as a prompt, its distinct continuations) in one
        :meth:`acb.Engine.score_batch` call: ``(key, continuation) -> (logprob, greedy)``."""
        batch = [(context, [list(x) for x in conts]) for context, conts in items.values()]
        outs = self.engine.score_batch(batch, progress_bar=not disable_tqdm, lora=self._lora)
        scored: dict[tuple[_K, tuple[int, ...]], tuple[float, bool]] = {}
        for (key, (_, conts)), out in zip(items.items(), outs):
            if out.status != RequestStatus.FINISHED:
                raise RuntimeError(f"acb loglikelihood: scoring failed: {out.error}")
            for cont_key, s in zip(conts, out.continuations):
                scored[(key, cont_key)] = (s.logprob, s.greedy)
        return scored

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's logprob over lm-eval's disjoint rolling windows of ``max_length`` tokens
        (the first conditioned on the prefix token), all windows of all texts in one batch."""
        windows: list[_TokenRequest] = []
        counts = []
        for (string,) in (req.args for req in requests):
            pairs = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            doc = [(None, ctx, cont) for ctx, cont in map(make_disjoint_window, pairs)]
            windows.extend(doc)
            counts.append(len(doc))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = []
        start = 0
        for req, n in zip(requests, counts):
            total = sum(lp for lp, _ in scores[start : start + n])
            start += n
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            totals.append(total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Generate for every context at once, each with its own stop strings and token budget;
        the text is cut before the first stop string (the model's EOS text is one), as ``hf``."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        prompts: list[Any] = []
        params: list[SamplingParams] = []
        stops: list[list[str]] = []
        for req in requests:
            sp, until, max_gen_toks = self._sampling(req.args[1], eos)
            # room for the generated tokens, as hf: the context is cut from the left
            prompts.append(self._generation_prompt(req.args, self.max_length - max_gen_toks))
            params.append(sp)
            stops.append(until)

        def text_of(i: int, out: GenerationOutput) -> str:
            return str(postprocess_generated_text(self.tok_decode(out.generated_tokens), stops[i], None))

        texts = self._run(prompts, params, "acb generate_until", disable_tqdm, text_of)
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args[:2], text)
        return texts

    def _generation_prompt(self, args: tuple[Any, ...], max_context: int) -> Any:
        """A ``generate_until`` request's prompt: its context's ids, cut from the left to ``max_context``."""
        ids = self.tok_encode(args[0], left_truncate_len=max_context)
        return ids or [self.prefix_token_id]  # an empty context: the prefix token, as loglikelihood

    def _sampling(self, gen_kwargs: dict[str, Any], eos: str) -> tuple[SamplingParams, list[str], int]:
        """A task's generation keywords as SamplingParams, its stop strings (with the EOS text) and
        its token budget. Keywords acb has no equivalent for are refused: another decoding than
        the task asks for would change the score."""
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until: list[str] = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        if max_gen_toks >= self.max_length:
            raise ValueError(
                f"max_gen_toks={max_gen_toks} leaves no room for the context in a window of {self.max_length} tokens"
            )
        do_sample = bool(kwargs.pop("do_sample"))
        temperature = float(kwargs.pop("temperature", 0.0))
        if kwargs.pop("num_beams", 1) != 1:
            raise ValueError("acb does not do beam search (generation keyword num_beams)")
        unknown = sorted(set(kwargs) - _SAMPLING_KEYS)
        if unknown:
            raise ValueError(
                f"generation keyword(s) {unknown} have no acb equivalent (known: do_sample, "
                f"temperature, until, max_gen_toks, {', '.join(sorted(_SAMPLING_KEYS))})"
            )
        sp = SamplingParams(
            max_new_tokens=max_gen_toks,
            do_sample=do_sample,
            temperature=temperature if do_sample else 0.0,
            stop=tuple(s for s in until if s),
            **kwargs,
        )
        return sp, until, max_gen_toks

    def _run(
        self,
        prompts: list[Any],
        params: list[SamplingParams],
        desc: str,
        disable_tqdm: bool,
        keep: Callable[[int, GenerationOutput], _T],
    ) -> list[_T]:
        """Submit every prompt, then collect the outputs in order, keeping ``keep(i, output)`` of
        each (an output's per-token lists are dropped as soon as it is read). Submitting everything
        first lets the engine batch freely; if anything fails, the requests still running are
        cancelled."""
        handles: list[SyncRequestHandle] = []
        try:
            for ids, sp in zip(prompts, params):
                handles.append(self.engine.submit(ids, sp, lora=self._lora))
            kept = []
            with tqdm(total=len(handles), desc=desc, disable=disable_tqdm) as bar:
                for i, h in enumerate(handles):
                    kept.append(keep(i, h.result()))
                    bar.update(1)
            return kept
        except BaseException:
            for h in handles:
                h.cancel()
            raise


class AcbMultimodalLM(AcbLM):
    """lm-eval model ``"acb-multimodal"``: :class:`AcbLM` for a vision-language model, with
    lm-eval's ``hf-multimodal`` handling of a request's images.

    Args:
        pretrained: a vision-language checkpoint (loaded with ``AutoModelForImageTextToText``, its
            processor with :func:`acb.model_source.load_processor`), or a model object (then pass
            ``processor``, or the processor is loaded from the model's ``name_or_path``).
        processor: the model's processor (an object, or where to load it from); ``tokenizer``
            is taken as such too, as ``hf-multimodal`` does. Its tokenizer is lm-eval's tokenizer.
        image_token_id, image_string: what lm-eval's ``<image>`` placeholders become: the string
            ``image_string``, else the decoded ``image_token_id`` (default: the model config's
            ``image_token_id`` / ``image_token_index``).
        interleave: as ``hf-multimodal``, under a chat template: the images where the
            placeholders are (True) or all before the text (False).
        max_images: at most this many images a request (the first ones); further placeholders
            are left as they are.
        convert_img_format: convert the images to RGB first.
        min_pixels, max_pixels: passed to the processor as it is loaded (Qwen-VL's image sizes).
        image_width, image_height, image_max_side: resize each image as ``hf-multimodal`` does
            (lm-eval's ``resize_image``) before the processor sees it.
        **kwargs: :class:`AcbLM`'s arguments (``dtype``, ``device``, ``max_length``,
            ``max_gen_toks``, the engine's settings...).
    """

    MULTIMODAL = True  # lm-eval runs tasks with images (doc_to_image) on models with this flag

    def __init__(
        self,
        pretrained: str | PreTrainedModel,
        processor: Any = None,
        image_token_id: int | None = None,
        image_string: str | None = None,
        interleave: bool = True,
        max_images: int | None = 999,
        convert_img_format: bool = False,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        image_width: int | None = None,
        image_height: int | None = None,
        image_max_side: int | None = None,
        **kwargs: Any,
    ) -> None:
        if image_max_side and (image_width or image_height):
            raise ValueError(
                "Ambiguous config for image resize: you can not specify both image_max_side and "
                "(image_width or image_height)"
            )
        self.processor = processor
        self.pixels = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v}
        self.image_width, self.image_height, self.image_max_side = image_width, image_height, image_max_side
        self.interleave = interleave
        self.max_images = 999 if max_images is None else int(max_images)
        self.rgb = convert_img_format
        self.chat_applied = False  # as hf-multimodal: once a chat template rendered a prompt, it placed the images
        super().__init__(pretrained, **kwargs)
        from acb.media import modality_token_id

        # the model's placeholder id, for the left-truncation checks
        self._image_token_id = modality_token_id(self.engine.model.config, "image")
        if image_string:
            self.image_token: str = image_string
        else:
            token_id = int(image_token_id) if image_token_id else self._image_token_id
            if token_id is None:
                self.close()
                raise ValueError(
                    "the model's config has no image_token_id (or image_token_index): pass image_token_id "
                    "or image_string in the model arguments"
                )
            if self._image_token_id is None:
                self._image_token_id = int(token_id)
            self.image_token = self.tok_decode([int(token_id)], skip_special_tokens=False)

    def _make_engine(
        self,
        pretrained: str | PreTrainedModel,
        tokenizer: Any,
        config: ContinuousBatchingConfig,
        dtype: str | torch.dtype,
        device: str | None,
        hub_kwargs: dict[str, Any],
    ) -> tuple[Engine, Any]:
        processor = self.processor if self.processor is not None else tokenizer
        if processor is None or isinstance(processor, str):
            from acb.model_source import load_processor

            source = processor or (
                pretrained if isinstance(pretrained, str) else getattr(pretrained.config, "name_or_path", "")
            )
            if not source:
                raise ValueError(
                    "AcbMultimodalLM needs a processor with a model object that has no name_or_path: pass processor=..."
                )
            processor = load_processor(source, **hub_kwargs, **self.pixels)
        if not hasattr(processor, "tokenizer") or not hasattr(processor, "image_processor"):
            raise TypeError(
                f"processor: expected the model's processor (an AutoProcessor with a tokenizer and an image "
                f"processor), got {type(processor).__name__}"
            )
        self.processor = processor
        if isinstance(pretrained, str):
            from transformers import AutoModelForImageTextToText

            model: Any = AutoModelForImageTextToText.from_pretrained(pretrained, dtype=dtype, **hub_kwargs)
            model = model.to(device).eval()
        else:
            model = pretrained
        return Engine(model, config, processor=processor), processor.tokenizer

    # ----------------------------------------------------------- chat
    def apply_chat_template(self, chat_history: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat rendered by the processor's template, each ``<image>`` placeholder an image
        part (where it stood with ``interleave``, else before the message's text), as ``hf-multimodal``."""
        self.chat_applied = True
        chat = []
        for message in chat_history:
            text = message["content"]
            wanted = min(self.max_images, text.count(DEFAULT_IMAGE_PLACEHOLDER))
            content: list[dict[str, Any]] = []
            if not self.interleave:
                content.extend({"type": "image", "image": None} for _ in range(wanted))
                content.append({"type": "text", "text": text.replace(DEFAULT_IMAGE_PLACEHOLDER, "")})
            else:
                parts = text.split(DEFAULT_IMAGE_PLACEHOLDER)
                for i, part in enumerate(parts):
                    if part:
                        content.append({"type": "text", "text": part})
                    if i < len(parts) - 1 and i < self.max_images:
                        content.append({"type": "image"})
            chat.append({**message, "content": content})
        return str(
            self.processor.apply_chat_template(
                chat,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
                **self.chat_template_args,
            )
        )

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The processor's chat template (lm-eval records it and keys its cache with it)."""
        if not hasattr(self.processor, "apply_chat_template"):
            return super().chat_template(chat_template)
        tok, self.tokenizer = self.tokenizer, self.processor
        try:
            return super().chat_template(chat_template)
        finally:
            self.tokenizer = tok

    # ------------------------------------------------------------- images
    def _images(self, aux: dict[str, Any]) -> list[Any]:
        """A request's images as ``hf-multimodal`` hands them to the processor: resized, the
        first ``max_images``, converted to RGB with ``convert_img_format``."""
        visual = aux.get("visual")
        if visual is None:
            return []
        images = list(visual) if isinstance(visual, (list, tuple)) else [visual]
        images = [resize_image(im, self.image_width, self.image_height, self.image_max_side) for im in images]
        images = images[: self.max_images]
        return [im.convert("RGB") for im in images] if self.rgb else images

    def _encode(self, text: str, images: list[Any]) -> Any:
        """``text`` and ``images`` through the processor, one request (``hf-multimodal``'s call):
        the ``<image>`` placeholders become the model's image token string first, unless a chat
        template rendered the text. A ``BatchFeature`` of ``[1, ...]`` tensors."""
        if not self.chat_applied:
            text = replace_placeholders(text, DEFAULT_IMAGE_PLACEHOLDER, self.image_token, self.max_images)
        # LLaVA's processor takes a flat list of images; the others one list per text
        batch = images if getattr(self.engine.model.config, "model_type", "") == "llava" else [images]
        enc = self.processor(text=[text], images=batch if images else None, return_tensors="pt")
        enc.pop("attention_mask", None)
        return enc.to(next(self.engine.model.parameters()).dtype)  # the floating tensors, as hf-multimodal casts them

    def _cut_left(self, enc: Any, keep: int) -> Any:
        """``enc`` with its first tokens dropped so that ``keep`` remain (and the per-token tensors
        with them), as ``hf-multimodal`` cuts a long context; refused where an image's tokens would go."""
        ids = enc["input_ids"]
        drop = ids.shape[-1] - keep
        if drop <= 0:
            return enc
        if self._image_token_id is not None and bool((ids[..., :drop] == self._image_token_id).any()):
            raise ValueError(
                f"a context of {ids.shape[-1]} tokens must lose its first {drop} to fit the context window, "
                f"and that would cut an image's tokens: raise max_length or lower max_gen_toks"
            )
        for name in list(enc.keys()):
            if name == "input_ids" or name.endswith("token_type_ids"):
                enc[name] = enc[name][..., drop:]
        return enc

    def _generation_prompt(self, args: tuple[Any, ...], max_context: int) -> Any:
        if len(args) < 3:
            return super()._generation_prompt(args, max_context)
        enc = self._cut_left(self._encode(args[0], self._images(args[2])), max_context)
        return enc if _has_pixels(enc) else enc["input_ids"][0].tolist()

    # ------------------------------------------------------------- requests
    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Requests without images as :class:`AcbLM`'s; those with images scored on their
        processed context (``hf-multimodal``'s ``_encode_multimodal_pair`` split: the context and
        the whole text processed with the images, the continuation the tokens past the context's)."""
        with_images = [i for i, r in enumerate(requests) if len(r.args) >= 3]
        if not with_images:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        picked = set(with_images)
        text = [r for i, r in enumerate(requests) if i not in picked]
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        if text:
            text_results = iter(super().loglikelihood(text, disable_tqdm=disable_tqdm))
            for i in range(len(requests)):
                if i not in picked:
                    results[i] = next(text_results)
        items: dict[tuple[Any, ...], tuple[Any, dict[tuple[int, ...], None]]] = {}
        keys = []
        for i in with_images:
            context, continuation, aux = requests[i].args
            if context == "":
                raise ValueError("loglikelihood: a request with images needs a non-empty context (as hf-multimodal)")
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            images = self._images(aux)
            ctx = self._encode(context, images)
            whole = self._encode(context + continuation, images)["input_ids"][0].tolist()
            ctx_ids = ctx["input_ids"][0].tolist()
            cont = tuple(whole[len(ctx_ids) :])
            if not cont:
                raise ValueError("loglikelihood: the continuation encodes to no tokens")
            if len(cont) > self.max_length:
                raise ValueError(
                    f"loglikelihood: a continuation of {len(cont)} tokens does not fit the "
                    f"context window of {self.max_length} tokens"
                )
            # the window hf scores: context and continuation cut from the left to max_length + 1 tokens
            ctx = self._cut_left(ctx, self.max_length + 1 - len(cont))
            # one item per context and images (the same list object: a document's choices)
            key = (tuple(ctx["input_ids"][0].tolist()), id(aux.get("visual")))
            items.setdefault(key, (ctx if _has_pixels(ctx) else list(key[0]), {}))[1][cont] = None
            keys.append((key, cont))
        scored = self._score(items, disable_tqdm)
        for i, pair in zip(with_images, keys):
            results[i] = scored[pair]
            self.cache_hook.add_partial("loglikelihood", requests[i].args[:2], scored[pair])
        return [r for r in results if r is not None]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        if any(len(r.args) > 1 for r in requests):  # (the text, then lm-eval's {"visual": ...})
            raise NotImplementedError(
                "acb-multimodal does not score images (loglikelihood_rolling); use 'acb' for text-only rolling tasks"
            )
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)


def _has_pixels(enc: Any) -> bool:
    """A processor's output that carries images (more than token ids and per-token types)."""
    return any(k not in ("input_ids", "attention_mask") and not k.endswith("token_type_ids") for k in enc.keys())


def _placement(dtype: str | torch.dtype, device: str | None) -> tuple[str | torch.dtype, str]:
    """A checkpoint's dtype (a name made a ``torch.dtype``; ``"auto"`` kept) and device (default
    ``cuda`` when available, else ``cpu``)."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(dtype, str) and dtype != "auto":
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype={dtype!r}: expected 'auto' or a torch dtype name such as 'bfloat16'")
        dtype = getattr(torch, dtype)
    return dtype, device


def _adapter_source(peft: Any, revision: str | None) -> Any:
    """What ``add_lora`` reads for ``peft``: a local folder as it is, a ``PeftModel`` as it is,
    else a hub id, fetched at ``revision`` (as ``hf``'s ``PeftModel.from_pretrained(..., revision=)``)."""
    if not isinstance(peft, (str, os.PathLike)) or os.path.isdir(peft):
        return peft
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            str(peft), revision=revision, allow_patterns=["adapter_config.json", "adapter_model.*"]
        )
    except Exception as exc:  # noqa: BLE001 - the hub's many errors, said as one
        raise ValueError(
            f"peft={str(peft)!r}: not a local folder, and the Hugging Face hub (or its cache) has no such "
            f"adapter ({type(exc).__name__}: {exc}); pass the folder PEFT's save_pretrained wrote"
        ) from exc


def _adapter_rank(source: Any) -> int | None:
    """The largest rank of an adapter (its ``r`` and ``rank_pattern``), or None when its config
    cannot be read here (``add_lora`` then says what is wrong)."""
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(os.path.join(source, "adapter_config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
    else:
        configs = getattr(source, "peft_config", None)
        active = getattr(source, "active_adapter", None)
        if not isinstance(configs, dict) or active not in configs:
            return None
        config = vars(configs[active])
    if not isinstance(config, dict):
        return None
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    ints = [int(r) for r in ranks if isinstance(r, int)]
    return max(ints) if ints else None


def _lora_settings(settings: dict[str, Any], source: Any) -> dict[str, Any]:
    """The engine settings with room for the ``peft`` adapter: ``max_loras=1`` and
    ``max_lora_rank`` the adapter's rank, where the model arguments do not set them."""
    settings = dict(settings)
    if "max_loras" not in settings:
        settings["max_loras"] = 1
    elif not (isinstance(settings["max_loras"], int) and settings["max_loras"] >= 1):
        raise ValueError(
            f"peft: the adapter needs an engine with LoRA on, and max_loras={settings['max_loras']!r} "
            "turns it off; leave max_loras out (1) or set it >= 1"
        )
    rank = _adapter_rank(source)
    if "max_lora_rank" not in settings and rank is not None:
        settings["max_lora_rank"] = rank
    return settings


def _load_tokenizer(
    tokenizer: str | TokenizerLike | None, pretrained: str | PreTrainedModel, hub_kwargs: dict[str, Any]
) -> Any:
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    source = (
        tokenizer
        if tokenizer is not None
        else (pretrained if isinstance(pretrained, str) else getattr(pretrained.config, "name_or_path", ""))
    )
    if not source:
        raise ValueError("AcbLM needs a tokenizer with a model object that has no name_or_path: pass tokenizer=...")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, **hub_kwargs)


# A placeholder rather than the class: ``python -m acb.integrations.lm_eval`` runs this file as
# ``__main__`` too, and lm-eval refuses a second, different class under the same name.
model_registry.register("acb", target="acb.integrations.lm_eval:AcbLM")
model_registry.register("acb-multimodal", target="acb.integrations.lm_eval:AcbMultimodalLM")


def main() -> None:
    """lm-eval's command line (``lm_eval ...``, arguments from ``sys.argv``) with ``--model acb`` known.

    Without ``--device``, an evaluation runs on acb's default device (``cuda`` when available,
    else ``cpu``), not on lm-eval's (``cuda:0``, which fails on a machine without CUDA).
    """
    import sys

    import torch
    from lm_eval.__main__ import cli_evaluate  # type: ignore[import-untyped]

    args = sys.argv[1:]
    if "--model" in args and not any(a == "--device" or a.startswith("--device=") for a in args):
        sys.argv.extend(["--device", "cuda" if torch.cuda.is_available() else "cpu"])
    cli_evaluate()


if __name__ == "__main__":
    main()
