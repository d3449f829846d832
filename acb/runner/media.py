"""The model's own vision code inside engine steps: image embeddings, cached by content.

A vision-language model's forward embeds the prompt's tokens, runs its vision encoder on the
pixels, puts the image features where the image placeholder tokens are (each model has its own
way: newline tokens between rows, tiles, scaling...), computes its positions (Qwen's multimodal
RoPE: three rows of positions, from the image layout) and hands ``inputs_embeds`` and
``position_ids`` to its language model. acb runs exactly that code, once per request, and stops it
at the language model: :meth:`MediaEmbedder.capture` calls the whole model on the request's
prompt and images with the language model's forward replaced by one that records its arguments
and raises. What it keeps (an :class:`Embedded`):

* the rows of ``inputs_embeds`` that differ from the plain token embeddings (the image
  features, wherever the model put them), with their prompt positions;
* the language model's ``position_ids`` when they have more than one row (M-RoPE), and the
  offset of the positions after the prompt (``rope_deltas``: a generated token at index ``t``
  has position ``t + delta`` in every row, as the model's own decode computes it);
* the per-layer inputs it hands its language model where they are not the plain lookup of the
  prompt's tokens (Gemma 3n/4's, which it computes from ``input_ids``: an image token's are the
  pad token's), and Qwen3-VL's DeepStack rows.

The first call that embeds several requests' images together is checked against one call per
request: a model whose image tensors refer to each other (Molmo2's pooling indices into its
patches) is then embedded request by request.

The vision tower runs once per distinct image, whatever text comes with it: during a capture, the
model's own image-feature method (``get_image_features``, which every transformers VLM's forward
calls with the pixel values) is served by :class:`ImageFeatures`, which cuts the call into images
(by the processor outputs the method receives: pixel rows, ``image_grid_thw`` rows for Qwen's
flattened patches, InternVL's tiles, LLaVA-OneVision's per-sample image counts), keys each by the
hash of its tensors, runs only the images it has not cached, in one call, and joins the output back
in the order the model asked for. The forward's own code then puts the features where they go, as
before. A model whose calls cannot be cut (Molmo2) runs each call whole; one whose joined features
differ from its own (checked on the first joins) is left uncached. ``IMAGE_FEATURE_CACHE = False``
turns the cache off (``benchmarks/vlm_offline.py --shared`` measures both).

A step whose tokens include a request with images then runs the model on ``inputs_embeds``: the
token embeddings of the flattened batch, with each such request's rows for the positions this
step prefills put back (a chunk boundary may cut an image's tokens anywhere), and, for M-RoPE
models, its positions. Entries are keyed by the request's images and tokens; they stay while a
row uses them and, after, in an LRU, so that a recompute after a preemption, or the same prompt
again, does not run the model's vision code again. The entries and the cached image features share
one byte budget (``image_cache_bytes``): past it, the entries no row holds go first, then the
least recently used features.

Some models' image tokens also attend to their image's later tokens in prefill, on some layers
(Gemma 3 on every layer; Gemma 4 on its sliding ones, with ``use_bidirectional_attention="vision"``;
Molmo2 to every image of the prompt): :func:`media_attention` reads which from the masks every
VLM's own code builds, and a step's :class:`MediaBlocks` tell the attention backend each such
prefill segment's image blocks. A mask acb cannot follow refuses the model's images; each
request's own masks are checked again when its images are embedded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from collections.abc import Iterator

import torch

from acb.media import modality_token_id, placeholder_token_ids, type_spans
from acb.runner.batch_invariant_flag import is_on
from acb.runner.intercept import call_arguments

if TYPE_CHECKING:
    from acb.core.messages import SchedulerOutput
    from acb.core.request import Request
    from acb.media import MediaInputs
    from acb.runner.kv_cache import KVCache

logger = logging.getLogger(__name__)

__all__ = [
    "Embedded",
    "MediaAttention",
    "MediaBlocks",
    "MediaEmbedder",
    "ImageFeatures",
    "MediaFacts",
    "bidirectional_media",
    "bidirectional_layers",
    "media_attention",
    "takes_media",
]


def bidirectional_media(model: Any) -> bool:
    """The model's image tokens attend to each other both ways in prefill, on some of its layers
    (:func:`media_attention`)."""
    return bool(media_attention(model).layers)


# one language-model stand-in at a time: it replaces the decoder's forward on the model object
_STAND_IN = threading.Lock()


def _language_model_arguments(model: Any, features: ImageFeatures | None = None, **inputs: Any) -> dict[str, Any]:
    """The keyword arguments the model's own forward hands its language model for ``inputs`` (the
    language model is not run: its forward is replaced, for the call, by one that records them);
    with ``features``, the model's image-feature method is served from their cache for the call."""
    seen: dict[str, Any] = {}

    def stand_in(*args: Any, **kw: Any) -> Any:
        seen.update(kw)
        if args:
            seen.setdefault("inputs_embeds", args[0] if args[0] is not None else None)
        raise _Captured

    decoder = model.get_decoder()
    with _STAND_IN, features.serving() if features is not None else contextlib.nullcontext():
        decoder.forward = stand_in
        try:
            model(use_cache=False, **inputs)
        except _Captured:
            pass
        finally:
            del decoder.forward
    return seen


@dataclass(frozen=True)
class MediaAttention:
    """How a model's image tokens attend in prefill, as its own masks say (:func:`media_attention`)."""

    # the language model's layers on which an image block's tokens see each other both ways
    layers: frozenset[int] = frozenset()
    # all of a prompt's images make one block (an image also sees the later images, across the text
    # between them: Molmo2): acb runs such a prompt only when its image tokens are one run
    one_block: bool = False
    # why acb cannot run the model's images ("" when it can)
    refused: str = ""


@dataclass(frozen=True)
class MediaFacts:
    """What a submit needs to know of the model's images, fixed when the engine starts
    (:meth:`acb.runner.model_runner.ModelRunner.media_facts`): plain values, and pure functions of a
    request's processed tensors. The input processor reads them on the caller's thread, so no
    submit calls the runner (only the engine thread drives it)."""

    refused: str = ""  # why this engine cannot run images ("" when it can)
    row_bytes: int = 0  # one image token's embedding row on the device (hidden size x dtype size; 0: unknown)
    both_ways: bool = False  # an image's tokens attend to each other both ways on some layers
    one_block: bool = False  # all of a prompt's images make one such block (Molmo2)
    model: str = ""  # the model's class name, for the refusals

    def nbytes(self, images: MediaInputs) -> int:
        """About what a request's image embeddings take on the device: a row of the model's hidden
        size per image token (the pixel tensors' own size when the model names no token)."""
        if images.num_placeholders and self.row_bytes:
            return images.num_placeholders * self.row_bytes
        return images.nbytes

    def with_spans(self, images: MediaInputs) -> MediaInputs:
        """``images`` with the spans of the image blocks whose tokens attend to each other both
        ways, for a model that does that (a prefill chunk never ends inside one).

        Raises:
            InvalidRequestError: the model puts all of a prompt's images in one block, and this
                prompt's image tokens are more than one run (acb's attention cannot do that)."""
        if not self.both_ways:
            return images
        spans = type_spans(images.tensors)
        if self.one_block and len(spans) > 1:
            from acb.errors import InvalidRequestError

            raise InvalidRequestError(
                f"{self.model} lets every image token of a prompt see every other one, both ways, "
                f"across the text between them; acb's attention lets an image's tokens see their own image only, "
                f"so it runs this model's prompts with one image (one run of image tokens); this one has {len(spans)}",
                "prompt",
            )
        return dataclasses.replace(images, spans=spans)


# the probe prompt: text, an image's three placeholder tokens, text, another image's two, text
_PROBE = "tIIItIIt"


def media_attention(model: Any) -> MediaAttention:
    """Which of the language model's layers let an image's tokens attend to each other both ways in
    prefill (each also sees its image's later tokens, within the layer's window; everything else
    stays causal), as the model's own code decides: Gemma 3 on every layer; Gemma 4 on its
    sliding-window layers only, and only with ``use_bidirectional_attention="vision"`` in its text
    config; Molmo2 puts all of a prompt's images in one block.

    Every vision-language model is asked at start, whatever its code calls: its forward runs on a
    probe prompt (text, an image's placeholder tokens, text, another image, text; per-token types
    as processors mark them, 1 on image tokens; no pixels) up to its language model, and the masks
    it built (one per layer type, by its own attention implementation) are read whole. Where a
    token sees a later one is compared with what acb's attention can do: nothing (causal), each
    image's tokens their own image's, or every image token every image's (acb then runs prompts
    whose image tokens are one run). Any other mask (a text token that sees a later token, as a
    prefix-LM's prompt does) refuses the model's images, and so does a probe that fails; each
    request's own masks are checked again when its images are embedded (:meth:`MediaEmbedder.capture`)."""
    from acb.runner.tp_sync import tp_size_of

    if not takes_media(model) or tp_size_of(model) > 1:  # (images are not run under tensor parallel)
        return MediaAttention()
    config = model.config
    text = config.get_text_config()
    image = modality_token_id(config, "image")
    assert image is not None
    specials = {
        v
        for c in (config, text)
        for k, v in vars(c).items()
        if isinstance(v, int) and (k.endswith("token_id") or k.endswith("token_index"))
    }
    word = next(i for i in range(3, text.vocab_size) if i not in specials)
    ids = torch.tensor([[image if c == "I" else word for c in _PROBE]], device=next(model.parameters()).device)
    types = (ids == image).long()
    params = inspect.signature(type(model).forward).parameters
    inputs: dict[str, Any] = {name: types for name in params if name.endswith("token_type_ids")}
    name = type(model).__name__
    try:
        with torch.no_grad():
            masks = _language_model_arguments(model, input_ids=ids, attention_mask=torch.ones_like(ids), **inputs)
    except Exception as exc:  # noqa: BLE001 - the model's own forward: any failure is the reason
        return MediaAttention(
            refused=f"acb cannot tell how {name}'s image tokens attend to each other: its forward on a probe "
            f"prompt failed ({type(exc).__name__}: {exc})"
        )
    mask = masks.get("attention_mask")
    n = int(text.num_hidden_layers)
    layer_types = list(getattr(text, "layer_types", None) or ["full_attention"] * n)
    image_pos = types[0].bool()
    run = _runs(image_pos)
    later = torch.ones(len(_PROBE), len(_PROBE), dtype=torch.bool, device=ids.device).triu(1)
    own = later & (run[:, None] == run[None, :]) & (run[:, None] >= 0)  # each image its own later tokens
    every = later & image_pos[:, None] & image_pos[None, :]  # every image token every later one
    layers, one_block = set(), False
    for i, kind in enumerate(layer_types[:n]):
        m = mask.get(kind) if isinstance(mask, dict) else mask
        sees = _sees(m, 0, 0, len(_PROBE), ids.device)
        if sees is None:
            return MediaAttention(refused=f"acb cannot read {name}'s {kind} mask ({type(m).__name__})")
        ahead = sees & later
        if not ahead.any():
            continue
        if torch.equal(ahead, own):
            layers.add(i)
        elif torch.equal(ahead, every):
            layers.add(i)
            one_block = True
        else:
            text_too = bool((ahead & ~(image_pos[:, None] & image_pos[None, :])).any())
            return MediaAttention(
                refused=f"{name}'s {kind} layers let "
                + (
                    "text tokens see later tokens (a prompt that attends both ways, as a prefix-LM's does)"
                    if text_too
                    else "image tokens see later image tokens in a way other than per image or all images together"
                )
                + ", and acb's attention lets a token see later ones only within its own image"
            )
    return MediaAttention(frozenset(layers), one_block)


def bidirectional_layers(model: Any) -> frozenset[int]:
    """The layers of :func:`media_attention`.

    Raises:
        UnsupportedModelError: acb cannot run the model's images (the reason)."""
    from acb.errors import UnsupportedModelError

    found = media_attention(model)
    if found.refused:
        raise UnsupportedModelError(found.refused)
    return found.layers


def _runs(flags: torch.Tensor) -> torch.Tensor:
    """Each position's run of consecutive True ``flags`` (0, 1, ...), -1 where False."""
    starts = flags & ~torch.cat([flags.new_zeros(1), flags[:-1]])
    return torch.where(flags, starts.long().cumsum(0) - 1, -1)


def _sees(mask: Any, b: int, lo: int, n: int, device: torch.device) -> torch.Tensor | None:
    """``[n, n]`` bool: whether query ``lo + i`` sees key ``lo + j`` in batch row ``b`` of a mask
    the model's attention implementation built: a boolean or additive 4-D tensor, flex attention's
    block mask, or None or a 2-D padding mask (causal: the implementation's own default). None
    when the mask is of another kind."""
    mod = getattr(mask, "mask_mod", None)
    idx = torch.arange(lo, lo + n, device=device)
    if mod is not None:  # flex attention's BlockMask: its mask function, on every pair at once
        d = mask.kv_indices.device
        try:
            out = mod(torch.tensor(b, device=d), torch.tensor(0, device=d), idx.to(d)[:, None], idx.to(d)[None, :])
            return torch.as_tensor(out, device=d).bool().expand(n, n).to(device)
        except Exception:  # noqa: BLE001 - a mask function that takes single indices only
            return None
    if mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        return idx[None, :] <= idx[:, None]
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    value = mask[min(b, mask.shape[0] - 1), 0, lo : lo + n, lo : lo + n]  # (a batch dimension may be broadcast)
    return (value if value.dtype == torch.bool else value == 0).to(device)


def takes_media(model: Any) -> bool:
    """A vision-language model: an image placeholder token and a vision sub-config."""
    config = model.config
    return modality_token_id(config, "image") is not None and getattr(config, "vision_config", None) is not None


class _Captured(Exception):
    """Raised by the language model's stand-in once it has recorded its arguments."""


@dataclass
class Embedded:
    """What the model's own code made of one request's prompt and images (see the module docstring)."""

    positions: torch.Tensor  # [K] long (device): prompt positions whose embedding is not the token's
    rows: torch.Tensor  # [K, D] (device): the embeddings there
    prompt_len: int
    mrope: torch.Tensor | None  # [R, L] long (device): the language model's position ids, or None
    delta: int  # positions after the prompt: index + delta (in the rotary rows)
    # Qwen3-VL's DeepStack: vision features the language model adds to the hidden states at these
    # prompt positions after its first layers ([K] long; [layers, K, D]), or None
    deep_positions: torch.Tensor | None = None
    deep_rows: torch.Tensor | None = None
    # models whose image tokens see each other both ways: each prompt position's image block (-1: none)
    groups: torch.Tensor | None = None
    # Gemma 3n/4's per-layer inputs where the model's own code made other ones than the plain
    # lookup of the prompt's tokens gives ([K] long; [K, layers, D']), or None
    layer_positions: torch.Tensor | None = None
    layer_rows: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        parts = (self.mrope, self.deep_positions, self.deep_rows, self.layer_positions, self.layer_rows)
        extra = [t for t in parts if t is not None]
        return int(self.rows.nbytes + self.positions.nbytes + sum(t.nbytes for t in extra))


@dataclass
class MediaBlocks:
    """A step's prefill segments whose image tokens attend to their whole image, and the model's
    layers where they do (:func:`bidirectional_layers`; the others are causal). The attention
    backend's prefill masks read them (``acb.runner.attention.torch_backend``)."""

    segments: dict[int, torch.Tensor]  # flattened start -> each context position's image block (-1: text)
    layers: frozenset[int]  # the model's layer indices
    _cache_layers: frozenset[int] | None = None

    def on(self, cache: KVCache, layer: int) -> bool:
        """Whether the cache layer ``layer``'s attention takes the blocks (a KV-shared layer reads
        the cache layer of an earlier layer of its own type)."""
        if self._cache_layers is None:
            self._cache_layers = frozenset(cache.layer_of(i) for i in self.layers)
        return layer in self._cache_layers


# the per-image cache of the model's image-feature method (False: every capture runs the vision
# tower on all its requests' images, as before it; benchmarks/vlm_shared_image.py's A/B)
IMAGE_FEATURE_CACHE = True

# the vision tower's own outputs, which a model's forward does not read once the feature method
# has made its features (its ``pooler_output``; Qwen3-VL's ``deepstack_features`` too): not kept
_RAW_FIELDS = frozenset({"last_hidden_state", "hidden_states", "attentions"})


class _Uncut(Exception):
    """A call's images or an output that the cache cannot cut per image."""


def _spans(sizes: list[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for n in sizes:
        out.append((at, at + n))
        at += n
    return out


@dataclass
class _Units:
    """A call of the feature method, cut into units the cache keys: an image (its rows of every
    tensor argument), or a processor's sample of images when a per-sample count says how many
    (LLaVA-OneVision's ``batch_num_images``: an image's features depend on its sample's count)."""

    named: dict[str, Any]  # the call's arguments by name
    rows: dict[str, list[tuple[int, int]]]  # tensor argument -> each unit's rows
    items: list[int]  # each unit's images (the output's entries it owns)
    keys: list[bytes]  # each unit's content hash

    def arguments(self, units: list[int]) -> dict[str, Any]:
        """The call's arguments for ``units`` only (in that order)."""
        out = dict(self.named)
        for name, spans in self.rows.items():
            t = self.named[name]
            idx = [i for u in units for i in range(*spans[u])]
            out[name] = t.index_select(0, torch.tensor(idx, dtype=torch.long, device=t.device))
        return out


def _units(named: dict[str, Any], twins: dict[int, tuple[torch.Tensor, torch.Tensor]], salt: bytes) -> _Units:
    """How a call's arguments split into units, from the processor outputs the model hands its
    feature method: its first argument (the pixel values) has a row per image, or per tile when
    each image's tiles are rows too (InternVL: a tile is then a unit), or is flattened patches whose
    per-image counts are the rows' products of an integer grid argument (Qwen's ``image_grid_thw``);
    every other tensor argument has a row per image (a grid's, sizes', a mask's) or is a per-sample
    count. Anything else raises :class:`_Uncut` (its calls are run whole, uncached)."""
    names = list(named)
    if not names:
        raise _Uncut("no arguments")
    first = names[0]
    tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if first not in tensors:
        raise _Uncut("its first argument is not a tensor")
    # each tensor's host copy (the capture's own inputs: no copy from the device for them)
    host = {}
    for k, v in tensors.items():
        twin = twins.get(id(v))
        host[k] = twin[1] if twin is not None and twin[0] is v else v.detach().cpu()
    pixels = host[first]
    rows: dict[str, list[tuple[int, int]]] = {}
    if pixels.dim() == 2:  # flattened patches: an integer grid argument gives each image's rows
        grid = next(
            (
                k
                for k, t in host.items()
                if k != first
                and t.dim() == 2
                and not t.is_floating_point()
                and int(t.prod(-1).sum()) == pixels.shape[0]
            ),
            None,
        )
        if grid is None:
            raise _Uncut("flattened pixel rows without a grid that counts them")
        sizes = [int(x) for x in host[grid].prod(-1).tolist()]
        items = [1] * len(sizes)
        rows[first] = _spans(sizes)
        for k, t in host.items():
            if k != first:
                if t.shape[0] != len(sizes):
                    raise _Uncut(f"{k} has {t.shape[0]} rows for {len(sizes)} images")
                rows[k] = _spans(items)
    else:
        n = pixels.shape[0]
        counts = None
        for k, t in host.items():
            if t.shape[0] == n:
                continue
            if (
                counts is None
                and t.dim() == 1
                and not t.is_floating_point()
                and int(t.sum()) == n
                and bool((t >= 1).all())
            ):
                counts = k
                continue
            raise _Uncut(f"{k} has {t.shape[0]} rows for {n} images")
        items = [int(x) for x in host[counts].tolist()] if counts is not None else [1] * n
        for k in host:
            rows[k] = _spans([1] * len(items)) if k == counts else _spans(items)
    keys = []
    for u in range(len(items)):
        h = hashlib.sha256(b"acb-image-features")
        h.update(salt)
        for k in sorted(named):
            h.update(k.encode())
            if k in rows:
                a, b = rows[k][u]
                c = host[k][a:b].contiguous()
                h.update(f"{c.dtype}{tuple(c.shape)}".encode())
                if c.numel():
                    h.update(cast(Any, c.view(torch.uint8).numpy()))  # (a buffer: not copied)
            else:
                v = named[k]
                h.update(repr(v.tolist() if isinstance(v, torch.Tensor) else v).encode())
        keys.append(h.digest())
    return _Units(named, rows, items, keys)


def _cut(value: Any, items: list[int]) -> tuple[Any, list[Any]]:
    """``value`` (a field of the feature method's output) cut per unit: its kind (how the parts
    join back: ``"rows"`` of a tensor, ``("seq", type)`` entries of a tuple or list, ``("nest",
    type, kinds)`` a tuple or list of those, as DeepStack's per-layer tuples) and each unit's part;
    a tensor's rows or a sequence's entries are per image, or per unit."""
    n_units, n_items = len(items), sum(items)

    def spans(length: int) -> list[tuple[int, int]]:
        if length == n_items:
            return _spans(items)
        if length == n_units:
            return _spans([1] * n_units)
        raise _Uncut(f"{length} entries for {n_units} units")

    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise _Uncut("a scalar")
        return "rows", [value[a:b].clone() for a, b in spans(value.shape[0])]
    if isinstance(value, (tuple, list)) and value:
        if all(isinstance(v, torch.Tensor) for v in value):
            return ("seq", type(value)), [[v.clone() for v in value[a:b]] for a, b in spans(len(value))]
        if all(isinstance(v, (tuple, list)) for v in value):
            cuts = [_cut(v, items) for v in value]
            return ("nest", type(value), tuple(k for k, _ in cuts)), [
                tuple(parts[u] for _, parts in cuts) for u in range(n_units)
            ]
    raise _Uncut(f"a {type(value).__name__}")


def _join(kind: Any, parts: list[Any]) -> Any:
    """The parts of :func:`_cut`, joined back (in the order given)."""
    if kind == "rows":
        return torch.cat(parts)
    if kind[0] == "seq":
        return kind[1](v for p in parts for v in p)
    return kind[1](_join(k, [p[i] for p in parts]) for i, k in enumerate(kind[2]))


def _part_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.nbytes)
    if isinstance(value, (tuple, list)):
        return sum(_part_bytes(v) for v in value)
    return 0


@dataclass
class _Part:
    """One unit's share of the feature method's output."""

    layout: tuple  # the output's class and each kept field's kind (all parts joined have one)
    values: dict[str, Any]  # field -> the unit's part
    nbytes: int
    multi: bool  # cut from a call that computed several units


def _cut_output(out: Any, items: list[int]) -> tuple[tuple, list[dict[str, Any]]]:
    """The feature method's output (a ``ModelOutput``) cut per unit: its layout and each unit's
    fields (the tower's raw outputs left out)."""
    if not dataclasses.is_dataclass(out) or isinstance(out, type):
        raise _Uncut(f"its output is a {type(out).__name__}")
    fields: list[tuple[str, Any]] = []
    parts: list[dict[str, Any]] = [{} for _ in items]
    for f in dataclasses.fields(out):
        value = getattr(out, f.name, None)
        if value is None or f.name in _RAW_FIELDS:
            continue
        kind, cut = _cut(value, items)
        fields.append((f.name, kind))
        for d, p in zip(parts, cut):
            d[f.name] = p
    if not fields:
        raise _Uncut("its output has no features")
    return (type(out), tuple(fields)), parts


class ImageFeatures:
    """The model's own image-feature method, its outputs cached per image by content.

    The method is found by what the model's code calls: every module whose class defines
    ``get_image_features`` (the method each transformers VLM's forward calls with the pixel
    values; the outer model's delegates to the inner one's) is served, during a capture, by
    :meth:`_serve`: the call is cut into units (:func:`_units`: an image, a tile, or a sample's
    images), each keyed by the SHA-256 of its rows of the tensor arguments and the other arguments;
    the units not cached go through the method in one call, their outputs are cut per unit
    (:func:`_cut_output`) and kept, and the call's output is joined from the parts in the order the
    model asked for them. A call whose units are all new and distinct gets the method's own output.
    A call the cache cannot cut (Molmo2's pooling indices point across images) runs whole, uncached.
    The first joined outputs are checked against the model's own (:meth:`MediaEmbedder._capture`);
    a model whose joined output differs is left uncached."""

    def __init__(self, model: Any) -> None:
        self.modules = [m for m in model.modules() if callable(getattr(type(m), "get_image_features", None))]
        self.on = IMAGE_FEATURE_CACHE and bool(self.modules)
        self.why_off = "" if self.on else ("switched off" if self.modules else "no get_image_features")
        self.entries: OrderedDict[bytes, _Part] = OrderedDict()  # LRU
        self.nbytes = 0
        self.generation = 0  # the weights' (forget moves it on): part of every key
        # host twins of the capture's device tensors (id -> (device tensor, host tensor))
        self.twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.verified: set[str] = set()  # kinds of joined outputs found equal to the model's own
        self.traits: set[str] = set()  # the kinds of joined outputs the current capture got
        self._inside = False
        self.tower_calls = 0  # calls of the model's feature method (the vision tower ran)
        self.computed = 0  # units the method computed
        self.hits = 0  # units served from the cache
        self.uncut_calls = 0  # calls run whole, not cut per image
        self._alone: dict[bytes, _Part] = {}  # the parts the mode's one-image calls just made

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """The feature method of every module that defines one served by the cache (an instance
        attribute over the class's method, for the call)."""
        for m in self.modules:
            m.get_image_features = functools.partial(self._call, m)
        try:
            yield
        finally:
            for m in self.modules:
                vars(m).pop("get_image_features", None)

    def unverified(self) -> bool:
        """The current capture got a joined output of a kind not yet checked against the model's own."""
        return not self.traits <= self.verified

    def turn_off(self, why: str, model: Any) -> None:
        self.on, self.why_off = False, why
        self.clear()
        logger.info("%s: image features are not cached per image (%s)", type(model).__name__, why)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def forget(self) -> None:
        """The weights changed: nothing cached is served again."""
        self.generation += 1
        self.clear()

    def evict_one(self) -> bool:
        """Drop the least recently used entry (False: none)."""
        if not self.entries:
            return False
        _, old = self.entries.popitem(last=False)
        self.nbytes -= old.nbytes
        return True

    def _call(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        fn = type(module).get_image_features
        if self._inside or not self.on:  # (an outer model's method calling the inner one's)
            return fn(module, *args, **kwargs)
        self._inside = True
        try:
            return self._serve(module, fn, args, kwargs)
        finally:
            self._inside = False

    def _serve_one(self, module: Any, fn: Any, units: _Units, u: int) -> None:
        """Unit ``u`` through the method alone, its part kept (the batch-invariant mode: an
        image's features then never depend on the other images of the call)."""
        out = fn(module, **units.arguments([u]))
        self.tower_calls += 1
        self.computed += 1
        layout, parts = _cut_output(out, [units.items[u]])
        part = _Part(layout, parts[0], _part_bytes(list(parts[0].values())), False)
        self._alone[units.keys[u]] = part
        self.entries[units.keys[u]] = part
        self.nbytes += part.nbytes

    def _serve(self, module: Any, fn: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        sig = inspect.signature(fn)
        try:
            bound = sig.bind(module, *args, **kwargs).arguments
            if any(sig.parameters[k].kind is inspect.Parameter.VAR_POSITIONAL and v for k, v in bound.items()):
                raise _Uncut("positional arguments past its named ones")
            units = _units(call_arguments(sig, module, args, kwargs), self.twins, self.generation.to_bytes(8, "little"))
        except _Uncut:
            self.uncut_calls += 1
            self.tower_calls += 1
            return fn(module, *args, **kwargs)
        keys = units.keys
        n = len(keys)
        missing: list[int] = []  # the first unit of each key not cached
        for u, k in enumerate(keys):
            if k not in self.entries and all(keys[v] != k for v in missing):
                missing.append(u)
        fresh: dict[bytes, _Part] = {}
        out = None
        alone = 0
        if missing and is_on() and len(missing) > 1:  # the batch-invariant mode: an image a call
            for u in missing:
                self._serve_one(module, fn, units, u)
            missing, alone = [], len(missing)
        if missing:
            whole = len(missing) == n
            out = fn(module, *args, **kwargs) if whole else fn(module, **units.arguments(missing))
            self.tower_calls += 1
            self.computed += len(missing)
            try:
                layout, parts = _cut_output(out, [units.items[u] for u in missing])
            except _Uncut as exc:
                self.turn_off(f"its image-feature output cannot be cut per image: {exc}", module)
                return out if whole else fn(module, *args, **kwargs)
            for u, values in zip(missing, parts):
                part = _Part(layout, values, _part_bytes(list(values.values())), len(missing) > 1)
                fresh[keys[u]] = part
                self.entries[keys[u]] = part
                self.nbytes += part.nbytes
            if whole:  # (every unit new and distinct: the method's own output, as it is)
                return out
        fresh.update(self._alone)
        self._alone.clear()
        got = []
        for k in keys:
            if k not in fresh:
                self.entries.move_to_end(k)
            got.append(fresh[k] if k in fresh else self.entries[k])
        self.hits += n - len(missing) - alone
        layout = got[0].layout
        if any(p.layout != layout for p in got):  # (outputs of other shapes: the whole call, uncached)
            self.tower_calls += 1
            return fn(module, *args, **kwargs)
        self.traits.add("join" if n > 1 else "one")
        if any(p.multi for p in got):
            self.traits.add("split")
        cls, fields = layout
        return cls(**{name: _join(kind, [p.values[name] for p in got]) for name, kind in fields})


class MediaEmbedder:
    """Runs the model's own vision code for the requests of a step (see the module docstring)."""

    def __init__(self, model: Any, max_bytes: int) -> None:
        self.model = model
        self.embed = model.get_input_embeddings()
        self.decoder = model.get_decoder()
        self.device = next(model.parameters()).device
        self.max_bytes = max_bytes
        self._used: dict[bytes, Embedded] = {}  # entries a row holds
        self._rows: dict[int, bytes] = {}  # row -> its entry's key
        self._free: OrderedDict[bytes, Embedded] = OrderedDict()  # entries no row holds (LRU)
        self._free_bytes = 0
        # the weights' generation, part of every key made from now on (forget_unused moves it on),
        # and the keys rows still held then: made by the old weights, dropped once no row holds them
        self.generation = 0
        self._stale: set[bytes] = set()
        self.mrope = False  # the model's positions have several rows (found at the first capture)
        self._lm_kwargs: dict[str, Any] = {}  # the step's extra language-model arguments
        self._model_kwargs: dict[str, Any] = {}  # the step's extra arguments of the model's own forward
        # how image tokens attend (the layers on which an image's tokens see each other both ways)
        found = media_attention(model)
        self.layers = found.layers
        self.bidirectional = bool(self.layers)
        self.one_block = found.one_block
        self.refused = found.refused
        text = model.config.get_text_config()
        kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * int(text.num_hidden_layers))
        self._kinds = set(kinds)
        self._kinds_both_ways = {kinds[i] for i in self.layers if i < len(kinds)}
        # Gemma 3n/4's per-layer inputs (token-identity embeddings the language model adds in every
        # layer): its own code computes them from input_ids, so a forward on inputs_embeds is handed
        # them: the decoder's own lookup for the step's tokens, each image request's rows as its
        # model made them (an image token's are another token's)
        lookup = getattr(self.decoder, "get_per_layer_inputs", None)
        self._per_layer = (
            lookup
            if callable(lookup)
            and bool(getattr(text, "hidden_size_per_layer_input", None))
            and "per_layer_inputs" in inspect.signature(type(model).forward).parameters
            else None
        )
        device = next(model.parameters()).device
        self._placeholders = torch.tensor(sorted(placeholder_token_ids(model.config)), dtype=torch.long, device=device)
        self._pad_token = int(getattr(text, "pad_token_id", None) or 0)
        # whether the model's own code makes of several requests' images together what it makes of
        # each alone (None: not tried yet): its image tensors may refer to each other (Molmo2's
        # pooling indices into its pixel patches), so the first batch is checked one by one
        self._batches: bool | None = None
        # the step's prefill segments whose image blocks attend both ways (None: none)
        self.step_groups: MediaBlocks | None = None
        # the model's image-feature method, its outputs cached per image (in this budget too)
        self.features = ImageFeatures(model)
        self.encoder_s = 0.0  # seconds in the model's own vision code (figures)
        self.captures = 0  # requests whose images the model's own code ran on
        self.capture_calls = 0  # calls of it (several requests of a step go together)

    # lifecycle ---------------------------------------------------------------
    def release(self, row: int) -> None:
        """The row's request is gone (finished, preempted, freed): its entry becomes reusable."""
        key = self._rows.pop(row, None)
        if key is None or key in self._rows.values():
            return
        entry = self._used.pop(key, None)
        if entry is None:
            return
        if key in self._stale:
            self._stale.discard(key)
            return
        self._free[key] = entry
        self._free_bytes += entry.nbytes
        self._evict()

    def _evict(self) -> None:
        """Within the byte budget: the entries no row holds go first (least recently used first),
        then cached image features; the rows' own entries stay."""
        while self.nbytes() > self.max_bytes and self._free:
            _, old = self._free.popitem(last=False)
            self._free_bytes -= old.nbytes
        while self.nbytes() > self.max_bytes and self.features.evict_one():
            pass

    def clear(self) -> None:
        self._stale.clear()
        self._used.clear()
        self._rows.clear()
        self._free.clear()
        self._free_bytes = 0
        self.features.clear()

    def forget_unused(self) -> None:
        """The weights changed: no request from now on is given an entry the old weights made.
        Those no row holds are dropped; a row's own stays with it (as its K/V does) and is dropped
        when the row lets it go; keys made from now on are of the next generation."""
        self.generation += 1
        self._stale.update(self._used)
        self._free.clear()
        self._free_bytes = 0
        self.features.forget()

    def nbytes(self) -> int:
        """The bytes of the entries (rows' and cached) and of the cached image features: within
        ``image_cache_bytes`` but for the entries rows hold."""
        return sum(e.nbytes for e in self._used.values()) + self._free_bytes + self.features.nbytes

    def key(self, req: Request) -> bytes:
        """The request's images and prompt tokens, and the weights' generation (computed once per
        request)."""
        if req.images_key is None:
            images = req.media
            assert images is not None
            h = hashlib.sha256(images.key)
            h.update(self.generation.to_bytes(8, "little"))
            h.update(repr(req.token_ids[: req.prompt_len]).encode())
            req.images_key = h.digest()
        return req.images_key

    def entry(self, req: Request) -> Embedded:
        """The request's embeddings: cached, or made now by the model's own code."""
        key = self.key(req)
        entry = self._used.get(key)
        if entry is None:
            entry = self._free.pop(key, None)
            if entry is not None:
                self._free_bytes -= entry.nbytes
            else:
                entry = self.capture(req)
            self._used[key] = entry
        self._rows[req.row] = key
        return entry

    # the model's own code ------------------------------------------------------
    def capture(self, req: Request) -> Embedded:
        """Run the model on the request's prompt and images up to its language model."""
        return self.capture_many([req])[0]

    def capture_many(self, reqs: list[Request]) -> list[Embedded]:
        """:meth:`capture` for several requests in one call of the model's own code, as the
        padded batch its processor would make of them (prompts left-padded, per-token types
        padded alike, image tensors concatenated), so that the vision encoder runs once for
        their images together; requests whose image tensors do not concatenate (other shapes
        past the first dimension) go one by one."""
        import time

        t0 = time.perf_counter()
        groups: dict[tuple, list[Request]] = {}
        for req in reqs:
            assert req.media is not None
            sig = tuple(
                (k, tuple(v.shape[1:]) if not k.endswith("token_type_ids") else ())
                for k, v in sorted(req.media.tensors.items())
                if isinstance(v, torch.Tensor)
            )
            groups.setdefault(sig, []).append(req)
        made: dict[int, Embedded] = {}
        for group in groups.values():
            one_by_one = self._batches is False or is_on()  # (the batch-invariant mode: each request alone)
            parts = [group] if len(group) == 1 or not one_by_one else [[r] for r in group]
            for part in parts:
                entries = self._capture(part)
                if len(part) > 1 and self._batches is None:
                    alone = [self._capture_as([r], uncached=True)[0] for r in part]
                    self._batches = all(_same(a, b) for a, b in zip(entries, alone))
                    if not self._batches:
                        logger.info(
                            "%s's own code makes other image embeddings of several requests together than of "
                            "each alone: acb runs it one request at a time",
                            type(self.model).__name__,
                        )
                        entries = alone
                        if self.features.on:  # (its images refer to each other: not cut per image)
                            self.features.turn_off("its image tensors refer to each other", self.model)
                made.update(zip(map(id, part), entries))
                self.captures += len(part)
                self.capture_calls += 1
        self.encoder_s += time.perf_counter() - t0
        return [made[id(r)] for r in reqs]

    def _capture(self, reqs: list[Request]) -> list[Embedded]:
        out = self._capture_as(reqs)
        self._evict()
        return out

    def _capture_as(self, reqs: list[Request], uncached: bool = False) -> list[Embedded]:
        """The requests' entries, from one call of the model's own code on them (``uncached``: its
        image-feature method not served from the cache). A capture whose image features were
        joined from cached parts in a way not yet checked is made again plain and compared; a
        model for which the two differ (or whose forward fails on joined features) is left
        uncached from then on."""
        features = None if uncached or not self.features.on else self.features
        prompts = [req.token_ids[: req.prompt_len] for req in reqs]
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(reqs), width), dtype=torch.long)
        attn = torch.zeros_like(ids)
        for b, p in enumerate(prompts):
            ids[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[b, width - len(p) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        kwargs: dict[str, Any] = {}
        twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        first = reqs[0].media
        assert first is not None
        for name, value in first.tensors.items():
            values = [r.media.tensors[name] for r in reqs if r.media is not None]
            if not isinstance(value, torch.Tensor):
                kwargs[name] = value
            elif name.endswith("token_type_ids"):  # per token: over each prompt, left-padded (0: text)
                rows = [v.reshape(-1)[: len(p)] for v, p in zip(values, prompts)]
                kwargs[name] = torch.stack(
                    [torch.nn.functional.pad(r, (width - len(p), len(p) - r.shape[0])) for r, p in zip(rows, prompts)]
                ).to(self.device)
            else:  # images (or their patches, sizes, counts) along the first dimension
                host = torch.cat(values)
                kwargs[name] = host.to(self.device)
                twins[id(kwargs[name])] = (kwargs[name], host)
        if features is not None:
            features.twins, features.traits = twins, set()
            try:
                seen = _language_model_arguments(self.model, features, input_ids=ids, attention_mask=attn, **kwargs)
            except Exception as exc:
                if not features.unverified():
                    raise
                features.turn_off(
                    f"its forward failed on joined image features ({type(exc).__name__}: {exc})", self.model
                )
                return self._capture_as(reqs, uncached=True)
            finally:
                features.twins = {}
            check = features.unverified()
            traits = set(features.traits)
        else:
            seen = _language_model_arguments(self.model, input_ids=ids, attention_mask=attn, **kwargs)
            check = False
        embeds = seen.get("inputs_embeds")
        if embeds is None:
            raise RuntimeError(
                f"{type(self.model).__name__} did not hand inputs_embeds to its language model "
                f"({type(self.decoder).__name__}); acb cannot run its images"
            )
        plain = self.embed(ids)
        layers = seen.get("per_layer_inputs") if self._per_layer is not None else None
        plain_layers = self._plain_layers(ids) if isinstance(layers, torch.Tensor) else None
        pos = seen.get("position_ids")
        mask, deep = seen.get("visual_pos_masks"), seen.get("deepstack_visual_embeds")
        deep_split = None
        if isinstance(mask, torch.Tensor) and deep:  # DeepStack rows: row-major over the padded batch
            counts = mask.sum(dim=1).tolist()
            deep_split = [torch.stack(parts) for parts in zip(*(d.split(counts) for d in deep))]
        out = []
        for b, (req, prompt) in enumerate(zip(reqs, prompts)):
            lo = width - len(prompt)
            e = embeds[b, lo:]  # [L, D]
            differ = (e != plain[b, lo:]).any(-1).nonzero()[:, 0]
            mrope, delta = None, 0
            if isinstance(pos, torch.Tensor) and pos.dim() == 3:  # [R, B, L]: multimodal rotary positions
                mrope = pos[:, b, lo:].to(torch.long).clone()
                # (Qwen's four rows: text positions for the mask, then the three rotary ones)
                delta = int(mrope[-3:].max()) + 1 - len(prompt)
            deep_positions = deep_rows = None
            if deep_split is not None and isinstance(mask, torch.Tensor):
                deep_positions = mask[b, lo:].nonzero()[:, 0]
                deep_rows = deep_split[b].to(e.dtype).clone()
            images = req.media
            assert images is not None
            blocks = None
            if images.spans:
                blocks = torch.full((len(prompt),), -1, dtype=torch.long, device=self.device)
                for k, (a, z) in enumerate(images.spans):
                    blocks[a:z] = k
            self.mrope = self.mrope or mrope is not None
            self._check_mask(seen.get("attention_mask"), b, lo, len(prompt), blocks)
            layer_positions = layer_rows = None
            if layers is not None and plain_layers is not None:
                got = layers[b, lo:]  # [L, layers, D']
                layer_positions = (got != plain_layers[b, lo:]).flatten(1).any(-1).nonzero()[:, 0]
                layer_rows = got[layer_positions].clone()
            out.append(
                Embedded(
                    differ,
                    e[differ].clone(),
                    len(prompt),
                    mrope,
                    delta,
                    deep_positions,
                    deep_rows,
                    blocks,
                    layer_positions,
                    layer_rows,
                )
            )
        if check:  # image features joined from cached parts: the same as the model's own?
            own = self._capture_as(reqs, uncached=True)
            if all(_same(a, b) for a, b in zip(out, own)):
                # (a join of several units checked covers the join of one)
                self.features.verified |= traits | ({"one"} if "join" in traits else set())
            else:
                self.features.turn_off("features joined from cached parts differ from its own", self.model)
                out = own
        return out

    def _check_mask(self, mask: Any, b: int, lo: int, n: int, blocks: torch.Tensor | None) -> None:
        """The masks the model's own code built for this request (row ``b`` of the capture's batch,
        its prompt from ``lo``) let a token see later ones exactly where acb's attention will: within
        each image block, on the layer types whose layers take the blocks; nowhere else. A request
        whose masks differ (a model whose probe at start did not show it) is refused here, before
        any of its tokens is computed, rather than answered with other tokens."""
        own = None
        if blocks is not None:
            own = ((blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)).triu(1)
        for kind, m in mask.items() if isinstance(mask, dict) else [(None, mask)]:
            if kind is not None and kind not in self._kinds:  # (a mask no layer of the model reads)
                continue
            sees = _sees(m, b, lo, n, self.device)
            if sees is None:  # (a mask function that takes single indices: the probe at start decided)
                continue
            both_ways = kind in self._kinds_both_ways if kind is not None else self.bidirectional
            ahead = sees.triu(1)  # [n, n]: where a token sees a later one
            want = own if both_ways and own is not None else None
            if (want is None and bool(ahead.any())) or (want is not None and not torch.equal(ahead, want)):
                from acb.errors import UnsupportedModelError

                q, k = (ahead ^ want if want is not None else ahead).nonzero()[0].tolist()
                how = "lets" if bool(ahead[q, k]) else "does not let"
                raise UnsupportedModelError(
                    f"{type(self.model).__name__}'s own {kind or 'attention'} mask for this prompt {how} token {q} "
                    f"see the later token {k}, and acb's attention would not do the same (it lets a token see later "
                    "ones only within its image's tokens, on the layers the model's masks showed at start): the "
                    "request is refused rather than answered with other tokens"
                )

    def _plain_layers(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The decoder's own per-layer inputs of ``ids`` (None for a model without them); image
        placeholders (of any modality) are looked up as the pad token (their ids may lie past the lookup's table:
        what the model's own code made there is put back from its capture)."""
        if self._per_layer is None:
            return None
        return self._per_layer(ids.masked_fill(torch.isin(ids, self._placeholders), self._pad_token))

    # a step ------------------------------------------------------------------
    def step_inputs(
        self, sched: SchedulerOutput, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``inputs_embeds`` ``[1, T, D]`` and ``position_ids`` (``[1, T]``, or ``[R, 1, T]`` for
        M-RoPE) for a step with image requests in it; None when it has none."""
        self.step_groups = None
        with_images = [
            i
            for i, req in enumerate(sched.requests)
            if req.media is not None and (self.mrope or sched.start_pos[i] < req.prompt_len)
        ]
        if not with_images:  # (decode rows of a model whose positions are the plain ones need nothing)
            return None
        starts = [0]
        for n in sched.num_new:
            starts.append(starts[-1] + n)
        fresh = [
            sched.requests[i]
            for i in with_images
            if self.key(sched.requests[i]) not in self._used and self.key(sched.requests[i]) not in self._free
        ]
        if len(fresh) > 1:  # their images through the vision encoder together
            for req, entry in zip(fresh, self.capture_many(fresh)):
                self._free[self.key(req)] = entry  # (taken by entry() below)
                self._free_bytes += entry.nbytes
        embeds = self.embed(input_ids)  # [1, T, D]
        # per-layer inputs: the decoder's own lookup of the step's tokens, image rows put back below
        layers = self._plain_layers(input_ids)  # [1, T, layers, D'] or None
        positions = position_ids
        deep_at: list[torch.Tensor] = []  # flattened-batch indices of DeepStack positions, ascending
        deep_rows: list[torch.Tensor] = []  # their rows, [layers, k, D] each
        for i in with_images:
            req, n, start = sched.requests[i], sched.num_new[i], sched.start_pos[i]
            entry = self.entry(req)
            off = starts[i]
            if entry.groups is not None and start < entry.prompt_len and n > 1:
                end = start + n
                groups = entry.groups[:end]
                if end > entry.prompt_len:
                    groups = torch.cat([groups, groups.new_full((end - entry.prompt_len,), -1)])
                if self.step_groups is None:
                    self.step_groups = MediaBlocks({}, self.layers)
                self.step_groups.segments[off] = groups
            if start < entry.prompt_len:  # this step prefills part of the prompt: its image rows
                sel = (entry.positions >= start) & (entry.positions < start + n)
                if bool(sel.any()):
                    embeds[0, off + entry.positions[sel] - start] = entry.rows[sel].to(embeds.dtype)
                if layers is not None and entry.layer_positions is not None and entry.layer_rows is not None:
                    lp = entry.layer_positions
                    at = (lp >= start) & (lp < start + n)
                    if bool(at.any()):
                        layers[0, off + lp[at] - start] = entry.layer_rows[at].to(layers.dtype)
                if entry.deep_positions is not None and entry.deep_rows is not None:
                    dp = entry.deep_positions
                    deep = (dp >= start) & (dp < start + n)
                    if bool(deep.any()):
                        deep_at.append(off + dp[deep] - start)
                        deep_rows.append(entry.deep_rows[:, deep])
            if entry.mrope is not None:
                if positions.dim() == 2:
                    positions = positions[None].expand(entry.mrope.shape[0], -1, -1).clone()
                end = min(start + n, entry.prompt_len)
                if start < end:
                    positions[:, 0, off : off + end - start] = entry.mrope[:, start:end]
                after = max(start, entry.prompt_len)
                if after < start + n:
                    positions[-3:, 0, off + after - start : off + n] += entry.delta
        self._lm_kwargs = {}
        self._model_kwargs = {} if layers is None else {"per_layer_inputs": layers}
        if deep_at:  # the language model adds these after its first layers (its own code does)
            mask = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
            mask[0, torch.cat(deep_at)] = True
            rows = torch.cat(deep_rows, dim=1).to(embeds.dtype)
            self._lm_kwargs = {"visual_pos_masks": mask, "deepstack_visual_embeds": list(rows.unbind(0))}
        return embeds, positions

    def model_kwargs(self) -> dict[str, Any]:
        """The step's extra arguments of the model's own forward on ``inputs_embeds`` (Gemma 3n/4's
        ``per_layer_inputs``, which it computes from ``input_ids`` otherwise); taken once."""
        extra, self._model_kwargs = self._model_kwargs, {}
        return extra

    @contextlib.contextmanager
    def language_model_kwargs(self) -> Iterator[None]:
        """During a step's forward: the language model also gets the arguments its own model
        computes from the images (DeepStack's), which a forward on ``inputs_embeds`` leaves out."""
        extra, self._lm_kwargs = self._lm_kwargs, {}
        if not extra:
            yield
            return
        decoder = self.decoder
        forward = type(decoder).forward

        def with_extra(*args: Any, **kw: Any) -> Any:
            kw.update(extra)
            return forward(decoder, *args, **kw)

        decoder.forward = with_extra
        try:
            yield
        finally:
            del decoder.forward


def _same(a: Embedded, b: Embedded) -> bool:
    """Two captures of one request give the same embeddings (up to the rounding of a batched
    vision encoder, which in bfloat16 is a few of its steps: a capture that mixes requests or
    images up differs by far more)."""

    def close(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
        if x is None or y is None:
            return x is None and y is None
        if x.shape != y.shape:
            return False
        if not x.is_floating_point():
            return torch.equal(x, y)
        scale = float(x.abs().max()) if x.numel() else 0.0
        tol = max(1e-3, 8 * torch.finfo(x.dtype).eps)
        return bool((x - y).abs().max() <= tol * max(scale, 1e-6)) if x.numel() else True

    return all(
        close(getattr(a, f.name), getattr(b, f.name))
        for f in dataclasses.fields(Embedded)
        if f.name not in ("prompt_len", "delta")
    ) and (a.prompt_len, a.delta) == (b.prompt_len, b.delta)
