"""``acb serve`` on a vision-language checkpoint (tiny LLaVA and its processor, saved to a dir),
as a real process driven by the ``openai`` client: image content parts in chat completions and
the Responses API (data URLs; http URLs from an allowed domain, served by a local HTTP server),
greedy, equal to ``model.generate`` on the same processor outputs; images refused with a 400 that
names the part (a domain not allowed, bytes that are no image, an image over the byte limit, over
the pixel limit decoded or as the processor would resize it, past the aspect-ratio limit); a
text-only chat beside them."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading
from types import SimpleNamespace

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.serve.test_openai_server import _serve  # noqa: E402
from tests.vlm_models import image, messages, tiny_vlm  # noqa: E402

MAX_BYTES = 60_000
MAX_PIXELS = 100_000  # the tiny processor scales the short edge to 32: a 1x150 strip would be 32x4800


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def solid_png(width: int, height: int) -> bytes:
    """A one-colour PNG: a few hundred bytes however many pixels it has."""
    from PIL import Image

    return png(Image.new("RGB", (width, height), (200, 30, 90)))


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model, processor = tiny_vlm("llava")
    d = tmp_path_factory.mktemp("tiny-llava")
    model.save_pretrained(d)
    processor.save_pretrained(d)
    return SimpleNamespace(dir=d, model=model, processor=processor)


@pytest.fixture(scope="module")
def images_host(tmp_path_factory):
    """A local HTTP server with two PNGs (the allowed domain: 127.0.0.1)."""
    root = tmp_path_factory.mktemp("images")
    (root / "one.png").write_bytes(png(image(1)))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    args = ["--served-model-name", "llava", "--num-blocks", "64", "--page-size", "8"]
    args += ["--allowed-media-domains", "127.0.0.1", "--max-image-bytes", str(MAX_BYTES)]
    args += ["--max-image-pixels", str(MAX_PIXELS)]
    yield from _serve(checkpoint, tmp_path_factory, "llava", args)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60) as c:
        yield c


def reference(checkpoint, chat, max_new: int) -> str:
    inputs = checkpoint.processor.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = checkpoint.model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    return checkpoint.processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def chat_with(url: str, text: str = "describe this") -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}
    ]


EXTRA = {"ignore_eos": True}


def test_chat_and_responses_with_images_equal_generate(client, checkpoint, images_host):
    want = reference(checkpoint, messages([image(1)], "describe this"), 8)
    other = reference(checkpoint, messages([image(2)], "describe this"), 8)
    assert want != other  # (the image decides the tokens)
    for url in (data_url(png(image(1))), f"{images_host}/one.png"):
        got = client.chat.completions.create(
            model="llava", messages=chat_with(url), max_tokens=8, temperature=0, extra_body=EXTRA
        )
        assert got.choices[0].message.content == want
    streamed = client.chat.completions.create(
        model="llava",
        messages=chat_with(data_url(png(image(2)))),
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body=EXTRA,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == other
    resp = client.responses.create(
        model="llava",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(png(image(1)))},
                    {"type": "input_text", "text": "describe this"},
                ],
            }
        ],
        max_output_tokens=8,
        temperature=0,
        extra_body=EXTRA,
    )
    assert resp.output_text == want
    text = client.chat.completions.create(
        model="llava", messages=[{"role": "user", "content": "text only"}], max_tokens=8, temperature=0
    )
    assert text.choices[0].message.content == reference(checkpoint, [{"role": "user", "content": "text only"}], 8)


@pytest.mark.parametrize(
    "url, says",
    [
        ("https://example.com/a.png", "not allowed"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "cannot decode"),
        (data_url(png(image(3, (256, 256)))), f"larger than {MAX_BYTES} bytes"),
        ("ftp://127.0.0.1/a.png", "data: URL or an http(s) URL"),
        # a 1x30000 strip (a few hundred bytes, 30k pixels) that the processor would make 32x960000
        (data_url(solid_png(1, 30000)), "a 1x30000 image is 30,000 times longer one way than the other"),
        (data_url(solid_png(30000, 1)), "a 30000x1 image is 30,000 times longer one way than the other"),
        (data_url(solid_png(1, 150)), "the model's processor would make 32x4800 pixels of this 1x150 image"),
        (data_url(solid_png(400, 400)), "400x400 pixels is more than the 100,000 allowed"),
    ],
    ids=["domain", "undecodable", "too-large", "scheme", "1xN", "Nx1", "processed-too-large", "too-many-pixels"],
)
def test_a_bad_image_is_a_400_naming_its_part(client, url, says):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="llava", messages=chat_with(url), max_tokens=4)
    body = info.value.body
    assert says in body["message"] and "messages[0].content[0]" in body["message"], body
    assert body["param"] == "messages"


def test_a_thin_image_within_the_limits_is_served_exactly(client, checkpoint):
    """A 2x100 strip (its processed 32x1600 within the pixel limit, its aspect ratio within 200)
    goes through as any image does, and exactly."""
    thin = image(5, (2, 100))
    got = client.chat.completions.create(
        model="llava", messages=chat_with(data_url(png(thin))), max_tokens=8, temperature=0, extra_body=EXTRA
    )
    assert got.choices[0].message.content == reference(checkpoint, messages([thin], "describe this"), 8)
