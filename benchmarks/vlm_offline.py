"""Images in, text out: acb against padded ``model.generate`` on 64 image+text requests, in one run.

    python benchmarks/vlm_offline.py [--requests 64] [--shared K] [--rounds 3]
        [--vision-depth 2 --vision-hidden 128] [--out benchmarks/results/vlm_cpu.json]

Model (random weights, float32, CPU): Qwen3-VL-shaped (DeepStack, M-RoPE), text hidden 256, 4
layers, 16 heads (4 KV heads), vocabulary of the byte-level tokenizer; a vision tower of depth
2, hidden 128 (``--vision-depth``, ``--vision-hidden``), patches of 8 merged 2x2: an image of 48
to 128 pixels a side is 9 to 64 image tokens. Workload: 64 chats, each one image (three in four)
or two, of random sizes, all distinct, and a text of 16 to 128 tokens; with ``--shared K``, each
chat one of K images (chat i the image i % K) and its own question. Each request its own 16 to 64
new tokens, EOS ignored. Padded ``generate`` runs groups of 16 chats (processed together,
left-padded; ``min_new_tokens = max_new_tokens =`` the group's largest), credited with each
request's own tokens only. Three sides, alternating, ``--rounds`` times, each side's best kept (and
every round's figure written): acb; acb with its per-image cache of image features off
(``acb.runner.media.IMAGE_FEATURE_CACHE = False``: each request's images go through the tower with
it, as before the cache); padded ``generate``. Each side's seconds in the vision tower (the model's
``visual`` module) and its calls are measured in the same run. Engine start is outside the timed
region, and so is a warm-up with the engine's one-time checks (two requests' images embedded
together against each alone; the first features joined from the cache against the model's own).

Measured 2026-11-29 on the 2-core CPU shared with other workers, with ``OMP_NUM_THREADS=1`` (at two
threads, beside another process, every side ran 5-20x slower and no two rounds agreed: acb 59, 291
and 132 tok/s, no cache 59, 70, 76, ``generate`` 48, 61, 133), tok/s per round:

- ``--shared 8`` (64 requests, 8 images; ``results/vlm_shared_cpu.json``): acb 834 / 840 / 1293, no
  cache 741 / 764 / 1119, ``generate`` 559 / 666 / 799; 1 tower call (8 images run, 56 reused) against
  25 calls and 4 calls, 0.02 s in the tower against 0.23 s and 0.19 s. Best: 1.62x ``generate``,
  1.16x acb without the cache.
- ``--shared 8 --vision-depth 8 --vision-hidden 256`` (``results/vlm_shared_big_cpu.json``): acb
  638 / 724 / 681, no cache 471 / 465 / 442, ``generate`` 399 / 401 / 395; 0.23 s in the tower against
  2.07 s and 1.81 s. Best: 1.80x ``generate``, 1.54x acb without the cache.
- distinct images, 5 rounds (``results/vlm_ab_cpu.json``): acb 488 / 557 / 791 / 575 / 572, no cache
  541 / 509 / 705 / 518 / 527, ``generate`` 340 / 456 / 428 / 389 / 395: the cache costs nothing seen
  when no image repeats (its hashing and cutting: about 15 ms of the run's 3.9 s, profiled).
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


def build(vision_depth: int = 2, vision_hidden: int = 128) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForImageTextToText

    from tests.vlm_models import _qwen_vl  # the tiny builder, scaled up here

    config, processor = _qwen_vl("qwen3_vl")
    text, vision = config.text_config, config.vision_config
    for k, v in dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4
    ).items():
        setattr(text, k, v)
    for k, v in dict(
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_heads=4,
        depth=vision_depth,
        out_hidden_size=256,
    ).items():
        setattr(vision, k, v)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, processor


def workload(n: int, seed: int = 0, shared: int = 0) -> tuple[list[list[dict]], list[int]]:
    """``n`` chats: one or two images each, all distinct, or (``shared`` K > 0) one of K images
    each (request i the image i % K), each with its own question."""
    from tests.vlm_models import image

    rng = random.Random(seed)
    pool = [image(seed * 1000 + 7 * j, (rng.randrange(48, 129, 16), rng.randrange(48, 129, 16))) for j in range(shared)]
    chats, outs = [], []
    for i in range(n):
        if shared:
            images = [pool[i % shared]]
        else:
            images = [
                image(seed * 1000 + 10 * i + j, (rng.randrange(48, 129, 16), rng.randrange(48, 129, 16)))
                for j in range(1 if rng.random() < 0.75 else 2)
            ]
        text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(16, 128)))
        content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
        chats.append([{"role": "user", "content": content}])
        outs.append(rng.randint(16, 64))
    return chats, outs


def warm_up_chat(k: int = 0, text: str = "hi") -> list[dict]:
    """A chat whose image is in no workload (so that it caches nothing the timed run uses)."""
    from tests.vlm_models import image

    return [
        {"role": "user", "content": [{"type": "image", "image": image(999_990 + k)}, {"type": "text", "text": text}]}
    ]


class VisionClock:
    """Seconds spent in the model's vision tower, and its calls (a forward pre/post hook pair)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.seconds, self.calls, self._t0 = 0.0, 0, 0.0
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._stop)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def _start(self, *args: object) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, *args: object) -> None:
        self.seconds += time.perf_counter() - self._t0
        self.calls += 1


def run_acb(model, processor, chats, outs, clock: VisionClock, feature_cache: bool = True) -> dict:
    from acb.runner import media as runner_media

    runner_media.IMAGE_FEATURE_CACHE = feature_cache  # (read when the engine starts)
    cfg = acb.ContinuousBatchingConfig(max_requests_per_batch=32, max_batch_tokens=2048)
    with acb.Engine(model, cfg, processor=processor) as eng:
        # warm-up, with the engine's one-time checks: several requests' images embedded together
        # against each alone, and (cache on) the first features joined from cached parts
        warm = acb.SamplingParams(max_new_tokens=2, ignore_eos=True)
        eng.generate_batch([warm_up_chat(0), warm_up_chat(1)], warm, progress_bar=False)
        eng.generate_batch([warm_up_chat(1, "again"), warm_up_chat(0, "again")], warm, progress_bar=False)
        params = [acb.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in outs]
        clock.reset()
        features = eng.runner.media.features
        computed, hits = features.computed, features.hits
        t0 = time.perf_counter()
        res = eng.generate_batch(chats, params, progress_bar=False)
        wall = time.perf_counter() - t0
        tower = {"images_computed": features.computed - computed, "images_reused": features.hits - hits}
    runner_media.IMAGE_FEATURE_CACHE = True
    tokens = sum(len(o.generated_tokens) for o in res.values())
    assert tokens == sum(outs), (tokens, sum(outs))
    return {
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "vision_s": clock.seconds,
        "tower_calls": clock.calls,
        **tower,
    }


def run_generate(model, processor, chats, outs, clock: VisionClock, batch: int = 16) -> dict:
    processor.tokenizer.padding_side = "left"
    kw = dict(return_dict=True, return_tensors="pt", add_generation_prompt=True, tokenize=True, padding=True)
    with torch.no_grad():
        model.generate(**processor.apply_chat_template([warm_up_chat()], **kw), max_new_tokens=2)  # warm-up
        clock.reset()
        t0 = time.perf_counter()
        for a in range(0, len(chats), batch):
            inputs = processor.apply_chat_template(chats[a : a + batch], **kw)
            n = max(outs[a : a + batch])
            model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(outs) / wall, "wall_s": wall, "vision_s": clock.seconds, "tower_calls": clock.calls}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--shared", type=int, default=0, help="K: the requests share K images (one each)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; each side's best is kept")
    ap.add_argument("--vision-depth", type=int, default=2)
    ap.add_argument("--vision-hidden", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = args.out or ("benchmarks/results/vlm_shared_cpu.json" if args.shared else "benchmarks/results/vlm_cpu.json")
    model, processor = build(args.vision_depth, args.vision_hidden)
    clock = VisionClock(model.model.visual)
    chats, outs = workload(args.requests, shared=args.shared)
    sides = {
        "acb": lambda: run_acb(model, processor, chats, outs, clock),
        "acb_no_feature_cache": lambda: run_acb(model, processor, chats, outs, clock, feature_cache=False),
        "generate": lambda: run_generate(model, processor, chats, outs, clock),
    }
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, run in sides.items():
            runs[name].append(run())
            print(f"round {r}: {name} {runs[name][-1]['tokens_per_s']:.0f} tok/s", flush=True)
    best = {name: max(rs, key=lambda x: x["tokens_per_s"]) for name, rs in runs.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "requests": args.requests,
        "shared_images": args.shared,
        "vision_tower": {"depth": args.vision_depth, "hidden": args.vision_hidden},
        "new_tokens": "16-64",
        "rounds": args.rounds,
        **best,
        "all_tokens_per_s": {name: [round(x["tokens_per_s"], 1) for x in rs] for name, rs in runs.items()},
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    what = f"sharing {args.shared} images" if args.shared else "with their own images"
    print(f"\n{args.requests} image+text requests {what}, 16-64 new tokens each, {result['date']}, {result['machine']}")
    print(f"best of {args.rounds} alternating rounds\n")
    print("| side | tok/s | wall s | vision tower s | tower calls | images run / reused | / generate |")
    print("|---|---|---|---|---|---|---|")
    g = best["generate"]["tokens_per_s"]
    for name, label in (
        ("acb", "acb"),
        ("acb_no_feature_cache", "acb, no per-image cache"),
        ("generate", "padded generate (16)"),
    ):
        b = best[name]
        run = f"{b['images_computed']} / {b['images_reused']}" if "images_computed" in b else ""
        calls = b.get("tower_calls", "")
        print(
            f"| {label} | {b['tokens_per_s']:.0f} | {b['wall_s']:.1f} | {b['vision_s']:.2f} | {calls} | {run} "
            f"| {b['tokens_per_s'] / g:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
