"""Images in, text out: acb against padded ``model.generate`` on 64 image+text requests, in one run.

    python benchmarks/vlm_offline.py [--requests 64] [--out benchmarks/results/vlm_cpu.json]

Model (random weights, float32, CPU): Qwen3-VL-shaped (DeepStack, M-RoPE), text hidden 256, 4
layers, 16 heads (4 KV heads), vocabulary of the byte-level tokenizer; a vision tower of depth
2, hidden 128, patches of 8 merged 2x2: an image of 48 to 128 pixels a side is 9 to 64 image
tokens. Workload: 64 chats, each one image (three in four) or two, of random sizes, and a text of
16 to 128 tokens; each request its own 16 to 64 new tokens, EOS ignored. Padded ``generate``
runs groups of 16 chats (processed together, left-padded; ``min_new_tokens = max_new_tokens =``
the group's largest), credited with each request's own tokens only. Both sides' time in the
vision encoder (the model's ``visual`` module) is measured in the same run. Engine start is
outside the timed region; one warm-up request runs first on each side.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import acb  # noqa: E402


def build() -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForImageTextToText

    from tests.vlm_models import _qwen_vl  # the tiny builder, scaled up here

    config, processor = _qwen_vl("qwen3_vl")
    text, vision = config.text_config, config.vision_config
    for k, v in dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4
    ).items():
        setattr(text, k, v)
    for k, v in dict(hidden_size=128, intermediate_size=256, num_heads=4, depth=2, out_hidden_size=256).items():
        setattr(vision, k, v)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, processor


def workload(n: int, seed: int = 0) -> tuple[list[list[dict]], list[int]]:
    from tests.vlm_models import image

    rng = random.Random(seed)
    chats, outs = [], []
    for i in range(n):
        images = [
            image(seed * 1000 + 10 * i + j, (rng.randrange(48, 129, 16), rng.randrange(48, 129, 16)))
            for j in range(1 if rng.random() < 0.75 else 2)
        ]
        text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(16, 128)))
        content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
        chats.append([{"role": "user", "content": content}])
        outs.append(rng.randint(16, 64))
    return chats, outs


class VisionClock:
    """Seconds spent in the model's vision tower (a forward pre/post hook pair)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.seconds, self._t0 = 0.0, 0.0
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._stop)

    def _start(self, *args: object) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, *args: object) -> None:
        self.seconds += time.perf_counter() - self._t0


def run_acb(model, processor, chats, outs, clock: VisionClock) -> dict:
    cfg = acb.ContinuousBatchingConfig(max_requests_per_batch=32, max_batch_tokens=2048)
    with acb.Engine(model, cfg, processor=processor) as eng:
        eng.generate(chats[0], max_new_tokens=2, ignore_eos=True)  # warm-up
        params = [acb.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in outs]
        clock.seconds = 0.0
        t0 = time.perf_counter()
        res = eng.generate_batch(chats, params, progress_bar=False)
        wall = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in res.values())
    assert tokens == sum(outs), (tokens, sum(outs))
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "vision_s": clock.seconds}


def run_generate(model, processor, chats, outs, clock: VisionClock, batch: int = 16) -> dict:
    processor.tokenizer.padding_side = "left"
    kw = dict(return_dict=True, return_tensors="pt", add_generation_prompt=True, tokenize=True, padding=True)
    with torch.no_grad():
        model.generate(**processor.apply_chat_template([chats[0]], **kw), max_new_tokens=2)  # warm-up
        clock.seconds = 0.0
        t0 = time.perf_counter()
        for a in range(0, len(chats), batch):
            inputs = processor.apply_chat_template(chats[a : a + batch], **kw)
            n = max(outs[a : a + batch])
            model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(outs) / wall, "wall_s": wall, "vision_s": clock.seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/vlm_cpu.json")
    args = ap.parse_args()
    model, processor = build()
    clock = VisionClock(model.model.visual)
    chats, outs = workload(args.requests)
    a = run_acb(model, processor, chats, outs, clock)
    g = run_generate(model, processor, chats, outs, clock)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "requests": args.requests,
        "new_tokens": "16-64",
        "acb": a,
        "generate": g,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.requests} image+text requests, 16-64 new tokens each, {result['date']}, {result['machine']}\n")
    print("| side | tok/s | wall s | vision encoder s | acb / generate |")
    print("|---|---|---|---|---|")
    print(
        f"| acb | {a['tokens_per_s']:.0f} | {a['wall_s']:.1f} | {a['vision_s']:.2f} | {a['tokens_per_s'] / g['tokens_per_s']:.2f}x |"
    )
    print(f"| padded generate (batch 16) | {g['tokens_per_s']:.0f} | {g['wall_s']:.1f} | {g['vision_s']:.2f} | 1.00x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
