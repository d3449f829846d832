"""The typed hand-offs between the engine's stages (plain data, no logic).

- :class:`EngineRequest`: a validated submit, from the API's input processor
  (``acb.api.processor.InputProcessor``) to the engine thread, which builds its
  :class:`Request` state from it; frozen, and plain values only (it is also what tensor parallelism sends the other
  ranks). Its results go to the sink registered under its ``request_id`` on the API's side.
- :class:`SchedulerOutput`: one step's batch, from the scheduler (which builds it, with the KV
  manager's block moves) to the runner and back to ``Scheduler.update_from_output``; its
  scored rows are :class:`PromptRows` and :class:`NextRows`.
- :class:`LaunchedStep`: a step the runner has launched, held by the core until its results
  are read (the next step with async batching).
- :class:`ModelRunnerOutput`: a launched step's results once read (``Runner.finish``: the sync).
- :class:`Runner`: the whole surface the core uses of a model runner.
- :data:`Command`: what callers post to the engine thread (``Add``, ``Cancel``, ``Call``,
  ``Pause``, ``Resume``, ``ResetPrefix``, ``Sleep``, ``Wake``, ``Stop``).

Results cross to the callers' threads as :class:`Delivery` (immutable), and the engine's
counters as :class:`EngineStats` snapshots. :mod:`acb.core.wire` is how the commands travel to
the other tensor-parallel ranks.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from acb.config import ResolvedConfig
    from acb.core.request import Request
    from acb.media import MediaInputs
    from acb.outputs import GenerationOutput
    from acb.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScoreTarget:
    """What a scoring request (or one of its group's children) records: the prompt positions
    from ``lp_start`` on, and ``next_tokens`` scored after its whole prompt."""

    prompt_ids: tuple[int, ...]
    lp_start: int
    next_tokens: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One validated submit: everything the engine needs, nothing of the caller's (no sink,
    tokenizer or trace). ``n`` samples (``n > 1``) or a scoring group (``children``) become one
    :class:`acb.core.request.RequestGroup` whose members are ``request_id`` and
    ``request_id#1``..; every id was claimed in the API's registry (``acb.api.ids``) on submit."""

    request_id: str
    sink_key: int  # where its results go: the API's sink registered under this key (never reused)
    prompt_ids: tuple[int, ...]
    params: SamplingParams  # resolved over the engine's defaults (frozen)
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    seed: int  # sample 0's; sample i's is derived from it
    n: int = 1
    created_time: float = 0.0  # perf_counter() at submit (queue time and latency count from it)
    record_timestamps: bool = False
    cache_salt: str | None = None
    # a scoring request (samples nothing): its own target, then its children's
    score: ScoreTarget | None = None
    children: tuple[ScoreTarget, ...] = ()
    media: MediaInputs | None = None  # its media (images), processed (acb.media): the model's own encoders run on them
    lora_slot: int = 0  # its LoRA adapter's slot in the runner (acb.api.loras; 0: the base model)

    @property
    def member_ids(self) -> list[str]:
        return [self.request_id] + [f"{self.request_id}#{i}" for i in range(1, self.n)]


class PromptRows(NamedTuple):
    """Prompt positions of one request whose next token's logprob this step records."""

    req: Request
    first: int  # the first such prompt position
    num: int  # how many consecutive positions
    row: int  # the first one's row in the step's flattened batch
    targets: list[int]  # the prompt tokens those positions predict


class NextRows(NamedTuple):
    """A scoring request's row after its whole prompt, and the tokens scored there."""

    req: Request
    row: int  # its last token's row in the step's flattened batch
    tokens: list[int]


class GrammarMask(NamedTuple):
    """The token bitmask of a step's constrained samples (structured outputs), filled by their
    matchers as the scheduler builds the step (:class:`acb.core.grammar_masks.GrammarMasks`)."""

    bitmask: torch.Tensor  # host int32 [num samples, ceil(V / 32)]; rows not in ``rows`` allow all
    rows: list[int]  # indices among the step's samples of the constrained ones


@dataclass
class SchedulerOutput:
    """One step's batch. Built and consumed on the engine thread; not mutated once returned."""

    step_id: int
    requests: list[Request]  # scheduled, in batch order
    rows: list[int]  # each request's row in the persistent block table
    num_new: list[int]  # query tokens of each request in this step
    start_pos: list[int]  # position of each request's first query token (= computed before)
    input_ids: list[int]  # all query tokens, flattened in batch order
    sample_idx: list[int]  # indices (into requests) of the sequences whose last logits are sampled
    sample_reqs: list[Request]  # who receives each sampled token (a child of n > 1 shares a row of logits)
    sample_rows: list[int]  # their block-table rows (per-row sampling parameters live there)
    sample_gen_idx: list[int]  # index of the token being generated, per sample (seeds, min_new_tokens)
    # (row, first column, block ids) to write into the persistent block table before running
    block_updates: list[tuple[int, int, list[int]]]
    newly_admitted: list[Request]  # scheduled for the first time
    row_inits: list[Request]  # requests given a row in this step (fresh or resumed)
    freed_rows: list[int]  # rows given back since the previous step
    block_copies_after: list[tuple[int, int]]  # (src, dst) KV blocks to copy after the forward
    swap_out: list[tuple[int, int]]  # (device block, host block): offload before the forward
    swap_in: list[tuple[int, int]]  # (host block, device block): restore before the forward (after swap_out)
    # async batching: (index in input_ids, index among the previous step's samples) of tokens that
    # are not known yet; the runner fills them on the device from the previous step's sampled ids
    placeholders: list[tuple[int, int]] = field(default_factory=list)
    # prompt logprobs and scoring: the rows of prompt positions this step records
    prompt_lp: list[PromptRows] = field(default_factory=list)
    # scoring requests whose prompt this step completes (they end when its output is recorded),
    # and those of them with tokens scored after the whole prompt
    scored: list[Request] = field(default_factory=list)
    next_lp: list[NextRows] = field(default_factory=list)
    scored_rows: int = 0  # rows of logits this step computes for prompt logprobs and scoring
    grammar: GrammarMask | None = None  # structured outputs: the masks of the constrained samples
    # forks (n > 1, scoring groups): (parent row, child row) whose per-request recurrent state
    # (hybrid models' linear-attention layers) the child copies after the forward
    state_copies_after: list[tuple[int, int]] = field(default_factory=list)
    # state layers' snapshots (acb.core.kv_manager): (slot, row) restored into a row before the
    # forward (a prefix hit), and (row, offset in its segment, slot) taken by the forward after
    # that many of the row's tokens in this step
    restores: list[tuple[int, int]] = field(default_factory=list)
    # state layers' rows offloaded at preemption: (row, host row) copied before anything else of the
    # step (the row may go to another request in it), and (host row, row) restored on resumption
    row_swap_out: list[tuple[int, int]] = field(default_factory=list)
    row_swap_in: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class LaunchedStep:
    """A step launched on the runner, waiting for its results to be read."""

    sched: SchedulerOutput
    handle: Any  # the runner's in-flight step (``InFlightStep``), passed back to ``Runner.finish``
    schedule_s: float
    stage_s: float
    launch_s: float  # execute's whole time (stage included)


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """One step's results, read back from the device by ``Runner.finish`` (the step's one sync)."""

    sampled: list[int]  # one per sample, in SchedulerOutput.sample_reqs order
    logprobs: list[float] | None = None  # the chosen tokens' logprobs, when anyone asked
    top: list[list[tuple[int, float]]] | None = None  # top alternatives per sample, when anyone asked
    # per SchedulerOutput.prompt_lp entry: the prompt tokens' logprobs and their top-k alternatives
    prompt: list[tuple[list[float], list[list[tuple[int, float]]]]] | None = None
    # per SchedulerOutput.next_lp entry: the scored tokens' logprobs after the whole prompt, and
    # that position's top alternatives
    next: list[tuple[list[float], list[tuple[int, float]]]] | None = None


class Runner(Protocol):
    """What the core needs of a model runner (:class:`acb.runner.model_runner.ModelRunner`)."""

    cfg: ResolvedConfig  # the sizes and policies the engine runs with
    vocab_size: int  # the output vocabulary: what can be sampled, scored and biased
    input_vocab_size: int  # the ids a prompt may hold (Molmo2's image tokens lie past the output vocabulary)
    asleep: bool  # sleep() freed the cache and the step buffers
    last_stage_s: float  # host time of the last execute's input staging

    def execute(self, sched: SchedulerOutput) -> Any: ...  # -> a handle for finish (no sync)
    def finish(self, step: Any) -> ModelRunnerOutput: ...  # the handle execute returned (the sync)
    def sleep(self) -> Any: ...  # -> what was freed (MemoryReleased)
    def wake_up(self) -> None: ...
    def idle(self) -> None: ...  # no work until the next command: release what waiting needs not hold
    def weights_changed(self) -> bool: ...
    def forget_weights(self) -> None: ...
    def swap_weights(self, staged: Any) -> None: ...  # copy a staged update in (acb.runner.weight_update.Staged)


# ---------------------------------------------------------------- the inbox's commands
# What callers post to the engine thread (``EngineCore._post``); applied in order between steps
# by ``EngineCore._apply``. Frozen: a command is handed from the caller's thread to the engine's.


@dataclass(frozen=True, slots=True)
class Add:
    req: EngineRequest


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class Call:
    fn: Any  # Callable[[EngineCore], Any]: run on the engine thread
    fut: Future[Any]


@dataclass(frozen=True, slots=True)
class Pause:
    mode: str  # "wait", "cancel" or "keep"
    fut: Future[None]


@dataclass(frozen=True, slots=True)
class Resume:
    fut: Future[None]


@dataclass(frozen=True, slots=True)
class ResetPrefix:
    fut: Future[int]
    weights: bool = False  # the weights changed (counted in ``EngineCore.weight_resets``)


@dataclass(frozen=True, slots=True)
class Sleep:
    fut: Future[Any]


@dataclass(frozen=True, slots=True)
class Wake:
    fut: Future[None]


@dataclass(frozen=True, slots=True)
class Stop:
    drain: bool  # finish the live requests first (else they are cancelled)


Command = Add | Cancel | Call | Pause | Resume | ResetPrefix | Sleep | Wake | Stop


# ------------------------------------------------------------- to the callers' threads


class Delivery(NamedTuple):
    """One request's results of one step, handed from the engine thread to the request's sink.

    Immutable, with no per-instance dict; a NamedTuple rather than a frozen dataclass because
    one is built per request per step and a frozen dataclass costs 3x as much to build
    (1.3 µs against 0.4 µs here: about 1 ms per step at 1,024 running requests)."""

    key: int  # the submit's ``EngineRequest.sink_key``: its sink is registered under it on the API's side
    token_ids: list[int]  # tokens new in this step (empty when only the outcome is delivered)
    logprobs: list[float] | None = None  # their logprobs, when the request asked
    top: list[list[tuple[int, float]]] | None = None  # their top alternatives, when asked
    sample_index: int = 0  # which of the request's ``n`` samples the tokens belong to
    final: GenerationOutput | None = None  # the outcome, once the request (all its samples) ended
    # the text those tokens complete, for requests decoded here (stop strings); None: the
    # consumer's side decodes the tokens itself
    text: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot published after every step (safe to read from any thread): every counter of
    :class:`SchedulerStats` under the same name, and the engine's gauges and timings."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0  # full blocks findable in the prefix cache (in use or free)
    prefix_queries: int = 0  # tokens looked up in the prefix cache when requests were admitted
    prefix_hits: int = 0  # of which were found (not recomputed)
    host_schedule_s: float = 0.0  # cumulative seconds per phase of the step
    host_stage_s: float = 0.0
    compute_s: float = 0.0  # forward + sampling + the sync that reads the sampled ids
    host_process_s: float = 0.0
    swapped_out_blocks: int = 0  # KV blocks offloaded to host memory by preemption
    swapped_out_rows: int = 0  # rows of state layers' state offloaded with them
    swapped_in_blocks: int = 0
    recomputed_preemptions: int = 0  # preemptions that had to drop the KV (no offload space)
    prefix_evictions: int = 0  # cached prefix blocks reused for other content (LRU)
    # state layers: snapshots of their state kept with cached blocks, and how many hits restored one
    state_snapshots_cached: int = 0
    state_snapshot_restores: int = 0
    paused: bool = False  # pause() (or sleep()) holds the steps back
    asleep: bool = False  # sleep() freed the KV cache and the step buffers

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
