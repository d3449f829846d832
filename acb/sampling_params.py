"""Per-request sampling settings, and their defaults taken from a transformers ``GenerationConfig``.

Fields left as ``None`` take the engine's default (from the engine's generation config),
so a request only says what differs from the engine-wide settings.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields, replace
from typing import Any

# Defaults used when neither the request nor the engine's generation config says otherwise.
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Args:
        max_new_tokens: most tokens to generate (> 0). ``None``: the engine default.
        temperature: 0 means greedy (argmax); > 0 samples from ``softmax(logits / temperature)``.
            ``None``: the engine default.
        stop_token_ids: tokens that end generation (the stop token is kept in the output, as
            ``model.generate`` does). ``None``: the generation config's ``eos_token_id``.
        ignore_eos: keep generating through stop tokens until ``max_new_tokens``.
        logprobs: ``None`` for no logprobs; ``0`` for the log-probability of each chosen token
            (log-softmax of the raw logits, before temperature).
        seed: accepted for forward compatibility; per-request random streams are not implemented
            yet, so sampled requests draw from the engine's generator (see README).
    """

    max_new_tokens: int | None = None
    temperature: float | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, tuple):
            ids = self.stop_token_ids
            if isinstance(ids, int):
                ids = (ids,)
            object.__setattr__(self, "stop_token_ids", tuple(ids))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the bad field."""
        m = self.max_new_tokens
        if m is not None:
            if isinstance(m, bool) or not isinstance(m, int):
                raise TypeError(f"max_new_tokens must be an int, got {type(m).__name__}")
            if m <= 0:
                raise ValueError(f"max_new_tokens must be > 0, got {m}")
        t = self.temperature
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, (int, float)):
                raise TypeError(f"temperature must be a number, got {type(t).__name__}")
            if not math.isfinite(t) or t < 0:
                raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t}")
        if self.stop_token_ids is not None:
            for tok in self.stop_token_ids:
                if isinstance(tok, bool) or not isinstance(tok, int):
                    raise TypeError(f"stop_token_ids must hold ints, got {tok!r}")
                if tok < 0:
                    raise ValueError(f"stop_token_ids must be >= 0, got {tok}")
        lp = self.logprobs
        if lp is not None:
            if isinstance(lp, bool) or not isinstance(lp, int):
                raise TypeError(f"logprobs must be an int or None, got {type(lp).__name__}")
            if lp != 0:
                raise ValueError(
                    f"logprobs={lp}: only 0 (the chosen token's logprob) is supported so far; "
                    "top-k alternatives are not implemented yet"
                )
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise TypeError(f"seed must be an int or None, got {type(s).__name__}")

    def merged_over(self, defaults: "SamplingParams") -> "SamplingParams":
        """These params with every ``None`` field taken from ``defaults``."""
        changes = {
            f.name: getattr(defaults, f.name)
            for f in fields(self)
            if getattr(self, f.name) is None and getattr(defaults, f.name) is not None
        }
        return replace(self, **changes) if changes else self

    @property
    def is_greedy(self) -> bool:
        return not self.temperature

    @classmethod
    def from_generation_config(cls, generation_config: Any, model_config: Any = None) -> "SamplingParams":
        """Engine-wide defaults from a transformers ``GenerationConfig``.

        ``do_sample=False`` means greedy whatever the temperature. Processors that acb does not
        apply yet (top-k, top-p, min-p, penalties...) are named in a warning rather than
        silently dropped.
        """
        gc = generation_config
        max_new = getattr(gc, "max_new_tokens", None)
        do_sample = bool(getattr(gc, "do_sample", False))
        temperature = float(getattr(gc, "temperature", 1.0) or 1.0) if do_sample else 0.0
        eos = getattr(gc, "eos_token_id", None)
        if eos is None and model_config is not None:
            eos = getattr(model_config, "eos_token_id", None)
        if isinstance(eos, int):
            eos = (eos,)
        stop = tuple(int(e) for e in eos if e is not None and int(e) >= 0) if eos is not None else ()
        if do_sample:
            ignored = []
            if getattr(gc, "top_k", None) not in (None, 0):
                ignored.append(f"top_k={gc.top_k}")
            if getattr(gc, "top_p", None) not in (None, 1.0):
                ignored.append(f"top_p={gc.top_p}")
            if getattr(gc, "min_p", None) not in (None, 0.0):
                ignored.append(f"min_p={gc.min_p}")
            if ignored:
                warnings.warn(
                    "acb applies only temperature so far; these generation-config settings are "
                    f"not applied: {', '.join(ignored)}",
                    stacklevel=3,
                )
        if getattr(gc, "repetition_penalty", None) not in (None, 1.0):
            warnings.warn(
                f"repetition_penalty={gc.repetition_penalty} is not applied by acb yet", stacklevel=3
            )
        return cls(
            max_new_tokens=max_new if max_new is not None else DEFAULT_MAX_NEW_TOKENS,
            temperature=temperature,
            stop_token_ids=stop,
        )
