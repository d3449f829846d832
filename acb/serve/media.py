"""Images in requests to ``acb serve``: content parts found, fetched and decoded within limits.

Chat completions take OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` parts, the
Responses API its ``{"type": "input_image", "image_url": ...}`` parts. A URL is either a ``data:``
URL (base64, at most ``max_image_bytes`` decoded) or, for a domain the operator allowed
(``--allowed-media-domains``), an ``http(s)`` URL fetched with a time limit and the same byte
limit (redirects are followed only to allowed domains). Anything else is a 400 naming the part.
An image has at most ``max_image_pixels`` pixels, decoded and as the model's processor would
resize it (a processor that scales the short edge keeps the aspect ratio: a 1x30000 strip would
become 32x960000), and is at most ``max_aspect_ratio`` times longer one way than the other; both
are read from the file's header, before its pixels are decoded.

The work runs in the render pool (worker threads, each job within its time bound), never on the
event loop: :func:`load_images` is called by the render job, which then hands the chat to the
engine's processor (:func:`acb.media.process_prompt`).
"""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from acb.media import MAX_ASPECT_RATIO, load_image
from acb.serve.protocol import APIError

DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_MAX_IMAGE_PIXELS = 6000 * 6000
DEFAULT_FETCH_TIMEOUT = 5.0
DEFAULT_MAX_ASPECT_RATIO = MAX_ASPECT_RATIO


@dataclass(frozen=True)
class MediaPolicy:
    """What a request's images may be (see the module docstring)."""

    allowed_domains: tuple[str, ...] = ()
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO

    def allows(self, host: str) -> bool:
        """``host`` is an allowed domain or a subdomain of one."""
        host = host.lower().rstrip(".")
        return any(host == d or host.endswith("." + d) for d in (d.lower().strip(".") for d in self.allowed_domains))

    def image(self, url: str, where: str, param: str, image_processor: Any = None) -> Any:
        """The image at ``url`` (a data URL, or an allowed http(s) URL), as a PIL image; its size
        checked against the limits, and against what ``image_processor`` (the served model's)
        would make of it, before it is decoded.

        Raises:
            APIError: 400 naming ``where``: a URL not allowed, too many bytes or pixels (decoded or
                processed), too thin, a fetch that failed or took too long, bytes that are no image.
        """
        if not isinstance(url, str) or not url:
            raise APIError(400, f"{where}: the image URL must be a non-empty string", param=param)
        source: str | bytes = url
        if url.startswith("data:"):  # (decoded by load_image, once its size is known to fit)
            if len(url.partition(",")[2]) * 3 // 4 > self.max_bytes:
                raise APIError(400, f"{where}: the image is larger than {self.max_bytes} bytes", param=param)
        else:
            source = self._fetch(url, where, param)
        try:
            return load_image(
                source,
                where,
                max_pixels=self.max_pixels,
                max_aspect_ratio=self.max_aspect_ratio,
                image_processor=image_processor,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None

    def _fetch(self, url: str, where: str, param: str) -> bytes:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise APIError(400, f"{where}: the image URL must be a data: URL or an http(s) URL", param=param)
        if not self.allows(parts.hostname):
            allowed = ", ".join(self.allowed_domains) or "none: start the server with --allowed-media-domains"
            raise APIError(
                400,
                f"{where}: images from {parts.hostname!r} are not allowed (allowed domains: {allowed})",
                param=param,
            )
        opener = urllib.request.build_opener(_Redirects(self, where, param))
        try:
            with opener.open(url, timeout=self.fetch_timeout) as response:
                length = response.headers.get("content-length")
                if length is not None and length.isdigit() and int(length) > self.max_bytes:
                    raise APIError(400, f"{where}: the image is larger than {self.max_bytes} bytes", param=param)
                raw = response.read(self.max_bytes + 1)
        except APIError:
            raise
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise APIError(
                400, f"{where}: fetching the image failed ({type(exc).__name__}: {exc})", param=param
            ) from None
        if len(raw) > self.max_bytes:
            raise APIError(400, f"{where}: the image is larger than {self.max_bytes} bytes", param=param)
        return bytes(raw)


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed domain."""

    def __init__(self, policy: MediaPolicy, where: str, param: str) -> None:
        self.policy, self.where, self.param = policy, where, param

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        host = urllib.parse.urlsplit(newurl).hostname or ""
        if not self.policy.allows(host):
            raise APIError(
                400, f"{self.where}: the image URL redirects to {host!r}, which is not allowed", param=self.param
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def image_url_of(part: Mapping[str, Any]) -> Any:
    """The URL of an ``image_url`` (chat) or ``input_image`` (Responses) part."""
    url = part.get("image_url")
    if isinstance(url, Mapping):
        url = url.get("url")
    return url


def has_image_parts(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(
        isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"]) for m in messages
    )


def load_images(
    messages: Sequence[Mapping[str, Any]], policy: MediaPolicy, param: str, processor: Any = None
) -> list[dict[str, Any]]:
    """The chat with each ``image_url`` part (as :func:`content_parts` left it) replaced by an
    ``{"type": "image", "image": <PIL image>}`` part, as processors take it. ``processor`` (the
    served model's) tells how large each image would become.

    Raises:
        APIError: 400 for an image that is not allowed or does not load, naming its part.
    """
    image_processor = getattr(processor, "image_processor", None)
    out = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(dict(m))
            continue
        parts = []
        for p in content:
            if p.get("type") == "image_url":
                parts.append({"type": "image", "image": policy.image(p["url"], p["where"], param, image_processor)})
            else:
                parts.append(p)
        out.append({**m, "content": parts})
    return out


def content_parts(
    content: Any, where: str, param: str, text_kinds: tuple[str, ...], image_kinds: tuple[str, ...]
) -> str | list[dict[str, Any]]:
    """A message's content: its text when it has no image, else its parts in order (``text``
    parts and ``image_url`` parts holding the URL and where the part is, for errors).

    Raises:
        APIError: 400 for a part of another type, or a malformed one.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts", param=param)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in text_kinds and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in image_kinds:
            parts.append({"type": "image_url", "url": image_url_of(part), "where": f"{where}.content[{j}]"})
        else:
            kinds = ", ".join(text_kinds + image_kinds)
            raise APIError(400, f"{where}.content[{j}]: content parts must be {kinds}, got type {kind!r}", param=param)
    if not any(p["type"] == "image_url" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts
