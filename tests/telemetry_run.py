"""Run by tests/test_telemetry.py in a subprocess (the OpenTelemetry providers are set once per
process): ``acb.telemetry.configure`` to the test's OTLP receiver, then an AsyncEngine (async
batching on, a KV cache small enough to preempt and offload) through every request outcome.
Prints one JSON document: what the engine returned, for the test to compare with the spans."""

from __future__ import annotations

import asyncio
import json
import sys

import acb
from acb import telemetry
from acb.models import build_tokenizer, tiny_model

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class Tokenizer:
    """The byte-level tokenizer, whose decode can be broken on purpose (a request then fails)."""

    def __init__(self) -> None:
        self.tok = build_tokenizer()
        self.tok.chat_template = TEMPLATE
        self.broken = False

    def decode(self, ids, **kw):
        if self.broken:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken on purpose")
        return self.tok.decode(ids, **kw)

    def __call__(self, *a, **kw):
        return self.tok(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __len__(self) -> int:
        return len(self.tok)


def summary(out: acb.GenerationOutput) -> dict:
    samples = out.samples or [out]
    return {
        "request_id": out.request_id,
        "status": out.status.name.lower(),
        "prompt_len": len(out.prompt_ids),
        "output_tokens": sum(len(s.generated_tokens) for s in samples),
        "tokens": [list(s.generated_tokens) for s in samples],
        "finish_reasons": [s.finish_reason.value for s in samples],
        "cached": out.num_cached_tokens,
        "preemptions": out.num_preemptions,
        "texts": [s.text for s in samples],
        "failure": out.failure.value if out.failure is not None else None,
    }


async def main(endpoint: str, protocol: str) -> dict:
    # "off": no SDK at all (the API's no-op providers), for comparison
    tel = (
        None
        if endpoint == "off"
        else telemetry.configure(
            endpoint, protocol, service_name="acb-test", capture_content=True, export_interval_s=3600
        )
    )
    tok = Tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=512)
    model.config.name_or_path = "tiny-llama"
    cfg = acb.ContinuousBatchingConfig(page_size=8, num_blocks=14, use_async_batching=True, cpu_offload_space=0.01)
    results: dict = {}
    tracer = __import__("opentelemetry.trace", fromlist=["trace"]).get_tracer("user-app")
    async with acb.AsyncEngine(model, cfg, tokenizer=tok) as eng:
        # a user's span around a submit: the request's span is its child
        with tracer.start_as_current_span("user-operation") as user:
            h = await eng.submit(
                "hello there",
                max_new_tokens=6,
                ignore_eos=True,
                temperature=0.7,
                top_p=0.9,
                top_k=20,
                seed=3,
                stop=["never-appears"],
            )
            results["user_span_id"] = format(user.get_span_context().span_id, "016x")
            results["user_trace_id"] = format(user.get_span_context().trace_id, "032x")
        results["text"] = summary(await h.result())
        chat = [{"role": "user", "content": "hi"}]
        results["chat"] = summary(
            await eng.generate(chat, max_new_tokens=5, n=2, temperature=1.0, seed=1, ignore_eos=True)
        )
        # two long requests in 13 usable blocks of 8: one is preempted (its KV offloaded)
        a = await eng.submit(list(range(5, 45)), max_new_tokens=30, ignore_eos=True)
        b = await eng.submit(list(range(50, 90)), max_new_tokens=30, ignore_eos=True)
        outs = [await a.result(), await b.result()]
        results["preempt"] = [summary(o) for o in outs]
        # cancelled after its first token
        c = await eng.submit([7, 8, 9], max_new_tokens=400, ignore_eos=True)
        async for _ in c:
            break
        c.cancel()
        results["cancelled"] = summary(await c.result())
        # failed: the stop-string check cannot decode
        tok.broken = True
        f = await eng.submit([10, 11, 12], max_new_tokens=8, stop=["zz"])
        try:
            await f.result()
        except acb.RequestFailedError as exc:
            results["failed"] = summary(exc.output)
        tok.broken = False
        results["stats"] = {"preemptions": eng.stats.preemptions, "swapped_out": eng.stats.swapped_out_blocks}
    results["sdk_imported"] = sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk"))
    if tel is not None:
        tel.shutdown()
    return results


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
