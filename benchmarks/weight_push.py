"""Remote rollouts: what a weight push costs against the wire's own speed, and GRPO steps per
minute remote vs colocated.

    python benchmarks/weight_push.py [--layers 28] [--servers 1,4] [--server-dtype bfloat16]
        [--no-ray] [--no-grpo] [--with-lora] [--out benchmarks/results/weight_push_cpu.json]

1. A Qwen3-0.6B-shaped model (hidden 1024, ``--layers`` layers (28 in Qwen3-0.6B), 16 heads,
   8 KV heads, MLP 3072, vocabulary 151,936, tied embeddings; random weights, bfloat16), saved
   as a checkpoint on local disk. It is served by ``acb serve --enable-weight-updates`` processes
   on this machine (``--server-dtype``), and pushed from this process over gloo
   (:class:`acb.rl.WeightPusher`, 256 MiB buckets) to one server, to four at once, and to the
   two replicas of one ``acb serve --ray --num-replicas 2`` (the ingress fans the routes out to
   both). Beside each, in the same run and the same processes' layout (this process rank 0, one
   rank per receiver), a raw ``torch.distributed`` broadcast of the same bytes in the same
   buckets over gloo, to as many plain processes that receive into buffers allocated once: the
   wire's speed here, the bound for a push. The two alternate, round by round (``--rounds``,
   5: raw, push, raw, push, ...), after two pushes that set up the group (and the servers' two
   sets of receive buffers): the figures are each side's best, and the median of the rounds'
   ratios (raw / push; the machine's drift falls on both sides of a round alike). That is set against ``POST /update_weights_from_disk`` of the same
   checkpoint. ``--with-lora`` (or ``--lora-only``: ``results/weight_push_lora_cpu.json``): the
   push of a LoRA adapter only (r=16 on every attention and MLP linear) against the whole
   model's, to one server serving both.
2. TRL's ``GRPOTrainer`` on the embedded tiny model, 6 steps of 16 completions of at most 32
   tokens: colocated, on acb in the trainer's process (``use_acb``); remote, on an ``acb serve``
   process (``acb.rl.rollout_func``, the weights pushed after each step by ``PushWeights``); and
   remote with ``PushWeights(max_staleness=1)`` (the push in flight while the next batch
   generates). The figure is steps per minute over the steady steps (the first left out), with
   a step's split: generate, push (the trainer's thread pushing or waiting for a push), train.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
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
from acb.weight_transfer import DEFAULT_BUCKET_BYTES  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """``acb serve --enable-weight-updates`` on a free port."""

    threads = 1  # each server's intra-op threads (OMP_NUM_THREADS; --server-threads)

    def __init__(self, ckpt: Path, name: str, log: Path, extra: list[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "acb", "serve", "--model", str(ckpt), "--port", str(self.port)]
        args += ["--served-model-name", name, "--enable-weight-updates", "--num-blocks", "64", "-v", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        self.proc = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
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


RAW_RECEIVER = r"""
import datetime, os, sys, torch, torch.distributed as dist
port, world, rank, rounds = map(int, sys.argv[1:5])
sizes = [int(s) for s in sys.argv[5].split(",")]
timeout = datetime.timedelta(seconds=600)
store = dist.TCPStore("127.0.0.1", port, None, False, timeout, wait_for_workers=False)
pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, world, timeout)
bufs = [torch.empty(s, dtype=torch.uint8) for s in sizes]  # allocated once, reused every round
opts = dist.BroadcastOptions()
opts.rootRank = 0
for _ in range(rounds):
    for b in bufs:
        pg.broadcast([b], opts).wait()
    pg.barrier().wait()
pg.shutdown()
sys.stdout.flush()
os._exit(0)  # (no destructors at exit: gloo's threads may abort the process there)
"""


class RawBroadcast:
    """A raw ``torch.distributed`` broadcast of the same bytes as a push, in the same buckets,
    over gloo, from this process (rank 0) to ``receivers`` plain processes (one rank each), the
    buffers allocated once on both sides: the wire's speed on this machine, the bound for a push.
    The receivers stay up for ``rounds`` rounds (:meth:`round`), so rounds can alternate with
    acb's pushes; each round ends with a barrier (every receiver has every byte)."""

    def __init__(self, tensors: list[torch.Tensor], bucket_bytes: int, receivers: int, rounds: int) -> None:
        import datetime

        import torch.distributed as dist

        from acb.weight_transfer import buckets

        self.flats = []
        for b in buckets([t.shape for t in tensors], [t.dtype for t in tensors], bucket_bytes):
            self.flats.append(torch.cat([tensors[i].reshape(-1).view(torch.uint8) for i in b]))
        port = free_port()
        world = receivers + 1
        sizes = ",".join(str(f.numel()) for f in self.flats)
        timeout = datetime.timedelta(seconds=600)
        self.store = dist.TCPStore("127.0.0.1", port, None, True, timeout, wait_for_workers=False)
        self.procs = [
            subprocess.Popen([sys.executable, "-c", RAW_RECEIVER, str(port), str(world), str(r), str(rounds), sizes])
            for r in range(1, world)
        ]
        self.left = rounds
        try:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", self.store), 0, world, timeout)
        except BaseException:
            self.close()
            raise
        self.opts = dist.BroadcastOptions()
        self.opts.rootRank = 0

    def round(self) -> float:
        assert self.left > 0, "the receivers were started for fewer rounds"
        self.left -= 1
        t0 = time.perf_counter()
        for f in self.flats:
            self.pg.broadcast([f], self.opts).wait()
        self.pg.barrier().wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            if hasattr(self, "pg"):
                while self.left > 0:  # (the receivers loop their rounds)
                    self.round()
                self.pg.shutdown()
                for p in self.procs:
                    assert p.wait(timeout=120) == 0
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()


def paired(urls: list[str], model: torch.nn.Module, receivers: int, bucket_bytes: int, rounds: int) -> dict:
    """acb's push (:class:`acb.rl.WeightPusher`) of ``model`` to the servers at ``urls`` and the
    raw broadcast of the same bytes to ``receivers`` plain processes, in alternating rounds
    (raw, push, raw, push, ...: the machine's drift and other load fall on both alike), after
    two pushes that warm the group's connections and the servers' two sets of receive buffers
    (on CPU a push is received into the set the served weights do not use: each set's first push
    pays its page faults) and one raw round that warms the raw group's. A push ends when every
    server answered: checked, received, staged and swapped in. Returns each side's seconds per
    round and each round's ratio raw / push (acb's share of the wire's speed)."""
    raw = RawBroadcast([t.detach() for t in weights_of(model)], bucket_bytes, receivers, rounds + 1)
    try:
        with WeightPusher(urls, master_port=free_port(), timeout_s=600, bucket_bytes=bucket_bytes) as pusher:
            pusher.push(model, version="warm")
            pusher.push(model, version="warm-2")
            raw.round()
            raw_s, push_s = [], []
            for i in range(rounds):
                raw_s.append(raw.round())
                t0 = time.perf_counter()
                pusher.push(model, version=f"push-{i}")
                push_s.append(time.perf_counter() - t0)
    finally:
        raw.close()
    ratios = sorted(r / p for r, p in zip(raw_s, push_s))
    return {"raw_s": raw_s, "push_s": push_s, "ratio_median": ratios[len(ratios) // 2], "ratio_min": ratios[0]}


def push_figures(
    layers: int, tmp: Path, counts: tuple[int, ...], bucket_bytes: int, dtype: str, rounds: int = 5
) -> dict:
    model = qwen3_06b(layers)
    params = sum(p.numel() for p in model.parameters())
    ckpt = tmp / "qwen3-0.6b"
    model.save_pretrained(ckpt)
    from acb.models import build_tokenizer

    build_tokenizer().save_pretrained(ckpt)
    tensors = [t.detach() for t in weights_of(model)]
    out: dict = {
        "layers": layers,
        "parameters": params,
        "bytes": sum(t.nbytes for t in tensors),
        "bucket_bytes": bucket_bytes,
        "server_dtype": dtype,
        "server_threads": Served.threads,
        "checkpoint": str(ckpt),
    }
    servers = [Served(ckpt, "qwen", tmp / f"serve{i}.log", ["--dtype", dtype]) for i in range(max(counts))]
    try:
        for n in counts:  # the raw broadcast and acb's push in alternating rounds
            pair = paired([s.url for s in servers[:n]], model, n, bucket_bytes, rounds)
            out[f"{n}_servers"] = pair
            out[f"raw_{n}_servers_s"] = min(pair["raw_s"])
            out[f"push_{n}_servers_s"] = min(pair["push_s"])
        servers[0].post("/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "warm"})
        t0 = time.perf_counter()
        servers[0].post("/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "disk"})
        out["load_from_disk_s"] = time.perf_counter() - t0  # (the checkpoint in the page cache)
    finally:
        for s in servers:
            s.stop()
    return out


def weights_of(model: torch.nn.Module) -> list[torch.Tensor]:
    """What a push of ``model`` sends, in its order (a tied weight once: acb sends it once)."""
    from acb.runner.weight_update import weight_targets

    return list({id(t): t for t in weight_targets(model).values()}.values())


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


def ray_push_figure(layers: int, ckpt: Path, tmp: Path, bucket_bytes: int, dtype: str, rounds: int = 5) -> dict:
    """Seconds of acb's push to ``acb serve --ray --num-replicas 2``, and of the raw broadcast to
    two plain processes beside it while the deployment is up (run last: Ray's processes outlive
    its shutdown for a while, and would share the cores with what follows)."""
    model = qwen3_06b(layers)
    replicas = Served(ckpt, "qwen", tmp / "serve-ray.log", ["--ray", "--num-replicas", "2", "--dtype", dtype])
    try:
        with WeightPusher([replicas.url], master_port=free_port(), timeout_s=600) as pusher:
            assert pusher.world_sizes() == [2]
        pair = paired([replicas.url], model, 2, bucket_bytes, rounds)
        return {
            "2_ray_replicas": pair,
            "raw_2_ray_replicas_s": min(pair["raw_s"]),
            "push_2_ray_replicas_s": min(pair["push_s"]),
        }
    finally:
        replicas.stop()


class StepTimes:
    """A ``TrainerCallback`` (duck-typed) timing each optimizer step, from its start to the end of
    the callbacks before it (put it after ``PushWeights``: a step then includes its push)."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self._t0 = 0.0

    def __getattr__(self, name: str):
        if name.startswith("on_"):
            return lambda *a, **kw: None
        raise AttributeError(name)

    def on_step_begin(self, *a, **kw) -> None:
        self._t0 = time.perf_counter()

    def on_step_end(self, *a, **kw) -> None:
        self.steps.append(time.perf_counter() - self._t0)


def timed(fn, times: list[float]):
    def call(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            times.append(time.perf_counter() - t0)

    return call


def split(steps: list[float], generate: list[float], push: list[float]) -> dict:
    """Steps per minute over the steady steps (the first, with the engine's start, left out), and
    a steady step's mean split: generate, push (what the trainer's thread spent pushing or waiting
    for a push), train (the rest: the loss, backward, optimizer, TRL's own work)."""
    n = len(steps) - 1
    gen = sum(generate[1 : n + 1]) / n
    pushed = sum(push[1 : n + 1]) / n if push else 0.0
    step = sum(steps[1:]) / n
    return {
        "steps_per_min": 60 / step,
        "step_s": step,
        "split_s": {"generate": gen, "push": pushed, "train": step - gen - pushed},
        "first_step_s": steps[0],
    }


def grpo_figures(tmp: Path, steps: int = 6) -> dict:
    """GRPO steps per minute colocated (acb in the trainer's process), remote (``acb serve``,
    the weights pushed after each step), and remote with ``PushWeights(max_staleness=1)`` (the
    push in flight while the next batch generates), in the same run, with each step's split."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from acb.integrations.trl import use_acb
    from acb.models import build_tokenizer, tiny_model

    tok = build_tokenizer()
    base = tiny_model("llama", seed=3, vocab_size=len(tok))
    ds = Dataset.from_list([{"prompt": f"question {i}: what is {i} plus {2 * i}?"} for i in range(4 * steps)])

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
            disable_tqdm=True,
            use_transformers_continuous_batching=colocated,
            transformers_continuous_batching_config={"num_blocks": 256, "max_batch_tokens": 512} if colocated else None,
        )

    out: dict = {"steps": steps, "completions_per_step": 16, "max_completion_length": 32}
    model = copy.deepcopy(base)
    timer, gen = StepTimes(), []
    trainer = GRPOTrainer(
        model=model, args=args(True), reward_funcs=reward, processing_class=tok, train_dataset=ds, callbacks=[timer]
    )
    with use_acb(trainer) as rollouts:
        model.generate_batch = timed(rollouts, gen)
        trainer.train()
        model.generate_batch = rollouts  # (as installed, for use_acb to take back)
    out["colocated"] = split(timer.steps, gen, [])
    ckpt = tmp / "tiny"
    base.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    server = Served(ckpt, "tiny", tmp / "serve-tiny.log", ["--page-size", "16", "--num-blocks", "256"])
    try:
        for name, staleness in (("remote", 0), ("remote_max_staleness_1", 1)):
            model = copy.deepcopy(base)
            with WeightPusher([server.url], master_port=free_port(), timeout_s=120) as pusher:
                timer, gen = StepTimes(), []
                push = PushWeights(pusher, max_staleness=staleness)
                trainer = GRPOTrainer(
                    model=model,
                    args=args(False),
                    reward_funcs=reward,
                    processing_class=tok,
                    train_dataset=ds,
                    rollout_func=timed(rollout_func(server.url, "tiny"), gen),
                    callbacks=[push, timer],
                )
                pusher.push(model, version=0)
                trainer.train()
                out[name] = split(timer.steps, gen, push.waited_s)
                out[name]["push_s_each"] = sum(push.push_s[1:]) / max(len(push.push_s) - 1, 1)
    finally:
        server.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--servers", default="1,4", help="server counts to push to, comma-separated")
    ap.add_argument("--bucket-mib", type=int, default=DEFAULT_BUCKET_BYTES >> 20)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of raw broadcast and push per layout")
    ap.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="each server's OMP_NUM_THREADS (1: as Ray gives a 1-CPU replica; more oversubscribes 2 cores)",
    )
    ap.add_argument(
        "--server-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the servers' --dtype (float32: each swap also casts the pushed bfloat16)",
    )
    ap.add_argument("--no-ray", action="store_true", help="skip the push to acb serve --ray's two replicas")
    ap.add_argument("--no-grpo", action="store_true", help="skip part 2 (GRPO steps per minute)")
    ap.add_argument("--grpo-only", action="store_true", help="only part 2")
    ap.add_argument("--grpo-steps", type=int, default=6)
    ap.add_argument("--with-lora", action="store_true", help="also the adapter-only push (part 1's LoRA figure)")
    ap.add_argument("--out", default=None, help="default: results/weight_push_cpu.json (--lora-only: _lora_cpu)")
    ap.add_argument("--lora-only", action="store_true", help="only the adapter-only push against the whole model's")
    a = ap.parse_args()
    if a.lora_only:
        with tempfile.TemporaryDirectory() as d:
            lora = lora_push_figures(a.layers, Path(d))
        return report_lora(lora, a.out or "benchmarks/results/weight_push_lora_cpu.json")
    a.out = a.out or "benchmarks/results/weight_push_cpu.json"
    if a.grpo_only:
        with tempfile.TemporaryDirectory() as d:
            grpo = grpo_figures(Path(d), a.grpo_steps)
        Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "grpo": grpo}, indent=1) + "\n")
        print_grpo(grpo)
        return 0
    counts = tuple(int(n) for n in a.servers.split(","))
    Served.threads = a.server_threads
    bucket_bytes = a.bucket_mib << 20
    grpo = None
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        push = push_figures(a.layers, tmp, counts, bucket_bytes, a.server_dtype, a.rounds)
        if a.with_lora:
            push["lora"] = lora_push_figures(a.layers, tmp, Path(push["checkpoint"]))
        if not a.no_grpo:
            grpo = grpo_figures(tmp, a.grpo_steps)
        if not a.no_ray:
            push.update(
                ray_push_figure(a.layers, Path(push["checkpoint"]), tmp, bucket_bytes, a.server_dtype, a.rounds)
            )
        del push["checkpoint"]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "push": push,
    }
    if grpo is not None:
        result["grpo"] = grpo
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    gb = push["bytes"] / 1e9
    print(
        f"Qwen3-0.6B shape, {push['layers']} layers: {push['parameters'] / 1e6:.0f}M parameters, "
        f"{gb:.2f} GB bfloat16, {push['bucket_bytes'] >> 20} MiB buckets, servers in {push['server_dtype']}, "
        f"{push['server_threads']} thread(s) each\n"
    )
    print("| to | raw broadcast s (best) | raw GB/s | acb push s (best) | acb GB/s | best / best | median of rounds |")
    print("|---|---|---|---|---|---|---|")
    for n in counts:
        row(push, f"{n} servers", f"{n}_servers")
    row(push, "acb serve --ray, 2 replicas", "2_ray_replicas")
    print(f"\nupdate_weights_from_disk: {push['load_from_disk_s']:.2f} s, {gb / push['load_from_disk_s']:.2f} GB/s")
    if grpo is not None:
        print_grpo(grpo)
    if "lora" in push:
        print_lora(push["lora"])
    return 0


def row(push: dict, label: str, key: str) -> None:
    if key not in push:
        return
    gb = push["bytes"] / 1e9
    pair = push[key]
    r, o = min(pair["raw_s"]), min(pair["push_s"])
    print(
        f"| {label} | {r:.2f} | {gb / r:.2f} | {o:.2f} | {gb / o:.2f} | {100 * r / o:.0f}% "
        f"| {100 * pair['ratio_median']:.0f}% |"
    )


def print_grpo(grpo: dict) -> None:
    print("\nGRPO (tiny model): steps per minute, and a steady step's split in seconds")
    for name, run in grpo.items():
        if isinstance(run, dict):
            split = ", ".join(f"{k} {v:.3f}" for k, v in run.get("split_s", {}).items())
            print(f"- {name}: {run['steps_per_min']:.1f} steps/min ({split})")


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
