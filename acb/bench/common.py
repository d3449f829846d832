"""Shared pieces of the benchmarks: model shapes, machine description, statistics, output."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Model shapes: "tiny" for smoke tests, "small" for a quick figure on any family (the families
# table of docs/performance.md), "default" the issue's ~40M-parameter Llama.
MODEL_SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=1024,
    ),
    "small": dict(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=1024,
    ),
    "default": dict(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=2048,
    ),
}


# The architectures with a sized benchmark config of their own (``acb bench --arch``): the Llama the
# figures were first measured on, a Qwen3.5-shaped hybrid (gated-DeltaNet linear attention, three
# layers to one gated full-attention layer) and a DeepSeek-V3-shaped MLA model (latent attention,
# MoE). Any other causal-LM model type of transformers is built by acb.bench.families.
ARCHS = ("llama", "qwen3_5", "deepseek_v3")


def arch_config(
    arch: str,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    vocab_size: int,
    max_position_embeddings: int,
) -> Any:
    """The config of a random-weight benchmark model of ``arch`` (:data:`ARCHS`), sized from a
    Llama shape (the keyword arguments: :data:`MODEL_SHAPES` or a workload's own):

    - ``llama``: that shape (:func:`acb.models.tiny_config`);
    - ``qwen3_5``: Qwen3.5's text model (``Qwen3_5TextConfig``) of the same hidden, MLP, heads,
      vocabulary and positions, its layers rounded up to whole groups of four in Qwen3.5's
      pattern (three ``linear_attention`` layers, then one ``full_attention``), the linear
      layers' heads sized as Qwen3.5's are to its hidden (value heads x head dim = hidden, half
      as many key heads), the full-attention head dim hidden / heads; Qwen3.5's other defaults
      (gated attention, partial rotary, conv kernel 4) kept;
    - ``deepseek_v3``: DeepSeek V3 (MLA: ``kv_lora_rank`` hidden / 2, rope head dim half a
      nope/value head; MoE: 4 routed experts, 2 per token, 1 shared, the first layer dense) at
      hidden at most 256, as many layers and heads.

    Every model's init is as wide as :func:`acb.models.tiny_config`'s (peaked logits: greedy
    parity does not hinge on near-ties), BOS 1, EOS 2, untied embeddings."""
    from transformers import AutoConfig

    from acb.models import tiny_config

    if arch not in ARCHS:
        raise ValueError(f"unknown benchmark architecture {arch!r}; choose from {ARCHS}")
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    if arch == "llama":
        return tiny_config(
            "llama",
            vocab_size=vocab_size,
            max_position_embeddings=max_position_embeddings,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
        )
    head_dim = hidden_size // num_attention_heads
    if arch == "qwen3_5":
        groups = max(1, math.ceil(num_hidden_layers / 4))
        return AutoConfig.for_model(
            "qwen3_5_text",
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=4 * groups,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            linear_num_value_heads=num_attention_heads,
            linear_num_key_heads=max(1, num_attention_heads // 2),
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * groups,
            **common,
        )
    hidden = min(hidden_size, 256)
    per_head = hidden // num_attention_heads
    return AutoConfig.for_model(
        "deepseek_v3",
        hidden_size=hidden,
        intermediate_size=intermediate_size * hidden // hidden_size,
        moe_intermediate_size=intermediate_size * hidden // hidden_size // 2,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        kv_lora_rank=hidden // 2,
        q_lora_rank=hidden // 2,
        qk_nope_head_dim=per_head,
        v_head_dim=per_head,
        qk_rope_head_dim=per_head // 2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        **common,
    )


def bench_config(arch: str, **shape: int) -> tuple[Any, str | None]:
    """The config of the benchmark model of ``arch`` sized from ``shape`` (a Llama shape, as
    :func:`arch_config` takes), and for a family outside :data:`ARCHS` a note of how it was made:
    :data:`ARCHS` by :func:`arch_config`, any other causal-LM model type by
    :func:`acb.bench.families.family_config` (the catalogue sweep's tiny config, scaled toward the
    shape where the config allows). ``ValueError`` for an unknown model type, or one whose config
    does not build a model that runs."""
    if arch in ARCHS:
        return arch_config(arch, **shape), None
    from acb.bench.families import check_model_type, family_config

    check_model_type(arch, also=ARCHS)
    return family_config(arch, **shape)


def bench_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **shape: int) -> Any:
    """A random-weight ``arch`` causal LM sized from ``shape`` (:func:`bench_config`), in eval mode
    on the CPU (``Any``: the baselines call its GenerationMixin methods). :data:`ARCHS` run on SDPA;
    other families on transformers' default attention for them."""
    from transformers import AutoModelForCausalLM

    cfg, _ = bench_config(arch, **shape)
    torch.manual_seed(seed)
    attn: dict[str, Any] = {"attn_implementation": "sdpa"} if arch in ARCHS else {}
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, **attn).eval()


def describe_config(arch: str, cfg: Any) -> dict[str, Any]:
    """A non-Llama benchmark model's sizes for the results JSON (the Llama's are its shape)."""
    keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"]
    keys += ["head_dim", "vocab_size", "max_position_embeddings"]
    if arch not in ARCHS:  # any family: its text model's sizes and layer kinds, as its config names them
        text = cfg.get_text_config()
        out = {"model_type": text.model_type, "hidden_size": getattr(text, "hidden_size", None)}
        out.update({k: getattr(text, k) for k in keys if hasattr(text, k)})
        kinds = ("layer_types", "layers_block_type", "mlp_layer_types", "attn_layer_period", "attn_layer_offset")
        out.update({k: getattr(text, k) for k in kinds if getattr(text, k, None) is not None})
        return out
    if arch == "qwen3_5":
        keys += ["linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"]
        keys += ["linear_conv_kernel_dim", "layer_types"]
    elif arch == "deepseek_v3":
        keys += ["kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
        keys += ["moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts"]
        keys += ["first_k_dense_replace"]
    return {k: getattr(cfg, k) for k in keys if hasattr(cfg, k)}


@dataclass
class ModelSpec:
    size: str
    seed: int = 0
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    arch: str = "llama"  # one of ARCHS, or any causal-LM model type of transformers (acb.bench.families)

    def config(self) -> tuple[Any, str | None]:
        """The model's config and, for a family outside :data:`ARCHS`, how it was made
        (:func:`bench_config`)."""
        return bench_config(self.arch, **MODEL_SHAPES[self.size])

    def build(self) -> Any:
        """The benchmark's model on its device: a transformers causal LM (``Any``: the baselines
        call its GenerationMixin methods, which ``PreTrainedModel`` does not declare)."""
        shape: dict[str, Any] = MODEL_SHAPES[self.size]  # keyword arguments of bench_model
        model = bench_model(self.arch, seed=self.seed, dtype=self.dtype, **shape)
        return model.to(self.device)

    @property
    def vocab(self) -> int:
        """The model's vocabulary (a family whose config kept its tiny one has that)."""
        if self.arch in ARCHS:
            return MODEL_SHAPES[self.size]["vocab_size"]
        return int(self.config()[0].get_text_config().vocab_size)

    def describe(self, model: torch.nn.Module) -> dict[str, Any]:
        n = sum(p.numel() for p in model.parameters())
        sizes = MODEL_SHAPES[self.size] if self.arch == "llama" else describe_config(self.arch, model.config)
        made = {} if self.arch in ARCHS else {"config": self.config()[1]}
        return {
            "arch": f"{self.arch} (random weights)",
            "params": n,
            "dtype": str(self.dtype).replace("torch.", ""),
            **sizes,
            **made,
        }


def machine_info(device: str = "cpu") -> dict[str, Any]:
    import transformers

    from acb.version import __version__

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    info = dict(
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        acb=__version__,
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        loadavg_at_start=load,
        device=device,
    )
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    else:
        info["gpu"] = None
    return info


def device_name(info: dict[str, Any]) -> str:
    if info.get("gpu"):
        return str(info["gpu"])
    return f"{info['processor']} CPU, {info['cpu_count']} cores"


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles (None when there are no values)."""
    if not values:
        return {f"p{p}": None for p in ps}
    v = sorted(values)
    return {f"p{p}": v[min(len(v) - 1, max(0, math.ceil(p / 100 * len(v)) - 1))] for p in ps}


def peak_memory_bytes(device: str) -> int:
    """Peak memory: CUDA allocator peak, or this process's peak RSS on CPU."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_memory(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def greedy_generate(model: Any, prompts: list[list[int]], new: int, streamer: Any = None) -> torch.Tensor:
    """``model.generate`` on equal-length prompts, exactly ``new`` tokens each, greedy: the
    generated ids, ``[B, new]``."""
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )
    return out[:, ids.shape[1] :]


def acb_greedy(engine: Any, prompts: list[list[int]], new: int) -> list[list[int]]:
    """``engine.generate_batch`` on ``prompts``, exactly ``new`` tokens each (EOS ignored), greedy:
    the generated ids, in the prompts' order."""
    outs = engine.generate_batch(prompts, max_new_tokens=new, ignore_eos=True, temperature=0.0, progress_bar=False)
    return [o.generated_tokens for o in outs.values()]


def phase_ms(before: Any, after: Any) -> dict[str, float]:
    """The engine's steps between two ``Engine.stats`` split by phase, in ms per step: the host's
    schedule, input staging and output processing, and the compute (forward, sampling, the sync)."""
    steps = max(1, after.steps - before.steps)
    return {
        "steps": steps,
        "schedule_ms": 1000 * (after.host_schedule_s - before.host_schedule_s) / steps,
        "stage_ms": 1000 * (after.host_stage_s - before.host_stage_s) / steps,
        "process_ms": 1000 * (after.host_process_s - before.host_process_s) / steps,
        "compute_ms": 1000 * (after.compute_s - before.compute_s) / steps,
    }


def decode_step_ms(run: Callable[[int], Any], steps: int) -> tuple[float, Any]:
    """One decode step's ms: a call of ``1 + steps`` new tokens less a call of one, over ``steps``
    (the prefill and the start of a call cancel out); and the longer call's result."""
    t0 = time.perf_counter()
    run(1)
    t1 = time.perf_counter()
    out = run(1 + steps)
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / steps * 1e3, out


def write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)


def random_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]  # 0-2 are special


def blocks_for_all(lengths: list[int], block_size: int) -> int:
    """KV blocks that hold every request at full length at once (no side ever preempts)."""
    return sum(math.ceil(n / block_size) for n in lengths) + 4


def tf_page(size: int) -> dict[str, Any]:
    """The page-size keyword of the installed transformers' ``ContinuousBatchingConfig``:
    ``page_size`` from 5.23, ``block_size`` before (the GPU image has 5.17)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig as TfConfig

    return {"page_size" if "page_size" in TfConfig.__dataclass_fields__ else "block_size": size}


def workload_flops(shape: dict[str, int], prompt_lens: list[int], outs: list[int]) -> dict[str, float]:
    """The least arithmetic a generation workload needs on a Llama-shaped model (2 FLOP per
    multiply-add): every prompt token and every generated token but the last through the
    body's linear layers; causal attention over each token's context (QK^T and PV, no KV
    padding); the LM head only for the rows that are sampled (one per generated token).
    Elementwise work (norms, rotary, activation, softmax) is not counted."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads, vocab = shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]
    head_dim = shape.get("head_dim", h // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    per_token_linear = 2 * layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    body_tokens = sum(p + o - 1 for p, o in zip(prompt_lens, outs))
    # a token at position i (0-based) attends to i + 1 keys: sum over i < n of (i + 1) = n (n + 1) / 2
    ctx_pairs = sum((p + o - 1) * (p + o) // 2 for p, o in zip(prompt_lens, outs))
    attention = 2 * 2 * layers * heads * head_dim * ctx_pairs
    head = 2 * h * vocab * sum(outs)
    linear = per_token_linear * body_tokens
    return dict(
        total=float(linear + attention + head),
        linear=float(linear),
        attention=float(attention),
        lm_head=float(head),
        body_tokens=float(body_tokens),
    )


def matmul_peak_gflops(
    device: str = "cpu", dtype: torch.dtype = torch.float32, seconds: float = 2.0, min_reps: int = 3
) -> dict[str, Any]:
    """This machine's matmul throughput, measured now: over square and model-shaped
    (tall-skinny) ``torch.mm`` calls, each repeated for about ``seconds / 4`` (and at least
    ``min_reps`` times, after one untimed call), the best GFLOP/s of a single call (the fastest
    call, not the mean: on a shared machine the mean measures the neighbours too)."""
    dev = torch.device(device)
    shapes = [(1024, 1024, 1024), (2048, 2048, 2048), (2048, 512, 2048), (512, 512, 8192)]
    best: dict[str, Any] = {"gflops": 0.0, "shape": None}
    for m, k, n in shapes:
        a = torch.randn(m, k, device=dev, dtype=dtype)
        b = torch.randn(k, n, device=dev, dtype=dtype)
        torch.mm(a, b)
        fastest, reps = float("inf"), 0
        end = time.perf_counter() + seconds / len(shapes)
        while time.perf_counter() < end or reps < min_reps:
            t0 = time.perf_counter()
            torch.mm(a, b)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            fastest = min(fastest, time.perf_counter() - t0)
            reps += 1
        g = 2 * m * k * n / fastest / 1e9
        if g > best["gflops"]:
            best = {"gflops": g, "shape": [m, k, n]}
    best["dtype"] = str(dtype).replace("torch.", "")
    best["threads"] = torch.get_num_threads()
    return best


# torch.profiler op names by kind (the profiles of benchmarks/profile_offline.py and `acb bench overhead`)
# the ops that do a matmul's arithmetic (aten::linear and aten::matmul only call one of them)
GEMM_LEAVES = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise"}
MATMUL = GEMM_LEAVES | {"aten::matmul", "aten::linear"}
# attention: SDPA's ops, and acb's CPU kernel (a ctypes call the profiler sees through its record_function)
SDPA_PREFIX = (
    "aten::_scaled_dot_product",
    "aten::scaled_dot_product",
    "aten::_flash_attention",
    "acb::paged_attention",
)
# acb's named ranges that are kernels (no ops inside them): counted as ops, where other ranges are not
KERNEL_RANGES = frozenset({"acb::paged_attention"})
GATHER = {
    "aten::index",
    "aten::index_copy_",
    "aten::index_select",
    "aten::gather",
    "aten::index_put_",
    "aten::_index_put_impl_",
    "aten::take",
}
COPY = {
    "aten::copy_",
    "aten::to",
    "aten::_to_copy",
    "aten::contiguous",
    "aten::cat",
    "aten::clone",
    "aten::repeat_interleave",
    "aten::expand",
    "aten::empty",
    "aten::empty_strided",
    "aten::new_empty",
}


def op_kind(name: str) -> str:
    """The kind of a profiled op, by its name: ``matmul``, ``sdpa``, ``gather/scatter``, ``copy``,
    ``elementwise`` (the rest of aten) or ``other``."""
    if name in MATMUL:
        return "matmul"
    if name.startswith(SDPA_PREFIX):
        return "sdpa"
    if name in GATHER:
        return "gather/scatter"
    if name in COPY:
        return "copy"
    return "elementwise" if name.startswith("aten::") else "other"
