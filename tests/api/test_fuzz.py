"""A stateful random driver over the engine: finds bookkeeping bugs, not just known instances.

Each example draws a configuration (async batching on/off, offload on/off, a KV cache small
enough to preempt, chunked prefill, prefix caching on/off, either scheduler policy, and now
and then the decode graphs' CPU twin with the Triton kernels in the interpreter) and then a
program of rounds. A round holds the engine, submits a burst of requests (random prompt
lengths from a few shared prefixes, ``n``, greedy or seeded sampling, logprobs, salts, stop
tokens, ``min_new_tokens``; now and then first a submit that must be refused, under the id
the good one then takes), lets it go, cancels some live requests (every way a user can:
``handle.cancel()``, ``engine.cancel(id)``, breaking out of ``async for``, cancelling the
awaiting task), now and then posts a few pause/resume/sleep/wake calls back to back (numbers
at the edges of their ranges are among the sampling values, and among the refused submits),
and waits a random number of steps. Now and then a round also starts a few ``score`` calls at
once, all with default ids (they must not collide); and in some examples the engine's model has
its weights replaced by assignment between rounds (``load_state_dict(..., assign=True)`` or
``module.weight = nn.Parameter(...)``, switching between two weight sets once every request has
ended): the requests after it must not read the prefix cache of the other weights.

Some examples run one request per step (``max_requests_per_batch=1``): there ``n`` samples must be
refused at submit (they need a row each), and a score call's continuations of several tokens
are requests of their own, one after another (one such example scores at least once). Some
examples give the engine a tokenizer (the byte-level one of ``acb.models.build_tokenizer``) and
mix constrained requests into their bursts (``structured_outputs``: a small ``choice`` or a
``regex`` whose matches are listed here, with stop tokens among the grammar's characters,
``min_new_tokens`` that can hold back its end, ``-inf`` biases, greedy and seeded sampling, ``n``);
now and then first a constrained submit that must be refused (a ``min_new_tokens`` beyond every
choice, a regex that cannot compile) under the id the good one then takes.

Invariants, after every round and at the end of the example:

- the engine is alive; no request failed; bad submits (and ``n`` samples that can never fork
  in the cache) are refused at submit without claiming their request id;
- every request has exactly one outcome, and a streamed request's deltas add up to it;
- every score equals a plain forward's log-softmax under the weights it ran with;
- every constrained output follows its grammar token by token: each token is one the step could
  take (it continues a match, or is the EOS that ends a complete one; less the stop tokens
  ``min_new_tokens`` holds back and the ``-inf`` biased ones), and a greedy one is the best of
  those under a plain forward (to float noise); it ends ``stop`` on the EOS after a match or on a
  stop token, ``length`` at its limit, ``grammar`` exactly where nothing could be taken (a
  prefix of a match in every case), its text is its tokens' and a stream's text adds up to it;
- every greedy request (each of its samples) equals ``model.generate`` on that prompt alone,
  cut at its first stop token (a cancelled one, a prefix of that), except where the
  reference's two best logits tie to float noise (|gap| < 1e-4): from there the check
  follows the engine's choice;
- once all requests ended, no KV block (device or host) is held, and the pool's reference
  counts agree with the running requests (``EngineCore.check_invariants``).

``ACB_FUZZ_EXAMPLES`` (default 10, about a minute on 2 CPU cores) and ``ACB_FUZZ_SEED`` set
the budget; a failure names the seed and the configuration, and
``ACB_FUZZ_EXAMPLES=1 ACB_FUZZ_SEED=<seed>`` replays that example (the engine thread's
timing can differ between runs; the program and the configuration do not).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import random
import re
import threading
from dataclasses import dataclass, field

os.environ.setdefault("TRITON_INTERPRET", "1")  # the graphs' CPU twin runs acb's Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

import acb  # noqa: E402
from acb.errors import field_of  # noqa: E402
from tests.conftest import get_model  # noqa: E402

# the interpreter's own numpy deprecation noise, in the programs that run the graphs' CPU twin
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.*")

EXAMPLES = int(os.environ.get("ACB_FUZZ_EXAMPLES", "10"))
SEED = int(os.environ.get("ACB_FUZZ_SEED", "0"))
MAX_NEW = 24
MAX_PROMPT = 56
VOCAB = 256
TIE = 1e-4  # two logits closer than this tie to float noise (the model's logits are O(1) to O(10))

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
try:
    import xgrammar  # noqa: F401

    HAVE_XGRAMMAR = True
except ImportError:
    HAVE_XGRAMMAR = False


class Reference:
    """Greedy continuations of prompts run alone through ``model.generate`` (computed once each)."""

    def __init__(self, model) -> None:
        self.model = model
        self.cache: dict[tuple, list[int]] = {}

    def __call__(self, prompt: list[int], max_new: int, stop: frozenset[int], min_new: int) -> list[int]:
        key = (tuple(prompt), stop, min_new)
        if key not in self.cache:
            with torch.no_grad():
                out = self.model.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=MAX_NEW,
                    do_sample=False,
                    eos_token_id=sorted(stop) or None,
                    pad_token_id=0,
                    min_new_tokens=min_new,
                )
            toks = out[0, len(prompt) :].tolist()
            for i, t in enumerate(toks):  # generate pads after the stop token
                if t in stop:
                    toks = toks[: i + 1]
                    break
            self.cache[key] = toks
        return self.cache[key][:max_new]

    def check(
        self, prompt: list[int], got: list[int], max_new: int, stop: frozenset[int], min_new: int, finished: bool
    ) -> None:
        """``got`` equals the greedy continuation of ``prompt`` (a prefix of it if not ``finished``).

        A greedy sequence may leave the reference only where the reference's two best logits
        tie to float noise (the engine's batch composition changes the last bits of the
        logits: the README's promise). There the check goes on from the engine's choice.
        """
        want = self(prompt, max_new, stop, min_new)
        i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if i is None:
            if finished:
                assert got == want, f"greedy tokens differ from generate alone:\n got  {got}\n want {want}"
            else:
                assert len(got) <= len(want), f"greedy tokens run past generate's:\n got  {got}\n want {want}"
            return
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + got[:i]])).logits[0, -1].double()
        gap = abs(float(logits[got[i]] - logits[want[i]]))
        assert gap < TIE, (
            f"greedy token {i} differs from generate alone, and the logits do not tie "
            f"(gap {gap:.3g}):\n got  {got}\n want {want}"
        )
        if got[i] in stop and i >= min_new:
            assert got[i + 1 :] == [], f"tokens after a stop token: {got}"
            return
        self.check(prompt + got[: i + 1], got[i + 1 :], max_new - i - 1, stop, max(0, min_new - i - 1), finished)


# ---------------------------------------------------------------------------------------------
# structured outputs: small constraints whose every match is listed here (each character is one
# token of the byte-level tokenizer), so that each generated token can be checked against what
# the grammar allows at that point

EOS = 2  # the fuzz model's generation-config EOS: the engine's EOS ids are every grammar's end token
CHOICE_WORDS = ["yes", "no", "maybe", "ab", "abc", "x"]  # ("ab" is a prefix of "abc": end or go on)


def _enumerated(pattern: str, alphabet: str, longest: int) -> list[str]:
    """Every string over ``alphabet`` of at most ``longest`` characters that ``pattern`` matches."""
    words = ("".join(p) for k in range(1, longest + 1) for p in itertools.product(alphabet, repeat=k))
    return [w for w in words if re.fullmatch(pattern, w)]


# (pattern, its matches): complete up to MAX_NEW + 1 characters (what an output and one step
# more can reach); the last one is unbounded (its outputs run to their length limit or stop)
REGEXES = [
    ("[a-c]{1,3}", _enumerated("[a-c]{1,3}", "abc", 3)),
    ("(ab|ba)c?", _enumerated("(ab|ba)c?", "abc", 3)),
    ("[0-2]{2}-[xy]", _enumerated("[0-2]{2}-[xy]", "012-xy", 4)),
    ("a+b?", ["a" * k + b for k in range(1, MAX_NEW + 2) for b in ("", "b")]),
]
# specs that cannot compile (xgrammar's regex parser refuses them at submit)
BAD_REGEXES = ["(ab", "[a-", "a{3,1}"]


@functools.cache
def tokenizer():
    from acb.models import build_tokenizer

    return build_tokenizer()


@functools.cache
def tid(ch: str) -> int:
    """The byte-level tokenizer's token of one printable ASCII character."""
    t = tokenizer().convert_tokens_to_ids(ch)
    assert 3 <= t < VOCAB and tokenizer().decode([t]) == ch, (ch, t)
    return t


class Constraint:
    """A structured outputs spec and every text that matches it; ``bound``: the most tokens a
    match has, where the library knows it at submit (a choice's longest word; None for a regex)."""

    def __init__(self, spec: acb.StructuredOutputs, matches: list[str], bound: int | None) -> None:
        self.spec, self.matches, self.bound = spec, frozenset(matches), bound
        self.prefixes = {m[:k] for m in self.matches for k in range(len(m) + 1)}
        self.chars = {tid(ch): ch for ch in sorted({ch for m in self.matches for ch in m})}
        self.longest = max(map(len, self.matches))

    def allowed(self, text: str, excluded: frozenset[int]) -> set[int]:
        """The tokens a step may take after ``text``: a character that continues a match, the EOS
        once ``text`` is one; less ``excluded`` (the stop tokens ``min_new_tokens`` holds back, the
        ``-inf`` biased ones)."""
        ok = {t for t, ch in self.chars.items() if text + ch in self.prefixes}
        if text in self.matches:
            ok.add(EOS)
        return ok - excluded


def random_constraint(rng: random.Random) -> Constraint:
    if rng.random() < 0.5:
        words = rng.sample(CHOICE_WORDS, rng.randint(1, 3))
        return Constraint(acb.StructuredOutputs(choice=words), words, max(map(len, words)))
    pattern, matches = rng.choice(REGEXES)
    return Constraint(acb.StructuredOutputs(regex=pattern), matches, None)


def stops_of(sp: acb.SamplingParams) -> frozenset[int]:
    """A fuzz request's stop tokens (the fuzz model's generation config has the one EOS)."""
    if sp.stop_token_ids is not None:
        return frozenset(sp.stop_token_ids)
    return frozenset() if sp.ignore_eos else frozenset({EOS})


def random_constrained(
    rng: random.Random, prefixes: list[list[int]], max_rows: int
) -> tuple[list[int], acb.SamplingParams, Constraint]:
    """A constrained request: short limits (a match, or a prefix of one at ``length``), the EOS a
    stop token or not (``ignore_eos``; explicit stop tokens, some of them the grammar's own
    characters), a ``min_new_tokens`` that may hold the end back past where a match ends (a regex's
    is not known at submit: the request then ends ``grammar``), ``-inf`` biases, ``n``."""
    c = random_constraint(rng)
    prompt = random_prompt(rng, prefixes)
    kw: dict = dict(
        max_new_tokens=rng.randint(1, 8) if rng.random() < 0.8 else rng.randint(1, MAX_NEW), structured_outputs=c.spec
    )
    r = rng.random()
    if r < 0.2:  # the grammar still ends at its EOS, which is no stop token: min_new_tokens does not hold it back
        kw["ignore_eos"] = True
    elif r < 0.5:
        kw["stop_token_ids"] = tuple(rng.sample([EOS, *c.chars, 200], rng.randint(1, 2)))
    if rng.random() < 0.4:
        # a choice's bound is checked at submit while the EOS is a stop token: within it here (past it:
        # refused_constrained); a regex's is not, nor the bound without the EOS among the stop tokens
        cap = c.bound if c.bound is not None and EOS in stops_of(acb.SamplingParams(**kw)) else c.longest + 1
        kw["min_new_tokens"] = rng.randint(1, min(kw["max_new_tokens"], cap))
    if rng.random() < 0.3:
        kw.update(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 2]), seed=rng.randrange(1 << 30))
    if rng.random() < 0.15:
        kw["logit_bias"] = {rng.choice(list(c.chars)): float("-inf")}
    if rng.random() < 0.15:
        kw["n"] = rng.randint(2, max(2, min(3, max_rows)))  # (refused at one row)
    if rng.random() < 0.2:
        kw["logprobs"] = rng.choice([0, 2])
    return prompt, acb.SamplingParams(**kw), c


async def refused_constrained(engine: acb.AsyncEngine, rng: random.Random, rid: str) -> None:
    """A constrained submit that must be refused, leaving nothing behind: a ``min_new_tokens`` past
    every choice's end while the EOS is a stop token, or a regex that cannot compile."""
    if rng.random() < 0.6:
        words = rng.sample(CHOICE_WORDS, rng.randint(1, 3))
        bound = max(map(len, words))
        min_new = bound + rng.randint(1, 3)
        kw = dict(
            structured_outputs=acb.StructuredOutputs(choice=words),
            min_new_tokens=min_new,
            max_new_tokens=rng.randint(min_new, MAX_NEW),
        )
        if rng.random() < 0.3:
            kw["stop_token_ids"] = (EOS, 200)
        match = (
            rf"structured_outputs: min_new_tokens={min_new} \(min_tokens\) can never be met: every output of "
            rf"the choice constraint has at most {bound} tokens before its end"
        )
    else:
        kw = dict(structured_outputs=dict(regex=rng.choice(BAD_REGEXES)))
        match = "structured_outputs: cannot compile the regex constraint"
    with pytest.raises(ValueError, match=match) as info:
        await engine.submit([5, 6, 7], request_id=rid, **kw)
    # submit (which compiles off the loop first) and submit_nowait name the same field (submit once
    # lost it, re-raising the compiler's error as a plain ValueError)
    assert field_of(info.value) == "structured_outputs", (info.value, field_of(info.value))
    if "min_new_tokens" not in kw:
        with pytest.raises(ValueError, match=match) as info:
            engine.submit_nowait([5, 6, 7], request_id=rid, **kw)
        assert field_of(info.value) == "structured_outputs", (info.value, field_of(info.value))


def check_constrained(t: Tracked, c: Constraint, s, model, max_new: int) -> None:
    """One sample of a constrained request follows its grammar token by token, is the best allowed
    token at each step if greedy (to float noise), and ends as its finish reason says."""
    sp = t.sp
    toks = s.generated_tokens
    stops = stops_of(sp)
    banned = frozenset(k for k, v in (sp.logit_bias or {}).items() if v == float("-inf"))
    min_new = sp.min_new_tokens or 0

    def excluded(i: int) -> frozenset[int]:
        return (stops if i < min_new else frozenset()) | banned

    assert len(toks) <= max_new
    assert s.text == tokenizer().decode(toks, skip_special_tokens=True), (s.text, toks)
    logits = None
    if not sp.temperature and toks:  # greedy: the best of the allowed tokens under a plain forward
        with torch.no_grad():
            logits = model(torch.tensor([t.prompt + toks])).logits[0, len(t.prompt) - 1 :].double()
    text = ""
    for i, x in enumerate(toks):
        ok = c.allowed(text, excluded(i))
        assert x in ok, f"token {i} ({x}) after {text!r} is not one the grammar allows ({sorted(ok)}): {toks}"
        if logits is not None:
            best = max(ok, key=lambda k: float(logits[i, k]))
            gap = float(logits[i, best] - logits[i, x])
            assert gap < TIE, (
                f"greedy token {i} ({x}) after {text!r} is not the best allowed one ({best}, gap {gap:.3g})"
            )
        if x == EOS or x in stops:
            assert i == len(toks) - 1, f"tokens after the end: {toks}"
        text += c.chars.get(x, "")
    if s.status == acb.RequestStatus.CANCELLED:
        return
    assert s.status == acb.RequestStatus.FINISHED, s.status
    reason = s.finish_reason
    ended = bool(toks) and (toks[-1] == EOS or toks[-1] in stops)
    if reason == acb.FinishReason.STOP:
        assert ended, f"stop without the EOS or a stop token: {toks}"
    elif reason == acb.FinishReason.LENGTH:
        assert len(toks) == max_new and not ended, f"length at {len(toks)} of {max_new}: {toks}"
    elif reason == acb.FinishReason.GRAMMAR:
        assert len(toks) < max_new and not ended, f"grammar at {len(toks)} of {max_new}: {toks}"
        ok = c.allowed(text, excluded(len(toks)))
        assert not ok, f"finished grammar after {text!r}, but {sorted(ok)} could go on"
    else:
        raise AssertionError(f"finish reason {reason!r}")


def random_config(rng: random.Random) -> dict:
    bs = rng.choice([4, 8, 16])
    longest = MAX_PROMPT + MAX_NEW
    per_req = -(-longest // bs)
    graphs = HAVE_TRITON and rng.random() < 0.15
    return dict(
        page_size=bs,
        # from "one request at a time" (constant preemption) to roomy
        num_blocks=1 + per_req + rng.choice([0, 1, 2, per_req // 2, per_req, 4 * per_req]),
        max_batch_tokens=rng.choice([7, 16, 32, 64, 256]),
        max_requests_per_batch=rng.choice([1, 3, 4, 8, 16]),  # 1: every request alone
        use_async_batching=rng.random() < 0.6,
        cpu_offload_space=rng.choice([0.0, 0.0, 2e-5, 1e-4, 0.01]),
        allow_block_sharing=rng.random() < 0.7,
        scheduler_type=rng.choice(["fifo", "prefill_first"]),
        safety_margin=rng.choice([0.0, 0.0, 0.1]),
        max_model_len=longest,
        **(dict(attn_backend="triton", use_cuda_graph=True) if graphs else {}),
    )


@dataclass
class Scored:
    """A ``score`` call started in a round, and the weights it ran with."""

    context: list[int]
    continuations: list[list[int]]
    task: asyncio.Task
    weights: int


def random_score(
    rng: random.Random, prefixes: list[list[int]], several: bool = False
) -> tuple[list[int], list[list[int]]]:
    """A short context (a prefix's start, so that calls share cached blocks) and a few
    continuations, some of one token, some sharing their first tokens (``several``: always one of
    two tokens and one of one token, sharing it)."""
    context = rng.choice(prefixes)[: rng.randint(1, 20)] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 3))]
    first = rng.randrange(3, VOCAB)
    conts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 3))]
    if several or rng.random() < 0.5:
        conts.append([first, rng.randrange(3, VOCAB)])
        conts.append([first])
    return context, conts


class WeightSets:
    """Two weight sets for the engine's own copy of the model, switched by assignment (new
    Parameter objects, never a copy into the old ones); a reference per set."""

    def __init__(self, model) -> None:
        import copy

        self.models = [model, get_model("llama", seed=5)]  # (cached, never changed: references)
        self.refs = [_REFS.setdefault(id(m), Reference(m)) for m in self.models]
        self.engine_model = copy.deepcopy(model)
        self.current = 0

    def switch(self, rng: random.Random) -> None:
        self.current = 1 - self.current
        source = self.models[self.current]
        if rng.random() < 0.5:
            self.engine_model.load_state_dict({k: v.clone() for k, v in source.state_dict().items()}, assign=True)
            return
        owners = dict(self.engine_model.named_modules())
        with torch.no_grad():
            for name, p in source.named_parameters():
                owner, _, attr = name.rpartition(".")
                setattr(owners[owner], attr, torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))


async def until_idle(engine: acb.AsyncEngine, timeout: float = 120.0) -> None:
    """Wait until no request is live (``timeout``: a hang-guard only, far above any example's need)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.ids.live:
        assert engine.is_running, "the engine stopped"
        assert loop.time() < deadline, "requests still live: the engine made no progress"
        await asyncio.sleep(0.002)


@dataclass
class Tracked:
    prompt: list[int]
    sp: acb.SamplingParams
    handle: acb.RequestHandle
    mode: str  # how the consumer reads it: result, stream, break
    weights: int = 0  # which weight set it ran with (WeightSets)
    task: asyncio.Task | None = None
    deltas: list = field(default_factory=list)
    cancel_asked: bool = False
    output: acb.GenerationOutput | None = None
    error: BaseException | None = None
    read_to_end: bool = False  # the consumer's ``async for`` ran out (not broken off, its task not cancelled)
    constraint: Constraint | None = None  # its structured outputs


def random_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    base = rng.choice(prefixes)
    cut = rng.randint(1, len(base))
    prompt = base[:cut] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 8))]
    return prompt[:MAX_PROMPT]


def random_request(
    rng: random.Random, prefixes: list[list[int]], max_rows: int
) -> tuple[list[int], acb.SamplingParams, str | None]:
    prompt = random_prompt(rng, prefixes)
    kw: dict = dict(max_new_tokens=rng.randint(1, MAX_NEW))
    r = rng.random()
    if r < 0.6:
        kw["ignore_eos"] = True
    elif r < 0.8:
        kw["stop_token_ids"] = tuple(rng.sample(range(3, VOCAB), rng.randint(1, 40)))
        kw["min_new_tokens"] = rng.randint(0, kw["max_new_tokens"])
    else:
        kw["stop_token_ids"] = ()
    if rng.random() < 0.25:
        kw.update(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 5, 300]), seed=rng.randrange(1 << 30))
        if rng.random() < 0.3:  # the extremes that are allowed: they must not touch the other requests
            kw.update(
                rng.choice(
                    [
                        dict(top_k=2**63 - 1),
                        dict(temperature=1e-40),
                        dict(seed=-(2**63)),
                        dict(seed=2**63 - 1, temperature=1e4),
                        dict(logit_bias={7: 100.0, 8: float("-inf")}),
                        dict(repetition_penalty=0.01),
                        dict(repetition_penalty=100.0),
                    ]
                )
            )
    if rng.random() < 0.2:
        kw["n"] = rng.randint(2, max(2, min(3, max_rows)))  # (refused at one row: a row per sample)
    if rng.random() < 0.2:
        kw["logprobs"] = rng.choice([0, 2])
    salt = rng.choice([None, None, None, "tenant-a"])
    return prompt, acb.SamplingParams(**kw), salt


def fork_fits(prompt_len: int, n: int, cfg) -> bool:
    """Whether ``n`` samples of the prompt can fork in this cache (else submit refuses them)."""
    bs = cfg.block_size
    return n == 1 or prompt_len // bs + (n if prompt_len % bs else 0) <= cfg.num_blocks - 1


async def refused(engine: acb.AsyncEngine, rng: random.Random, rid: str, live: list[str], max_rows: int) -> None:
    """One of the submits that must be refused, leaving nothing behind. ``live``: ids submitted
    behind the gate in this round, which cannot have ended yet."""
    cases = [
        (([5, 6],), dict(sampling=acb.SamplingParams(n=max_rows + 1)), ValueError),
        (([5, 6],), dict(sampling=acb.SamplingParams(stop_token_ids=(VOCAB + 3,), min_new_tokens=2)), ValueError),
        (([5, 6],), dict(cache_salt=b"tenant"), TypeError),
        (([5, VOCAB],), {}, ValueError),
        (({5: 1},), {}, TypeError),
        # numbers that pass a type check but overflow the engine's int64 tables, the wire or float32
        (([5, 6],), dict(top_k=10**400), ValueError),
        (([5, 6],), dict(max_new_tokens=2**63), ValueError),
        (([5, 6],), dict(seed=2**64, temperature=1.0), ValueError),
        (([5, 6],), dict(logit_bias={5: 1e39}), ValueError),
        (([5, 6],), dict(repetition_penalty=1e-40), ValueError),
        (([5, 6],), dict(temperature=1e300), ValueError),
    ]
    args, kw, exc = rng.choice(cases)
    with pytest.raises(exc):
        await engine.submit(*args, request_id=rid, **kw)
    if live:
        with pytest.raises(ValueError, match="already used"):
            await engine.submit([5, 6], request_id=rng.choice(live))


async def lifecycle_burst(engine: acb.AsyncEngine, rng: random.Random) -> None:
    """A few pause/resume/sleep/wake calls posted back to back while requests run (checked against
    the lifecycle's model, ``tests.api.test_pause_sleep.LifecycleModel``), then back to running."""
    from tests.api.test_pause_sleep import LifecycleModel, _post

    core = engine.core
    want = LifecycleModel()
    ops = [rng.choice(["pause_wait", "pause_keep", "sleep", "wake", "resume"]) for _ in range(rng.randint(1, 4))]
    futs = [(_post(core, op), want.apply(op)) for op in ops]
    await asyncio.sleep(rng.random() * 0.02)
    assert engine.is_sleeping == want.asleep or not all(f.done() for f, _ in futs)
    for f in (_post(core, "wake"), _post(core, "resume")):
        await asyncio.wrap_future(f)
    for f, err in futs:
        if err is None:
            await asyncio.wrap_future(f)  # a pause("wait") ends once resumed, drained or not
        else:
            with pytest.raises(RuntimeError, match=err):
                await asyncio.wrap_future(f)
    assert not engine.is_paused and not engine.is_sleeping


async def consume(t: Tracked, rng_value: float) -> None:
    try:
        if t.mode == "result":
            t.output = await t.handle.result()
            return
        async for d in t.handle:
            t.deltas.append(d)
            if t.mode == "break" and len(t.deltas) >= 1 + int(rng_value * 6):
                t.cancel_asked = True
                break
        else:
            t.read_to_end = True
        t.output = await t.handle.result()
    except asyncio.CancelledError:
        t.cancel_asked = True
        raise
    except BaseException as exc:  # noqa: BLE001 - recorded, checked below
        t.error = exc


async def wait_steps(engine: acb.AsyncEngine, k: int, timeout: float = 60.0) -> None:
    """Let the engine run ``k`` more steps (or until it is idle)."""
    target = engine.stats.steps + k
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.stats.steps < target and (engine.stats.running or engine.stats.waiting):
        assert engine.is_running, "the engine stopped"
        assert loop.time() < deadline, "the engine made no progress"
        await asyncio.sleep(0.002)


def check(t: Tracked, ref: Reference, max_len: int) -> None:
    out = t.output
    assert t.error is None, f"request failed: {t.error!r}"
    assert out is not None
    sp = t.sp
    assert out.status in (acb.RequestStatus.FINISHED, acb.RequestStatus.CANCELLED), out.status
    if out.status == acb.RequestStatus.CANCELLED:
        assert t.cancel_asked, "cancelled without being asked"
    if t.deltas:  # a stream's deltas add up to the output (for a request broken off, or whose
        # consumer's task was cancelled while the engine still made tokens: a prefix)
        per: dict[int, list[int]] = {}
        for d in t.deltas:
            per.setdefault(d.sample_index, []).extend(d.token_ids)
        samples = out.samples or [out]
        for i, toks in per.items():
            gen = samples[i].generated_tokens
            assert toks == gen[: len(toks)], f"sample {i}: stream {toks} vs output {gen}"
            if t.read_to_end:
                assert toks == gen, f"sample {i}: stream {toks} vs output {gen}"
            if samples[i].text is not None and (t.read_to_end or t.constraint is not None):  # (constrained: ASCII)
                text = "".join(d.text or "" for d in t.deltas if d.sample_index == i)  # (None: no tokens)
                assert samples[i].text.startswith(text), f"sample {i}: stream {text!r} vs output {samples[i].text!r}"
                assert text == samples[i].text or not t.read_to_end, f"sample {i}: {text!r} vs {samples[i].text!r}"
        if t.read_to_end:
            assert t.deltas[-1].finished
    max_new = min(sp.max_new_tokens, max_len - len(t.prompt))
    samples = out.samples or [out]
    assert len(samples) == (sp.n or 1)
    ends = {acb.FinishReason.STOP, acb.FinishReason.LENGTH} | ({acb.FinishReason.GRAMMAR} if t.constraint else set())
    for i, s in enumerate(samples):
        if s.status == acb.RequestStatus.FINISHED:
            assert s.finish_reason in ends, f"sample {i}: finished with reason {s.finish_reason!r}"
        else:
            assert s.status == acb.RequestStatus.CANCELLED and t.cancel_asked, f"sample {i}: {s.status!r}"
            # (samples cancelled before they forked once ended with no reason at all)
            assert s.finish_reason == acb.FinishReason.CANCELLED, (
                f"sample {i}: cancelled with reason {s.finish_reason!r}"
            )
    for s in samples:
        toks = s.generated_tokens
        assert len(toks) <= max_new and all(0 <= x < VOCAB for x in toks)
        if sp.logprobs is not None:
            assert len(s.logprobs) == len(toks)
        if t.constraint is not None:
            check_constrained(t, t.constraint, s, ref.model, max_new)
            continue
        if sp.temperature:
            continue
        stop = frozenset() if sp.ignore_eos else frozenset(sp.stop_token_ids or ())
        ref.check(t.prompt, toks, max_new, stop, sp.min_new_tokens or 0, s.status == acb.RequestStatus.FINISHED)


async def run_example(seed: int, model, ref: Reference) -> dict:
    rng = random.Random(seed)
    cfg = random_config(rng)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(MAX_PROMPT)] for _ in range(3)]
    tracked: list[Tracked] = []
    scored: list[Scored] = []
    weights = WeightSets(model) if rng.random() < 0.3 else None
    refs = weights.refs if weights is not None else [ref]
    rows = cfg["max_requests_per_batch"]
    structured = rng.random() < 0.3 and HAVE_XGRAMMAR  # a tokenizer, and constrained requests in some rounds
    constrained = refused_specs = scored_multi = 0
    async with acb.AsyncEngine(
        weights.engine_model if weights is not None else model,
        acb.ContinuousBatchingConfig(**cfg),
        tokenizer=tokenizer() if structured else None,
    ) as engine:
        core = engine.core
        max_len = engine.config.max_model_len
        # the grammar compiler's workers start while the first round runs (a compile is cached by spec)
        warm = (
            asyncio.create_task(engine.compile_structured_outputs(random_constraint(rng).spec)) if structured else None
        )
        rounds = rng.randint(2, 5)
        for _round in range(rounds):
            if weights is not None and _round and rng.random() < 0.6:
                # between calls: once every request has ended, the other weights by assignment
                await until_idle(engine)
                weights.switch(rng)
            now = weights.current if weights is not None else 0
            gate = threading.Event()
            core.call(lambda c: gate.wait(30))  # hold the engine: the burst lands in one step
            burst: list[str] = []
            structured_round = structured and rng.random() < 0.7
            for _ in range(rng.randint(1, 8)):
                constraint = None
                if structured_round and rng.random() < 0.5:
                    prompt, sp, constraint = random_constrained(rng, prefixes, rows)
                    salt = rng.choice([None, "tenant-a"])
                else:
                    prompt, sp, salt = random_request(rng, prefixes, rows)
                rid = None
                if rng.random() < 0.15:  # a refused submit first, under the id the good one then takes
                    rid = f"retry-{len(tracked)}"
                    if constraint is not None and rng.random() < 0.7:
                        await refused_constrained(engine, rng, rid)
                        refused_specs += 1
                    else:
                        await refused(engine, rng, rid, burst, rows)
                if (sp.n or 1) > rows:  # one row a step: n samples run side by side, a row each
                    with pytest.raises(
                        ValueError,
                        match=rf"n={sp.n} samples run side by side and need {sp.n} of the "
                        rf"engine's rows, but max_requests_per_batch is {rows}",
                    ) as info:
                        await engine.submit(prompt, sp, cache_salt=salt, request_id=rid)
                    assert field_of(info.value) == "n"
                    continue
                if not fork_fits(len(prompt), sp.n or 1, engine.config):
                    with pytest.raises(ValueError, match="can never fit"):
                        await engine.submit(prompt, sp, cache_salt=salt, request_id=rid)
                    continue
                h = await engine.submit(prompt, sp, cache_salt=salt, request_id=rid)
                burst.append(h.request_id)
                t = Tracked(
                    prompt, sp, h, rng.choice(["result", "result", "stream", "break"]), now, constraint=constraint
                )
                t.task = asyncio.create_task(consume(t, rng.random()))
                tracked.append(t)
                constrained += constraint is not None
            # concurrent score calls, every one with a default id; at one row, a continuation of
            # several tokens is a request of its own: such an example scores at least once
            if rng.random() < (0.6 if rows == 1 else 0.35) or (rows == 1 and _round == rounds - 1 and not scored):
                for _ in range(rng.randint(2, 4)):
                    context, conts = random_score(rng, prefixes, several=rows == 1)
                    scored.append(Scored(context, conts, asyncio.create_task(engine.score(context, conts)), now))
                    scored_multi += rows == 1 and any(len(c) > 1 for c in conts)
            gate.set()
            if rng.random() < 0.3:
                await lifecycle_burst(engine, rng)
            await wait_steps(engine, rng.randint(0, 8))
            live = [t for t in tracked if not t.handle.done]
            for t in rng.sample(live, k=min(len(live), rng.randint(0, 2))):
                how = rng.choice(["handle", "engine", "task"])
                t.cancel_asked = True
                if how == "handle":
                    t.handle.cancel()
                elif how == "engine":
                    engine.cancel(t.handle.request_id)
                else:
                    t.task.cancel()
            await wait_steps(engine, rng.randint(0, 4))
            assert core.dead_error is None, f"the engine died: {core.dead_error!r}"
        await asyncio.wait_for(
            asyncio.gather(*(t.task for t in tracked), *(c.task for c in scored), return_exceptions=True), 120
        )
        if warm is not None:
            await asyncio.wait_for(warm, 120)
        for t in tracked:
            if t.output is None and t.error is None:  # its task was cancelled: the outcome is on the handle
                try:
                    t.output = await asyncio.wait_for(t.handle.result(), 60)
                except BaseException as exc:  # noqa: BLE001
                    t.error = exc
        assert core.dead_error is None, f"the engine died: {core.dead_error!r}"
        assert engine.is_running
        await asyncio.wrap_future(core.call(lambda c: c.check_invariants()))
        stats = engine.stats
    from tests.api.test_scoring import check as check_score

    for c in scored:
        assert not c.task.cancelled() and c.task.exception() is None, f"score failed: {c.task.exception()!r}"
        out = c.task.result()
        check_score(refs[c.weights].model, out, c.context, c.continuations)
    assert len({c.task.result().request_id for c in scored}) == len(scored)
    for i, t in enumerate(tracked):
        try:
            check(t, refs[t.weights], max_len)
        except AssertionError as exc:
            raise AssertionError(
                f"request {i} ({t.mode}, prompt {t.prompt}, {t.sp}, "
                f"{t.output.num_preemptions if t.output else '?'} preemptions): {exc}"
            ) from None
    assert rows > 1 or scored_multi, "a one-row example scored no continuation of several tokens"
    return dict(
        requests=len(tracked),
        scores=len(scored),
        preemptions=stats.preemptions,
        swapped_out=stats.swapped_out_blocks,
        steps=stats.steps,
        constrained=constrained,
        refused_specs=refused_specs,
        scored_at_one_row=scored_multi,
    )


@pytest.fixture(scope="module")
def fuzz_model():
    return get_model("llama")


@pytest.mark.parametrize("seed", range(SEED, SEED + EXAMPLES))
async def test_engine_fuzz(seed, fuzz_model):
    ref = _REFS.setdefault(id(fuzz_model), Reference(fuzz_model))
    cfg = random_config(random.Random(seed))
    try:
        await asyncio.wait_for(run_example(seed, fuzz_model, ref), 300)
    except BaseException as exc:
        raise AssertionError(f"fuzz example seed={seed} failed with config {cfg}: {exc!r}") from exc


_REFS: dict[int, Reference] = {}
