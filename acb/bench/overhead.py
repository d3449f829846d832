"""``overhead``: engine host time per decode step with a null model, for 1..1024 running requests,
and a real model's decode step split into its matmuls and everything else, against ``model.generate``.

acb runs with a runner whose forward returns zero logits without touching the model, so
what is left is the engine's own host work per step: schedule, stage inputs (positions,
slot mapping, block-table rows, attention metadata, sampling parameters) and process
outputs (record tokens, stop checks, deliver to handles). transformers' continuous
batching runs the same tiny model, and its ``prepare_next_batch`` + ``update_batch`` are
timed (its forward excluded). Medians over the steps in which every request decodes.

Per family (``--arch``): the null model is the Llama's 1-layer tiny model, or for any other
architecture the tiny model of that family (:data:`acb.bench.common.MODEL_SHAPES` ``tiny``), so its
layer kinds' own per-step host work (the state layers' rows, snapshots and forks, the page groups'
metadata) is in the figure; only the forward is skipped (on the own-cache path, the whole
per-request forward: its host work shows in the real step's time outside the matmuls).
transformers' side runs the same family where its continuous batching can (else none).
Telemetry's cost (its own processes) is measured on the Llama only.

The real-model part (``steps``) runs the benchmark's model at B = 1, 4, 16 (equal prompt lengths,
EOS ignored, greedy) through ``Engine.generate_batch`` and one ``model.generate`` call, and
measures one decode step of each: the time of a call with ``1 + K`` new tokens less that of a
call with one (the prefill and its first token), over ``K``. A second pair of calls under
torch.profiler gives the self time of the matmul ops per decode step (the linear layers and the
LM head); the step's time outside its matmuls is the unprofiled step less that. The other ops'
self times, by kind (attention, gathers, copies, elementwise), say where it goes (as profiled:
the profiler's cost per op inflates the small ones); acb's engine timers split its host share
(schedule, stage, process).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import torch

from acb.api.engine import Engine
from acb.bench.common import (
    GEMM_LEAVES,
    KERNEL_RANGES,
    ModelSpec,
    acb_greedy,
    greedy_generate,
    op_kind,
    phase_ms,
    tf_page,
)
from acb.config import ContinuousBatchingConfig
from acb.runner.model_runner import ModelRunner
from acb.sampling_params import SamplingParams

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(running=[1, 4, 16], steps=12, telemetry_running=16, telemetry_rounds=1),
    "small": dict(running=[1, 16, 64], steps=12, telemetry_running=16, telemetry_rounds=1),
    "default": dict(running=[1, 16, 64, 256, 1024], steps=24, telemetry_running=256, telemetry_rounds=3),
}
TELEMETRY_MODES = ("off", "api", "sdk")  # OTEL_SDK_DISABLED; the API alone (no SDK); SDK + OTLP exporter
PROMPT_LEN = 4
# the real model's decode step: batch sizes, prompt length, decode steps timed (K), repeats (best of)
STEP_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(batches=[1, 4], prompt=16, decode_steps=16, repeats=2),
    "small": dict(batches=[1, 4, 16], prompt=32, decode_steps=16, repeats=2),
    "default": dict(batches=[1, 4, 16], prompt=128, decode_steps=48, repeats=2),
}


class NullModelRunner(ModelRunner):
    """A runner whose forward costs nothing: zero logits for the sampling rows (on the own-cache
    path too, where the model's own per-request forward is replaced the same way)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.own_cache_runner is not None:

            def zeros(
                input_ids: Any, position_ids: Any, num_new: Any, rows: Any, logits_indices: list[int]
            ) -> torch.Tensor:
                return torch.zeros(len(logits_indices), self.vocab_size, device=self.device)

            self.own_cache_runner.forward = zeros  # type: ignore[method-assign]

    def forward(self, batch: Any, ctx: Any) -> torch.Tensor:
        return torch.zeros(batch.logits_indices.shape[0], self.vocab_size, device=self.device)


def _null_model(arch: str = "llama") -> Any:
    """The null model's weights (its forward never runs but on transformers' side): a 1-layer tiny
    Llama, or the tiny model of ``arch`` (its layer kinds set up the engine's per-step work)."""
    if arch != "llama":
        from acb.bench.common import MODEL_SHAPES, bench_model

        shape: dict[str, Any] = MODEL_SHAPES["tiny"]  # (keyword arguments of bench_model)
        return bench_model(arch, **shape)
    from acb.models import tiny_model

    return tiny_model(
        "llama",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=256,
        max_position_embeddings=4096,
    )


def _acb(n: int, steps: int, finals: list[Any] | None = None, arch: str = "llama") -> dict[str, float]:
    model = _null_model(arch)
    cfg = ContinuousBatchingConfig(
        page_size=16, num_blocks=n * 8 + 8, max_requests_per_batch=max(n, 1), max_batch_tokens=max(2048, n * PROMPT_LEN)
    )
    eng = Engine(model, cfg, runner_cls=NullModelRunner)
    eng.start()
    try:
        core = eng.core
        assert core is not None  # started
        core.step_log = []
        # hold the engine thread while submitting, so that all n requests start together
        gate = threading.Event()
        core.call(lambda c: gate.wait())
        g = torch.Generator().manual_seed(0)
        hs = [
            eng.submit(
                torch.randint(3, 256, (PROMPT_LEN,), generator=g).tolist(),
                SamplingParams(max_new_tokens=steps + 2, ignore_eos=True),
            )
            for _ in range(n)
        ]
        gate.set()
        for h in hs:
            out = h.result()
            if finals is not None:
                finals.append(out)
    finally:
        eng.shutdown()  # joins the engine thread: its step log is complete
    log = [s for s in core.step_log if s[0] == n and s[2] == n]  # every request decoding
    if not log:
        raise RuntimeError(f"overhead: no all-decode step with {n} requests in {core.step_log[:5]}...")
    med = {
        k: statistics.median(s[i] for s in log) * 1e6
        for k, i in (("schedule_us", 3), ("stage_us", 4), ("process_us", 6))
    }
    med["host_us"] = med["schedule_us"] + med["stage_us"] + med["process_us"]
    med["steps_measured"] = len(log)
    return med


def _transformers(n: int, steps: int, arch: str = "llama") -> dict[str, float] | None:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig as TfConfig
    from transformers.generation.continuous_batching import continuous_api

    from acb.bench.offline import patch_transformers_cpu_memory

    patch_transformers_cpu_memory()
    proc = continuous_api.ContinuousBatchProcessor
    if not (hasattr(proc, "prepare_next_batch") and hasattr(proc, "update_batch")):
        return None
    times: dict[str, list[float]] = {"prepare": [], "update": []}
    originals = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                times[name].append(time.perf_counter() - t0)

        return wrapper

    for name, attr in (("prepare", "prepare_next_batch"), ("update", "update_batch")):
        originals[attr] = getattr(proc, attr)
        setattr(proc, attr, timed(name, originals[attr]))
    try:
        model = _null_model(arch)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 256, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]
        model.generate_batch(  # (raises for a family transformers' continuous batching cannot run)
            inputs=prompts,
            generation_config=GenerationConfig(max_new_tokens=steps + 2, do_sample=False, eos_token_id=-1),
            continuous_batching_config=TfConfig(
                **tf_page(16),
                num_blocks=n * 8 + 8,
                max_requests_per_batch=max(n, 1),
                max_batch_tokens=max(2048, n * PROMPT_LEN),
            ),
            progress_bar=False,
        )
    finally:
        for attr, fn in originals.items():
            setattr(proc, attr, fn)
    k = len(times["update"])
    if k < 6:
        return None
    # drop the prefill steps at the start and the draining ones at the end
    prep = times["prepare"][2 : k - 2]
    upd = times["update"][2 : k - 2]
    return dict(
        prepare_us=statistics.median(prep) * 1e6,
        update_us=statistics.median(upd) * 1e6,
        host_us=(statistics.median(prep) + statistics.median(upd)) * 1e6,
        steps_measured=len(upd),
    )


# ------------------------------------------------------------------ a real model's decode step


def _op_times_ms(prof: torch.profiler.profile) -> dict[str, float]:
    """Self CPU time per kind of op (``op_kind``), in ms, and ``gemm_calls``: how many matmuls ran."""
    kinds: dict[str, float] = {"gemm_calls": 0.0}
    for ev in prof.key_averages():
        if ev.key.startswith(("acb::", "ProfilerStep")) and ev.key not in KERNEL_RANGES:  # ranges, not ops
            continue
        k = op_kind(ev.key)
        kinds[k] = kinds.get(k, 0.0) + ev.self_cpu_time_total / 1e3
        if ev.key in GEMM_LEAVES:
            kinds["gemm_calls"] += ev.count
    return kinds


def _decode_step(call: Any, profile: Any, new: int, repeats: int) -> tuple[float, dict[str, float], list[list[int]]]:
    """One decode step's ms (the best of ``repeats`` pairs of calls with ``1 + new`` and 1 new
    tokens), its ops' self ms per kind (a profiled pair), and the long call's tokens."""
    longs, shorts = [], []
    tokens: list[list[int]] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call(1)
        shorts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tokens = call(1 + new)
        longs.append(time.perf_counter() - t0)
    step_ms = (min(longs) - min(shorts)) / new * 1e3
    short_ops = profile(lambda: call(1))
    long_ops = profile(lambda: call(1 + new))
    ops = {k: (long_ops.get(k, 0.0) - short_ops.get(k, 0.0)) / new for k in set(long_ops) | set(short_ops)}
    return step_ms, ops, tokens


def _step_row(step_ms: float, ops: dict[str, float]) -> dict[str, Any]:
    matmul = ops.get("matmul", 0.0)
    rest = {k: v for k, v in sorted(ops.items()) if k not in ("matmul", "gemm_calls")}
    return dict(
        step_ms=step_ms,
        matmul_ms=matmul,
        matmul_calls=ops["gemm_calls"],  # per decode step: the model's linear layers and its LM head
        outside_matmul_ms=step_ms - matmul,
        # the ops that are not matmuls, by kind, as profiled (the profiler's cost per op inflates the small ones)
        outside_ops_ms=rest,
    )


def real_steps(size: str, spec: ModelSpec, baselines: bool = True) -> list[dict[str, Any]]:
    """The benchmark's model, B = 1, 4, 16: a decode step's ms, its matmuls' ms and the rest,
    acb against ``model.generate`` (same prompts, same number of tokens)."""
    p = STEP_SIZES[size]
    model = spec.build().eval()
    new = p["decode_steps"]
    rows = []
    with Engine(model) as engine:
        core = engine.core
        assert core is not None  # started

        def acb_profile(fn: Any) -> dict[str, float]:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            core.call(lambda _c: prof.__enter__()).result()  # on the engine thread, where the steps run
            try:
                fn()
            finally:
                core.call(lambda _c: prof.__exit__(None, None, None)).result()
            return _op_times_ms(prof)

        def generate_profile(fn: Any) -> dict[str, float]:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                fn()
            return _op_times_ms(prof)

        # a first profile on each thread (kineto's first start on a thread is slow and says so on stderr)
        acb_profile(lambda: None)
        generate_profile(lambda: None)
        g = torch.Generator().manual_seed(0)
        for b in p["batches"]:
            ps = torch.randint(3, spec.vocab, (b, p["prompt"]), generator=g).tolist()

            def run_acb(k: int, ps: list[list[int]] = ps) -> list[list[int]]:
                return acb_greedy(engine, ps, k)

            def run_generate(k: int, ps: list[list[int]] = ps) -> list[list[int]]:
                return greedy_generate(model, ps, k).tolist()

            run_acb(2)  # (warm: this B's shapes)
            before = engine.stats
            step_ms, ops, toks = _decode_step(run_acb, acb_profile, new, p["repeats"])
            phases = phase_ms(before, engine.stats)  # the engine's own timers, per step of every call above
            row: dict[str, Any] = dict(batch=b, acb=_step_row(step_ms, ops))
            row["acb"]["host_ms"] = {k: phases[f"{k}_ms"] for k in ("schedule", "stage", "process")}
            if baselines:
                run_generate(2)
                step_ms, ops, ref = _decode_step(run_generate, generate_profile, new, p["repeats"])
                row["generate"] = _step_row(step_ms, ops)
                row["outside_matmul_ratio"] = row["generate"]["outside_matmul_ms"] / row["acb"]["outside_matmul_ms"]
                row["step_ratio"] = row["generate"]["step_ms"] / row["acb"]["step_ms"]
                row["greedy_tokens_equal"] = toks == ref
            rows.append(row)
    return rows


# ------------------------------------------------------------------ telemetry's cost
def telemetry_child(mode: str, n: int, steps: int) -> dict[str, Any]:
    """In a fresh process (the OpenTelemetry providers are set once per process): host time
    per step at ``n`` running requests with telemetry in ``mode``, and the cost of recording
    one ended request (span + metrics)."""
    import os

    from acb import telemetry

    server = None
    if mode == "off":
        os.environ["OTEL_SDK_DISABLED"] = "true"
    elif mode == "sdk":  # an OTLP/HTTP sink in this process that accepts everything
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Sink(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        tel = telemetry.configure(
            f"http://127.0.0.1:{server.server_address[1]}", "http/protobuf", export_interval_s=1.0
        )
    finals: list[Any] = []
    _acb(n, steps)  # warm-up (first-use imports and instrument creation)
    res = _acb(n, steps * 2, finals)
    # one ended request's recording, as the handle does it when the final output arrives
    trace = telemetry.begin([5, 6, 7], "null-model", SamplingParams(max_new_tokens=steps + 2))
    t0 = time.perf_counter()
    for out in finals:
        telemetry.end(trace, out)
    t1 = time.perf_counter()
    telemetry.flush()
    k = max(len(finals), 1)
    res["queue_us_per_request"] = (t1 - t0) / k * 1e6  # on the caller's thread (the engine's, for Engine)
    res["record_us_per_request"] = (time.perf_counter() - t0) / k * 1e6  # until recorded by the worker
    import sys

    res["sdk_imported"] = any(m.startswith("opentelemetry.sdk") for m in sys.modules)
    if mode == "sdk":
        tel.shutdown()
    if server is not None:
        server.shutdown()
    return res


def telemetry_child_main(mode: str, n: int, steps: int) -> None:
    """A telemetry child process's entry (:func:`_telemetry` starts one per mode, together): imports
    and builds what every mode needs, prints ``ready``, waits for a line on stdin (the parent's go,
    sent once every child is ready, so each is measured while the others wait idle), then prints
    :func:`telemetry_child`'s figures as JSON."""
    import json
    import sys

    _null_model()  # acb, torch and transformers' Llama imported (the modes' own set-up is theirs)
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(telemetry_child(mode, n, steps)), flush=True)


def _telemetry(n: int, steps: int, rounds: int) -> list[dict[str, Any]]:
    import json
    import os
    import select
    import subprocess
    import sys
    import tempfile

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in TELEMETRY_MODES}
    for _ in range(rounds):  # the modes interleaved, each in a fresh process
        # the round's processes start together (their imports overlap) and are measured one at a time
        procs: dict[str, tuple[subprocess.Popen[str], Any]] = {}
        try:
            for mode in TELEMETRY_MODES:
                code = (
                    f"from acb.bench.overhead import telemetry_child_main; telemetry_child_main({mode!r}, {n}, {steps})"
                )
                err = tempfile.TemporaryFile("w+")
                procs[mode] = (
                    subprocess.Popen(
                        [sys.executable, "-c", code],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                        env=env,
                    ),
                    err,
                )
            deadline = time.monotonic() + 900
            for mode, (p, err) in procs.items():
                assert p.stdout is not None
                ready = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]
                if not ready or p.stdout.readline().strip() != "ready":
                    p.kill()
                    p.wait()
                    err.seek(0)
                    raise RuntimeError(f"overhead telemetry mode {mode} did not start: {err.read()[-2000:]}")
            for mode, (p, err) in procs.items():
                out, _ = p.communicate("go\n", timeout=900)
                if p.returncode != 0:
                    err.seek(0)
                    raise RuntimeError(f"overhead telemetry mode {mode}: {err.read()[-2000:]}")
                runs[mode].append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p, err in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
                err.close()
    rows = []
    for mode, rs in runs.items():  # the median round of each figure
        row: dict[str, Any] = dict(mode=mode, running=n, rounds=len(rs))
        for key in (
            "host_us",
            "schedule_us",
            "stage_us",
            "process_us",
            "queue_us_per_request",
            "record_us_per_request",
        ):
            row[key] = statistics.median(r[key] for r in rs)
        row["host_us_rounds"] = [r["host_us"] for r in rs]
        row["sdk_imported"] = any(r["sdk_imported"] for r in rs)
        rows.append(row)
    return rows


def run(size: str, spec: ModelSpec, baselines: bool = True) -> dict[str, Any]:
    p = SIZES[size]
    rows = []
    notes = []
    if baselines:
        from acb.bench.offline import patch_transformers_cpu_memory

        note = patch_transformers_cpu_memory()
        if note:
            notes.append(note)
    tf_runs = baselines  # (another family than the Llama: until transformers' side fails on it)
    for n in p["running"]:
        row = dict(running=n, acb=_acb(n, p["steps"], arch=spec.arch))
        if baselines:
            tf = None
            try:
                tf = _transformers(n, p["steps"], spec.arch) if tf_runs else None
            except Exception as e:  # noqa: BLE001 - a family transformers' paged cache cannot run
                if spec.arch == "llama":
                    raise
                tf_runs = False
                notes.append(f"transformers CB cannot run this family: {type(e).__name__}: {str(e)[:200]}")
            row["transformers"] = tf
            row["ratio"] = tf["host_us"] / row["acb"]["host_us"] if tf else None
        rows.append(row)
    steps = real_steps(size, spec, baselines)
    tel = None
    if spec.arch == "llama":
        tel = _telemetry(p["telemetry_running"], p["steps"], p["telemetry_rounds"])
        off = next(r for r in tel if r["mode"] == "off")["host_us"]
        for r in tel:
            r["vs_off"] = r["host_us"] / off - 1.0
    return dict(
        workload="overhead",
        arch=spec.arch,
        settings=dict(p, prompt_len=PROMPT_LEN, null_model=True),
        rows=rows,
        steps=steps,
        steps_settings=STEP_SIZES[size],
        telemetry=tel,
        notes=notes,
    )
