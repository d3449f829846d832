"""OpenAI's shapes of acb's outputs for chat and text completions: the response bodies
(``chat.completion``, ``text_completion``), their stream chunks (server-sent events, ended by
``data: [DONE]``, or by an error event then ``[DONE]``), usage and logprobs.

:class:`CompletionOutput` is one request's formatting, whole (:meth:`~CompletionOutput.body`) or
streamed (:meth:`~CompletionOutput.start`, :meth:`~CompletionOutput.delta`,
:meth:`~CompletionOutput.end`, :meth:`~CompletionOutput.error`): the shape
:mod:`acb.serve.pipeline` asks of every route's output (the Responses API has its own, in
:mod:`acb.serve.responses`). Plain functions over outputs; no I/O.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from acb.outputs import GenerationOutput, StreamDelta
from acb.serve import shaping
from acb.serve.protocol import APIError
from acb.text import token_bytes

__all__ = ["CompletionOutput", "TokenTexts", "chat_logprobs", "finish_reason", "samples", "text_logprobs", "usage"]

# acb's finish reasons that OpenAI's API lacks, as the nearest of OpenAI's: an output its grammar
# could not continue (acb's "grammar": no token was left to sample) ends before its constraint was
# met, a prefix of a match, as one cut short does
_OPENAI_FINISH = {"grammar": "length"}

DONE = "data: [DONE]\n\n"


def finish_reason(out: Any) -> str | None:
    """An output's (or a sample's) finish reason as OpenAI names it.

    Args:
        out: a :class:`~acb.GenerationOutput` or one of its samples.

    Returns:
        ``"stop"``, ``"length"``...; ``None`` while it runs.
    """
    reason = getattr(out, "finish_reason", None)
    if reason is None:
        return None
    value = str(reason.value)
    return _OPENAI_FINISH.get(value, value)


def samples(out: GenerationOutput) -> list[Any]:
    """An output's samples (``n > 1``), or the output itself as its one sample.

    Args:
        out: a request's final output.

    Returns:
        Its samples, each with ``text``, ``generated_tokens``, ``logprobs``, ``finish_reason``.
    """
    return list(out.samples) if out.samples else [out]


def usage(outs: Sequence[GenerationOutput]) -> dict[str, Any]:
    """OpenAI's ``usage`` of a request's outputs (every prompt's, every sample's).

    Args:
        outs: the final outputs.

    Returns:
        ``prompt_tokens``, ``completion_tokens``, ``total_tokens``, ``prompt_tokens_details``.
    """
    prompt = sum(len(o.prompt_ids) for o in outs)
    completion = sum(len(s.generated_tokens) for o in outs for s in samples(o))
    cached = sum(o.num_cached_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class TokenTexts:
    """Each token's text and bytes for logprobs, cached for the server's life. A token that is
    only part of a UTF-8 character keeps its own bytes, and its text shows them escaped
    (``\\xe2``), so tokens stay distinct."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token: int) -> tuple[str, list[int]]:
        """A token's text and bytes.

        Args:
            token: a token id.

        Returns:
            ``(text, bytes)`` (empty without a tokenizer).
        """
        found = self._cache.get(token)
        if found is None:
            raw = b"" if self.tokenizer is None else token_bytes(self.tokenizer, token)
            found = self._cache[token] = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
        return found

    def text(self, token: int) -> str:
        """A token's text (see :meth:`get`).

        Args:
            token: a token id.

        Returns:
            Its text.
        """
        return self.get(token)[0]


def weight_version(outs: Sequence[GenerationOutput]) -> Any:
    """The response's weight version: its outputs' (the first one's when they differ; spans
    ``[version, first token, end]`` when an update landed while it ran)."""
    versions = [o.weight_version for o in outs]
    v = versions[0] if versions else 0
    return [list(span) for span in v] if isinstance(v, list) else v


def chat_logprobs(
    texts: TokenTexts,
    tokens: Sequence[int],
    logprobs: Sequence[float] | None,
    top: Sequence[Sequence[tuple[int, float]]] | None,
) -> dict[str, Any] | None:
    """A chat choice's (or chunk's) ``logprobs``.

    Args:
        texts: the server's token texts.
        tokens: the generated tokens.
        logprobs: their logprobs; ``None`` when the request asked for none.
        top: each position's top alternatives ``(token, logprob)``, if asked for.

    Returns:
        ``{"content": [...]}``, or ``None`` without logprobs.
    """
    if logprobs is None or not logprobs and tokens:
        return None
    content = []
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        alts = top[i] if top is not None and i < len(top) else []
        content.append(
            {
                "token": texts.text(t),
                "logprob": lp,
                "bytes": texts.get(t)[1],
                "top_logprobs": [{"token": texts.text(a), "logprob": alp, "bytes": texts.get(a)[1]} for a, alp in alts],
            }
        )
    return {"content": content}


def text_logprobs(
    texts: TokenTexts,
    tokens: Sequence[int],
    logprobs: Sequence[float] | None,
    top: Sequence[Sequence[tuple[int, float]]] | None,
    offset: int,
) -> dict[str, Any] | None:
    """A text completion choice's (or chunk's) ``logprobs``.

    Args:
        texts: the server's token texts.
        tokens: the generated tokens.
        logprobs: their logprobs; ``None`` when the request asked for none.
        top: each position's top alternatives ``(token, logprob)``, if asked for.
        offset: the first token's offset in the choice's text.

    Returns:
        ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``; or ``None`` without logprobs.
    """
    if logprobs is None or not logprobs and tokens:
        return None
    words = [texts.text(t) for t in tokens]
    offsets = []
    for w in words:
        offsets.append(offset)
        offset += len(w)
    return {
        "tokens": words,
        "token_logprobs": list(logprobs[: len(tokens)]),
        "top_logprobs": [{texts.text(a): alp for a, alp in (top[i] if top else [])} for i in range(len(tokens))],
        "text_offset": offsets,
    }


def chat_delta(shaped: shaping.Shaped) -> dict[str, Any]:
    """A chat chunk's ``delta`` from shaped text.

    Args:
        shaped: the text's content, reasoning and tool call deltas.

    Returns:
        ``content``, ``reasoning_content``, ``tool_calls`` (those it has).
    """
    out: dict[str, Any] = {}
    if shaped.reasoning:
        out["reasoning_content"] = shaped.reasoning
    if shaped.content or not shaped:
        out["content"] = shaped.content
    if shaped.tool_calls:
        out["tool_calls"] = [c.to_openai() for c in shaped.tool_calls]
    return out


class CompletionOutput:
    """One chat or text completion request's response: OpenAI's ``chat.completion`` /
    ``text_completion`` body, or its stream of chunks. Choice ``p * n + i`` is prompt ``p``'s
    sample ``i``.

    Args:
        chat: a chat completion (else a text completion).
        model: the served model's name.
        texts: the server's token texts (logprobs).
        num_prompts: the request's prompts.
        n: samples per prompt.
        logprobs: whether the request asked for logprobs.
        include_usage: a stream's last chunk carries the usage (``stream_options.include_usage``).
        shaper: makes a chat choice's :class:`~acb.serve.shaping.OutputShaper` (reasoning, tool
            calls); ``None``: the text is the content.
        token_ids: each choice carries its ``token_ids`` and ``prompt_token_ids`` (vLLM's
            ``return_token_ids``).

    Every response (a stream: its last chunks) carries the ``weight_version`` its tokens were
    sampled under (:attr:`acb.GenerationOutput.weight_version`).
    """

    def __init__(
        self,
        *,
        chat: bool,
        model: str,
        texts: TokenTexts,
        num_prompts: int,
        n: int,
        logprobs: bool,
        include_usage: bool = False,
        shaper: Callable[[], shaping.OutputShaper] | None = None,
        token_ids: bool = False,
    ) -> None:
        self.chat = chat
        self.model = model
        self.texts = texts
        self.num_prompts = num_prompts
        self.n = n
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.shaper = shaper if chat else None
        self.token_ids = token_ids  # return_token_ids: the prompt's and each choice's token ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # a text choice's length so far (logprobs' text_offset)
        self._shapers: dict[int, shaping.OutputShaper] = {}  # each chat choice's, made on its first delta

    # ---------------------------------------------------------------- the whole response
    def body(self, outs: Sequence[GenerationOutput]) -> dict[str, Any]:
        """The response to a request that is not streamed.

        Args:
            outs: each prompt's final output, in order.

        Returns:
            The ``chat.completion`` / ``text_completion`` object.
        """
        choices = []
        for p, out in enumerate(outs):
            for s in samples(out):
                index = p * self.n + getattr(s, "index", 0)
                text = s.text or ""
                lp = s.logprobs if self.logprobs else None
                if self.chat:
                    message: dict[str, Any] = {"role": "assistant", "content": text}
                    reason = finish_reason(s)
                    if self.shaper is not None:
                        shaped = self.shaper()
                        shaped.shape_whole(text)
                        message, reason = shaped.message(), shaped.finish_reason(reason)
                    choices.append(
                        {
                            "index": index,
                            "message": message,
                            "logprobs": chat_logprobs(self.texts, s.generated_tokens, lp, s.top_logprobs),
                            "finish_reason": reason,
                        }
                    )
                else:
                    choices.append(
                        {
                            "index": index,
                            "text": text,
                            "logprobs": text_logprobs(self.texts, s.generated_tokens, lp, s.top_logprobs, 0),
                            "finish_reason": finish_reason(s),
                        }
                    )
                if self.token_ids:
                    choices[-1].update(token_ids=list(s.generated_tokens), prompt_token_ids=list(out.prompt_ids))
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": usage(outs),
            "weight_version": weight_version(outs),
        }

    # ---------------------------------------------------------------- the stream
    def _chunk(self, choices: list[dict[str, Any]], use: dict[str, Any] | None = None, version: Any = None) -> str:
        data: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            data["usage"] = use
        if version is not None:  # (a sample's last chunk)
            data["weight_version"] = version
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        """A stream's first events: a chat's role chunk (every choice's).

        Returns:
            SSE events.
        """
        if not self.chat:
            return []
        return [
            self._chunk(
                [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(self.num_prompts * self.n)
                ]
            )
        ]

    def delta(self, p: int, delta: StreamDelta) -> list[str]:
        """One stream delta of prompt ``p`` as a chunk (a sample's last piece carries its finish
        reason; text a parser holds back sends nothing yet).

        Args:
            p: the prompt's index in the request.
            delta: what its request produced since the last one.

        Returns:
            SSE events (none or one).
        """
        choices = self._choices(p, delta)
        if not choices:
            return []
        final = delta.output if delta.finished else None
        return [self._chunk(choices, version=weight_version([final]) if final is not None else None)]

    def end(self, finals: Sequence[GenerationOutput]) -> list[str]:
        """A stream's last events, once every request finished: the usage chunk if asked for,
        then ``[DONE]``.

        Args:
            finals: every request's final output.

        Returns:
            SSE events; the last one is sent after the request's span ended.
        """
        return ([self._chunk([], usage(finals))] if self.include_usage else []) + [DONE]

    def error(self, err: APIError) -> str:
        """A stream's last words when it fails after it began.

        Args:
            err: the failure, as the error body a request would get.

        Returns:
            The error event, then ``[DONE]``.
        """
        return err.sse()

    def _shaper_of(self, i: int) -> shaping.OutputShaper | None:
        if self.shaper is None:
            return None
        if i not in self._shapers:
            self._shapers[i] = self.shaper()
        return self._shapers[i]

    def _choices(self, p: int, delta: StreamDelta) -> list[dict[str, Any]]:
        n, chat = self.n, self.chat
        index = p * n + delta.sample_index
        choices: list[dict[str, Any]] = []
        if delta.token_ids or delta.text:
            lp = delta.logprobs if self.logprobs else None
            if chat:
                sh = self._shaper_of(index)
                shaped = sh.feed(delta.text or "") if sh is not None else None
                if shaped is None or shaped or lp is not None:  # (text a parser holds back: nothing to send yet)
                    content = {"content": delta.text or ""} if shaped is None else chat_delta(shaped)
                    choices.append(
                        {
                            "index": index,
                            "delta": content,
                            "logprobs": chat_logprobs(self.texts, delta.token_ids, lp, delta.top_logprobs),
                            "finish_reason": None,
                        }
                    )
            else:
                off = self._offsets.get(index, 0)
                choices.append(
                    {
                        "index": index,
                        "text": delta.text or "",
                        "logprobs": text_logprobs(self.texts, delta.token_ids, lp, delta.top_logprobs, off),
                        "finish_reason": None,
                    }
                )
                self._offsets[index] = off + len(delta.text or "")
            if self.token_ids and choices:
                choices[-1]["token_ids"] = list(delta.token_ids)
        if delta.finished and delta.output is not None:
            for s in samples(delta.output):
                i = p * n + getattr(s, "index", 0)
                reason = finish_reason(s)
                sh = self._shaper_of(i) if chat else None
                tail = sh.finish() if sh is not None else None
                if sh is not None:
                    reason = sh.finish_reason(reason)
                same = next((c for c in choices if c["index"] == i), None)
                if same is not None:
                    same["finish_reason"] = reason
                    if tail:  # what the parsers held until the end joins this chunk's delta
                        merged = chat_delta(tail)
                        d = same["delta"]
                        for key in ("content", "reasoning_content"):
                            if merged.get(key):
                                d[key] = (d.get(key) or "") + merged[key]
                        if merged.get("tool_calls"):
                            d["tool_calls"] = d.get("tool_calls", []) + merged["tool_calls"]
                    continue
                end: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": reason}
                end.update(delta=chat_delta(tail) if tail else {}) if chat else end.update(text="")
                choices.append(end)
        return choices
