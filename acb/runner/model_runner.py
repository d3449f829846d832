"""Runs one scheduled batch through the unmodified Hugging Face model and samples.

The batch is one flattened sequence (``[1, total_tokens]`` ids and positions). acb's
attention function is swapped in through transformers' attention interface for the life
of the runner (``close()`` restores the model's own implementation), and logits are
computed only for the rows that sample (``logits_to_keep`` with an index tensor).

Host/device syncs: exactly one per step, in :meth:`ModelRunner.finish` (reading the
sampled ids, and logprobs when asked).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from acb.config import ContinuousBatchingConfig
from acb.core.messages import ModelRunnerOutput, SchedulerOutput
from acb.errors import InvalidRequestError, UnsupportedModelError
from acb.lora import FIELD as LORA_FIELD
from acb.lora import LoraAdapter
from acb.runner import batch_invariant
from acb.runner.attention import (
    AttentionBackend,
    SharedAttention,
    StepContext,
    make_backend,
    register_with_transformers,
    step_context,
)
from acb.runner.cpu_linear import MIN_LAYER_PARAMS, PackedLinears, linear_params_per_layer, packable
from acb.runner.eval_mode import DROPOUT_GUARD
from acb.runner.host_threads import ThreadTuner, release_idle_threads
from acb.runner.indexed import IndexedLayers, indexer_modules
from acb.runner.input_batch import DeviceStreams, InputBatch, PreparedBatch, StagingRing
from acb.runner.kinds import hooks_of, layout_of
from acb.runner.kv_cache import UNPAGED, KVCache, KVSpec, kv_memory_budget
from acb.runner.latent import LatentLayers, latent_modules
from acb.runner.linear_state import (
    STEPWISE_MAX_TAIL,
    LinearLayers,
    LinearStates,
    linear_layers,
    resumes_prefill,
    resumes_stepwise,
    state_row_bytes,
)
from acb.runner.lora import LoraLayers
from acb.runner.media import MediaEmbedder, MediaFacts, takes_media
from acb.runner.module_state import module_attributes
from acb.runner.own_cache_runner import OwnCacheRunner, snapshot_memory
from acb.runner.sampler import SamplingState, sample
from acb.runner.setup import (
    ATTN_SWAP,
    check_decoder,
    check_model,
    decode_graph_flag,
    device_scope,
    model_device,
    resolve_config,
    staging_bytes,
)
from acb.runner.tp_sync import agree_min, check_same_settings, tp_group, tp_size_of
from acb.runner.unpaged_layers import UnpagedCaches, UnpagedLayers, find_unpaged_layers
from acb.runner.weights import WeightsKey, WeightWatch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from acb.runner.cuda_graphs import DecodeGraphs
    from acb.runner.weight_update import Staged

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryReleased:
    """What :meth:`acb.Engine.sleep` gave back, in bytes, by kind."""

    kv_cache: int
    graphs: int  # CUDA: the memory the capture took; the eager twin: its static buffers
    staging: int  # the two staging sets (host and device buffers)
    other: int  # the device block table, the sampling buffers, the attention backend's workspace and
    # (CPU) the packed linear weights
    device_measured: int | None  # CUDA: the drop in the allocator's reserved bytes (None elsewhere)

    @property
    def total(self) -> int:
        return self.kv_cache + self.graphs + self.staging + self.other


@dataclass
class InFlightStep:
    """A launched step; its results are read (the step's one sync) by ``ModelRunner.finish``."""

    sched: SchedulerOutput
    result: HostResult
    num_top: int
    prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # logprobs, top ids, top logprobs
    # scored tokens after whole prompts (flat, SchedulerOutput.next_lp order), top ids, top logprobs
    next: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class HostResult:
    """Sampled ids on their way to the host: ``[S]`` ids, or ``[S, 2 + 2k]`` (id, logprob, k ids,
    k logprobs), pinned on CUDA; ``done`` completes when the copy has landed (None on CPU)."""

    tensor: torch.Tensor
    done: torch.cuda.Event | None


class ModelRunner:
    """Owns the model's forward, the KV cache and the sampler. Engine thread only."""

    def __init__(self, model: PreTrainedModel, config: ContinuousBatchingConfig) -> None:
        # the paged path when the model passes its checks; else (or when asked) the model's own
        # cache objects, whole (acb.runner.own_cache_runner)
        check_decoder(model)
        # the model's module attributes before any forward here: state a model keeps in them
        # (acb.runner.module_state) starts each request from these
        start = module_attributes(model)
        why = None
        if config.runner != "own_cache":
            try:
                check_model(model)
            except UnsupportedModelError as exc:
                if config.runner == "paged":
                    raise
                why = str(exc)
        own_path = config.runner == "own_cache" or why is not None
        self._paged_refused = why  # why the paged path refused the model (None: it did not)
        if own_path:
            logger.info(
                "%s runs on its own cache objects, not paged: %s",
                type(model).__name__,
                why or "runner='own_cache' was asked for",
            )
        # the model's train/eval flags stay the user's: steps run in eval semantics through
        # acb.runner.eval_mode (dropout off on the engine thread only), never by model.eval()
        self.model: PreTrainedModel = model
        # the weights' objects, storages and in-place versions, and the optimizer steps taken on
        # them: a change invalidates the prefix cache (its global hooks are registered last)
        self._weights = WeightWatch(model)
        self.device = model_device(model)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what a stopped engine freed must count as free when sizing the cache
        # before the cache is sized: the packed copies take host memory
        # (the batch-invariant mode runs every linear through acb.runner.batch_invariant instead)
        self.packed = None if own_path or config.batch_invariant else self._packed_linears(model, config)
        try:
            self.cfg, spec = resolve_config(model, config, own_path=own_path)
        except Exception as exc:
            if not own_path or isinstance(exc, (UnsupportedModelError, ValueError)):
                raise
            # the model's own forward failed when measured: it runs on neither path
            raise UnsupportedModelError(
                f"{type(model).__name__} cannot run in acb: "
                + (f"the paged path refuses it ({why}), and " if why else "")
                + f"its own forward failed on its own cache ({type(exc).__name__}: {exc})"
            ) from exc
        # the whole model on its own caches (the second runner path), or None (the paged path)
        self.own_cache_runner = OwnCacheRunner(model, start, config.batch_invariant) if own_path else None
        self.state_row_bytes = 0  # one request's state over the state layers (set with them)
        self.state_why = ""
        # vision-language models: the model's own vision code for the requests with images
        self.media = MediaEmbedder(model, self.cfg.image_cache_bytes) if takes_media(model) else None
        paged = not own_path
        # hybrid models: linear-attention layers run per request with their recurrent state
        self.linear = LinearLayers(model) if paged and linear_layers(model) else None
        # attention layers that run per request on the model's own cache (DeepSeek V4's compressed attention)
        self.unpaged = UnpagedLayers(model) if paged and find_unpaged_layers(model) else None
        self.unpaged_caches = UnpagedCaches(model.config) if self.unpaged is not None else None
        # modules told their layer at call time (Zamba2)
        self.shared_attention = SharedAttention(model) if paged else None
        # indexed (DSA) attention: the indexers run per request over their paged keys
        self.indexed = IndexedLayers(model) if paged and indexer_modules(model) else None
        # MLA layers paged as their latent: their expand_kv passes it through to acb's attention
        self.latent = LatentLayers(model) if paged and spec.latent_layers else None
        if self.linear is not None or self.unpaged is not None or self.own_cache_runner is not None:
            self._hybrid_settings(config, spec)
        if self.packed is not None:
            self.cfg = dataclasses.replace(self.cfg, packed_linears=len(self.packed))
        # LoRA adapters: stacked buffers per target linear, priced before the KV blocks are made
        self.lora = self._lora_layers(config, spec, own_path)
        self.vocab_size = (
            int(model.get_output_embeddings().weight.shape[0])
            if model.get_output_embeddings() is not None
            else int(model.config.get_text_config().vocab_size)
        )
        embeddings = model.get_input_embeddings()
        rows = getattr(embeddings, "num_embeddings", None)
        self.input_vocab_size = max(self.vocab_size, rows if isinstance(rows, int) else 0)
        self.kv_cache = KVCache(spec, self.cfg.num_blocks, self.cfg.block_size, self.device)
        self.kv_cache.allocate_swap(self.cfg.num_swap_blocks)
        if (
            self.cfg.attn_backend == "triton"
            and self.device.type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"
        ):
            raise ValueError(
                "attn_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 to run the kernels "
                "in Triton's interpreter, for testing); use attn_backend='torch' on CPU"
            )
        self.backend = self._checked_backend(config, spec)
        if self.cfg.batch_invariant:  # every query through the fixed-order kernel (checked in resolve_config)
            if self.cfg.attn_backend not in ("cpu", "triton"):  # (triton: CUDA, acb.runner.batch_invariant_kernels)
                raise ValueError("batch_invariant=True: the mode's attention backend failed its start-up check here")
            self.backend.fixed_order = True  # type: ignore[attr-defined]
            from acb.runner.batch_invariant_families import install

            install(self.model)  # the state layers' fixed forms (acb.runner.batch_invariant_families)
        self._graphs_requested = decode_graph_flag(config.use_cuda_graph)
        self.cfg = dataclasses.replace(
            self.cfg,
            cuda_graphs=self._want_graphs()
            and self.linear is None
            and self.unpaged is None
            and self.indexed is None
            and self.latent is None
            # the mode's Triton path runs eager: a graph's capture is not an engine step in the mode
            and not (self.cfg.batch_invariant and self.cfg.attn_backend == "triton")
            and paged,
            graph_step=config.q_padding_interval_size or None,
        )
        group = tp_group(model)
        if group is not None:  # before any collective of the model's: the ranks must run the same steps
            check_same_settings(group, self.cfg)
        self._compiled: dict[str, Any] = {}
        if self.indexed is not None or self.latent is not None:
            self._indexed_settings(config)
        elif self.lora is not None and (
            config.default_compile_level
            or config.decode_compile_config is not None
            or config.varlen_compile_config is not None
        ):
            logger.warning("torch.compile is off with max_loras > 0: the adapters' interception runs eagerly")
        elif self.linear is None and self.unpaged is None and paged:
            self._setup_compile(config)
        self.streams = DeviceStreams(self.device)
        self._step_buffers()
        self.graphs: DecodeGraphs | None = None  # decode CUDA graphs, set up by warmup()
        self.asleep = False  # sleep() dropped the cache and the step buffers; wake_up() brings them back
        self.last_stage_s = 0.0  # host time of the last step's input staging (read by the engine)
        # CPU: the engine thread's intra-op threads (pinned, or measured: host_threads.ThreadTuner)
        self.threads = self._thread_tuner(config, tensor_parallel=group is not None)
        self._no_mask = torch.zeros((1, 1, 0, 0), dtype=torch.bool, device=self.device)
        self._supports_logits_to_keep = bool(getattr(model, "_supports_logits_to_keep", lambda: False)())
        register_with_transformers(compiled=bool(self._compiled))
        # registered last, after everything that can refuse the model (a failed start leaves no hook)
        self._weights.attach()
        self._weights_seen = self._weights.key()
        self._swapped_attn = paged  # the own-cache path runs the model's own attention
        if paged:
            ATTN_SWAP.acquire(model)
        DROPOUT_GUARD.acquire(model)
        self._holds_attn = True
        # each kind of layer the model has, what its cache costs and how it is reused, and its part
        # of a step (acb.runner.kinds)
        self.layout = layout_of(self)
        self.hooks = hooks_of(self)
        logger.info(
            "%d KV blocks of %d tokens (%.1f MiB), max_batch_tokens=%d, max_requests_per_batch=%d, "
            "max_model_len=%d, offload space %d blocks, backend=%s, decode graphs=%s, device=%s",
            self.cfg.num_blocks,
            self.cfg.block_size,
            self.cfg.kv_cache_bytes / 2**20,
            self.cfg.max_batch_tokens,
            self.cfg.max_requests_per_batch,
            self.cfg.max_model_len,
            self.cfg.num_swap_blocks,
            self.cfg.attn_backend,
            self.cfg.cuda_graphs,
            self.device,
        )

    def _hybrid_settings(self, config: ContinuousBatchingConfig, spec: KVSpec) -> None:
        """A hybrid model's linear layers keep a recurrent state per request, beside the KV pages.
        Prefix caching keeps snapshots of that state with cached blocks (:mod:`acb.core.kv_manager`)
        where every state layer resumes a prefill from a state, whole or (Mamba1, whose scan takes
        no state: :func:`resumes_stepwise`) one token at a time after a hit. Offload moves a preempted request's row of state to a host row beside its KV
        blocks. A model that keeps its own caches has neither (a preempted request recomputes).
        Decode graphs and torch.compile are off (the layers run once per request, from Python).
        The rows of state, the snapshots and the host rows are priced in the memory budget."""
        hidden = getattr(self.model.config.get_text_config(), "hidden_size", 0)
        tried: dict[type, bool] = {}
        for layer in self.linear.layers if self.linear is not None else ():
            if type(layer) not in tried:
                tried[type(layer)] = resumes_prefill(layer, hidden)
        whole = [cls.__name__ for cls, ok in tried.items() if not ok]
        # snapshots of the state layers' state resume a prefix hit, where every state layer resumes
        # (the layers whose scan takes no state: a token at a time after the hit)
        first = {type(layer): layer for layer in reversed(self.linear.layers)} if self.linear is not None else {}
        resumes = all(ok or resumes_stepwise(first[cls], hidden) for cls, ok in tried.items())
        states_only = self.unpaged is None and self.own_cache_runner is None  # no caches of the model's own
        snapshots = self.cfg.prefix_caching and resumes and states_only
        # the model on its own caches: snapshots are copies of a request's cache cut at a block
        # boundary, where the start-up try found a cut exact (acb.runner.own_cache_runner)
        own_cut = self.own_cache_runner is not None and self.own_cache_runner.croppable
        snapshots = snapshots or (self.cfg.prefix_caching and not whole and own_cut)
        off = [
            name
            for name, on in (
                ("prefix caching", self.cfg.prefix_caching and not snapshots),
                ("KV offload", self.cfg.num_swap_blocks > 0 and not states_only),
            )
            if on
        ]
        if off:
            logger.info(
                "%s keeps per-request state outside KV pages (linear-attention states, or the model's own cache): "
                "%s off for it",
                type(self.model).__name__,
                " and ".join(off),
            )
        if whole:
            logger.info(
                "%s's %s layers cannot resume a prefill from a state: each prompt is prefilled in one step",
                type(self.model).__name__,
                ", ".join(whole),
            )
        if self.own_cache_runner is not None and not self.own_cache_runner.chunkable:
            logger.info(
                "%s's own cache or generation hooks are not plain growing K/V behind transformers' defaults: "
                "each prompt is prefilled in one step",
                type(self.model).__name__,
            )
            whole.append("unpaged")
        slots = self._state_memory(config, spec, snapshots) if self.linear is not None else 0
        if snapshots and self.own_cache_runner is not None:  # cut copies of own caches, within a token budget
            budget = kv_memory_budget(self.device, config.max_memory_percent)
            self.cfg, slots = snapshot_memory(self.cfg, config, spec.bytes_per_token().get(UNPAGED, 0), budget)
        # why the state layers' prefix is not reused (acb.runner.kinds reports it)
        self.state_why = (
            ""
            if snapshots and slots
            else "prefix caching is off (allow_block_sharing=False)"
            if not self.cfg.prefix_caching
            else "the model also keeps its own caches"
            if not states_only
            else "a layer resumes a prefill neither whole nor a token at a time"
            if not resumes
            else "state_snapshots=0"
        )
        self.cfg = dataclasses.replace(
            self.cfg,
            prefix_caching=snapshots and slots > 0,
            num_swap_blocks=self.cfg.num_swap_blocks if states_only and self.cfg.state_host_rows else 0,
            whole_prefill=bool(whole),
            state_snapshots=slots if snapshots else 0,
            # stepping a token at a time beats recomputing for short rests of a prompt only
            # (benchmarks/mamba1_resume.py: on CPU, 0.4-0.6x a recompute at 16-32 tokens, 1.3x at 64)
            state_resume_max_tail=STEPWISE_MAX_TAIL if snapshots and not all(tried.values()) else 0,
        )
        if (
            config.use_cuda_graph
            or config.default_compile_level
            or config.decode_compile_config is not None
            or config.varlen_compile_config is not None
        ):
            logger.warning(
                "decode CUDA graphs and torch.compile are off for %s: its state layers run per request",
                type(self.model).__name__,
            )
        conv_only = self.linear.conv_only if self.linear is not None else frozenset()
        self.states = LinearStates(
            self.cfg.max_requests_per_batch + 1,
            self.device,
            conv_only,
            self.cfg.state_snapshots,
            self.cfg.state_host_rows,
        )

    def _state_memory(self, config: ContinuousBatchingConfig, spec: KVSpec, snapshots: bool) -> int:
        """Price the state layers' rows (one per request, and a scratch one) and snapshot slots in
        the memory budget: a cache sized from the budget gives up the KV blocks they take.
        Returns the number of snapshot slots (``state_snapshots``, or by default twice the rows,
        within a quarter of the budget). The host-memory offload space is shared between KV blocks
        and host rows of state (half each, at most four rows per request row)."""
        assert self.linear is not None
        row_bytes = state_row_bytes(self.linear.layers, getattr(self.model.config.get_text_config(), "hidden_size", 0))
        self.state_row_bytes = row_bytes
        rows = self.cfg.max_requests_per_batch + 1
        budget = kv_memory_budget(self.device, config.max_memory_percent)
        if not snapshots:
            slots = 0
        elif config.state_snapshots is not None:
            slots = config.state_snapshots
        else:
            slots = max(1, min(2 * rows, budget // 4 // max(row_bytes, 1)))
        group = tp_group(self.model)
        if group is not None:  # every rank runs the same schedule
            (slots,) = agree_min(group, [slots])
        per_block = spec.bytes_per_block(self.cfg.block_size)
        if config.num_blocks is None and per_block and row_bytes:
            needed = self.cfg.max_blocks_per_seq + 1
            taken = -(-(rows + slots) * row_bytes // per_block)
            if self.cfg.num_blocks - taken < needed and config.state_snapshots is None:
                slots = max(0, (self.cfg.num_blocks - needed) * per_block // row_bytes - rows)
                taken = -(-(rows + slots) * row_bytes // per_block)
            num_blocks = max(needed, self.cfg.num_blocks - taken)
            self.cfg = dataclasses.replace(
                self.cfg,
                num_blocks=num_blocks,
                kv_cache_bytes=num_blocks * per_block,
                max_model_len=min(self.cfg.max_model_len, (num_blocks - 1) * self.cfg.block_size),
            )
        offload = self.cfg.offload_bytes if self.unpaged is None and self.own_cache_runner is None else 0
        host_rows = min(4 * rows, offload // (2 if per_block else 1) // max(row_bytes, 1)) if offload else 0
        if host_rows:
            # pages without bytes (state layers only): the host blocks only measure lengths
            swap_blocks = (offload - host_rows * row_bytes) // per_block if per_block else 4 * self.cfg.num_blocks
            self.cfg = dataclasses.replace(self.cfg, state_host_rows=host_rows, num_swap_blocks=swap_blocks)
        logger.info(
            "%s's state layers: %.1f MiB per request row (%d rows), %d snapshot slots for prefix caching "
            "(%.1f MiB), %d host rows for offload",
            type(self.model).__name__,
            row_bytes / 2**20,
            rows,
            slots,
            slots * row_bytes / 2**20,
            host_rows,
        )
        return slots

    def _lora_layers(self, config: ContinuousBatchingConfig, spec: KVSpec, own_path: bool) -> LoraLayers | None:
        """The LoRA adapters' stacked buffers (None with ``max_loras == 0``), priced in the memory
        budget: a cache sized from the budget gives up the KV blocks they take. Refused where
        adapters do not run yet: tensor parallel, the own-cache runner path."""
        if not config.max_loras:
            return None
        name = type(self.model).__name__
        if own_path:
            raise ValueError(
                f"LoRA adapters (max_loras={config.max_loras}) run on the paged path only, and {name} runs on its "
                "own cache objects ("
                + (f"the paged path refuses it: {self._paged_refused}" if self._paged_refused else "runner='own_cache'")
                + "); set max_loras=0"
            )
        if tp_size_of(self.model) > 1:
            raise ValueError(
                f"LoRA adapters (max_loras={config.max_loras}) are not run under tensor parallel yet; set max_loras=0"
            )
        per_segment = [
            *(self.linear.layers if self.linear is not None else ()),
            *(self.unpaged.layers if self.unpaged is not None else ()),
            *(self.indexed.layers if self.indexed is not None else ()),
        ]
        kv_b = [m.kv_b_proj for m in latent_modules(self.model).values()] if self.latent is not None else []
        lora = LoraLayers(
            self.model, config.max_loras, config.max_lora_rank, self.device, per_segment=per_segment, not_per_token=kv_b
        )
        nbytes = lora.reserved_bytes
        per_block = spec.bytes_per_block(self.cfg.block_size)
        if config.num_blocks is None and per_block and nbytes:
            needed = self.cfg.max_blocks_per_seq + 1
            num_blocks = self.cfg.num_blocks - -(-nbytes // per_block)
            if num_blocks < needed:
                raise ValueError(
                    f"not enough memory for LoRA adapters: max_loras={config.max_loras} of max_lora_rank="
                    f"{config.max_lora_rank} take {nbytes / 2**20:.1f} MiB, and what is left of the budget holds "
                    f"{max(num_blocks, 0)} KV blocks where one request of max_model_len={self.cfg.max_model_len} "
                    f"needs {needed}; lower max_loras, max_lora_rank or max_model_len, or set num_blocks"
                )
            self.cfg = dataclasses.replace(
                self.cfg,
                num_blocks=num_blocks,
                kv_cache_bytes=num_blocks * per_block,
                max_model_len=min(self.cfg.max_model_len, (num_blocks - 1) * self.cfg.block_size),
            )
        self.cfg = dataclasses.replace(
            self.cfg, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank, lora_bytes=nbytes
        )
        logger.info(
            "LoRA: %d adapter slots of rank <= %d over %d target linears (%.1f MiB set aside)",
            config.max_loras,
            config.max_lora_rank,
            len(lora.targets),
            nbytes / 2**20,
        )
        return lora

    def add_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` in ``slot`` (``1..max_loras``; 0 is "no adapter"), replacing what was there.
        Engine thread only (through ``EngineCore.call``), between two steps."""
        if self.lora is None:
            raise InvalidRequestError(
                "LoRA is off: ContinuousBatchingConfig.max_loras is 0; set max_loras > 0 to load adapters", LORA_FIELD
            )
        self.lora.add(slot, adapter)

    def remove_lora(self, slot: int) -> None:
        """Empty ``slot`` (engine thread only); requests still naming it would run the base model."""
        if self.lora is None:
            raise InvalidRequestError("LoRA is off: ContinuousBatchingConfig.max_loras is 0", LORA_FIELD)
        self.lora.remove(slot)

    def _indexed_settings(self, config: ContinuousBatchingConfig) -> None:
        """An indexed-attention model's indexers run once per request, from Python (the reference
        path), and an MLA model's latent is expanded per request by the torch backend: decode
        graphs and torch.compile are off for them."""
        if (
            config.use_cuda_graph
            or config.default_compile_level
            or config.decode_compile_config is not None
            or config.varlen_compile_config is not None
        ):
            logger.warning(
                "decode CUDA graphs and torch.compile are off for %s: its %s per request",
                type(self.model).__name__,
                "attention indexers run" if self.indexed is not None else "MLA latent is expanded",
            )

    def _packed_linears(self, model: PreTrainedModel, config: ContinuousBatchingConfig) -> PackedLinears | None:
        """oneDNN-packed copies of the float32 linear weights, for the CPU forward (see
        :mod:`acb.runner.cpu_linear`); None where they do not apply or were turned off."""
        want = config.cpu_packed_linears
        if want is False:
            return None
        problem = packable(model)
        if problem is None and (
            config.default_compile_level
            or config.decode_compile_config is not None
            or config.varlen_compile_config is not None
        ):
            problem = "the forward is compiled (inductor packs weights itself)"
        if problem is None and tp_size_of(model) > 1:
            problem = "the model is tensor parallel"
        if problem is None and want is None and linear_params_per_layer(model) < MIN_LAYER_PARAMS:
            return None  # too small to gain: the mode's per-call cost outweighs the faster matmuls
        packed = PackedLinears(model, self._weights_key) if problem is None else None
        if packed is not None and not len(packed):
            packed, problem = None, "the model has no plain float32 nn.Linear"
        if packed is None:
            if want:
                logger.warning("cpu_packed_linears is ignored: %s", problem)
            return None
        packed.refresh()
        return packed

    def _step_buffers(self) -> None:
        """The block table, the staging buffers, the per-row sampling state and the last samples:
        what a step needs besides the KV cache (built at start and by ``wake_up``, with no request
        holding a row)."""
        cfg = self.cfg
        self.inputs = InputBatch(
            cfg.max_requests_per_batch, cfg.max_blocks_per_seq, cfg.block_size, self.device, lora=self.lora is not None
        )
        self.staging = StagingRing(staging_bytes(cfg), self.device, self.streams)
        self.sampling = SamplingState(cfg.max_requests_per_batch, self.vocab_size, self.device)
        self._prev_ids = torch.zeros(0, dtype=torch.long, device=self.device)  # last step's sampled ids

    def media_facts(self) -> MediaFacts:
        """What a submit needs to know of the model's images (:class:`acb.runner.media.MediaFacts`),
        read once when the engine starts, before its thread runs: submits never call the runner."""
        vision, name = self.media, type(self.model).__name__
        if vision is None:
            refused = f"{name} takes no images (no image token and vision config)"
        elif self.own_cache_runner is not None:
            refused = (
                "the model runs on its own cache objects (runner='own_cache'); images run on the paged path only"
                + (f" (the paged path refuses it: {self._paged_refused})" if self._paged_refused else "")
            )
        elif tp_size_of(self.model) > 1:
            refused = "images are not run under tensor parallel yet"
        else:
            refused = vision.refused
        text = self.model.config.get_text_config()
        row = int(getattr(text, "hidden_size", 0) or 0) * self.model.dtype.itemsize
        both_ways, one_block = (vision.bidirectional, vision.one_block) if vision is not None else (False, False)
        return MediaFacts(refused, row, both_ways, one_block, name)

    def sleep(self) -> MemoryReleased:
        """Free the device memory the engine holds besides the model: the KV cache, the decode
        graphs, the staging buffers, the block table and the sampling buffers. No request may hold
        KV blocks or a row (the engine preempts them first); the cache's content is lost. The host
        offload space is kept (offloaded requests resume from it)."""
        if self.asleep:
            return MemoryReleased(0, 0, 0, 0, 0 if self.device.type == "cuda" else None)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
        kv = self.kv_cache.release()
        graphs = 0
        if self.graphs is not None:
            g = self.graphs
            graphs = g.capture_bytes if cuda else g.static.nbytes + g.qsl.nbytes
            self.graphs = None
        staging = sum(s.host.nbytes + s.dev.nbytes for s in self.staging.sets)
        other = self.inputs.block_table_dev.nbytes + sum(
            t.nbytes
            for t in (self.sampling.seen, self.sampling.counts, self.sampling.bias, self.sampling.stop_mask)
            if t is not None
        )
        release = getattr(self.backend, "release", None)  # a backend's own buffers (the torch backend's workspace)
        if release is not None:
            other += release()
        if self.packed is not None:  # packed again by the first step after wake_up
            other += self.packed.release()
        self.staging = self.sampling = self.inputs = None  # type: ignore[assignment]
        self._prev_ids = None  # type: ignore[assignment]
        if self.linear is not None:  # the requests are recomputed after wake_up: their states start anew
            other += self.states.nbytes()
            old = self.states
            self.states = LinearStates(old.rows, self.device, old.conv_only, old.slots)
            self.states.keep_host_rows(old)  # offloaded requests keep their state
        if self.unpaged_caches is not None:
            other += self.unpaged_caches.nbytes()
            self.unpaged_caches.clear()
        if self.own_cache_runner is not None:
            other += self.own_cache_runner.nbytes()
            self.own_cache_runner.clear()
        if self.media is not None:
            other += self.media.nbytes()
            self.media.clear()
        measured = None
        if cuda:
            torch.cuda.empty_cache()
            measured = max(0, reserved - torch.cuda.memory_reserved(self.device))
        self.asleep = True
        return MemoryReleased(kv, graphs, staging, other, measured)

    def idle(self) -> None:
        """The engine has no work until its next command: hand back this thread's OpenMP workers,
        so that other threads' parallel regions are not throttled while it waits
        (:mod:`acb.runner.host_threads`; the next step starts a new pool). On CPU only: a GPU
        engine's thread opens few parallel regions, and keeps its pool."""
        if self.device.type == "cpu":
            release_idle_threads()

    def wake_up(self) -> None:
        """Allocate again what :meth:`sleep` freed and capture the decode graphs again."""
        if not self.asleep:
            return
        with device_scope(self.device):
            self.kv_cache.restore()
            self._step_buffers()
            self.asleep = False
            self.warmup()

    def _checked_backend(self, config: ContinuousBatchingConfig, spec: KVSpec) -> AttentionBackend:
        """The configured backend; when it was picked automatically, it must first agree with the
        torch reference on this device (flash_attn falls back to triton, triton to torch)."""
        from acb.runner.attention import check_backend, query_heads

        name = self.cfg.attn_backend
        # a model without attention layers (pure Mamba2) never calls the backend: nothing to check
        while config.attn_backend is None and name != "torch" and spec.kv_shapes():
            try:
                backend = make_backend(name)
                problem = None
                for kv_heads, head_dim in spec.kv_shapes():  # each page shape the model's layers use
                    problem = problem or check_backend(
                        backend,
                        self.device,
                        spec.dtype,
                        head_dim=head_dim,
                        block_size=self.cfg.block_size,
                        kv_heads=kv_heads,
                        heads=query_heads(self.model.config, kv_heads, tp_size_of(self.model)),
                    )
            except Exception as exc:  # noqa: BLE001 - reported, then the next backend
                problem = f"{type(exc).__name__}: {exc}"
            if problem is None:
                return backend
            fallback = "triton" if name == "flash_attn" else "torch"
            logger.warning(
                "the %s attention backend failed its start-up check (%s); falling back to %s", name, problem, fallback
            )
            name = fallback
            self.cfg = dataclasses.replace(self.cfg, attn_backend=name)
        return make_backend(name)

    def _want_graphs(self) -> bool:
        """Decode graphs: on by default on CUDA with a backend that supports them; on CPU only when
        asked for (the eager twin, for tests)."""
        asked = self._graphs_requested
        ok = getattr(self.backend, "supports_graphs", False)
        if asked is None:
            return self.device.type == "cuda" and ok
        if asked and not ok:
            logger.warning(
                "use_cuda_graph is ignored: the %r attention backend sizes its work from host "
                "values each step, so it cannot be captured (use 'triton' or 'flash_attn')",
                self.backend.name,
            )
            return False
        if asked and self.device.type != "cuda":
            logger.info(
                "use_cuda_graph on %s runs the eager twin of the decode graphs (static buffers and "
                "padding, no capture)",
                self.device,
            )
        return asked

    def warmup(self) -> None:
        """Capture the decode CUDA graphs (when enabled) and check a replay against eager.

        When graphs were asked for explicitly, a failure raises; when they were chosen
        automatically, it logs a warning and the engine runs eagerly."""
        if not self.cfg.cuda_graphs or self.graphs is not None:
            return
        from acb.runner.cuda_graphs import DecodeGraphs, graph_sizes

        graphs = DecodeGraphs(
            self, graph_sizes(self.cfg.max_requests_per_batch, self.cfg.graph_step), twin=self.device.type != "cuda"
        )
        try:
            graphs.capture_all()
            problem = graphs.self_check()
        except Exception as exc:  # noqa: BLE001 - reported below, with the cause
            problem = f"{type(exc).__name__}: {exc}"
        if problem is None:
            self.graphs = graphs
            return
        del graphs
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self._graphs_requested:
            raise RuntimeError(f"capturing the decode CUDA graphs failed: {problem}")
        logger.warning("decode CUDA graphs disabled, their capture or check failed (%s)", problem)
        self.cfg = dataclasses.replace(self.cfg, cuda_graphs=False)

    def _weights_key(self) -> WeightsKey:
        """The weights' key (:class:`acb.runner.weights.WeightWatch`: objects, storages, in-place
        versions, optimizer steps), shared by the prefix cache's check and the packed linears'
        copies. Not seen: in-place writes through ``.data`` outside an optimizer (call
        ``reset_prefix_cache()`` after those)."""
        return self._weights.key()

    def weights_changed(self) -> bool:
        """Whether the weights changed since the last call (or construction)."""
        key = self._weights_key()
        if key == self._weights_seen:
            return False
        self._weights_seen = key
        return True

    def forget_weights(self) -> None:
        """Drop what was derived from the weights (the packed linears, the image embeddings no row
        holds); the next step rebuilds it. For weight changes the version counters cannot see
        (writes through ``.data``)."""
        if self.packed is not None:
            self.packed.release()
        if self.media is not None:
            self.media.forget_unused()

    def _mode_step(self) -> contextlib.AbstractContextManager[Any]:
        """The batch-invariant mode's ops for the forward (``batch_invariant=True``), else nothing."""
        if not self.cfg.batch_invariant:
            return contextlib.nullcontext()
        return batch_invariant.engine_step(self.device.type == "cuda")

    def swap_weights(self, staged: Staged) -> None:
        """Put an update's staged tensors in the weights (engine thread, between two steps): a copy
        into each, or on CPU, for a receiver's buffers that fit as they are, the weights rebound to
        them (:meth:`Staged.swap`). The core then forgets what it computed with the old ones
        (``forget_weights``: the packed linears, repacked from the new data; the prefix cache)."""
        staged.swap()
        logger.info("swapped in %d updated tensors (%.1f MiB)", len(staged.names), staged.nbytes / 2**20)

    def close(self) -> None:
        """Give the model its own attention implementation back, and drop the KV cache, the
        graphs and the step buffers, so that a stopped engine's device memory is free for the next
        start (the stopped engine core still holds this runner). The runner is unusable after."""
        if self.threads is not None:  # (on the engine thread, as it exits)
            self.threads.close()
        if self._holds_attn:
            if self._swapped_attn:
                ATTN_SWAP.release(self.model)
            DROPOUT_GUARD.release(self.model)
            self._holds_attn = False
        if self.linear is not None:
            self.linear.remove()
        if self.unpaged is not None:
            self.unpaged.remove()
        if self.indexed is not None:
            self.indexed.remove()
        if self.latent is not None:
            self.latent.remove()
        if self.shared_attention is not None:
            self.shared_attention.remove()
        if self.lora is not None:
            self.lora.close()
        self._weights.close()
        self.graphs = None  # the graphs hold the runner: break the cycle, so their pool goes now
        if self.packed is not None:  # the linears get their own forward back
            self.packed.remove()
        self.packed = None
        # the runner is unusable after close, so these are not typed Optional
        self.kv_cache = self.staging = self.sampling = self.inputs = None  # type: ignore[assignment]
        self._prev_ids = None  # type: ignore[assignment]

    def execute(self, sched: SchedulerOutput) -> InFlightStep:
        """Launch one step (no host sync): stage its inputs (one copy), run the forward and the
        sampler on the compute stream, and start copying the sampled ids back to the host."""
        tuner = self.threads
        if tuner is None:
            with device_scope(self.device, self.streams.compute):
                return self._execute(sched)
        # CPU: the step runs here and now (execute is the whole step's work), at the tuner's count
        tuner.begin(sched.num_tokens, sched.num_decode_tokens == sched.num_tokens)
        t0 = time.perf_counter()
        try:
            with device_scope(self.device, self.streams.compute):
                return self._execute(sched)
        finally:
            tuner.end(time.perf_counter() - t0)

    def _thread_tuner(self, config: ContinuousBatchingConfig, *, tensor_parallel: bool) -> ThreadTuner | None:
        """The engine thread's intra-op thread count on CPU (None elsewhere): ``cpu_threads`` (or,
        when it is None, the ``ACB_CPU_THREADS`` environment variable) pins it to an int, or leaves
        it at the count torch gives the thread ("fixed"); "auto" measures
        (:class:`ThreadTuner`), except under tensor parallelism, where the ranks' steps wait on each
        other and one rank's step time says little of its own count."""
        if self.device.type != "cpu":
            return None
        want = config.cpu_threads
        if want is None:
            env = os.environ.get("ACB_CPU_THREADS", "auto").strip()
            if env not in ("auto", "fixed"):
                if not env.isdigit() or int(env) < 1:
                    raise ValueError(f"ACB_CPU_THREADS must be 'auto', 'fixed' or a positive int; got {env!r}")
                want = int(env)
            else:
                want = env
        if want == "fixed":  # the count torch gives the engine thread, as it is (no measuring)
            return None
        if isinstance(want, int):
            return ThreadTuner(want, pinned=True)
        n = torch.get_num_threads()
        if n <= 1 or tensor_parallel:
            return None
        return ThreadTuner(n)

    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput) -> InFlightStep:
        t0 = time.perf_counter()
        sampling = self.sampling
        for row in sched.freed_rows:
            sampling.free_row(row)
        for req in sched.row_inits:
            sampling.init_row(req.row, req)
        hooks = self.hooks  # each layer kind's part of the step (acb.runner.kinds)
        for h in hooks:  # rows given, freed, restored from a snapshot, swapped in
            h.begin_step(sched)
        if sched.swap_out:  # before swap-ins and the forward, which may reuse these device blocks
            self.kv_cache.swap_out(sched.swap_out)
        if sched.swap_in:
            self.kv_cache.swap_in(sched.swap_in)
        st = self.staging.begin()
        host = self.inputs.stage(sched, st)
        step = sampling.stage(st, sched.sample_rows, sched.sample_gen_idx)
        dev = st.send()
        self.last_stage_s = time.perf_counter() - t0
        sampling.apply_inits(dev)
        batch = self.inputs.build(host, dev, self._prev_ids)
        if self.media is not None:  # image rows (and multimodal positions) of the requests with images
            with self._mode_step():  # (the vision code's ops in the batch-invariant mode too)
                mm = self.media.step_inputs(sched, batch.input_ids, batch.position_ids)
            if mm is not None:
                batch = dataclasses.replace(batch, inputs_embeds=mm[0], position_ids=mm[1], decode_only=False)
        num_samples = len(sched.sample_idx)
        scored = sched.prompt_lp or sched.next_lp
        if scored:  # prompt logprobs and scoring: the head also runs on those rows (and on no other)
            rows = torch.tensor(
                [p.row + j for p in sched.prompt_lp for j in range(p.num)] + [n.row for n in sched.next_lp],
                dtype=torch.long,
            )
            batch = dataclasses.replace(
                batch,
                logits_indices=torch.cat([batch.logits_indices, rows.to(self.device)]),
                logits_identity=False,
                decode_only=False,
            )
        logits = None
        # adapter rows replay the graphs' LoRA form, unless a slot has fused experts' factors
        lora_ok = batch.lora is None or (self.lora is not None and self.lora.graphable(batch.lora))
        if self.graphs is not None and batch.decode_only and lora_ok:
            logits = self.graphs.run(batch)  # None when no captured graph fits this step
        if self.own_cache_runner is not None:  # the model on its own caches (the second runner path)
            # inside a step context: the model's dropout is off on this thread (acb.runner.eval_mode)
            with step_context(StepContext(self.kv_cache, self.backend, None)):
                logits = self.own_cache_runner.forward(
                    batch.input_ids, batch.position_ids, sched.num_new, sched.rows, batch.logits_indices.tolist()
                )
        if logits is None:
            ctx = StepContext(self.kv_cache, self.backend, self.backend.build_metadata(batch.attn, self.cfg.block_size))
            if self.media is not None and self.media.step_groups:  # image blocks that attend both ways
                ctx.metadata.media_groups = self.media.step_groups
            with contextlib.ExitStack() as per_request:
                # the state layers, indexers and own-cache layers run per request segment of the
                # flattened batch; the language model takes the step's image rows
                for h in hooks:
                    cm = h.step(sched, batch)
                    if cm is not None:
                        per_request.enter_context(cm)
                logits = self.forward(batch, ctx)
        for h in hooks:  # forks: children start from the parent's state (own caches: and snapshots)
            h.end_step(sched)
        prompt = nxt = None
        if scored:
            n_prompt = logits.shape[0] - num_samples - len(sched.next_lp)
            if sched.prompt_lp:
                targets = [t for p in sched.prompt_lp for t in p.targets]
                prompt = self._scored_logprobs(
                    logits[num_samples : num_samples + n_prompt],
                    targets,
                    max(p.req.params.prompt_logprobs for p in sched.prompt_lp),
                )
            if sched.next_lp:
                nxt = self._next_logprobs(logits[num_samples + n_prompt :], sched)
            logits = logits[:num_samples]
        for src, dst in sched.block_copies_after:  # n > 1: copy-on-write of the prompt's partial block
            self.kv_cache.copy_block(src, dst)
        if num_samples:
            packed = sample(logits, step, sampling, dev, sched.grammar)
        else:  # a step of scoring requests only: nothing to sample
            packed = torch.empty(0, dtype=torch.long, device=self.device)
        st.release()
        self._prev_ids = packed if packed.dim() == 1 else packed[:, 0].long()
        return InFlightStep(sched, self._to_host(packed), max(step.max_logprobs, 0), prompt, nxt)

    def _scored_logprobs(
        self, logits: torch.Tensor, targets: list[int], k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-softmax of the raw logits of scored rows (``[R, V]``, R bounded by the scheduler's
        ``max_scored_rows``): each row's target's logprob and the row's top-k."""
        tgt = torch.tensor(targets, dtype=torch.long, device=self.device)
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp.gather(1, tgt[:, None])[:, 0]
        top = lp.topk(k, dim=-1) if k else None
        empty = torch.empty((lp.shape[0], 0), device=self.device)
        return chosen, (top.indices if top is not None else empty.long()), (top.values if top is not None else empty)

    def _next_logprobs(
        self, logits: torch.Tensor, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows after whole prompts (one per ``next_lp`` entry, ``[E, V]``): the scored tokens'
        logprobs (flat, in entry order) and each row's top-k (the largest k asked for, at least 1:
        the greedy token)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        row = torch.tensor(
            [i for i, n in enumerate(sched.next_lp) for _ in n.tokens], dtype=torch.long, device=self.device
        )
        tok = torch.tensor([t for n in sched.next_lp for t in n.tokens], dtype=torch.long, device=self.device)
        k = max(max(n.req.params.prompt_logprobs or 0, 1) for n in sched.next_lp)
        top = lp.topk(k, dim=-1)
        return lp[row, tok], top.indices, top.values

    def _to_host(self, packed: torch.Tensor) -> HostResult:
        """Start the copy of the sampled ids to (pinned) host memory on the device-to-host stream."""
        s = self.streams
        if not s.cuda:
            return HostResult(packed, None)
        d2h = s.d2h
        assert d2h is not None  # the streams exist on CUDA
        sampled = torch.cuda.Event()
        sampled.record(s.compute)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        with torch.cuda.stream(d2h):
            d2h.wait_event(sampled)
            host.copy_(packed, non_blocking=True)
            packed.record_stream(d2h)
            done = torch.cuda.Event()
            done.record(d2h)
        return HostResult(host, done)

    def _setup_compile(self, config: ContinuousBatchingConfig) -> None:
        """``torch.compile`` the forward for the decode-only and the mixed (varlen) paths, as
        ``decode_compile_config`` / ``varlen_compile_config`` / ``default_compile_level`` ask.
        acb's attention is an opaque custom op (its metadata is host-side, read from the step
        context); ``fullgraph`` is still forced off, and inductor's CUDA-graph mode
        ("reduce-overhead") is replaced by "default"."""
        levels = {
            1: dict(mode="default", dynamic=True),
            2: dict(mode="max-autotune-no-cudagraphs", dynamic=True),
            3: dict(mode="max-autotune-no-cudagraphs", dynamic=False),
        }
        self._compiled = {}
        for path, cc in (("decode", config.decode_compile_config), ("varlen", config.varlen_compile_config)):
            if cc is None and config.default_compile_level:
                cc = levels[min(config.default_compile_level, 3)]
            if cc is None:
                continue
            kw = dict(cc.to_dict() if hasattr(cc, "to_dict") else cc)
            kw["fullgraph"] = False
            if kw.get("mode") == "reduce-overhead":
                kw["mode"] = "default"
            kw = {k: v for k, v in kw.items() if k in ("fullgraph", "dynamic", "backend", "mode", "options")}
            if kw.get("mode") and kw.get("options"):
                kw.pop("mode")  # torch.compile takes one of the two
            self._compiled[path] = torch.compile(self._model_forward, **kw)

    @property
    def compiled_paths(self) -> frozenset[str]:
        """Which forward paths run through ``torch.compile`` ("decode", "varlen")."""
        return frozenset(self._compiled)

    def forward(self, batch: PreparedBatch, ctx: StepContext) -> torch.Tensor:
        """The model's forward over the flattened batch; logits of the sampling rows, ``[S, V]``."""
        fn = (
            None if batch.inputs_embeds is not None else self._compiled.get("decode" if batch.decode_only else "varlen")
        )
        # the thread's step context: compiled attention finds it there (the graph takes tensors
        # only), and the model's dropout is off inside it (acb.runner.eval_mode: eval semantics on
        # this thread only, the model's flags stay the user's)
        with step_context(ctx):
            if fn is None:
                return self._model_forward(batch, ctx)
            return fn(batch, True)

    def _model_forward(self, batch: PreparedBatch, ctx: StepContext | Literal[True]) -> torch.Tensor:
        # a 4-D "mask" is returned as-is by transformers' mask creation: no mask is built (acb's
        # attention needs none) and nothing inspects the flattened positions (a host sync).
        # ctx is True under torch.compile: attention then reads the thread's step context
        kw = dict(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=self._no_mask,
            use_cache=False,
            acb_ctx=ctx,
        )
        if batch.inputs_embeds is not None:  # a step with image rows (acb.runner.media)
            kw["input_ids"], kw["inputs_embeds"] = None, batch.inputs_embeds
            if self.media is not None:
                kw.update(self.media.model_kwargs())
        with (
            self.packed.active(batch.input_ids.shape[-1]) if self.packed is not None else contextlib.nullcontext(),
            self._mode_step(),
        ):
            if self._supports_logits_to_keep:
                return self.model(**kw, logits_to_keep=batch.logits_indices).logits[0]
            return self.model(**kw).logits[0, batch.logits_indices]

    def finish(self, step: InFlightStep) -> ModelRunnerOutput:
        """Sync: wait for the step's sampled ids (with logprobs when asked) to reach the host.

        Waits on the device-to-host copy's event only, so a step launched after this one
        keeps running on the device meanwhile."""
        res = step.result
        if res.done is not None:
            res.done.synchronize()
        rows = res.tensor.tolist()
        prompt = self._prompt_to_host(step) if step.prompt is not None else None
        nxt = self._next_to_host(step) if step.next is not None else None
        if res.tensor.dim() == 1:
            return ModelRunnerOutput(sampled=rows, logprobs=None, top=None, prompt=prompt, next=nxt)
        k = step.num_top
        sampled = [int(r[0]) for r in rows]
        logprobs = [r[1] for r in rows]
        top = [list(zip(map(int, r[2 : 2 + k]), r[2 + k :])) for r in rows] if k else None
        return ModelRunnerOutput(sampled=sampled, logprobs=logprobs, top=top, prompt=prompt, next=nxt)

    @staticmethod
    def _next_to_host(step: InFlightStep) -> list[tuple[list[float], list[tuple[int, float]]]]:
        assert step.next is not None
        values, ids, vals = (t.tolist() for t in step.next)  # scoring steps: a plain sync is fine
        out, i = [], 0
        for e, n in enumerate(step.sched.next_lp):
            k = max(n.req.params.prompt_logprobs or 0, 1)
            out.append((values[i : i + len(n.tokens)], list(zip(ids[e][:k], vals[e][:k]))))
            i += len(n.tokens)
        return out

    @staticmethod
    def _prompt_to_host(step: InFlightStep) -> list[tuple[list[float], list[list[tuple[int, float]]]]]:
        assert step.prompt is not None
        chosen, ids, vals = (t.tolist() for t in step.prompt)  # rare: a plain sync is fine
        out, i = [], 0
        for p in step.sched.prompt_lp:
            k = p.req.params.prompt_logprobs
            out.append((chosen[i : i + p.num], [list(zip(ids[j][:k], vals[j][:k])) for j in range(i, i + p.num)]))
            i += p.num
        return out
