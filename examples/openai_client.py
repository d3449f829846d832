"""Call `acb serve` with the official `openai` client: a chat, a streamed completion, and usage.

Start the server first (it prints its URL once the engine runs):

    pip install -e ".[serve]" openai      # in acb's checkout
    acb serve --model ./my-checkpoint --port 8000
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1

Without --model, `acb serve` serves its embedded random-weight model (meaningless text). The
client asks the server which model it serves (`GET /v1/models`); --model-name picks one by name
(the checkpoint directory's name, or the server's --served-model-name).
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main(base_url: str, model: str | None, api_key: str) -> None:
    client = OpenAI(base_url=base_url, api_key=api_key)
    if model is None:  # whatever the server serves: its first (and usually only) model
        model = client.models.list().data[0].id
        print("model:", model)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, extra_body={"top_k": 20}
    )  # acb's extras go in extra_body
    print("chat:", repr(chat.choices[0].message.content), chat.choices[0].finish_reason, chat.usage.total_tokens)
    print("stream: ", end="")
    usage = None
    for chunk in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=16, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
        if chunk.usage is not None:
            usage = chunk.usage
    print()
    print("streamed tokens:", usage.completion_tokens if usage else None)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model-name", default=None, help="the served model's name (default: the server's first model)")
    p.add_argument("--api-key", default="unused", help="the server's --api-key, if it has one")
    args = p.parse_args()
    main(args.base_url, args.model_name, args.api_key)
