"""``serve``: ``acb serve`` vs ``transformers serve --continuous-batching``, over HTTP, same load.

One local checkpoint (a random Llama of :data:`acb.models.DEFAULT_MODEL_CONFIG`'s shape, or a
tiny one, with the byte-level tokenizer of :func:`acb.models.build_tokenizer` and a chat
template; its generation config's ``eos_token_id`` is -1 so that neither server stops early)
is saved to a temporary folder. Each server is started on it as a subprocess (CPU or the given
device, float32, the same KV cache: page size and block count) and driven by the same
``openai.AsyncOpenAI`` load generator: streaming chat completions of the same chats, greedy,
fixed ``max_tokens`` (acb also gets ``ignore_eos``), first at fixed concurrency levels (N
clients, each sending its next request when the last one ended) and then at Poisson arrival
rates. The in-process :class:`acb.AsyncEngine` runs the same concurrency levels on the same
checkpoint for the HTTP layer's own cost.

Per level: output tokens/s and requests/s (wall time from the first send to the last end),
TTFT (send -> first chunk with text), ITL (gaps between consecutive chunks with text, as the
client sees them) and TPOT (a request's (last - first chunk) / (tokens - 1)), p50/p90/p99.
Token counts come from the servers' ``usage``, and are checked equal to ``max_tokens``.

transformers serve needs ``fastapi``, ``uvicorn``, ``openai`` and ``accelerate``
(``pip install "transformers[serving]" accelerate``); without them, or when it fails to start,
its rows are left out and the reason is recorded in the JSON's notes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from acb.bench.common import ModelSpec, percentiles

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        shape="tiny",
        concurrency=[1, 4],
        requests={1: 2, 4: 8},
        rates=[20.0],
        rate_requests=6,
        min_chars=8,
        max_chars=24,
        max_tokens=8,
        page_size=16,
        num_blocks=64,
    ),
    "default": dict(
        shape="default",
        concurrency=[1, 8, 32, 128],
        requests={1: 8, 8: 32, 32: 64, 128: 128},
        rates=[2.0, 8.0],
        rate_requests=32,
        min_chars=32,
        max_chars=256,
        max_tokens=64,
        page_size=32,
        num_blocks=1536,
    ),
}

ACB = "acb serve"
TF = "transformers serve"
INPROC = "acb AsyncEngine (in-process)"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


# ------------------------------------------------------------------ checkpoint and prompts
def save_checkpoint(path: str, shape: str, seed: int = 0) -> dict[str, Any]:
    """A random Llama + the byte-level tokenizer with a chat template, EOS disabled (-1) in the
    generation config; returns the model's description."""
    from acb.models import DEFAULT_MODEL_CONFIG, build_tokenizer, tiny_model

    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    if shape == "tiny":
        cfg: dict[str, Any] = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
    else:
        cfg = dict(DEFAULT_MODEL_CONFIG)
    model = tiny_model("llama", seed=seed, vocab_size=len(tok), **cfg)
    model.generation_config.eos_token_id = -1  # neither server stops early
    model.save_pretrained(path)
    tok.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    return {"arch": "llama (random weights)", "params": n, "dtype": "float32", "vocab_size": len(tok), **cfg}


def make_chats(n: int, min_chars: int, max_chars: int, seed: int) -> list[list[dict[str, str]]]:
    rnd = random.Random(seed)
    alphabet = string.ascii_letters + "      "
    return [
        [{"role": "user", "content": "".join(rnd.choice(alphabet) for _ in range(rnd.randint(min_chars, max_chars)))}]
        for _ in range(n)
    ]


# ------------------------------------------------------------------ servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except Exception:
        return False


def thread_cpu(pid: int) -> dict[str, float] | None:
    """CPU seconds of process ``pid`` so far: its main thread (for a server, the event loop:
    HTTP, JSON, streaming) and all its other threads (the engine and torch's workers). Linux
    only (``/proc``); None elsewhere."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {"main": 0.0, "other": 0.0}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        fields = stat[stat.rindex(")") + 2 :].split()
        out["main" if int(tid) == pid else "other"] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


class Server:
    """A server subprocess: started, waited for (/health 200), stopped (SIGINT, then kill)."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: str, env: dict[str, str]) -> None:
        self.name, self.port, self.log_path = name, port, log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started = time.perf_counter()

    def wait_ready(self, timeout: float = 300.0) -> float:
        while time.perf_counter() - self.started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            if _healthy(self.port):
                return time.perf_counter() - self.started
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s: {self.tail()}")

    def tail(self, n: int = 1500) -> str:
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def start_acb(ckpt: str, p: dict[str, Any], device: str, log_dir: str) -> tuple[Server, str]:
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "acb",
        "serve",
        "--model",
        ckpt,
        "--served-model-name",
        "bench",
        "--port",
        str(port),
        "--device",
        device,
        "--dtype",
        "float32",
        "--page-size",
        str(p["page_size"]),
        "--num-blocks",
        str(p["num_blocks"]),
        "--grace-period",
        "1",
    ]
    return Server(ACB, argv, port, os.path.join(log_dir, "acb.log"), _env()), "bench"


def transformers_serve_missing() -> str | None:
    """Why ``transformers serve`` cannot run here, or None."""
    try:
        from transformers.utils import is_serve_available
    except ImportError as exc:
        return f"transformers has no serve CLI ({exc})"
    if not is_serve_available():
        return "transformers serve needs pydantic, fastapi, uvicorn and openai: pip install 'transformers[serving]'"
    if importlib.util.find_spec("accelerate") is None:  # transformers serve imports it, not acb
        return (
            "transformers serve loads with a device_map, which needs accelerate (ValueError: Using a `device_map` "
            "... requires `accelerate`): pip install accelerate"
        )
    return None


def start_transformers(ckpt: str, p: dict[str, Any], device: str, log_dir: str) -> tuple[Server, str]:
    port = _free_port()
    exe = shutil.which("transformers", path=os.path.dirname(sys.executable)) or shutil.which("transformers")
    head = [exe] if exe else [sys.executable, "-m", "transformers.cli.transformers"]
    argv = [
        *head,
        "serve",
        ckpt,
        "--continuous-batching",
        "--device",
        device,
        "--dtype",
        "float32",
        "--cb-block-size",
        str(p["page_size"]),
        "--cb-num-blocks",
        str(p["num_blocks"]),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    return Server(TF, argv, port, os.path.join(log_dir, "transformers.log"), _env()), ckpt


# ------------------------------------------------------------------ load generator
class Target:
    """Where requests go: an OpenAI-compatible server, or the in-process engine."""

    def __init__(
        self,
        name: str,
        *,
        port: int | None = None,
        model: str = "",
        extra_body: dict[str, Any] | None = None,
        engine: Any = None,
        pid: int | None = None,
    ) -> None:
        self.name, self.model, self.extra_body, self.engine, self.pid = name, model, extra_body or {}, engine, pid
        self.client: Any = None
        if port is not None:
            import openai

            # openai's default pool: 1000 connections, enough for every level
            self.client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900.0
            )

    async def one(self, chat: list[dict[str, str]], max_tokens: int) -> tuple[float, list[float], int]:
        """(send time, times of the chunks with text, output tokens)."""
        t0 = time.perf_counter()
        times: list[float] = []
        if self.engine is not None:
            from acb.sampling_params import SamplingParams

            h = await self.engine.submit(chat, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))
            async for d in h:
                if d.text:
                    times.append(time.perf_counter())
            out = await h.result()
            return t0, times, len(out.generated_tokens)
        tokens = 0
        stream = await self.client.chat.completions.create(
            model=self.model,
            messages=chat,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=self.extra_body,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return t0, times, tokens

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


def _summary(
    records: list[tuple[float, list[float], int]], start: float, end: float, max_tokens: int
) -> dict[str, Any]:
    ttft = [ts[0] - t0 for t0, ts, _ in records if ts]
    itl = [b - a for _, ts, _ in records for a, b in zip(ts, ts[1:])]
    tpot = [(ts[-1] - ts[0]) / (n - 1) for _, ts, n in records if len(ts) > 1 and n > 1]
    tokens = sum(n for *_, n in records)
    dt = end - start
    return dict(
        requests=len(records),
        output_tokens=tokens,
        seconds=dt,
        tokens_per_s=tokens / dt,
        requests_per_s=len(records) / dt,
        counts_ok=all(n == max_tokens for *_, n in records),
        ttft_s=percentiles(ttft),
        itl_s=percentiles(itl),
        tpot_s=percentiles(tpot),
    )


async def at_concurrency(target: Target, chats: list[list[dict[str, str]]], c: int, max_tokens: int) -> dict[str, Any]:
    queue = list(reversed(chats))
    records: list[tuple[float, list[float], int]] = []

    async def worker() -> None:
        while queue:
            records.append(await target.one(queue.pop(), max_tokens))

    server0, client0 = _cpu(target), time.process_time()
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    end = time.perf_counter()
    return dict(
        mode="concurrency",
        concurrency=c,
        **_summary(records, start, end, max_tokens),
        cpu_s=_cpu_used(target, server0, client0, end - start),
    )


def _cpu(target: Target) -> dict[str, float] | None:
    return thread_cpu(target.pid) if target.pid is not None else None


def _cpu_used(target: Target, server0: dict[str, float] | None, client0: float, wall: float) -> dict[str, Any]:
    """CPU seconds spent during a level: by the load generator's process (for the in-process
    engine, that process is the engine too), and by the server's event loop and its other
    threads; ``cores`` is the machine's."""
    used: dict[str, Any] = {"client_process": time.process_time() - client0, "wall": wall, "cores": os.cpu_count()}
    server1 = _cpu(target)
    if server0 is not None and server1 is not None:
        used["server_event_loop"] = server1["main"] - server0["main"]
        used["server_engine_threads"] = server1["other"] - server0["other"]
    return used


async def at_rate(
    target: Target, chats: list[list[dict[str, str]]], rate: float, max_tokens: int, seed: int
) -> dict[str, Any]:
    rnd = random.Random(seed)
    tasks = []
    start = time.perf_counter()
    for chat in chats:
        tasks.append(asyncio.create_task(target.one(chat, max_tokens)))
        await asyncio.sleep(rnd.expovariate(rate))
    records = list(await asyncio.gather(*tasks))
    return dict(mode="rate", rate=rate, **_summary(records, start, time.perf_counter(), max_tokens))


async def drive(
    target: Target, p: dict[str, Any], chats: list[list[dict[str, str]]], rates: bool = True
) -> list[dict[str, Any]]:
    rows = []
    try:
        await asyncio.gather(*(target.one(c, p["max_tokens"]) for c in chats[:2]))  # warm-up (transformers: CB init)
        for c in p["concurrency"]:
            row = await at_concurrency(target, chats[: p["requests"][c]], c, p["max_tokens"])
            rows.append(dict(engine=target.name, **row))
            print(f"  {target.name}: concurrency {c}: {row['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
        for i, r in enumerate(p["rates"] if rates else []):
            row = await at_rate(target, chats[: p["rate_requests"]], r, p["max_tokens"], seed=20 + i)
            rows.append(dict(engine=target.name, **row))
            print(f"  {target.name}: rate {r}: {row['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        await target.close()
    return rows


def _in_process(ckpt: str, p: dict[str, Any], device: str, chats: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from acb.api.async_engine import AsyncEngine
    from acb.config import ContinuousBatchingConfig

    tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True).to(device).eval()  # type: ignore[arg-type]
    cfg = ContinuousBatchingConfig(page_size=p["page_size"], num_blocks=p["num_blocks"])

    async def go() -> list[dict[str, Any]]:
        async with AsyncEngine(model, cfg, tokenizer=tok) as eng:
            return await drive(Target(INPROC, engine=eng), p, chats, rates=False)

    return asyncio.run(go())


# ------------------------------------------------------------------ the workload
def run(size: str, spec: ModelSpec, baselines: bool = True) -> dict[str, Any]:
    p = SIZES[size]
    n = max([*p["requests"].values(), p["rate_requests"], 2])
    chats = make_chats(n, p["min_chars"], p["max_chars"], seed=5)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    servers: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="acb-bench-serve-") as tmp:
        ckpt = os.path.join(tmp, "model")
        model_desc = save_checkpoint(ckpt, p["shape"], seed=spec.seed)
        starters = [(ACB, start_acb, {"ignore_eos": True})]
        if baselines:
            why = transformers_serve_missing()
            if why is None:
                starters.append((TF, start_transformers, {}))
            else:
                notes.append(f"transformers serve did not run: {why}")
        for name, start, extra in starters:
            print(f"  starting {name}", file=sys.stderr, flush=True)
            server, model_name = start(ckpt, p, spec.device, tmp)
            try:
                ready_s = server.wait_ready()
                servers[name] = dict(argv=server.proc.args, ready_s=ready_s)
                rows += asyncio.run(
                    drive(
                        Target(name, port=server.port, model=model_name, extra_body=extra, pid=server.proc.pid),
                        p,
                        chats,
                    )
                )
            except Exception as exc:
                if name == ACB:
                    raise
                notes.append(f"{name} failed: {type(exc).__name__}: {str(exc)[-600:]}")
            finally:
                server.stop()
        if baselines:
            print(f"  {INPROC}", file=sys.stderr, flush=True)
            rows += _in_process(ckpt, p, spec.device, chats)
    _compare(rows)
    notes.append(
        "TTFT: send to the first chunk with text; ITL: gaps between chunks with text (client side); "
        "TPOT: per request, (last - first chunk) / (tokens - 1); one client process drives every engine"
    )
    return dict(
        workload="serve",
        model=model_desc,
        servers=servers,
        settings=dict(
            {k: v for k, v in p.items() if k != "requests"},
            requests_per_level={str(k): v for k, v in p["requests"].items()},
            greedy=True,
            eos_disabled=True,
            streaming=True,
            device=spec.device,
        ),
        rows=rows,
        notes=notes,
    )


def _compare(rows: list[dict[str, Any]]) -> None:
    """acb serve's output tokens/s over each other engine's at the same level."""

    def key(r: dict[str, Any]) -> tuple[str, Any]:
        return r["mode"], r.get("concurrency", r.get("rate"))

    ref = {key(r): r for r in rows if r["engine"] == ACB}
    for r in rows:
        a = ref.get(key(r))
        r["acb_serve_speedup"] = a["tokens_per_s"] / r["tokens_per_s"] if a and r["tokens_per_s"] else None


# ------------------------------------------------------------------ report
def _ms(d: dict[str, Any]) -> str:
    return " / ".join("–" if d[k] is None else f"{d[k] * 1e3:.0f}" for k in ("p50", "p90", "p99"))


def markdown(doc: dict[str, Any]) -> str:
    """The serve workload's tables in Markdown (one per mode: concurrency levels, arrival rates)."""
    from acb.bench.common import device_name

    r, m, model = doc["result"], doc["machine"], doc["model"]
    s = r["settings"]
    head = (
        f"**serve** — {device_name(m)}, {m['date'][:10]}, torch {m['torch']}, transformers {m['transformers']}; "
        f"model: {model['arch']}, {model['params'] / 1e6:.1f}M params, {model['dtype']}; size `{doc['size']}`\n\n"
        f"Streaming chat completions through `openai.AsyncOpenAI`, {s['max_tokens']} output tokens each (EOS off), "
        f"greedy, prompts of {s['min_chars']}-{s['max_chars']} characters (byte-level tokenizer); requests per "
        f"concurrency level {', '.join(f'{k}: {v}' for k, v in s['requests_per_level'].items())}; "
        f"{s['rate_requests']} requests per Poisson rate. Same checkpoint, same KV cache ({s['num_blocks']} blocks "
        f"of {s['page_size']}).\n\n"
    )
    lines = [
        "| streams / rate | engine | tokens/s | requests/s | TTFT p50 / p90 / p99 (ms) | "
        "ITL p50 / p90 / p99 (ms) | TPOT p50 (ms) | acb serve speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = sorted(r["rows"], key=lambda x: (x["mode"] != "concurrency", x.get("concurrency", x.get("rate"))))
    for row in rows:
        level = f"{row['concurrency']} streams" if row["mode"] == "concurrency" else f"{row['rate']} req/s"
        tp = row["tpot_s"]["p50"]
        sp = row.get("acb_serve_speedup")
        lines.append(
            f"| {level} | {row['engine']} | {row['tokens_per_s']:,.1f} | {row['requests_per_s']:.2f} | "
            f"{_ms(row['ttft_s'])} | {_ms(row['itl_s'])} | {'–' if tp is None else f'{tp * 1e3:.0f}'} | "
            f"{'' if sp is None else f'{sp:.2f}x'} |"
        )
    notes = "".join(f"\n_{n}_\n" for n in r.get("notes", []))
    return head + "\n".join(lines) + "\n" + _cpu_table(rows) + notes


def _cpu_table(rows: list[dict[str, Any]]) -> str:
    """Where the machine's CPU went at each concurrency level (rows measured with ``cpu_s``)."""
    have = [r for r in rows if r["mode"] == "concurrency" and r.get("cpu_s")]
    if not have:
        return ""
    lines = [
        "",
        "CPU seconds used during each concurrency level, and their share of the machine's core-seconds "
        "(cores x wall time). The load generator (one `AsyncOpenAI` process: HTTP, SSE and pydantic parsing "
        "of every chunk) shares the cores with the server; for the in-process engine it is the engine's own "
        "process.",
        "",
        "| streams | engine | load generator | server event loop (HTTP) | server engine threads |",
        "|---|---|---|---|---|",
    ]

    def cell(v: float | None, total: float) -> str:
        return "–" if v is None else f"{v:.1f} s ({v / total:.0%})"

    for r in have:
        c = r["cpu_s"]
        total = (c.get("cores") or 1) * c["wall"]
        lines.append(
            f"| {r['concurrency']} | {r['engine']} | {cell(c['client_process'], total)} | "
            f"{cell(c.get('server_event_loop'), total)} | {cell(c.get('server_engine_threads'), total)} |"
        )
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: str, plt: Any) -> str:
    """Output tokens/s and p99 TTFT per concurrency level, one line per engine (``plt``: pyplot,
    from :func:`acb.bench.report.plot`)."""
    from acb.bench.common import device_name

    rows = [r for r in doc["result"]["rows"] if r["mode"] == "concurrency"]
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for e in engines:
        rs = [r for r in rows if r["engine"] == e]
        c = [r["concurrency"] for r in rs]
        a1.plot(c, [r["tokens_per_s"] for r in rs], "-o", label=e)
        a2.plot(c, [(r["ttft_s"]["p99"] or 0) * 1e3 for r in rs], "-o", label=e)
    for ax, label in ((a1, "output tokens/s"), (a2, "TTFT p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    a2.set_yscale("log")
    fig.suptitle(f"serve — {device_name(doc['machine'])}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
