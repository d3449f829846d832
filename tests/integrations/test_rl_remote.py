"""RL past one process: ``acb serve --enable-weight-updates`` as the rollout server of a trainer
in another process, with the real pieces: a real ``acb serve`` process, ``torch.distributed``
over gloo, TRL's own ``GRPOTrainer`` with ``acb.rl.rollout_func`` and a callback that pushes the
weights after each optimizer step. No vLLM anywhere.

- Three GRPO steps: after each push the server's greedy output equals, token for token, an
  engine's in the trainer's process on the trainer's weights with the server's thread count
  (like with like: equal by construction when the push landed), and ``weight_version`` advances.
- A push with a wrong shape is a 4xx. The old weights still serve, and the next good push works.
- A request parked by ``POST /pause?mode=keep`` while the weights change finishes after
  ``/resume``, with spans saying which tokens came from which version.
- A trainer process killed mid-broadcast leaves the server serving its old weights, and it
  accepts a new ``/init_weight_transfer``.
- ``/update_weights_from_disk`` and the pause and sleep routes.
- Two trainers: the one whose group the server left is refused with a 409 (never its version on
  the other's tensors), its ``close()`` leaves the other's group alone; a seeded interleaving of
  two trainers' joins, pushes and closes keeps every served version on its own weights.
- A push that fails (a stall past the group's timeout, a meta tensor) raises ``WeightPushError``,
  and the same pusher's next push lands.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("trl")

import acb  # noqa: E402
from acb.errors import InvalidRequestError  # noqa: E402
from acb.models import build_tokenizer, tiny_model  # noqa: E402
from acb.rl import PushWeights, WeightPusher, WeightPushError, rollout_func  # noqa: E402
from acb.runner.weight_update import weight_targets  # noqa: E402
from tests.conftest import reference_generate  # noqa: E402
from tests.integrations.grpo import grpo_config, questions  # noqa: E402
from tests.serve.test_openai_server import CHAT_TEMPLATE, ROOT, _free_port, _serve  # noqa: E402

NAME = "tiny"
MAX_NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = tiny_model("llama", seed=3, vocab_size=len(tok))
    d = tmp_path_factory.mktemp("tiny-rl")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    # the server's LoRA adapter (a random one: GRPO's LoRA policy pushes its own over it)
    from peft import get_peft_model

    get_peft_model(copy.deepcopy(model), lora_config()).save_pretrained(d / "policy")
    return SimpleNamespace(dir=d, model=model, tok=tok, policy=d / "policy")


def lora_config():
    """The LoRA policy's config (the server's adapter folder and the trainer's ``peft_config``):
    random A and B from the start (``init_lora_weights=False``), so that the adapter changes tokens."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    args = ["--served-model-name", NAME, "--enable-weight-updates", "--num-blocks", "128", "--page-size", "8"]
    args += ["--max-loras", "1", "--max-lora-rank", "4", "--lora-modules", f"policy={checkpoint.policy}"]
    yield from _serve(checkpoint, tmp_path_factory, "rl", args, {"OMP_NUM_THREADS": str(SERVER_THREADS)})


def base(server) -> str:
    return server.url.removesuffix("/v1")


def post(server, path: str, body: dict | None = None, timeout: float = 120) -> dict:
    req = urllib.request.Request(
        base(server) + path, data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def greedy(server, prompt: list[int], n: int = MAX_NEW, model: str = NAME) -> tuple[list[int], object]:
    out = post(
        server,
        "/v1/completions",
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    return out["choices"][0]["token_ids"], out["weight_version"]


PROMPT = [5, 9, 14, 3, 77, 41, 8]


def shifted(model, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return out


GREEDY = acb.SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)


SERVER_THREADS = 1  # the server's intra-op threads (OMP_NUM_THREADS); Ray gives a 1-CPU replica 1 too


def served_reference(model, threads: int = SERVER_THREADS, lora=None) -> acb.Engine:
    """An acb engine on ``model``, made as the servers' are (page size 8, 128 blocks), whose thread
    runs ``threads`` intra-op threads, as theirs do: a lone greedy request runs the same kernels on
    the same shapes with the same thread count, so on the same weights its tokens are the served
    ones bit for bit. (``model.generate`` is not such a reference: it attends with other kernels,
    and the last bits of its logits differ from any engine's (about 1e-6 on these models); a
    CPU matmul of several rows also splits its work by thread count, and the trainer's process
    runs 1 thread under xdist, 2 otherwise. Where the weights after a GRPO step put two tokens
    within those bits of each other, its greedy tokens and the server's part.)"""
    loras = {"max_loras": 1, "max_lora_rank": 4} if lora is not None else {}
    eng = acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=128, **loras))
    was = torch.get_num_threads()
    torch.set_num_threads(threads)  # the engine thread takes torch's count at its first parallel op
    try:
        eng.start()
        if lora is not None:  # (the server's adapter: ``policy``)
            eng.add_lora("policy", lora)
        eng.generate(PROMPT, GREEDY)
        assert eng.call(lambda c: torch.get_num_threads()).result() == threads
    except BaseException:
        eng.shutdown()
        raise
    finally:
        torch.set_num_threads(was)
    return eng


def test_pushes_land_exactly_and_a_bad_push_changes_nothing(server, checkpoint):
    model = copy.deepcopy(checkpoint.model)
    start, _ = greedy(server, PROMPT)
    assert start == reference_generate(model, PROMPT, MAX_NEW)
    with WeightPusher([base(server)], master_port=_free_port(), timeout_s=60) as pusher:
        bad = [
            (n, torch.zeros(t.shape[0] + 1, *t.shape[1:])) if i == 0 else (n, t)
            for i, (n, t) in enumerate(model.named_parameters())
        ]
        with pytest.raises(WeightPushError, match="400.*shape"):
            pusher.push(bad, version=99)
        assert greedy(server, PROMPT) == (start, 0)  # the old weights still serve
        trained = shifted(model, 1)
        answers: list = []  # (each push's answers: how the server swapped it in)
        real_all = pusher._all
        pusher._all = lambda *a, **kw: answers.append(real_all(*a, **kw)) or answers[-1]
        assert pusher.push(trained, version=1) == 1
        got, version = greedy(server, PROMPT)
        assert version == 1 and got == reference_generate(trained, PROMPT, MAX_NEW) != start
        # float32 into the float32 server: the weights take the received buffers (no copy); the
        # next push is received into the group's other buffers, while the first's serve
        again = shifted(model, 2)
        assert pusher.push(again, version=2) == 2
        assert greedy(server, PROMPT) == (reference_generate(again, PROMPT, MAX_NEW), 2)
        half = copy.deepcopy(trained).to(torch.bfloat16)  # another dtype: cast by one copy
        assert pusher.push(half, version=3) == 3
        assert greedy(server, PROMPT) == (reference_generate(half.float(), PROMPT, MAX_NEW), 3)
        assert [a[0]["swap"] for a in answers] == ["rebind", "rebind", "copy"], answers


def grpo_three_steps(url: str, name: str, start, tok, tmp_path, served, threads: int = SERVER_THREADS) -> None:
    """TRL's GRPOTrainer with ``rollout_func`` on the server at ``url`` and a callback that pushes
    the weights after each optimizer step: three steps; after each push every replica's greedy
    tokens (``served()``: ``(tokens, version)`` per replica) are exactly those of an engine in
    this process on the trainer's weights (:func:`served_reference`: the servers' kernels, shapes
    and thread count, ``threads``), and the version is the step. A push that did not land, or
    landed other bits, serves other weights."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    model = copy.deepcopy(start)
    mirror = copy.deepcopy(start).eval()  # the trainer's weights, copied in after each step
    reference = served_reference(mirror, threads)
    pusher = WeightPusher([url], master_port=_free_port(), timeout_s=60)
    pusher.push(model, version=0)  # the server starts from the trainer's weights
    checks = []

    class Check(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # (after PushWeights: it was added first)
            with torch.no_grad():
                for mine, trained in zip(mirror.parameters(), model.parameters(), strict=True):
                    mine.copy_(trained)
            want = reference.generate(PROMPT, GREEDY).generated_tokens
            checks.append([(version, got == want) for got, version in served()])

    seen = []

    def reward(prompts, completions, completion_ids, **kw):
        seen.append([list(c) for c in completion_ids])
        return [(sum(c) % 97) / 97.0 for c in completion_ids]

    args = grpo_config(
        tmp_path / "out",
        max_completion_length=MAX_NEW,
        max_steps=3,
        temperature=1.0,
    )
    ds = questions()
    trainer = GRPOTrainer(
        model=model,
        args=args,
        reward_funcs=reward,
        processing_class=tok,
        train_dataset=ds,
        rollout_func=rollout_func(url, name),
        callbacks=[PushWeights(pusher), Check()],
    )
    try:
        trainer.train()
    finally:
        pusher.close()
        reference.shutdown()
    assert trainer.state.global_step == 3 and len(seen) == 3
    replicas = len(checks[0])
    assert checks == [[(step, True)] * replicas for step in (1, 2, 3)], checks
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters()))


def test_grpo_trainer_generates_remotely_and_pushes_after_each_step(server, checkpoint, tmp_path):
    grpo_three_steps(base(server), NAME, checkpoint.model, checkpoint.tok, tmp_path, lambda: [greedy(server, PROMPT)])


def test_pause_keep_across_an_update_and_the_routes(server, checkpoint, tmp_path):
    model = copy.deepcopy(checkpoint.model)
    trained = shifted(model, 4)
    result: dict = {}
    started = threading.Event()

    def long_request() -> None:  # streamed, so that the pause comes once its first tokens are out
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(
            base(server) + "/v1/completions",
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                started.set()
                if "weight_version" in chunk:  # (the stream's last chunks carry it)
                    result["versions"] = chunk["weight_version"]

    with WeightPusher([base(server)], master_port=_free_port(), timeout_s=60) as pusher:
        pusher.push(model, version="a")
        t = threading.Thread(target=long_request)
        t.start()
        # the request is running (400 tokens take this tiny model a few tenths of a second, so a
        # fixed sleep could miss them all); whenever the pause lands, its spans say where
        assert started.wait(120)
        assert post(server, "/pause?mode=keep") == {"paused": True}
        assert json.loads(urllib.request.urlopen(base(server) + "/is_paused").read()) == {"paused": True}
        pusher.push(trained, version="b")
        post(server, "/resume")
        t.join(timeout=300)
    spans = result["versions"]
    assert [s[0] for s in spans] == ["a", "b"] and spans[0][1] == 0 and spans[-1][2] == 400, spans
    # from disk (SGLang's route), and sleep / wake
    trained.save_pretrained(tmp_path / "ckpt")
    assert (
        post(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "ckpt"), "weight_version": "disk"})[
            "weight_version"
        ]
        == "disk"
    )
    assert post(server, "/sleep")["sleeping"] and not post(server, "/wake_up")["sleeping"]
    got, version = greedy(server, PROMPT)
    assert version == "disk" and got == reference_generate(trained, PROMPT, MAX_NEW)
    with pytest.raises(urllib.error.HTTPError) as info:
        post(server, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert info.value.code == 400


def stream_tokens(server, max_tokens: int, out: dict, started: threading.Event) -> None:
    """A greedy streamed completion: ``out["times"]`` gets each chunk's arrival (a chunk has one
    token or more), ``out["versions"]`` the stream's ``weight_version``."""
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        base(server) + "/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    out["times"] = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            out["times"].append(time.monotonic())
            started.set()
            if "weight_version" in chunk:
                out["versions"] = chunk["weight_version"]


def test_generation_goes_on_while_a_push_is_received(server, checkpoint):
    """The server keeps generating while a push is on the wire and staged: a streamed request in
    flight gets tokens while the trainer stalls between two buckets, and completes; the swap
    lands during it, and its spans say which tokens came from which weights (no pause asked)."""
    model = copy.deepcopy(checkpoint.model)
    size = sum(t.nbytes for t in weight_targets(model).values())
    with WeightPusher([base(server)], master_port=_free_port(), timeout_s=60, bucket_bytes=size // 2) as pusher:
        pusher.push(model, version="old")
        group = pusher.group
        real, calls, during = group.start_broadcast, [], []
        out: dict = {}
        started = threading.Event()

        def stalling(flat: torch.Tensor):  # between the first bucket and the next: wait for tokens
            calls.append(len(flat))
            if len(calls) == 2:
                before = len(out["times"])
                deadline = time.monotonic() + 30
                while len(out["times"]) < before + 16 and time.monotonic() < deadline:
                    time.sleep(0.005)
                during.append(len(out["times"]) - before)
            return real(flat)

        t = threading.Thread(target=stream_tokens, args=(server, 900, out, started))
        t.start()
        assert started.wait(120)
        group.start_broadcast = stalling
        assert pusher.push(shifted(model, 7), version="new") == "new"
        t.join(timeout=300)
    assert len(calls) >= 2 and during and during[0] >= 16, (calls, during)  # tokens while the push was on the wire
    spans = out["versions"]
    assert [s[0] for s in spans] == ["old", "new"] and spans[0][1] == 0 and spans[-1][2] == 900, spans


def test_a_tied_weight_is_sent_once_and_lands_under_both_names(server, checkpoint):
    """A module whose LM head is its embedding (tied, one tensor under two names): the push sends
    its bytes once, and the server (whose model is untied) writes it under both names; the same
    in bfloat16 lands cast into the server's float32."""
    model = shifted(checkpoint.model, 8)
    model.lm_head.weight = model.model.embed_tokens.weight
    unique = sum(t.nbytes for t in {id(t): t for t in weight_targets(model).values()}.values())
    sent = []
    with WeightPusher([base(server)], master_port=_free_port(), timeout_s=60) as pusher:
        pusher.init()
        real = pusher.group.start_broadcast
        pusher.group.start_broadcast = lambda flat: sent.append(flat.numel()) or real(flat)
        assert pusher.push(model, version="tied") == "tied"
        assert sum(sent) == unique < sum(t.nbytes for t in weight_targets(model).values())
        assert greedy(server, PROMPT) == (reference_generate(model, PROMPT, MAX_NEW), "tied")
        # in bfloat16 into the server's float32: the swap casts what was received, as staging did
        half = copy.deepcopy(model).to(torch.bfloat16)
        assert pusher.push(half, version="bf16") == "bf16"
        assert greedy(server, PROMPT) == (reference_generate(half.float(), PROMPT, MAX_NEW), "bf16")
        # the two names' weights stayed apart (the one tensor sent was copied into each, not
        # bound to both): an untied push lands each
        untied = shifted(checkpoint.model, 10)
        assert pusher.push(untied, version="untied") == "untied"
    assert greedy(server, PROMPT) == (reference_generate(untied, PROMPT, MAX_NEW), "untied")


def test_a_lora_push_in_flight_leaves_the_served_adapter_whole(server, checkpoint):
    """The group's receive buffers are reused by the next push: an adapter's tensors are copied
    off them, so while the next adapter push is on the wire (stalled between two buckets) the
    served adapter still generates its own tokens, and the push then lands."""
    from peft import get_peft_model

    torch.manual_seed(11)
    first = get_peft_model(copy.deepcopy(checkpoint.model), lora_config())
    second = get_peft_model(copy.deepcopy(checkpoint.model), lora_config())
    during = []
    with WeightPusher([base(server)], master_port=_free_port(), timeout_s=60, bucket_bytes=1024) as pusher:
        assert pusher.push(first, version="lora-a", lora="policy") == "lora-a"
        served = greedy(server, PROMPT, model="policy")
        real, calls = pusher.group.start_broadcast, []

        def stalling(flat: torch.Tensor):
            calls.append(1)
            if len(calls) == 4:  # (three buckets of the next adapter are in the server's buffers)
                during.append(greedy(server, PROMPT, model="policy"))
            return real(flat)

        pusher.group.start_broadcast = stalling
        assert pusher.push(second, version="lora-b", lora="policy") == "lora-b"
    assert during == [served], (during, served)
    after = greedy(server, PROMPT, model="policy")
    assert after[1] == "lora-b" and after[0] != served[0]


def grpo_timed(url: str, start, tok, tmp_path, max_staleness: int) -> tuple[list, list, list]:
    """Three GRPO steps with ``PushWeights(max_staleness=...)``, each push stalled 0.4 s between two
    buckets: (each rollout's start, end and the trainer's step then), (each push's start and
    end), (each rollout's versions)."""
    from trl import GRPOTrainer

    model = copy.deepcopy(start)
    pusher = WeightPusher([url], master_port=_free_port(), timeout_s=60, bucket_bytes=64 << 10)
    pusher.push(model, version=0)
    real_push, pushes, rollouts_at = pusher.push, [], []

    def push(*a, **kw):
        t0 = time.monotonic()
        real = pusher.group.start_broadcast
        calls = []

        def stalling(flat):
            calls.append(1)
            if len(calls) == 2:
                time.sleep(0.4)
            return real(flat)

        pusher.group.start_broadcast = stalling
        try:
            return real_push(*a, **kw)
        finally:
            pushes.append((t0, time.monotonic()))

    pusher.push = push
    rollouts = rollout_func(url, NAME)
    trainer = None

    def timed(prompts, tr):
        t0 = time.monotonic()
        got = rollouts(prompts, tr)
        rollouts_at.append((t0, time.monotonic(), trainer.state.global_step))
        return got

    args = grpo_config(
        tmp_path / f"out{max_staleness}",
        max_completion_length=MAX_NEW,
        max_steps=3,
    )
    ds = questions()
    callback = PushWeights(pusher, max_staleness=max_staleness)
    trainer = GRPOTrainer(
        model=model,
        args=args,
        reward_funcs=lambda completion_ids, **kw: [(sum(c) % 97) / 97.0 for c in completion_ids],
        processing_class=tok,
        train_dataset=ds,
        rollout_func=timed,
        callbacks=[callback],
    )
    try:
        trainer.train()
    finally:
        pusher.close()
    assert callback.pushed == [1, 2, 3] and trainer.state.global_step == 3
    return rollouts_at, pushes, rollouts.weight_versions


def oldest(version) -> int:
    return min(s[0] for s in version) if isinstance(version, list) else version


@pytest.mark.parametrize("max_staleness", [1, 0])
def test_max_staleness_overlaps_generation_with_the_push(server, checkpoint, tmp_path, max_staleness):
    """``PushWeights(max_staleness=1)``: step k+1's rollouts are generated while step k's push is
    in flight, on weights at most one step behind; ``0`` (the default): never while a push is in
    flight, always on the step's own weights."""
    rollouts_at, pushes, versions = grpo_timed(base(server), checkpoint.model, checkpoint.tok, tmp_path, max_staleness)
    assert [r[2] for r in rollouts_at] == [0, 1, 2]
    overlaps = [any(p0 < r1 and r0 < p1 for p0, p1 in pushes) for r0, r1, _ in rollouts_at]
    lags = [[step - oldest(v) for v in vs] for (_, _, step), vs in zip(rollouts_at, versions, strict=True)]
    if max_staleness:
        assert overlaps[1:] == [True, True], (rollouts_at, pushes)
        assert all(0 <= lag <= 1 for lag_s in lags for lag in lag_s) and any(1 in lag_s for lag_s in lags), lags
    else:
        assert overlaps == [False] * 3, (rollouts_at, pushes)
        assert lags == [[0] * 4] * 3, versions


def test_max_staleness_is_0_or_1():
    with pytest.raises(ValueError, match="max_staleness"):
        PushWeights(WeightPusher([]), max_staleness=2)


KILLED_TRAINER = textwrap.dedent(
    """
    import json, os, sys, threading, time, urllib.request
    import torch
    from acb.weight_transfer import TransferGroup
    url, port, shapes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    def post(path, body):
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=120).read()
        except Exception:
            pass
    threading.Thread(target=post, args=("/init_weight_transfer", {"master_address": "127.0.0.1", "master_port": port,
        "world_size": 2, "rank_offset": 1, "timeout_s": 20, "group_id": "killed"}), daemon=True).start()
    group = TransferGroup.join("127.0.0.1", port, 2, 0, group_id="killed", timeout_s=20)
    time.sleep(1.0)
    items = [(n, torch.ones(s)) for n, s in shapes]
    body = {"names": [n for n, _ in items], "dtype_names": ["float32"] * len(items),
            "shapes": [list(t.shape) for _, t in items], "weight_version": "never", "bucket_bytes": 4096, "seq": 1,
            "group_id": "killed"}
    threading.Thread(target=post, args=("/update_weights", body), daemon=True).start()
    group.verdicts(1)
    group.decide(1, True)
    group.broadcast(torch.cat([t.reshape(-1).view(torch.uint8) for _, t in items])[:4096].clone())
    print("sent one bucket", flush=True)
    os._exit(17)  # killed mid-broadcast
    """
)


def test_a_trainer_killed_mid_broadcast_leaves_the_old_weights(server, checkpoint, tmp_path):
    before, version = greedy(server, PROMPT)
    shapes = [(n, list(p.shape)) for n, p in checkpoint.model.named_parameters()]
    script = tmp_path / "killed.py"
    script.write_text(KILLED_TRAINER)
    env = {"PYTHONPATH": str(ROOT)}
    import os

    proc = subprocess.run(
        [sys.executable, str(script), base(server), str(_free_port()), json.dumps(shapes)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 17 and "sent one bucket" in proc.stdout, proc.stderr[-2000:]
    # the server's receive fails (its group's peer is gone): nothing swapped, the old weights serve
    assert greedy(server, PROMPT) == (before, version)
    # and a new trainer joins and pushes
    trained = shifted(checkpoint.model, 9)
    with WeightPusher([base(server)], master_port=_free_port(), timeout_s=60) as pusher:
        assert pusher.push(trained, version="after") == "after"
    assert greedy(server, PROMPT) == (reference_generate(trained, PROMPT, MAX_NEW), "after")


INIT = {"master_address": "127.0.0.1", "master_port": 29999, "world_size": 2, "rank_offset": 1, "timeout_s": 2}


@pytest.mark.parametrize(
    "path, body, code, says",
    [
        ("/pause", {"mode": "sometimes"}, 400, "mode must be one of"),
        (
            "/init_weight_transfer",
            {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "rank_offset": 0},
            400,
            "rank_offset",
        ),
        ("/init_weight_transfer", {"master_address": "127.0.0.1"}, 400, "master_port"),
        (
            "/update_weights",
            {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]], "seq": 1, "bucket_bytes": "x"},
            400,
            "bucket_bytes",
        ),
        (
            "/update_weights",
            {"names": ["a", "b"], "dtype_names": ["float32"], "shapes": [[1]], "seq": 1},
            400,
            "one entry per tensor",
        ),
        (
            "/update_weights",
            {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]], "seq": 1, "group_id": "g"},
            409,
            "init_weight_transfer",
        ),
        (
            "/update_weights",
            {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]], "seq": 1},
            400,
            "group_id",
        ),
        ("/update_weights_from_disk", {}, 400, "model_path"),
        # out of range: a 400 naming the field, not a 500 from deep in torch.distributed
        ("/init_weight_transfer", {**INIT, "timeout_s": 1e300}, 400, "timeout_s"),
        ("/init_weight_transfer", {**INIT, "timeout_s": float("nan")}, 400, "timeout_s"),
        ("/init_weight_transfer", {**INIT, "master_port": 1000000}, 400, "master_port"),
        ("/init_weight_transfer", {**INIT, "world_size": 10**12}, 400, "world_size"),
        ("/init_weight_transfer", {**INIT, "group_id": "a b/../c"}, 400, "group_id"),
        ("/init_weight_transfer", {**INIT, "master_address": ""}, 400, "master_address"),
        # somewhere the operator did not allow (loopback only by default): nothing connected to
        ("/init_weight_transfer", {**INIT, "master_address": "203.0.113.7"}, 403, "--weight-transfer-hosts"),
        (
            "/update_weights",
            {"names": ["a"], "dtype_names": [7], "shapes": [[1]], "seq": 1, "group_id": "g"},
            400,
            "dtype_names",
        ),
        (
            "/update_weights",
            {"names": ["a"], "dtype_names": ["float32"], "shapes": [["x"]], "seq": 1, "group_id": "g"},
            400,
            "shapes",
        ),
    ],
)
def test_malformed_calls_are_4xx_and_harm_nothing(server, path, body, code, says):
    before = greedy(server, PROMPT)
    with pytest.raises(urllib.error.HTTPError) as info:
        post(server, path, body)
    assert info.value.code == code
    assert says in json.loads(info.value.read())["error"]["message"]
    assert (
        greedy(server, PROMPT) == before
        and not json.loads(urllib.request.urlopen(base(server) + "/is_paused").read())["paused"]
    )


# ---------------------------------------------------------------------------------------------
# two trainers, and pushes that fail


SECOND_TRAINER = textwrap.dedent(
    """
    import sys, torch
    from acb.rl import WeightPusher
    url, port = sys.argv[1], int(sys.argv[2])
    pusher = WeightPusher([url], master_port=port, timeout_s=10)
    pusher.init()
    print("joined", flush=True)
    for line in sys.stdin:  # "<version> <weights file>": push them under that version
        version, path = line.split()
        try:
            print("pushed", pusher.push(torch.load(path, weights_only=True).items(), version=version), flush=True)
        except Exception as exc:
            print("failed", type(exc).__name__, str(exc).replace(chr(10), " "), flush=True)
    pusher.close()
    """
)


def test_a_second_trainer_takes_the_server_and_the_first_is_refused(server, checkpoint, tmp_path):
    """Trainer A joins, trainer B (another process) joins: the server leaves A's group. A pushes
    and B pushes a second later: A is refused with a 409 saying another trainer joined (its
    version never labels B's tensors), B's push lands under B's version, and A's ``close()``
    leaves B's group alone (B's next push lands)."""
    import os

    model = copy.deepcopy(checkpoint.model)
    weights = {v: shifted(model, seed) for v, seed in (("A1", 31), ("B1", 32), ("B2", 33))}
    for v in ("B1", "B2"):
        torch.save(dict(weight_targets(weights[v])), tmp_path / f"{v}.pt")
    script = tmp_path / "second.py"
    script.write_text(SECOND_TRAINER)
    a = WeightPusher([base(server)], master_port=_free_port(), timeout_s=10)
    b = subprocess.Popen(
        [sys.executable, str(script), base(server), str(_free_port())],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        a.init()
        assert b.stdout.readline() == "joined\n", b.stderr.read()[-2000:]  # the server left A's group
        failed: list[BaseException] = []

        def push_a() -> None:
            try:
                a.push(weights["A1"], version="A1")
            except BaseException as exc:  # noqa: BLE001 - checked below
                failed.append(exc)

        t = threading.Thread(target=push_a)
        t.start()
        time.sleep(1.0)
        b.stdin.write(f"B1 {tmp_path / 'B1.pt'}\n")
        b.stdin.flush()
        answer_b = b.stdout.readline()
        t.join(timeout=60)
        assert answer_b == "pushed B1\n", answer_b
        assert len(failed) == 1 and isinstance(failed[0], WeightPushError), failed
        assert "409" in str(failed[0]) and "another trainer" in str(failed[0]), failed[0]
        assert greedy(server, PROMPT) == (reference_generate(weights["B1"], PROMPT, MAX_NEW), "B1")
        a.close()  # A's group is gone from the server already: B's must stay
        b.stdin.write(f"B2 {tmp_path / 'B2.pt'}\n")
        b.stdin.flush()
        assert b.stdout.readline() == "pushed B2\n"
        assert greedy(server, PROMPT) == (reference_generate(weights["B2"], PROMPT, MAX_NEW), "B2")
        b.stdin.close()
        assert b.wait(timeout=60) == 0, b.stderr.read()[-2000:]
    finally:
        a.close()
        if b.poll() is None:
            b.kill()
            b.wait()


def test_two_trainers_interleaved_never_mislabel(server, checkpoint):
    """A seeded interleaving of two trainers' joins, pushes (one at a time, and both at once) and
    closes: every push ends in its version or a ``WeightPushError``, a push from the trainer whose
    group the server holds lands, one whose group the server left is refused, and after every
    step the server's greedy tokens are those of the weights its ``weight_version`` names."""
    import random

    model = copy.deepcopy(checkpoint.model)
    rng = random.Random(52)
    refs: dict[object, list[int]] = {}
    pushers = {who: WeightPusher([base(server)], master_port=_free_port(), timeout_s=20) for who in "AB"}
    owner: list[str | None] = [None]  # whose group the server holds (the last to join; "?": not known)
    served: dict[object, list[int]] = {}
    count = [0]

    def push(who: str) -> tuple[str, object]:
        count[0] += 1
        version = f"{who}{count[0]}"
        trained = shifted(model, 100 + count[0])
        refs[version] = reference_generate(trained, PROMPT, MAX_NEW)
        try:
            return "ok", pushers[who].push(trained, version=version)
        except WeightPushError as exc:
            return "refused", str(exc)

    start = greedy(server, PROMPT)
    refs[start[1]] = start[0]
    ops = ["init", "push", "close", "both"]
    log = []
    try:
        for _ in range(12):
            op, who = rng.choice(ops), rng.choice("AB")
            other = "B" if who == "A" else "A"
            if op == "init":
                pushers[who].init()
                owner[0] = who
            elif op == "close":
                pushers[who].close()
                if owner[0] == who:
                    owner[0] = None
            elif op == "push":
                held = pushers[who].group is not None
                outcome, said = push(who)
                if not held or owner[0] == who:  # (no group: the push joins first, taking the server)
                    assert outcome == "ok", (log, said)
                elif owner[0] != "?":  # the server left this trainer's group: refused, and it must say why
                    assert outcome == "refused" and "409" in said, (log, said)
                owner[0] = who if outcome == "ok" else "?" if owner[0] == "?" else owner[0]
            else:  # both at once
                outs: dict[str, tuple[str, object]] = {}
                threads = [threading.Thread(target=lambda w=w: outs.__setitem__(w, push(w))) for w in (who, other)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=120)
                assert set(outs) == {"A", "B"} and any(o == "ok" for o, _ in outs.values()), (log, outs)
                owner[0] = "?"  # (who holds it now depends on the race; the next init or push says)
            got, version = greedy(server, PROMPT)
            log.append((op, who, version))
            assert version in refs and got == refs[version], log
            served[version] = got
    finally:
        for p in pushers.values():
            p.close()
    assert len(served) >= 3, log  # (the seed exercises several pushes that landed)


def test_a_failed_push_raises_weight_push_error_and_the_next_lands(server, checkpoint):
    """A tensor it cannot send (a meta tensor: an offloaded parameter) is refused before anything
    moves; a stall past the group's timeout between two buckets makes the server give up (503):
    both raise ``WeightPushError`` with the cause, the old weights serve, and the same pusher's
    next push lands at once (it joins again rather than waiting on a group the server closed)."""
    model = copy.deepcopy(checkpoint.model)
    with WeightPusher([base(server)], master_port=_free_port(), timeout_s=3, bucket_bytes=4096) as pusher:
        first = shifted(model, 41)
        assert pusher.push(first, version="m1") == "m1"
        landed = (reference_generate(first, PROMPT, MAX_NEW), "m1")
        assert greedy(server, PROMPT) == landed
        offloaded = [
            (n, torch.empty(t.shape, device="meta")) if i == 1 else (n, t)
            for i, (n, t) in enumerate(weight_targets(shifted(model, 42)).items())
        ]
        with pytest.raises(WeightPushError, match="meta"):
            pusher.push(offloaded, version="meta")
        assert greedy(server, PROMPT) == landed
        second = shifted(model, 43)
        t0 = time.monotonic()
        assert pusher.push(second, version="m2") == "m2"
        assert time.monotonic() - t0 < 3  # (not the group's timeout)
        landed = (reference_generate(second, PROMPT, MAX_NEW), "m2")
        assert greedy(server, PROMPT) == landed
        # the trainer stalls between two buckets past the group's timeout (3 s)
        group = pusher.group
        real, calls = group.start_broadcast, []

        def stalling(flat: torch.Tensor):
            calls.append(len(flat))
            if len(calls) == 2:
                time.sleep(4.5)
            return real(flat)

        group.start_broadcast = stalling
        with pytest.raises(WeightPushError, match="503"):
            pusher.push(shifted(model, 44), version="stalled")
        assert greedy(server, PROMPT) == landed
        third = shifted(model, 45)
        t0 = time.monotonic()
        assert pusher.push(third, version="m3") == "m3"
        assert time.monotonic() - t0 < 3
        assert greedy(server, PROMPT) == (reference_generate(third, PROMPT, MAX_NEW), "m3")


def test_rollout_func_raises_the_generations_own_error(server, checkpoint):
    """A prompt the server refuses (empty, or longer than the model takes) is the generation's
    error (acb's ``InvalidRequestError``, with the server's message and field), not a weight push's."""
    trainer = SimpleNamespace(
        processing_class=checkpoint.tok,
        args=SimpleNamespace(max_completion_length=4, temperature=1.0, top_p=1.0),
    )
    rollouts = rollout_func(base(server), NAME)
    # (sampled at temperature 1: the model's EOS may end it early; a clean-clone run once drew it)
    assert 1 <= len(rollouts(["hello"], trainer)["completion_ids"][0]) <= 4
    for prompts in ([""], ["hello", "word " * 5000]):  # (an empty prompt; one past 1024 positions)
        with pytest.raises(InvalidRequestError, match="prompt") as info:
            rollouts(prompts, trainer)
        assert not isinstance(info.value, WeightPushError) and info.value.field == "prompt", info.value


def test_the_operator_says_where_the_server_connects():
    """``--weight-transfer-hosts``: loopback by default; IP addresses, networks, host names (the
    addresses they resolve to) or ``*``; the checked address is the one connected to. A refusal
    is a 403 naming the flag (the real server's is in the malformed-calls test)."""
    from acb.cli import build_parser
    from acb.cli.serve import server_settings
    from acb.serve.protocol import APIError
    from acb.serve.weights import resolve_trainer
    from acb.weight_transfer import LOOPBACK_HOSTS as LOOPBACK

    assert resolve_trainer("127.0.0.5", 1, LOOPBACK) == "127.0.0.5"
    assert resolve_trainer("localhost", 1, LOOPBACK) in ("127.0.0.1", "::1")
    assert resolve_trainer("::ffff:127.0.0.1", 1, LOOPBACK) == "::ffff:127.0.0.1"
    for address, allowed in (("10.1.2.3", LOOPBACK), ("10.1.2.3", ("10.1.2.4", "192.168.0.0/16", "localhost"))):
        with pytest.raises(APIError) as info:
            resolve_trainer(address, 1, allowed)
        assert info.value.status == 403 and "--weight-transfer-hosts" in info.value.message
    assert resolve_trainer("10.1.2.3", 1, ("10.0.0.0/8",)) == "10.1.2.3"
    assert resolve_trainer("127.0.0.1", 1, ("localhost",)) == "127.0.0.1"  # (a name allows its addresses)
    assert resolve_trainer("trainer.example", 1, ("*",)) == "trainer.example"
    default = server_settings(build_parser().parse_args(["serve", "--enable-weight-updates"]))
    assert default.weight_transfer_hosts == LOOPBACK
    args = build_parser().parse_args(["serve", "--weight-transfer-hosts", "10.0.0.0/8", "trainer-host"])
    assert server_settings(args).weight_transfer_hosts == ("10.0.0.0/8", "trainer-host")


def test_grpo_with_a_lora_policy_pushes_its_adapter_only(server, checkpoint, tmp_path):
    """TRL's GRPOTrainer with a ``peft_config`` (its policy a ``PeftModel``) generating on the
    server's adapter ``policy`` (``--lora-modules``) and pushing only the adapter's tensors after
    each step (``PushWeights(pusher, lora="policy")``): the first step's rollouts (greedy) are the
    trainer's own ``generate``; after each push the served adapter's greedy tokens are those of an
    engine in this process given the trainer's adapter (``update_lora``), under the step's version;
    a push that does not fit the adapter is refused whole, and the base model is untouched."""
    import random

    from peft import get_peft_model_state_dict
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    base_tokens = reference_generate(checkpoint.model, PROMPT, MAX_NEW)
    pusher = WeightPusher([base(server)], master_port=_free_port(), timeout_s=60)
    rng = random.Random(56)
    seen: list = []
    wanted: list = []
    checks: list = []
    inner = rollout_func(base(server), "policy", ignore_eos=True)

    def rollouts(prompts, trainer):
        out = inner(prompts, trainer)
        if not seen:  # the first step: the trainer's own generate on its initial adapter
            policy, was = trainer.model, trainer.model.training
            policy.eval()  # (TRL trains it in train mode; generating, as acb does, in eval semantics)
            try:
                wanted.extend(reference_generate(policy, p, MAX_NEW, ignore_eos=True) for p in out["prompt_ids"])
            finally:
                policy.train(was)
        seen.append(out["completion_ids"])
        return out

    def reward(prompts, completions, completion_ids, **kw):  # (greedy rollouts: random rewards, so it learns)
        return [rng.random() for _ in completion_ids]

    args = grpo_config(
        tmp_path / "out",
        max_completion_length=MAX_NEW,
        generation_kwargs={"do_sample": False},
    )
    ds = questions()
    reference = None

    class Check(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):  # (after PushWeights)
            assert reference is not None
            version = reference.update_lora("policy", model, version=state.global_step)
            want = reference.generate(PROMPT, GREEDY, lora="policy").generated_tokens
            checks.append((greedy(server, PROMPT, model="policy"), (want, version)))

    trainer = GRPOTrainer(
        model=copy.deepcopy(checkpoint.model),
        args=args,
        reward_funcs=reward,
        processing_class=checkpoint.tok,
        train_dataset=ds,
        peft_config=lora_config(),
        rollout_func=rollouts,
        callbacks=[PushWeights(pusher, lora="policy"), Check()],
    )
    policy = trainer.model
    start = {k: v.clone() for k, v in policy.state_dict().items() if "lora_" in k}
    try:
        pusher.push(checkpoint.model, version=0)  # (the base weights: earlier tests pushed others)
        # refused whole, nothing moves: a shape the adapter does not have, an adapter the server lacks,
        # a PeftModel pushed as full weights
        state = get_peft_model_state_dict(policy)
        key = next(iter(state))
        bad = [(k, torch.zeros(t.shape[0] + 1, *t.shape[1:]) if k == key else t) for k, t in state.items()]
        with pytest.raises(WeightPushError, match="400.*shape") as info:
            pusher.push(bad, version="bad", lora="policy")
        assert info.value.status == 400
        with pytest.raises(WeightPushError, match="no LoRA adapter named 'other'"):
            pusher.push(policy, version="bad", lora="other")
        with pytest.raises(WeightPushError, match="lora="):
            pusher.push(policy, version="bad")
        assert greedy(server, PROMPT)[1] == 0
        assert pusher.push(policy, version="init", lora="policy") == "init"  # the trainer's initial adapter
        reference = served_reference(copy.deepcopy(checkpoint.model).eval(), lora=policy)
        want = reference.generate(PROMPT, GREEDY, lora="policy").generated_tokens
        assert greedy(server, PROMPT, model="policy") == (want, "init") and want != base_tokens
        trainer.train()
    finally:
        pusher.close()
        if reference is not None:
            reference.shutdown()
    assert trainer.state.global_step == 2 and len(seen) == 2
    assert seen[0] == wanted and len(wanted) == 4, (seen[0], wanted)  # the first step: the trainer's generate
    assert checks == [(w, w) for _, w in checks] and [v for _, (_, v) in checks] == [1, 2], checks
    assert any(not torch.equal(v, policy.state_dict()[k]) for k, v in start.items())  # (it learned)
    assert greedy(server, PROMPT) == (base_tokens, 2)  # the base model serves its own weights


@pytest.fixture(scope="module")
def bi_server(checkpoint, tmp_path_factory):
    """``acb serve --batch-invariant`` (issue 57 item 3): the sampler's logprobs are the trainer's."""
    args = ["--served-model-name", NAME, "--enable-weight-updates", "--num-blocks", "128", "--page-size", "8"]
    yield from _serve(checkpoint, tmp_path_factory, "rl-bi", [*args, "--batch-invariant"], {"OMP_NUM_THREADS": "2"})


def test_batch_invariant_sampler_logprobs_are_the_trainers_exactly(bi_server, checkpoint, tmp_path):
    """TRL's GRPOTrainer on ``acb serve --batch-invariant`` with ``match_sampler(trainer)``: after
    each rollout (two GRPO steps, the weights pushed after the first), the trainer's own per-token
    logprobs of the rollouts (TRL's method, on the batch padded as TRL pads it: prompts left,
    completions right; the trainer at its own thread count, the server at 2) equal the server's
    bit for bit. Exact equality, no tolerance (without the mode they differ by ~1e-6)."""
    from trl import GRPOTrainer

    from acb.integrations.trl import match_sampler

    url = base(bi_server)
    model = copy.deepcopy(checkpoint.model)
    pusher = WeightPusher([url], master_port=_free_port(), timeout_s=60)
    pusher.push(model, version=0)
    inner = rollout_func(url, NAME)
    checked = []

    def rollouts(prompts, trainer):
        out = inner(prompts, trainer)
        pad = checkpoint.tok.pad_token_id or 0
        width_p = max(map(len, out["prompt_ids"]))
        width_c = max(map(len, out["completion_ids"]))
        ids, mask = [], []
        for p, c in zip(out["prompt_ids"], out["completion_ids"]):
            ids.append([pad] * (width_p - len(p)) + p + c + [pad] * (width_c - len(c)))
            mask.append([0] * (width_p - len(p)) + [1] * (len(p) + len(c)) + [0] * (width_c - len(c)))
        with torch.no_grad():
            got = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.tensor(ids), torch.tensor(mask), width_c
            )[0]
        for row, (c, lp) in enumerate(zip(out["completion_ids"], out["logprobs"])):
            checked.append(torch.equal(got[row, : len(c)].double(), torch.tensor(lp, dtype=torch.float64)))
        return out

    args = grpo_config(
        tmp_path / "out",
        max_completion_length=MAX_NEW,
        temperature=0.7,
    )
    ds = questions()
    trainer = GRPOTrainer(
        model=model,
        args=args,
        reward_funcs=lambda completion_ids, **kw: [(sum(c) % 97) / 97.0 for c in completion_ids],
        processing_class=checkpoint.tok,
        train_dataset=ds,
        rollout_func=rollouts,
        callbacks=[PushWeights(pusher)],
    )
    matched = match_sampler(trainer)
    try:
        trainer.train()
    finally:
        matched.close()
        pusher.close()
    assert trainer.state.global_step == 2 and len(checked) == 8 and all(checked), checked


def test_the_group_sends_large_tensors_as_they_are_and_alternates_receive_buffers():
    """The transfer group's own wire, over gloo on loopback (rank 0 a thread, rank 1 this one):
    tensors of at least ``DIRECT_BYTES`` are broadcast on their own, as they are, runs of small
    ones packed, each received into its place in its bucket's buffer; a non-contiguous large one
    is packed. Every tensor arrives whole. A receive never writes into a buffer set in use
    (``busy``: weights rebound to it): the next one goes into the other set, and back."""
    from acb.weight_transfer import DIRECT_BYTES, TransferGroup, host_store, pieces

    g = torch.Generator().manual_seed(0)
    big = DIRECT_BYTES // 4
    tensors = [
        torch.randn(3, generator=g),
        torch.randn(big + 5, generator=g),  # direct
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randn(11, generator=g),
        torch.randn(big, 2, generator=g).t(),  # large, not contiguous: packed
        torch.randn(2 * big, generator=g).to(torch.bfloat16),  # direct, a bucket of its own
        torch.randn(1, generator=g),
    ]
    shapes = [tuple(t.shape) for t in tensors]
    dtypes = [t.dtype for t in tensors]
    bucket = 3 * DIRECT_BYTES
    plan = pieces(shapes, dtypes, bucket)
    assert [len(p.tensors) for p in plan] == [1, 1, 2, 1, 1, 1] and len({p.bucket for p in plan}) == 3, plan
    assert all(at % 16 == 0 for p in plan for at in p.offsets)  # (a bf16 tensor of odd size, then float32)
    port = _free_port()
    store = host_store("127.0.0.1", port)
    groups: dict = {}
    t = threading.Thread(
        target=lambda: groups.setdefault(0, TransferGroup.join("127.0.0.1", port, 2, 0, group_id="wire", store=store))
    )
    t.start()
    receiver = TransferGroup.join("127.0.0.1", port, 2, 1, group_id="wire")
    t.join(60)
    sender = groups[0]
    try:
        busy: set[int] = set()
        sets = []
        for _ in range(3):
            t = threading.Thread(target=sender.send, args=(tensors, bucket))
            t.start()
            got = list(receiver.receive(shapes, dtypes, bucket, busy=busy))
            t.join(60)
            assert all(torch.equal(a, b) for a, b in zip(got, tensors, strict=True))
            storages = {x.untyped_storage().data_ptr() for x in got}
            assert not storages & busy  # (never into the set in use)
            sets.append(storages)
            busy = storages  # (the weights rebound to what arrived)
        assert sets[0] == sets[2] != sets[1]  # two sets, alternating
    finally:
        sender.close()
        receiver.close()
