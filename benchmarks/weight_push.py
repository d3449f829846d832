"""Remote rollouts: what a weight push costs, and GRPO steps per minute remote vs colocated.

    python benchmarks/weight_push.py [--layers 28] [--no-ray] [--out benchmarks/results/weight_push_cpu.json]

1. A Qwen3-0.6B-shaped model (hidden 1024, 28 layers, 16 heads, 8 KV heads, MLP 3072,
   vocabulary 151,936; random weights, bfloat16: 0.6B parameters, 1.2 GB), saved as a
   checkpoint on local disk. It is served by ``acb serve --enable-weight-updates`` processes
   on this machine, and pushed from this process over gloo (:class:`acb.rl.WeightPusher`,
   256 MiB buckets) to one server, to two servers at once, and to the two replicas of one
   ``acb serve --ray --num-replicas 2`` (``--ray``; the ingress fans the routes out to both).
   That is set against ``POST /update_weights_from_disk`` of the same checkpoint, all in the
   same run.
   With a LoRA adapter (r=16 on every attention and MLP linear, ``peft.get_peft_model``) loaded
   on the server (``--lora-modules policy=...``), the push of the adapter only
   (``WeightPusher.push(peft_model, lora="policy")``, what a GRPO trainer with a ``peft_config``
   sends) is set against the push of the whole model, to the same server in the same run
   (``--lora-only`` runs just that: ``results/weight_push_lora_cpu.json``).
2. TRL's ``GRPOTrainer`` on the embedded tiny model, 4 steps of 16 completions of at most 32
   tokens. It runs colocated, on acb in the trainer's process (``use_acb``), and remote, on an
   ``acb serve`` process (``acb.rl.rollout_func``, with the weights pushed after each step). The
   figure is steps per minute for each.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from acb.rl import PushWeights, WeightPusher, rollout_func  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """``acb serve --enable-weight-updates`` on a free port."""

    def __init__(self, ckpt: Path, name: str, log: Path, extra: list[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "acb", "serve", "--model", str(ckpt), "--port", str(self.port)]
        args += ["--served-model-name", name, "--enable-weight-updates", "--num-blocks", "64", *extra]
        self.proc = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=5).status == 200 and self.world_ready():
                    return
            except OSError:
                time.sleep(0.5)
            assert self.proc.poll() is None, log.read_text()[-3000:]
        raise TimeoutError(log.read_text()[-3000:])

    def world_ready(self) -> bool:
        """Every replica up (``--ray``: the ingress answers ``/get_world_size`` once all are)."""
        try:
            with urllib.request.urlopen(self.url + "/get_world_size", timeout=120) as r:
                return json.loads(r.read())["world_size"] >= 1
        except OSError:
            time.sleep(0.5)
            return False

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=1200) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)


def qwen3_06b(layers: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3",
        hidden_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def push_figures(layers: int, tmp: Path) -> dict:
    model = qwen3_06b(layers)
    params = sum(p.numel() for p in model.parameters())
    ckpt = tmp / "qwen3-0.6b"
    model.save_pretrained(ckpt)
    from acb.models import build_tokenizer

    build_tokenizer().save_pretrained(ckpt)
    out: dict = {"parameters": params, "bytes": sum(p.nbytes for p in model.parameters()), "checkpoint": str(ckpt)}
    servers = [Served(ckpt, "qwen", tmp / f"serve{i}.log") for i in range(2)]
    try:
        for n in (1, 2):
            with WeightPusher([s.url for s in servers[:n]], master_port=free_port(), timeout_s=600) as pusher:
                pusher.init()
                pusher.push(model, version=f"warm-{n}")  # (the group's connections, first allocations)
                t0 = time.perf_counter()
                pusher.push(model, version=f"push-{n}")
                out[f"push_{n}_servers_s"] = time.perf_counter() - t0
        servers[0].post("/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "warm"})
        t0 = time.perf_counter()
        servers[0].post("/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "disk"})
        out["load_from_disk_s"] = time.perf_counter() - t0  # (the checkpoint in the page cache)
    finally:
        for s in servers:
            s.stop()
    return out


def lora_push_figures(layers: int, tmp: Path, ckpt: Path | None = None, rank: int = 16) -> dict:
    """Bytes and seconds of pushing a LoRA adapter only vs the whole model, to one server that
    serves both (the second push of each: the first warms the group and the allocations)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    model = qwen3_06b(layers)
    if ckpt is None:
        ckpt = tmp / "qwen3-0.6b"
        model.save_pretrained(ckpt)
        from acb.models import build_tokenizer

        build_tokenizer().save_pretrained(ckpt)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    )
    peft_model.save_pretrained(tmp / "policy")
    adapter = get_peft_model_state_dict(peft_model)
    out: dict = {
        "rank": rank,
        "targets": targets,
        "adapter_tensors": len(adapter),
        "adapter_dtype": str(next(iter(adapter.values())).dtype).removeprefix("torch."),
        "adapter_bytes": sum(t.nbytes for t in adapter.values()),
        "model_bytes": sum(p.nbytes for p in model.parameters()),
    }
    lora = ["--max-loras", "1", "--max-lora-rank", str(rank), "--lora-modules", f"policy={tmp / 'policy'}"]
    server = Served(ckpt, "qwen", tmp / "serve-lora.log", lora)
    try:
        with WeightPusher([server.url], master_port=free_port(), timeout_s=600) as pusher:
            pusher.init()
            for what, push in (
                ("model", lambda v: pusher.push(model, version=v)),
                ("adapter", lambda v: pusher.push(peft_model, version=v, lora="policy")),
            ):
                push(f"warm-{what}")
                times = []
                for i in range(3):
                    t0 = time.perf_counter()
                    push(f"{what}-{i}")
                    times.append(time.perf_counter() - t0)
                out[f"push_{what}_s"] = min(times)
                out[f"push_{what}_all_s"] = times
    finally:
        server.stop()
    return out


def ray_push_figure(layers: int, ckpt: Path, tmp: Path) -> float:
    """Seconds of the second push to ``acb serve --ray --num-replicas 2`` (run last: Ray's
    processes outlive its shutdown for a while, and would share the cores with what follows)."""
    model = qwen3_06b(layers)
    replicas = Served(ckpt, "qwen", tmp / "serve-ray.log", ["--ray", "--num-replicas", "2"])
    try:
        with WeightPusher([replicas.url], master_port=free_port(), timeout_s=600) as pusher:
            assert pusher.world_sizes() == [2]
            pusher.push(model, version="warm-ray")
            t0 = time.perf_counter()
            pusher.push(model, version="push-ray")
            return time.perf_counter() - t0
    finally:
        replicas.stop()


def grpo_figures(tmp: Path, steps: int = 4) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from acb.integrations.trl import use_acb
    from acb.models import build_tokenizer, tiny_model

    tok = build_tokenizer()
    base = tiny_model("llama", seed=3, vocab_size=len(tok))
    ds = Dataset.from_list([{"prompt": f"question {i}: what is {i} plus {2 * i}?"} for i in range(16)])

    def reward(prompts, completions, completion_ids, **kw):
        return [(sum(c) % 97) / 97.0 for c in completion_ids]

    def args(colocated: bool) -> GRPOConfig:
        return GRPOConfig(
            output_dir=str(tmp / "out"),
            per_device_train_batch_size=16,
            num_generations=4,
            max_completion_length=32,
            max_steps=steps,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            seed=0,
            learning_rate=0.01,
            use_transformers_continuous_batching=colocated,
            transformers_continuous_batching_config={"num_blocks": 256, "max_batch_tokens": 512} if colocated else None,
        )

    out = {}
    model = copy.deepcopy(base)
    trainer = GRPOTrainer(model=model, args=args(True), reward_funcs=reward, processing_class=tok, train_dataset=ds)
    with use_acb(trainer):
        t0 = time.perf_counter()
        trainer.train()
        out["colocated_steps_per_min"] = steps * 60 / (time.perf_counter() - t0)
    ckpt = tmp / "tiny"
    base.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    server = Served(ckpt, "tiny", tmp / "serve-tiny.log", ["--page-size", "16", "--num-blocks", "256"])
    try:
        model = copy.deepcopy(base)
        with WeightPusher([server.url], master_port=free_port(), timeout_s=120) as pusher:
            trainer = GRPOTrainer(
                model=model,
                args=args(False),
                reward_funcs=reward,
                processing_class=tok,
                train_dataset=ds,
                rollout_func=rollout_func(server.url, "tiny"),
                callbacks=[PushWeights(pusher)],
            )
            pusher.push(model, version=0)
            t0 = time.perf_counter()
            trainer.train()
            out["remote_steps_per_min"] = steps * 60 / (time.perf_counter() - t0)
    finally:
        server.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--no-ray", action="store_true", help="skip the push to acb serve --ray's two replicas")
    ap.add_argument("--out", default=None, help="default: results/weight_push_cpu.json (--lora-only: _lora_cpu)")
    ap.add_argument("--lora-only", action="store_true", help="only the adapter-only push against the whole model's")
    a = ap.parse_args()
    if a.lora_only:
        with tempfile.TemporaryDirectory() as d:
            lora = lora_push_figures(a.layers, Path(d))
        return report_lora(lora, a.out or "benchmarks/results/weight_push_lora_cpu.json")
    a.out = a.out or "benchmarks/results/weight_push_cpu.json"
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        push = push_figures(a.layers, tmp)
        push["lora"] = lora_push_figures(a.layers, tmp, Path(push["checkpoint"]))
        grpo = grpo_figures(tmp)
        if not a.no_ray:
            push["push_2_ray_replicas_s"] = ray_push_figure(a.layers, Path(push["checkpoint"]), tmp)
        del push["checkpoint"]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "push": push,
        "grpo": grpo,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    gb = push["bytes"] / 1e9
    print(f"Qwen3-0.6B shape: {push['parameters'] / 1e6:.0f}M parameters, {gb:.2f} GB bfloat16\n")
    print("| what | seconds | GB/s |")
    print("|---|---|---|")
    for key, label in (
        ("push_1_servers_s", "push over gloo, one server"),
        ("push_2_servers_s", "push over gloo, two servers"),
        ("push_2_ray_replicas_s", "push over gloo, acb serve --ray, two replicas"),
        ("load_from_disk_s", "update_weights_from_disk"),
    ):
        if key in push:
            print(f"| {label} | {push[key]:.1f} | {gb / push[key]:.2f} |")
    print(
        f"\nGRPO steps per minute (tiny model): colocated {grpo['colocated_steps_per_min']:.1f}, "
        f"remote {grpo['remote_steps_per_min']:.1f}"
    )
    print_lora(push["lora"])
    return 0


def print_lora(lora: dict) -> None:
    print(f"\nLoRA r={lora['rank']} on {', '.join(lora['targets'])} ({lora['adapter_dtype']}), one server:")
    print("| push | MB | seconds |")
    print("|---|---|---|")
    for what in ("model", "adapter"):
        print(f"| {what} | {lora[f'{what}_bytes'] / 1e6:.1f} | {lora[f'push_{what}_s']:.3f} |")


def report_lora(lora: dict, out: str) -> int:
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "lora": lora,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print_lora(lora)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
