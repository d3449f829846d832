"""Tracing: export acb's request spans and GenAI metrics over OTLP to a collector.

Shows `acb.telemetry.configure()` in front of an AsyncEngine: every request becomes a span
(`text_completion <model>` / `chat <model>`) under the span current at submit, and the
`gen_ai.server.*` metrics go out with it.

Run a collector (for example the OpenTelemetry Collector or Jaeger, listening for OTLP/HTTP on
4318), then:

    pip install -e ".[otel]"       # in acb's checkout
    python examples/tracing.py --endpoint http://localhost:4318 --model ./my-checkpoint

Without --model it runs acb's embedded random-weight model (meaningless text).
"""

from __future__ import annotations

import argparse
import asyncio

from opentelemetry import trace

import acb
import acb.telemetry
from acb.models import build_tokenizer, default_model


async def main(endpoint: str, model_path: str | None) -> None:
    tel = acb.telemetry.configure(endpoint, service_name="acb-example")
    if model_path:
        engine = acb.AsyncEngine.from_pretrained(model_path)
    else:
        engine = acb.AsyncEngine(
            default_model(), acb.ContinuousBatchingConfig(page_size=16, num_blocks=128), tokenizer=build_tokenizer()
        )
    tracer = trace.get_tracer("acb-example")
    async with engine:
        with tracer.start_as_current_span("answer-questions"):  # the requests' spans are its children
            outs = await asyncio.gather(
                *(
                    engine.generate(q, max_new_tokens=16, ignore_eos=True)
                    for q in ("What is continuous batching?", "Why page the KV cache?")
                )
            )
    for out in outs:
        print(out.request_id, repr(out.text))
    tel.shutdown()  # export what is left before exiting


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", default="http://localhost:4318", help="the collector's OTLP/HTTP base URL")
    p.add_argument("--model", default=None, help="a local checkpoint directory")
    args = p.parse_args()
    asyncio.run(main(args.endpoint, args.model))
