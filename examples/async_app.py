"""A minimal async web app on acb: a FastAPI endpoint that streams generated text as it comes.

The engine starts with the app and stops with it; each request submits a prompt and streams
the text of its deltas (`async for`); a client that disconnects cancels its request.

    pip install -e ".[serve]"      # in acb's checkout
    python examples/async_app.py --port 8001          # or --model ./my-checkpoint
    curl -N 'http://127.0.0.1:8001/generate?prompt=Hello&max_new_tokens=32'

Without --model it runs acb's embedded random-weight model (meaningless text).
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

import acb
from acb.models import build_tokenizer, default_model


def make_app(engine: acb.AsyncEngine) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine:  # starts the engine thread; stops it (cancelling what runs) on exit
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/generate")
    async def generate(prompt: str, max_new_tokens: int = 32) -> StreamingResponse:
        handle = await engine.submit(prompt, max_new_tokens=max_new_tokens)

        async def text() -> AsyncIterator[str]:
            async for delta in handle:  # leaving the loop early (client gone) cancels the request
                if delta.text:
                    yield delta.text

        return StreamingResponse(text(), media_type="text/plain; charset=utf-8")

    return app


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a local checkpoint directory")
    p.add_argument("--port", type=int, default=8001)
    args = p.parse_args()
    if args.model:
        engine = acb.AsyncEngine.from_pretrained(args.model)
    else:
        engine = acb.AsyncEngine(
            default_model(), acb.ContinuousBatchingConfig(page_size=16, num_blocks=128), tokenizer=build_tokenizer()
        )
    uvicorn.run(make_app(engine), host="127.0.0.1", port=args.port, log_level="warning")
