"""The engine's grammar compiler (structured outputs), built on first use: :class:`Grammars`.

xgrammar reads the tokenizer's whole vocabulary once to build a compiler, so an engine that never
sees a constrained request never pays for it. The compiler lives for one run of the engine: the
engine opens the holder when it starts (the vocabulary is known then) and closes it when its
thread exits (the compiler's worker processes end with it). Thread-safe: submits compile on
callers' threads (an async submit in a worker thread), the engine thread builds matchers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from acb.errors import EngineNotRunningError, InvalidRequestError
from acb.text import text_tokenizer

if TYPE_CHECKING:
    from acb.config import ContinuousBatchingConfig
    from acb.structured import GrammarCompiler
    from acb.text import TokenizerLike

__all__ = ["Grammars"]


class Grammars:
    """Holds the grammar compiler of one engine.

    Args:
        tokenizer: the engine's tokenizer (or processor); None: structured outputs are refused.
    """

    def __init__(self, tokenizer: TokenizerLike | None) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None
        # set while the engine runs: the output vocabulary, the config and whether it follows a leader
        self._run: tuple[int, ContinuousBatchingConfig, bool] | None = None

    def open(self, vocab_size: int, config: ContinuousBatchingConfig, follower: bool) -> None:
        """The engine starts: a compiler may be built from now on.

        Args:
            vocab_size: the model's output vocabulary (the bitmasks' width).
            config: the engine's config (its ``grammar_*`` limits).
            follower: a tensor-parallel follower rank (it compiles what its leader accepted).
        """
        with self._lock:
            self._run = (vocab_size, config, follower)

    def get(self, stop_token_ids: Sequence[int] | None, check: Callable[[], object] | None = None) -> GrammarCompiler:
        """The compiler, built on the first call of a run.

        Args:
            stop_token_ids: the engine's EOS ids (the defaults'): a grammar's end is one of them.
            check: called before a compiler is built (the engine's liveness check).

        Returns:
            The :class:`acb.structured.GrammarCompiler`.

        Raises:
            InvalidRequestError: the engine has no tokenizer (field ``structured_outputs``).
            EngineNotRunningError: the engine is not running.
        """
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise InvalidRequestError(
                        "structured_outputs need a tokenizer: pass tokenizer=... to the engine", "structured_outputs"
                    )
                if check is not None:
                    check()
                if self._run is None:
                    raise EngineNotRunningError("the engine is not running")
                from acb.grammar_budget import GrammarBudget
                from acb.structured import GrammarCompiler

                vocab, config, follower = self._run
                eos = [t for t in stop_token_ids or () if 0 <= t < vocab]
                budget = GrammarBudget.from_config(config)
                if follower:
                    # a follower compiles what its leader accepted (the static limits agree): a
                    # time limit could refuse here what the leader ran, and the ranks would part
                    budget = replace(budget, compile_timeout_s=None)
                self._compiler = GrammarCompiler(
                    text_tokenizer(self._tokenizer), vocab, stop_token_ids=eos or None, budget=budget
                )
            return self._compiler

    def close(self) -> None:
        """The engine's thread exited: close the compiler (its worker processes end)."""
        with self._lock:
            self._run = None
            if self._compiler is not None:
                self._compiler.close()
                self._compiler = None
