"""Per-request sampling settings, and their defaults taken from a transformers ``GenerationConfig``.

Fields left as ``None`` take the engine's default (from the engine's generation config),
so a request only says what differs from the engine-wide settings.

Processing order (the same as transformers' ``generate`` for the processors it has):
``logit_bias`` -> ``repetition_penalty`` -> ``presence_penalty``/``frequency_penalty`` ->
``min_new_tokens`` (stop tokens suppressed) -> greedy argmax, or, when sampling,
``temperature`` -> ``top_k`` -> ``top_p`` -> ``min_p`` -> sample.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, TypedDict

from acb.errors import InvalidRequestError, InvalidRequestTypeError, prefixed
from acb.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedConfig

DEFAULT_MAX_NEW_TOKENS = 128
LOGPROBS_MODES = ("raw", "processed")
MAX_LOGPROBS = 20
# Range limits, so that no value a request carries can overflow on the engine thread: every int
# fits the int64 that the sampler's tables and the tensor-parallel wire hold, and every float stays
# finite through what the sampler does with it in float32 (logits / temperature, logits /
# repetition_penalty, logits + bias: a model's logits are far below 1e4, and 1e4 / 1e-2 / 1e-2 + 100
# is nowhere near float32's 3.4e38).
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
MIN_TEMPERATURE = 1e-2  # a positive temperature below this samples at this one (as vLLM)
MAX_TEMPERATURE = 1e4
PENALTY_RANGE = (1e-2, 1e2)  # repetition_penalty
MAX_LOGIT_BIAS = 100.0  # |bias| (OpenAI's range); -inf bans a token


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _short(v: Any) -> str:
    """A value for an error message: a 400-digit int is not repeated whole."""
    r = repr(v)
    return r if len(r) <= 40 else f"{r[:20]}...({len(r)} characters)"


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. ``None`` means "the engine's default".

    Args:
        max_new_tokens: most tokens to generate (> 0).
        min_new_tokens: stop tokens are suppressed until this many tokens were generated.
        do_sample: ``False`` forces greedy decoding whatever the temperature (a request that sets
            only ``temperature`` samples when it is > 0).
        temperature: 0 means greedy (argmax); > 0 samples from ``softmax(logits / temperature)``
            (at most 1e4; a temperature in (0, 0.01) samples at 0.01, as vLLM does: a smaller one
            overflows the float32 logits). The engine default comes from the generation config (0
            unless ``do_sample=True``).
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (1 = off).
        min_p: drop tokens less likely than ``min_p`` times the most likely one (0 = off).
        repetition_penalty: transformers' repetition penalty over prompt and generated tokens (1 = off;
            in [0.01, 100]).
        presence_penalty: subtracted once from the logit of every token already generated (0 = off).
        frequency_penalty: subtracted from a token's logit once per time it was generated (0 = off).
        logit_bias: ``{token_id: bias}`` added to the raw logits; a bias is in [-100, 100] (OpenAI's
            range, enough to force or ban a token) or ``-inf`` (never sample it).
        stop_token_ids: tokens that end generation (kept in the output, as ``model.generate`` does).
            ``None``: the generation config's ``eos_token_id``.
        ignore_eos: keep generating through the model's EOS tokens (the generation config's) until
            ``max_new_tokens``, as vLLM's ``ignore_eos``. ``stop_token_ids`` and ``stop`` given
            explicitly still end the request.
        stop: strings that end generation (the engine needs a tokenizer); see the README for
            how the output is cut.
        seed: makes sampling reproducible whatever else is in the batch (a signed 64-bit int).
            Requests without a
            seed get one from the engine's generator (seeded by ``ContinuousBatchingConfig.seed``).
        n: number of samples; the prompt is prefilled once and shared.
        logprobs: ``None``: none; ``k >= 0``: the chosen token's logprob and the top ``k``
            alternatives (``k <= 20``).
        logprobs_mode: ``"raw"``: log-softmax of the model's logits before any processing;
            ``"processed"``: log-softmax of the logits the token was drawn from (after bias,
            penalties and, when sampling, temperature and truncation).
        skip_special_tokens: leave special tokens out of the streamed and final text (default
            True; the engine needs a tokenizer for text).
        prompt_logprobs: ``None``: none; ``k >= 0``: for every prompt token after the first,
            its logprob given the tokens before it (raw logits) and the top ``k`` alternatives
            (``output.prompt_logprobs`` / ``output.prompt_top_logprobs``). Such a request does
            not read the prefix cache (a cached prefix has no logits): its whole prompt is
            computed; it still fills the cache for others.
        structured_outputs: constrain the output to a JSON schema, any JSON object, a regex, a
            choice among strings or an EBNF grammar (:class:`acb.StructuredOutputs`, or a dict of
            its fields: vLLM's ``structured_outputs`` names). The engine needs a tokenizer and
            xgrammar (``pip install -e '.[structured]'`` in acb's checkout); a spec that cannot compile is
            refused at submit with xgrammar's message. ``logprobs_mode="raw"`` logprobs are the
            model's, before the grammar's mask; ``"processed"`` ones are after it.
    """

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] | None = None
    seed: int | None = None
    n: int | None = None
    logprobs: int | None = None
    logprobs_mode: str | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        ids = self.stop_token_ids
        if ids is not None and not isinstance(ids, tuple):
            object.__setattr__(self, "stop_token_ids", (ids,) if _is_int(ids) else tuple(ids))
        st = self.stop
        if st is not None and not isinstance(st, tuple):
            object.__setattr__(self, "stop", (st,) if isinstance(st, str) else tuple(st))
        so = self.structured_outputs
        if isinstance(so, Mapping):
            object.__setattr__(self, "structured_outputs", StructuredOutputs(**so))
        elif so is not None and not isinstance(so, StructuredOutputs):
            raise InvalidRequestTypeError(
                f"structured_outputs must be an acb.StructuredOutputs, a dict of its fields or None, "
                f"got {type(so).__name__}",
                "structured_outputs",
            )
        if self.logit_bias is not None and not isinstance(self.logit_bias, Mapping):
            raise InvalidRequestTypeError(
                f"logit_bias must be a mapping of token id -> bias, got {type(self.logit_bias).__name__}", "logit_bias"
            )
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the bad field."""

        def check_int(name: str, lo: int) -> None:
            v = getattr(self, name)
            if v is None:
                return
            if not _is_int(v):
                raise InvalidRequestTypeError(f"{name} must be an int, got {type(v).__name__}", name)
            if v < lo:
                raise InvalidRequestError(f"{name} must be >= {lo}, got {v}", name)
            if v > INT64_MAX:  # the engine's tables and the tensor-parallel wire hold int64
                raise InvalidRequestError(f"{name} must be <= {INT64_MAX} (2**63 - 1), got {_short(v)}", name)

        def check_float(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if v is None:
                return
            if not _is_num(v):
                raise InvalidRequestTypeError(f"{name} must be a number, got {type(v).__name__}", name)
            # (an int is compared as is: float() of a 400-digit one overflows)
            if isinstance(v, float) and not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
                bound = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
                raise InvalidRequestError(f"{name} must be in {bound}, got {_short(v)}", name)

        check_int("max_new_tokens", 1)
        check_int("min_new_tokens", 0)
        check_int("top_k", 0)
        check_int("n", 1)
        check_int("logprobs", 0)
        check_int("prompt_logprobs", 0)
        if self.prompt_logprobs is not None and self.prompt_logprobs > MAX_LOGPROBS:
            raise InvalidRequestError(
                f"prompt_logprobs must be <= {MAX_LOGPROBS}, got {self.prompt_logprobs}", "prompt_logprobs"
            )
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be <= {MAX_LOGPROBS}, got {self.logprobs}", "logprobs")
        if (
            self.max_new_tokens is not None
            and self.min_new_tokens is not None
            and self.min_new_tokens > self.max_new_tokens
        ):
            raise InvalidRequestError(
                f"min_new_tokens ({self.min_new_tokens}) > max_new_tokens ({self.max_new_tokens})", "min_new_tokens"
            )
        check_float("temperature", 0.0, MAX_TEMPERATURE)
        check_float("top_p", 0.0, 1.0, lo_open=True)
        check_float("min_p", 0.0, 1.0)
        check_float("repetition_penalty", *PENALTY_RANGE)
        check_float("presence_penalty", -2.0, 2.0)
        check_float("frequency_penalty", -2.0, 2.0)
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise InvalidRequestTypeError(f"do_sample must be a bool, got {type(self.do_sample).__name__}", "do_sample")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestTypeError(
                f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}", "ignore_eos"
            )
        if self.stop_token_ids is not None:
            for tok in self.stop_token_ids:
                if not _is_int(tok):
                    raise InvalidRequestTypeError(f"stop_token_ids must hold ints, got {tok!r}", "stop_token_ids")
                if tok < 0 or tok > INT64_MAX:
                    raise InvalidRequestError(
                        f"stop_token_ids must be in [0, 2**63 - 1], got {_short(tok)}", "stop_token_ids"
                    )
        if self.stop is not None:
            for s in self.stop:
                if not isinstance(s, str) or not s:
                    raise InvalidRequestError(f"stop must hold non-empty strings, got {s!r}", "stop")
        if self.logit_bias is not None:
            for tok, b in self.logit_bias.items():
                if not _is_int(tok) or tok < 0 or tok > INT64_MAX:
                    raise InvalidRequestError(
                        f"logit_bias keys must be token ids in [0, 2**63 - 1], got {_short(tok)}", "logit_bias"
                    )
                if not _is_num(b) or not (-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS) and b != -math.inf:
                    raise InvalidRequestError(
                        f"logit_bias[{tok}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] or -inf, "
                        f"got {_short(b)}",
                        "logit_bias",
                    )
        if self.seed is not None:
            if not _is_int(self.seed):
                raise InvalidRequestTypeError(f"seed must be an int or None, got {type(self.seed).__name__}", "seed")
            if not INT64_MIN <= self.seed <= INT64_MAX:
                raise InvalidRequestError(f"seed must be a signed 64-bit int, got {_short(self.seed)}", "seed")
        if self.logprobs_mode is not None and self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidRequestError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}", "logprobs_mode"
            )
        if self.skip_special_tokens is not None and not isinstance(self.skip_special_tokens, bool):
            raise InvalidRequestTypeError(
                f"skip_special_tokens must be a bool, got {type(self.skip_special_tokens).__name__}",
                "skip_special_tokens",
            )

    def merged_over(self, defaults: SamplingParams) -> SamplingParams:
        """These params with every ``None`` field taken from ``defaults``.

        Args:
            defaults: the values for the fields left ``None`` here.

        Returns:
            A new :class:`SamplingParams` (this one when nothing was ``None``).
        """
        changes = {
            f.name: getattr(defaults, f.name)
            for f in fields(self)
            if getattr(self, f.name) is None and getattr(defaults, f.name) is not None
        }
        return replace(self, **changes) if changes else self

    @property
    def is_greedy(self) -> bool:
        return self.do_sample is False or not self.temperature

    # The tokens a request may never sample, stated once: the sampler builds its min_new_tokens
    # table from held_stops (acb.runner.sampler; a -inf bias is -inf once added to the logits), and
    # structured outputs' dead-end check (acb.core.grammar_masks) reads never_sampled.
    def held_stops(self, stop_token_ids: frozenset[int]) -> frozenset[int]:
        """The stop tokens ``min_new_tokens`` holds back: never sampled as a generated token whose
        index (0 = the first) is below ``min_new_tokens``.

        Args:
            stop_token_ids: the request's resolved stop tokens (``EngineRequest.stop_token_ids``).

        Returns:
            ``stop_token_ids`` when ``min_new_tokens`` is set, else an empty set.
        """
        return stop_token_ids if self.min_new_tokens and stop_token_ids else frozenset()

    def never_sampled(self, stop_token_ids: frozenset[int], gen_idx: int) -> Collection[int]:
        """The tokens never sampled as a request's ``gen_idx``-th generated token (0 = the first):
        the stop tokens ``min_new_tokens`` still holds back (:meth:`held_stops`), and those with a
        ``-inf`` logit bias.

        Args:
            stop_token_ids: the request's resolved stop tokens (``EngineRequest.stop_token_ids``).
            gen_idx: the index of the token being generated.

        Returns:
            Those tokens (empty for most requests).
        """
        held: Collection[int] = ()
        if self.min_new_tokens and gen_idx < self.min_new_tokens:
            held = self.held_stops(stop_token_ids)
        if self.logit_bias:
            banned = [t for t, b in self.logit_bias.items() if b == -math.inf]
            if banned:
                held = {*held, *banned}
        return held

    @classmethod
    def from_generation_config(
        cls,
        generation_config: GenerationConfig,
        model_config: PreTrainedConfig | None = None,
        *,
        drop_unsupported: bool = True,
    ) -> SamplingParams:
        """Engine-wide defaults from a transformers ``GenerationConfig``.

        Settings acb has no processor for (``typical_p``, ``no_repeat_ngram_size``, ...) are
        dropped with a warning naming them, or refused with ``drop_unsupported=False``.
        """
        gc = generation_config

        def get(name: str, default: Any = None) -> Any:
            return getattr(gc, name, default)

        do_sample = bool(get("do_sample", False))
        eos = get("eos_token_id")
        if eos is None and model_config is not None:
            eos = getattr(model_config, "eos_token_id", None)
        if _is_int(eos):
            eos = (eos,)
        stop = tuple(int(e) for e in eos if e is not None and int(e) >= 0) if eos is not None else ()
        unsupported = []
        for name, off in (
            ("typical_p", 1.0),
            ("epsilon_cutoff", 0.0),
            ("eta_cutoff", 0.0),
            ("top_h", None),
            ("no_repeat_ngram_size", 0),
            ("encoder_repetition_penalty", 1.0),
            ("bad_words_ids", None),
            ("sequence_bias", None),
            ("begin_suppress_tokens", None),
            ("forced_bos_token_id", None),
            ("forced_eos_token_id", None),
            ("min_length", 0),
            ("watermarking_config", None),
        ):
            v = get(name)
            if v is not None and v != off:
                unsupported.append(f"{name}={v!r}")
        if (get("num_beams") or 1) > 1:
            unsupported.append(f"num_beams={get('num_beams')}")
        if unsupported:
            msg = f"acb has no processor for these generation-config settings: {', '.join(unsupported)}"
            if not drop_unsupported:
                raise ValueError(msg + " (drop_unsupported_processors=False)")
            warnings.warn(msg + "; they are not applied", stacklevel=3)
        top_k = get("top_k")
        min_p = get("min_p")
        rep = get("repetition_penalty")
        # suppressed tokens (TRL sets a VLM's image token): a logit bias of -inf, as transformers' processor masks them
        suppress = {int(t): float("-inf") for t in get("suppress_tokens") or ()}
        return cls(
            logit_bias=suppress or None,
            max_new_tokens=get("max_new_tokens") if get("max_new_tokens") is not None else DEFAULT_MAX_NEW_TOKENS,
            min_new_tokens=get("min_new_tokens") or 0,
            temperature=float(get("temperature") if get("temperature") is not None else 1.0) if do_sample else 0.0,
            top_k=int(top_k) if do_sample and top_k else 0,
            top_p=float(get("top_p")) if do_sample and get("top_p") is not None else 1.0,
            min_p=float(min_p) if do_sample and min_p is not None else 0.0,
            repetition_penalty=float(rep) if rep is not None else 1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            stop_token_ids=stop,
            n=int(get("num_return_sequences") or 1),
        )


class SamplingKwargs(TypedDict, total=False):
    """The fields of :class:`SamplingParams`, as keyword arguments of ``submit``, ``generate``
    and ``generate_batch`` (``engine.generate(ids, max_new_tokens=8, temperature=0.7)``)."""

    max_new_tokens: int
    min_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: Mapping[int, float]
    stop_token_ids: int | tuple[int, ...] | list[int]
    ignore_eos: bool
    stop: str | tuple[str, ...] | list[str]
    seed: int
    n: int
    logprobs: int
    logprobs_mode: str
    skip_special_tokens: bool
    prompt_logprobs: int
    structured_outputs: StructuredOutputs | Mapping[str, Any]


# Names other libraries use for a field, for the error that refuses them.
_OTHER_NAMES = {
    "max_tokens": "max_new_tokens",  # vLLM, OpenAI
    "min_tokens": "min_new_tokens",  # vLLM
    "num_return_sequences": "n",  # transformers
    "eos_token_id": "stop_token_ids",  # transformers
    "stop_strings": "stop",  # transformers
    "top_logprobs": "logprobs",  # OpenAI
}


def with_overrides(method: str, sampling: SamplingParams | None, overrides: Mapping[str, Any]) -> SamplingParams | None:
    """``sampling`` (or the defaults) with the sampling keyword arguments ``method`` was called
    with laid over it: ``engine.generate(ids, temperature=0.7)``. Errors name ``method``."""
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise InvalidRequestTypeError(
            f"{method}(): sampling must be an acb.SamplingParams or None, got {type(sampling).__name__}", "sampling"
        )
    if not overrides:
        return sampling
    names = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        hints = [f"{k!r} is called {_OTHER_NAMES[k]!r} here" for k in unknown if k in _OTHER_NAMES]
        raise TypeError(
            f"{method}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}"
            + (f" ({'; '.join(hints)})" if hints else "")
            + "; sampling keywords are the fields of acb.SamplingParams"
        )
    try:
        return replace(sampling or SamplingParams(), **overrides)
    except (TypeError, ValueError) as exc:
        raise prefixed(exc, f"{method}()") from None


# What a request gets when neither it nor the engine's generation config says otherwise.
FALLBACK = SamplingParams(
    max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
    min_new_tokens=0,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    stop_token_ids=(),
    n=1,
)
