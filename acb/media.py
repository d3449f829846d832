"""Media in a prompt: found, loaded, hashed and processed at submit, off the engine thread.

The path is named for any modality; images are the one with a loader today. A modality is a row
of :data:`MODALITIES` (:class:`Modality`: its chat part types, where a part keeps its source,
its loader and hash, and the config fields that name its placeholder token), so video or audio
would be a loader and a token id here, and nothing else on the path would change its name.

A prompt sees media in one of two forms:

- a chat whose messages' ``content`` is a list of parts, some of them images:
  ``{"type": "image", "image": <PIL image | path | bytes | data URL>}`` (as transformers'
  processors take them) or OpenAI's ``{"type": "image_url", "image_url": {"url": "data:..."}}``;
  the engine's processor (``processor=``, the model's own ``AutoProcessor``) renders it with its
  chat template and makes the pixel tensors;
- an already processed ``BatchFeature`` (or any mapping) with ``input_ids`` and the tensors the
  processor made (``pixel_values``, ``image_grid_thw``, ``image_sizes``...), one request.

Either becomes an :class:`MediaPrompt`: the token ids (image placeholders included, as many as
the processor put there) and the :class:`MediaInputs` the engine carries with the request. The
engine thread never runs the processor; it runs the model's own vision code on
``MediaInputs.tensors`` (:mod:`acb.runner.media`). Each image is hashed by its content, so
that the prefix cache never shares K/V between two requests with the same text and different
images (``MediaInputs.key`` salts every block from the first image token on) and does share it
when the images are the same.

Remote URLs are not fetched here: ``acb serve`` fetches them itself, for the domains its
operator allows; a caller of the Python API loads the image and passes it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "MODALITIES",
    "MediaInputs",
    "MediaPrompt",
    "Modality",
    "check_size",
    "has_media",
    "load_image",
    "media_parts",
    "modality_token_id",
    "placeholder_token_ids",
    "process_prompt",
    "processed_size",
    "type_spans",
]

# the keys of a processor's output that are text, not images (the rest go to the vision code)
_TEXT_KEYS = frozenset({"input_ids", "attention_mask"})
# how many pixels one image may have, decoded and as the processor resizes it (a 16k x 16k image
# is 1 GiB of RGBA); acb serve has its own, lower, limit
MAX_PIXELS = 64 * 1024 * 1024
# how much longer than wide (or wider than long) an image may be: a processor that scales the short
# edge up keeps the aspect ratio, so a 1x30000 strip becomes 32x960000 (Qwen's own resize refuses
# past 200 as well)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True, eq=False)
class MediaInputs:
    """The images of one request, processed: what the model's own forward takes beside
    ``input_ids`` (``pixel_values`` and the rest of the processor's output, each ``[1, ...]`` or as
    the processor batches one request), and their content hashes."""

    tensors: Mapping[str, torch.Tensor]
    hashes: tuple[bytes, ...]  # one per image, in order (SHA-256 of its pixels, or of its tensors)
    first: int  # the position of the request's first image token (0 when the model does not say)
    num_placeholders: int  # its image placeholder tokens (0 when the model does not say)
    # the prompt positions [a, b) of each image whose tokens attend to each other both ways
    # (Gemma 3's prefill): a prefill chunk never ends inside one (set by the engine, per model)
    spans: tuple[tuple[int, int], ...] = ()
    key: bytes = field(init=False)  # all of them: salts the prefix cache from ``first`` on

    def __post_init__(self) -> None:
        h = hashlib.sha256(b"acb-images")
        for one in self.hashes:
            h.update(one)
        object.__setattr__(self, "key", h.digest())

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(t, "nbytes", 0)) for t in self.tensors.values())


class MediaPrompt(list[int]):  # the token ids
    """A prompt processed at submit: its token ids (this list) and its :class:`MediaInputs`
    (``None``: no image after all). The engine takes it as it is, so a caller that processes
    elsewhere (an async submit does it in a worker thread, off the event loop) submits this."""

    def __init__(self, token_ids: Sequence[int], media: MediaInputs | None, source: Any = None) -> None:
        super().__init__(int(t) for t in token_ids)
        self.media = media
        self.source = source  # what the caller gave (a chat: telemetry reads it as one)


def media_parts(prompt: Any) -> list[Mapping[str, Any]]:
    """The media content parts of a chat prompt (of every modality), in order (none for anything else)."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        return []
    out: list[Mapping[str, Any]] = []
    for message in prompt:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, (str, bytes)) or not isinstance(content, Sequence):
            continue
        out.extend(p for p in content if isinstance(p, Mapping) and p.get("type") in _PART_TYPES)
    return out


def has_media(prompt: Any) -> bool:
    """A chat with media parts, or a processor's output with tensors beside its text."""
    if isinstance(prompt, MediaPrompt):
        return prompt.media is not None
    if isinstance(prompt, Mapping):
        return "input_ids" in prompt and any(k not in _TEXT_KEYS for k in prompt)
    return bool(media_parts(prompt))


def load_image(
    source: Any,
    what: str = "image",
    max_pixels: int = MAX_PIXELS,
    *,
    max_aspect_ratio: float = MAX_ASPECT_RATIO,
    image_processor: Any = None,
) -> Any:
    """A PIL image (RGB) from a PIL image, a local path, bytes, or a ``data:`` URL, its size
    checked (:func:`check_size`) from the file's header, before its pixels are decoded.

    Raises:
        ValueError: not decodable, too many pixels (decoded, or as ``image_processor`` would
            resize it), too thin, or a remote URL (``what`` names the part).
    """
    from PIL import Image

    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, Mapping):  # OpenAI's {"url": ...}
            source = source.get("url")
        if isinstance(source, str) and source.startswith("data:"):
            head, _, data = source.partition(",")
            if ";base64" not in head:
                raise ValueError(f"{what}: a data URL must be base64 (data:image/...;base64,...)")
            try:
                source = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"{what}: the data URL is not valid base64") from None
        elif isinstance(source, str) and source.split(":", 1)[0].lower() in ("http", "https"):
            raise ValueError(
                f"{what}: remote URLs are not fetched by the engine; load the image and pass it (a PIL image, "
                "bytes or a data URL), or serve with `acb serve --allowed-media-domains`"
            )
        try:
            if isinstance(source, (bytes, bytearray, memoryview)):
                image = Image.open(io.BytesIO(bytes(source)))
            elif isinstance(source, str):
                image = Image.open(source)
            else:
                raise ValueError(
                    f"{what}: expected a PIL image, a path, bytes or a data URL, got {type(source).__name__}"
                )
            check_size(image.size, what, max_pixels, max_aspect_ratio, image_processor)
            image.load()
        except (OSError, Image.DecompressionBombError) as exc:  # PIL.UnidentifiedImageError is an OSError
            raise ValueError(f"{what}: cannot decode the image ({type(exc).__name__}: {exc})") from None
    check_size(image.size, what, max_pixels, max_aspect_ratio, image_processor)
    return image if image.mode == "RGB" else image.convert("RGB")


def check_size(
    size: tuple[int, int],
    what: str,
    max_pixels: int = MAX_PIXELS,
    max_aspect_ratio: float = MAX_ASPECT_RATIO,
    image_processor: Any = None,
) -> None:
    """Refuse an image of ``size`` (width, height) with more than ``max_pixels`` pixels, longer
    than ``max_aspect_ratio`` times its width (or the reverse), or that ``image_processor`` would
    make larger than ``max_pixels`` (:func:`processed_size`) — all before a pixel is decoded.

    Raises:
        ValueError: naming ``what``, the size, and the limit it passes.
    """
    width, height = size
    if width * height > max_pixels:
        raise ValueError(f"{what}: {width}x{height} pixels is more than the {max_pixels:,} allowed")
    if max(width, height) > max_aspect_ratio * max(1, min(width, height)):
        ratio = max(width, height) / max(1, min(width, height))
        raise ValueError(
            f"{what}: a {width}x{height} image is {ratio:,.0f} times longer one way than the other, more than "
            f"the {max_aspect_ratio:g} allowed (the processor keeps the aspect ratio as it resizes)"
        )
    if image_processor is None:
        return
    w, h, how = processed_size(image_processor, size)
    if w * h > max_pixels:
        raise ValueError(
            f"{what}: the model's processor would make {w}x{h} pixels of this {width}x{height} image ({how}), "
            f"more than the {max_pixels:,} allowed"
        )


def processed_size(image_processor: Any, size: tuple[int, int]) -> tuple[int, int, str]:
    """The largest image, ``(width, height, how)``, that ``image_processor`` makes of an image of
    ``size`` on its way to the pixel tensors, from the size alone: LLaVA's padding to a square
    (``do_pad`` with a ``pad_to_square`` step), then transformers' own resize when its rule is the
    shortest edge (scaled to ``size["shortest_edge"]``, the aspect ratio kept, the long edge capped
    at ``size["longest_edge"]`` when set): the rules under which an image grows with its longer
    side. Other rules (a fixed size, a longest edge, a pixel budget, a processor's own ``resize``)
    are bounded by the processor's config; for them this is ``size`` itself."""
    width, height = size
    peak, how = (width, height), "as it is"
    if getattr(image_processor, "do_pad", False) and callable(getattr(image_processor, "pad_to_square", None)):
        side = max(width, height)
        if width != height:
            peak, how = (side, side), "padded to a square"
        width = height = side
    target = getattr(image_processor, "size", None)
    short_edge = _size_field(target, "shortest_edge")
    own_resize = getattr(type(image_processor).resize, "__module__", "") if hasattr(image_processor, "resize") else ""
    if getattr(image_processor, "do_resize", True) and short_edge and own_resize == _BASE_RESIZE:
        long_edge = _size_field(target, "longest_edge")
        short, long = min(width, height), max(width, height)
        new_short, new_long = short_edge, int(short_edge * long / max(1, short))
        if long_edge and new_long > long_edge:
            new_short, new_long = int(long_edge * new_short / new_long), long_edge
        resized = (new_short, new_long) if width <= height else (new_long, new_short)
        if resized[0] * resized[1] > peak[0] * peak[1]:
            peak, how = resized, f"its short edge scaled to {short_edge}, the aspect ratio kept"
    return peak[0], peak[1], how


# the module of transformers' own ``resize`` (the shortest-edge rule lives there); a processor
# that defines its own resize (Qwen's pixel budget, Idefics' longest edge) has its own bounds
_BASE_RESIZE = "transformers.image_processing_backends"


def _size_field(size: Any, name: str) -> int | None:
    value = size.get(name) if isinstance(size, Mapping) else getattr(size, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _image_hash(image: Any) -> bytes:
    h = hashlib.sha256(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.digest()


def _tensor_hash(tensors: Mapping[str, Any]) -> bytes:
    import torch

    h = hashlib.sha256(b"tensors")
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        if isinstance(t, torch.Tensor):
            c = t.detach().to("cpu").contiguous()
            h.update(f"{c.dtype}{tuple(c.shape)}".encode())
            h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
        else:
            h.update(repr(t).encode())
    return h.digest()


def _one_request(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """A processed request's ``input_ids`` as one row (``[1, T]`` or ``[T]``)."""
    if name == "input_ids" and tensor.dim() == 2:
        if tensor.shape[0] != 1:
            raise ValueError(f"a processed prompt is one request: input_ids has {tensor.shape[0]} rows")
        return tensor[0]
    return tensor


def process_prompt(
    processor: Any,
    prompt: Any,
    *,
    placeholder_ids: frozenset[int] = frozenset(),
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> MediaPrompt:
    """A prompt with images as token ids and :class:`MediaInputs` (see the module docstring).

    Args:
        processor: the engine's processor (needed for a chat; a processed mapping needs none).
        prompt: a chat with image parts, or a processor's output for one request.
        placeholder_ids: the model's media placeholder token ids (:func:`placeholder_token_ids`).
        chat_template_kwargs: the chat template's variables.

    Raises:
        ValueError: an image that does not load, a processor that refuses the chat, no processor.
        TypeError: a processed prompt without ``input_ids``.
    """
    import torch

    if isinstance(prompt, MediaPrompt):
        return prompt
    hashes: list[bytes]
    if isinstance(prompt, Mapping):
        if "input_ids" not in prompt:
            raise TypeError("a processed prompt (a BatchFeature or mapping) needs input_ids")
        ids = torch.as_tensor(_one_request(torch.as_tensor(prompt["input_ids"]), "input_ids")).tolist()
        tensors = {k: v for k, v in prompt.items() if k not in _TEXT_KEYS and v is not None}
        hashes = [_tensor_hash(tensors)]
    else:
        if (
            processor is None
            or not hasattr(processor, "apply_chat_template")
            or not hasattr(processor, "image_processor")
        ):
            raise ValueError(
                "the prompt has images, but the engine has no processor: pass processor=... (the model's "
                "AutoProcessor) to the engine, or submit the processor's output (input_ids, pixel_values, ...)"
            )
        messages, hashes = [], []
        n = 0
        for message in prompt:
            content = message.get("content")
            if isinstance(content, (str, bytes)) or not isinstance(content, Sequence):
                messages.append(dict(message))
                continue
            parts = []
            for part in content:
                modality = _BY_PART_TYPE.get(str(part.get("type"))) if isinstance(part, Mapping) else None
                if modality is None:
                    parts.append(dict(part))
                    continue
                item = modality.load(modality.source(part), f"{modality.name} {n}", processor)
                hashes.append(modality.hash(item))
                parts.append({"type": modality.name, modality.name: item})
                n += 1
            messages.append({**message, "content": parts})
        kwargs = {"add_generation_prompt": True, **(chat_template_kwargs or {})}
        try:
            out = processor.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_tensors="pt", **kwargs
            )
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise ValueError(f"the processor refused this chat: {type(exc).__name__}: {exc}") from None
        ids = _one_request(torch.as_tensor(out["input_ids"]), "input_ids").tolist()
        tensors = {k: v for k, v in out.items() if k not in _TEXT_KEYS and v is not None}
        if not hashes:  # (a chat without image parts: text only)
            return MediaPrompt(ids, None, prompt)
        check_pixel_tensors(tensors, len(hashes))
    placeholders = [i for i, t in enumerate(ids) if t in placeholder_ids]
    images = MediaInputs(
        tensors={k: torch.as_tensor(v) if not isinstance(v, torch.Tensor) else v for k, v in tensors.items()},
        hashes=tuple(hashes),
        first=placeholders[0] if placeholders else 0,
        num_placeholders=len(placeholders),
    )
    return MediaPrompt(ids, images, prompt)


def check_pixel_tensors(tensors: Mapping[str, Any], num_images: int, max_pixels: int = MAX_PIXELS) -> None:
    """Refuse a processor's output whose pixel tensors (its floating-point ones, three values a
    pixel) hold more than ``max_pixels`` per image: the backstop, before the engine sees them, for
    a processor whose growth :func:`processed_size` cannot tell from the size.

    Raises:
        ValueError: saying how many values there are and the limit.
    """
    import torch

    values = sum(int(t.numel()) for t in tensors.values() if isinstance(t, torch.Tensor) and t.is_floating_point())
    if values > 3 * max_pixels * max(1, num_images):
        raise ValueError(
            f"the processor made {values:,} pixel values of {num_images} image(s), more than "
            f"{max_pixels:,} pixels an image allows"
        )


def type_spans(tensors: Mapping[str, Any]) -> tuple[tuple[int, int], ...]:
    """The runs ``[a, b)`` of image tokens that a processor's ``token_type_ids`` (or
    ``mm_token_type_ids``) mark with 1: each image's block of tokens."""
    for name in ("token_type_ids", "mm_token_type_ids"):
        types = tensors.get(name)
        if types is not None:
            flags = [int(t) == 1 for t in types.reshape(-1).tolist()]
            spans, start = [], None
            for i, on in enumerate([*flags, False]):
                if on and start is None:
                    start = i
                elif not on and start is not None:
                    spans.append((start, i))
                    start = None
            return tuple(spans)
    return ()


def modality_token_id(config: Any, modality: str = "image") -> int | None:
    """The model's placeholder token id for ``modality``, from its config (for images
    ``image_token_id`` or ``image_token_index``), or None."""
    for name in _BY_NAME[modality].token_fields:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def placeholder_token_ids(config: Any) -> frozenset[int]:
    """The placeholder token ids of every modality the model's config names."""
    found = (modality_token_id(config, m.name) for m in MODALITIES)
    return frozenset(t for t in found if t is not None)


@dataclass(frozen=True)
class Modality:
    """One kind of media on the path: how a chat names it and a model's config its placeholder."""

    name: str  # the part type a processor's chat template takes ("image")
    part_types: tuple[str, ...]  # the chat content part types of this modality (OpenAI's too)
    token_fields: tuple[str, ...]  # the config fields that name its placeholder token id
    source: Callable[[Mapping[str, Any]], Any]  # a part -> what it holds (an object, path, bytes or URL)
    load: Callable[[Any, str, Any], Any]  # (source, its name in errors, the processor) -> the loaded item
    hash: Callable[[Any], bytes]  # a loaded item's content hash


def _image_source(part: Mapping[str, Any]) -> Any:
    if part["type"] == "image":
        return part.get("image", part.get("url", part.get("path")))
    return part.get("image_url")


def _load_image_part(src: Any, what: str, processor: Any) -> Any:
    return load_image(src, what, image_processor=processor.image_processor)


MODALITIES: tuple[Modality, ...] = (
    Modality(
        "image",
        ("image", "image_url"),
        ("image_token_id", "image_token_index"),
        _image_source,
        _load_image_part,
        _image_hash,
    ),
)
_BY_NAME = {m.name: m for m in MODALITIES}
_BY_PART_TYPE = {t: m for m in MODALITIES for t in m.part_types}
_PART_TYPES = frozenset(_BY_PART_TYPE)
