"""LoRA adapters as plain data: :class:`LoraAdapter`, and :func:`load_adapter` from a PEFT folder or
a ``peft.PeftModel``.

An adapter is, per target linear of the base model, a pair ``A [r, in]``, ``B [out, r]`` and a
scaling; the layer computes ``base(x) + B(A(x)) * scaling``, PEFT's order
(``result + lora_B(lora_A(x)) * scaling``). The module paths are the engine's model's own
(``model.named_modules()``, no PEFT prefix). Loading runs on the caller's thread; the engine thread
only copies the tensors into its stacked buffers (:class:`acb.runner.lora.LoraLayers`).

PEFT's ``target_parameters`` (LoRA on a MoE's fused 3-D expert parameters, PEFT's ``ParamWrapper``)
are taken too: :attr:`LoraAdapter.params` holds, per parameter, the factors PEFT folds into the
weight before the experts run (``W + scaling * lhs @ rhs``, one ``baddbmm``).

PEFT options acb does not run are refused, each with what and why (an
:class:`~acb.errors.InvalidRequestError` with field ``"lora"``): DoRA, LoRA biases, ``modules_to_save``, trainable tokens, layer replication, and the
PEFT variants that change the forward (aLoRA, QALoRA, Arrow, BD-LoRA, KaSA, MonteCLoRA).
``rank_pattern`` / ``alpha_pattern`` are taken (a rank and a scaling per module, as PEFT resolves
them), and so is ``use_rslora`` (``alpha / sqrt(r)``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from acb.errors import InvalidRequestError, InvalidRequestTypeError

FIELD = "lora"
_PREFIX = "base_model.model."  # PEFT's key prefix (PeftModel -> LoraModel -> the base model)
_KEY = re.compile(r"^(?P<path>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_NESTED = ".base_layer"  # PEFT nests one ParamWrapper per targeted parameter of a module

# PEFT options that change the forward acb runs: the config key, the value that is plain LoRA, and why
_REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("use_dora", False, "DoRA (weight-decomposed LoRA) rescales the base weight per column"),
    ("bias", "none", "adapter biases change the base layers' biases"),
    ("lora_bias", False, "a bias on lora_B"),
    ("modules_to_save", None, "modules_to_save replaces whole modules (full copies), not a low-rank update"),
    ("trainable_token_indices", None, "trainable tokens replace embedding rows"),
    ("layer_replication", None, "layer replication changes the model's layer stack"),
    ("use_qalora", False, "QALoRA pools the input"),
    ("alora_invocation_tokens", None, "activated LoRA (aLoRA) applies the adapter from an invocation on"),
    ("arrow_config", None, "Arrow routes among adapters per token"),
    ("use_bdlora", None, "BD-LoRA's block-diagonal factors"),
    ("kasa_config", None, "KaSA changes the base weight and inserts singular values"),
    ("monteclora_config", None, "MonteCLoRA samples the adapter"),
)


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One LoRA adapter, ready for the engine (plain tensors on the CPU, in the model's dtype).

    Attributes:
        name: the adapter's name (the caller's).
        rank: its largest ``r`` over its modules (at most the engine's ``max_lora_rank``).
        scaling: PEFT's scaling, ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).
        weights: base-model module path -> ``(A [r, in_features], B [out_features, r])``.
        uid: a content hash of its config and tensors (salts the prefix cache: no block is shared
            across adapters).
        nbytes: the bytes of its tensors.
        scalings: each module's own scaling where ``rank_pattern`` / ``alpha_pattern`` give it one
            (every module of ``weights`` is in it).
        params: ``target_parameters``: ``"<module path>.<parameter>"`` -> ``(lhs [E, m, r], rhs
            [E, r, n], scaling)`` for a 3-D parameter ``W [E, m, n]``: the weight PEFT's
            ``ParamWrapper`` runs the module with is ``torch.baddbmm(W, lhs, rhs, alpha=scaling)``.
        param_paths: for an update by PEFT's keys: each ``ParamWrapper``'s module path as its
            ``lora_A``/``lora_B`` keys name it (the engine model's path, with PEFT's
            ``.base_layer`` nesting when a module has several) -> ``(its key in params, whether the
            parameter is ``[E, in, out]``, the module's ``is_transposed``)``.
    """

    name: str
    rank: int
    scaling: float
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    uid: bytes
    nbytes: int
    scalings: Mapping[str, float]
    params: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]] = dataclasses.field(default_factory=dict)
    param_paths: Mapping[str, tuple[str, bool]] = dataclasses.field(default_factory=dict)


def adapter_uid(
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    scalings: Mapping[str, float],
    params: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]],
    dtype: torch.dtype,
) -> bytes:
    """A content hash of an adapter's scalings and tensors (:attr:`LoraAdapter.uid`)."""
    h = hashlib.sha256()
    meta: dict[str, Any] = {"scalings": dict(scalings), "dtype": str(dtype)}
    if params:  # (absent without target_parameters: the hash of a linears-only adapter is unchanged)
        meta["params"] = {k: v[2] for k, v in params.items()}
    h.update(json.dumps(meta, sort_keys=True).encode())
    for path, pair in [*weights.items(), *((k, (v[0], v[1])) for k, v in params.items())]:
        for t in pair:
            h.update(f"{path}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def _expert_factors(
    name: str, module: torch.nn.Module, path: str, a: torch.Tensor, b: torch.Tensor
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """PEFT's ``ParamWrapper.get_delta_factors`` for the 3-D parameter of ``module`` that
    ``lora_A [r*E, in]`` / ``lora_B [out, r*E]`` fit: ``(parameter name, lhs, rhs)``."""
    transposed = bool(getattr(module, "is_transposed", False))  # [E, in, out] (else [E, out, in])
    fits = []
    for pname, p in module.named_parameters(recurse=False):
        if p.dim() != 3:
            continue
        e = int(p.shape[0])
        out_f, in_f = (int(p.shape[2]), int(p.shape[1])) if transposed else (int(p.shape[1]), int(p.shape[2]))
        if a.dim() == 2 and b.dim() == 2 and a.shape[0] % e == 0 and tuple(a.shape) == (a.shape[0], in_f):
            if tuple(b.shape) == (out_f, a.shape[0]):
                fits.append((pname, e))
    if len(fits) != 1:
        raise _refuse(
            name,
            f"module {path!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} fit "
            + ("none" if not fits else f"several ({[f for f, _ in fits]})")
            + " of its 3-D parameters",
        )
    pname, e = fits[0]
    factors = dict(_expert_side(ab, t, e, transposed) for ab, t in (("A", a), ("B", b)))
    return pname, factors[0], factors[1]


def _expert_side(ab: str, t: torch.Tensor, e: int, transposed: bool) -> tuple[int, torch.Tensor]:
    """Which factor (0: lhs, 1: rhs) PEFT's ``lora_A [r*E, in]`` / ``lora_B [out, r*E]`` of a
    parameter of ``e`` experts gives, and its value (``ParamWrapper.get_delta_factors``)."""
    if ab == "A":
        wa = t.reshape(e, -1, t.shape[-1])  # [E, r, in]
        return (0, wa.transpose(-2, -1)) if transposed else (1, wa)
    wb = t.reshape(t.shape[0], -1, e).permute(2, 0, 1)  # [E, out, r]
    return (1, wb.transpose(-2, -1)) if transposed else (0, wb)


def expert_tensor_shape(adapter: LoraAdapter, path: str, ab: str) -> tuple[int, int]:
    """The shape of PEFT's ``lora_A`` (``[r*E, in]``) or ``lora_B`` (``[out, r*E]``) tensor of the
    ``ParamWrapper`` at ``path`` (a key of :attr:`LoraAdapter.param_paths`) in ``adapter``."""
    key, transposed = adapter.param_paths[path]
    lhs, rhs, _ = adapter.params[key]
    e, m, r = (int(d) for d in lhs.shape)
    n = int(rhs.shape[2])
    out_f, in_f = (n, m) if transposed else (m, n)
    return (e * r, in_f) if ab == "A" else (out_f, e * r)


def expert_factors_with(
    adapter: LoraAdapter,
    params: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]],
    path: str,
    ab: str,
    t: torch.Tensor,
) -> tuple[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``(key, (lhs, rhs, scaling))``: the entry of ``params`` (``adapter``'s, or an update's so
    far) for the ``ParamWrapper`` at ``path``, with the factor PEFT's ``lora_A``/``lora_B`` tensor
    ``t`` gives put in (of :func:`expert_tensor_shape`'s shape; the other factor and the scaling
    kept)."""
    key, transposed = adapter.param_paths[path]
    lhs, rhs, scale = params[key]
    side, value = _expert_side(ab, t, int(lhs.shape[0]), transposed)
    value = value.detach().to("cpu", lhs.dtype).contiguous()
    return key, ((value, rhs, scale) if side == 0 else (lhs, value, scale))


def lora_targets(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The linears an adapter may target: the ``nn.Linear`` modules of the model's decoder (its
    language model), by path in ``model.named_modules()``; the output head is not among them."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    decoder = None
    get = getattr(model, "get_decoder", None)
    if callable(get):
        try:
            decoder = get()
        except Exception:  # noqa: BLE001 - a model without one: every linear but the head
            decoder = None
    inside = {id(m) for m in decoder.modules()} if isinstance(decoder, torch.nn.Module) else None
    return {
        path: m
        for path, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head and (inside is None or id(m) in inside)
    }


def _refuse(name: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {name!r}: {why}", FIELD)


def _pattern_key(patterns: Mapping[str, Any], key: str) -> str | None:
    """PEFT's rule for ``rank_pattern`` / ``alpha_pattern``: the first pattern that matches the
    module's path at a dot boundary (``(.*\\.)?(pattern)$``)."""
    for p in patterns:
        if re.match(rf"(.*\.)?({p})$", key):
            return p
    return None


def _read_folder(folder: Path, name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg_path = folder / "adapter_config.json"
    if not folder.is_dir():
        raise _refuse(name, f"{str(folder)!r} is not a folder (a PEFT adapter folder or a peft.PeftModel is taken)")
    if not cfg_path.is_file():
        raise _refuse(name, f"{str(folder)!r} has no adapter_config.json: not a PEFT adapter folder")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise _refuse(name, f"{cfg_path} cannot be read as JSON ({exc})") from exc
    st, binf = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if st.is_file():
        from safetensors.torch import load_file

        tensors = load_file(str(st))
    elif binf.is_file():
        tensors = torch.load(str(binf), map_location="cpu", weights_only=True)
    else:
        raise _refuse(name, f"{str(folder)!r} has no adapter_model.safetensors or adapter_model.bin")
    return config, dict(tensors)


def _read_peft_model(
    source: Any, adapter_name: str | None, name: str
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    configs = source.peft_config
    if adapter_name is None:
        adapter_name = source.active_adapter
        if not isinstance(adapter_name, str):
            raise _refuse(name, f"the PeftModel has several active adapters ({adapter_name}); name one (adapter_name=)")
    if adapter_name not in configs:
        raise _refuse(name, f"the PeftModel has no adapter {adapter_name!r} (it has {sorted(configs)})")
    cfg = configs[adapter_name]
    config = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    tensors = {}
    for key, t in source.state_dict().items():
        m = _KEY.match(key)
        if m is not None and m["adapter"] == adapter_name:
            tensors[f"{m['path']}.lora_{m['ab']}.weight"] = t.detach()
        elif f".{adapter_name}." in key and "lora_" in key:
            tensors[key] = t.detach()  # (DoRA's magnitude, embeddings' factors: refused below)
    return config, tensors


def _plain(value: Any) -> Any:
    """A config value as JSON would hold it (sets and enums from a live LoraConfig)."""
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value, key=str)
    if hasattr(value, "value") and not isinstance(value, (int, float, str)):
        return value.value
    return value


def load_adapter(
    source: str | os.PathLike[str] | Any,
    model: torch.nn.Module,
    *,
    max_rank: int,
    name: str,
    adapter_name: str | None = None,
) -> LoraAdapter:
    """Read a LoRA adapter for ``model`` (the engine's base model).

    Args:
        source: a PEFT adapter folder (``adapter_config.json`` and ``adapter_model.safetensors`` or
            ``.bin``, as ``save_pretrained`` writes it), or a ``peft.PeftModel``.
        model: the engine's model; the adapter's modules are its ``nn.Linear`` modules by path.
        max_rank: the largest rank taken (the engine's ``max_lora_rank``).
        name: the adapter's name, for messages and the result.
        adapter_name: which of a ``PeftModel``'s adapters (default: its active one).

    Returns:
        The adapter, its tensors in the model's dtype on the CPU.

    Raises:
        InvalidRequestError: (field ``"lora"``) what is wrong and why: a folder without adapter
            files, a rank over ``max_rank``, a module the model does not have or that is not a
            linear of its decoder, a PEFT option acb does not run.
        InvalidRequestTypeError: ``source`` is neither a path nor a ``PeftModel``.
    """
    if isinstance(source, (str, os.PathLike)):
        config, tensors = _read_folder(Path(source), name)
    elif isinstance(getattr(source, "peft_config", None), Mapping):
        config, tensors = _read_peft_model(source, adapter_name, name)
    else:
        raise InvalidRequestTypeError(
            f"LoRA adapter {name!r}: expected a PEFT adapter folder (a path) or a peft.PeftModel, "
            f"got {type(source).__name__}",
            FIELD,
        )
    config = {k: _plain(v) for k, v in config.items()}
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise _refuse(name, f"it is a {kind} adapter; acb runs LoRA adapters only")
    for key, plain, why in _REFUSED:
        value = config.get(key, plain)
        if value != plain and not (plain is None and value in ([], {}, "", False)):
            raise _refuse(name, f"{key}={value!r} is not supported: {why}")

    targets = lora_targets(model)
    named = dict(model.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or m["adapter"] is not None:
            raise _refuse(name, f"tensor {key!r} is not a lora_A/lora_B weight of a linear layer")
        path = m["path"].removeprefix(_PREFIX)
        pairs.setdefault(path, {})[m["ab"]] = t  # (a nested ParamWrapper's: "<path>.base_layer...")
    if not pairs:
        raise _refuse(name, "it has no lora_A/lora_B weights")

    dtype = next(model.parameters()).dtype
    rslora = bool(config.get("use_rslora", False))
    r0, alpha0 = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    ranks = config.get("rank_pattern") or {}
    alphas = config.get("alpha_pattern") or {}
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scalings: dict[str, float] = {}
    params: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    param_paths: dict[str, tuple[str, bool]] = {}
    for path, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise _refuse(name, f"module {path!r} has lora_{''.join(ab)} but not both lora_A and lora_B")
        mpath = path
        while mpath.endswith(_NESTED):
            mpath = mpath.removesuffix(_NESTED)
        mod = named.get(mpath)
        if mod is not None and config.get("target_parameters") and mpath not in targets:
            if any(p.dim() == 3 for p in mod.parameters(recurse=False)):
                pname, lhs, rhs = _expert_factors(name, mod, mpath, ab["A"], ab["B"])
                key = f"{mpath}.{pname}"
                if key in params:
                    raise _refuse(name, f"parameter {key!r} has two pairs of lora_A/lora_B")
                r = int(lhs.shape[-1])
                if r > max_rank:
                    raise _refuse(name, f"rank {r} (parameter {key!r}) is over max_lora_rank={max_rank}")
                ak = _pattern_key(alphas, key)
                alpha = float(alphas[ak]) if ak is not None else alpha0
                rk = _pattern_key(ranks, key)
                want_r = int(ranks[rk]) if rk is not None else r0
                if want_r != r:
                    raise _refuse(name, f"parameter {key!r} has rank {r} but its config says {want_r}")
                params[key] = (
                    lhs.detach().to("cpu", dtype).contiguous(),
                    rhs.detach().to("cpu", dtype).contiguous(),
                    alpha / math.sqrt(r) if rslora else alpha / r,
                )
                param_paths[path] = (key, bool(getattr(mod, "is_transposed", False)))
                continue
        if path not in named:
            raise _refuse(name, f"target module {path!r} is not in the model ({type(model).__name__})")
        if path not in targets:
            raise _refuse(
                name,
                f"target module {path!r} is a {type(named[path]).__name__}: acb applies adapters to the "
                "nn.Linear layers of the model's decoder only"
                + (
                    " (it is a PEFT layer: give the engine the base model, not one with adapters injected)"
                    if hasattr(named[path], "base_layer")
                    else ""
                ),
            )
        a, b = ab["A"], ab["B"]
        lin = targets[path]
        r = int(a.shape[0])
        if (
            a.dim() != 2
            or b.dim() != 2
            or tuple(a.shape) != (r, lin.in_features)
            or tuple(b.shape) != (lin.out_features, r)
        ):
            raise _refuse(
                name,
                f"module {path!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit its "
                f"[{lin.out_features}, {lin.in_features}] weight",
            )
        if r > max_rank:
            raise _refuse(name, f"rank {r} (module {path!r}) is over max_lora_rank={max_rank}")
        rk = _pattern_key(ranks, path)
        want_r = int(ranks[rk]) if rk is not None else r0
        if want_r != r:
            raise _refuse(name, f"module {path!r} has rank {r} but its config says {want_r}")
        ak = _pattern_key(alphas, path)
        alpha = float(alphas[ak]) if ak is not None else alpha0
        scalings[path] = alpha / math.sqrt(r) if rslora else alpha / r
        weights[path] = (
            a.detach().to("cpu", dtype).contiguous(),
            b.detach().to("cpu", dtype).contiguous(),
        )

    uid = adapter_uid(weights, scalings, params, dtype)
    rank = max([int(a.shape[0]) for a, _ in weights.values()] + [int(v[0].shape[-1]) for v in params.values()])
    return LoraAdapter(
        name=name,
        rank=rank,
        scaling=alpha0 / math.sqrt(r0) if rslora else alpha0 / r0,
        weights=weights,
        uid=uid,
        nbytes=sum(a.nbytes + b.nbytes for a, b in weights.values())
        + sum(v[0].nbytes + v[1].nbytes for v in params.values()),
        scalings=scalings,
        params=params,
        param_paths=param_paths,
    )
