"""Output tokens/s of acb vs transformers' continuous batching vs padded ``model.generate``, on CPU.

One process, the same random-weight Llama (rebuilt from the same seed for each side, so the
weights are identical and no side inherits another's attention-implementation switch), the
same prompts and the same number of generated tokens per request on every side (EOS ignored;
the counts are checked and printed).

Two modes:

* default: per-request output lengths, uniform in [--min-new-tokens, --max-new-tokens].
  transformers' ``model.generate_batch`` takes a single ``max_new_tokens`` for the whole batch,
  so its side drives the very manager ``generate_batch`` wraps
  (``model.continuous_batching_context_manager`` + ``manager.add_request(..., max_new_tokens=n)``,
  with the same workload hints ``generate_batch`` computes); acb's side uses ``acb.Engine``
  with a ``SamplingParams`` per request. Engine set-up (KV cache allocation, transformers'
  warmup) is outside the timed region on both sides and reported as ``setup_s``.
* ``--fixed-output-len N``: every request generates N tokens and the two continuous-batching
  sides are the plain one-call APIs, ``acb.generate_batch`` and ``model.generate_batch`` (their
  set-up is then inside the timed region on both sides).

The padded baseline runs ``model.generate`` on consecutive groups of ``--generate-batch-size``
(32) prompts, left-padded with an attention mask, greedy, ``min_new_tokens = max_new_tokens =``
the largest target of the group; only each request's own target count is credited (the extra
tokens of shorter requests in a group are the waste of static batching, reported separately).

Example (tiny, for debugging)::

    python benchmarks/compare_cpu.py --num-prompts 8 --hidden 64 --layers 2 --vocab 256 --max-new-tokens 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from typing import Any

import torch

import acb
from acb.models import tiny_model


# ----------------------------------------------------------------------------- setup
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--min-new-tokens", type=int, default=16, help="lower bound of per-request output lengths "
                   "(clipped to --max-new-tokens)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="upper bound of per-request output lengths")
    p.add_argument("--fixed-output-len", type=int, default=None,
                   help="every request generates exactly this many tokens; the CB sides then use the one-call "
                        "generate_batch APIs")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=None, help="default: 4 x hidden")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="same token budget per step for both CB sides")
    p.add_argument("--max-requests-per-batch", type=int, default=128, help="same for both CB sides")
    p.add_argument("--acb-block-size", type=int, default=None, help="default: acb's default (32)")
    p.add_argument("--tf-block-size", type=int, default=None, help="default: transformers' default (256)")
    p.add_argument("--generate-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-transformers-cb", action="store_true")
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--json", type=str, default=None, help="write the results as JSON to this path")
    p.add_argument("--quiet-transformers", action="store_true", help="transformers logging at ERROR level")
    a = p.parse_args(argv)
    if a.intermediate is None:
        a.intermediate = 4 * a.hidden
    if a.min_prompt_len < 1 or a.max_prompt_len < a.min_prompt_len:
        p.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if a.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    a.min_new_tokens = max(1, min(a.min_new_tokens, a.max_new_tokens))
    return a


def build_model(a: argparse.Namespace) -> Any:
    return tiny_model(
        "llama", seed=a.seed, dtype=torch.float32, vocab_size=a.vocab,
        max_position_embeddings=a.max_position_embeddings, hidden_size=a.hidden,
        intermediate_size=a.intermediate, num_hidden_layers=a.layers, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
    )


def make_workload(a: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(a.seed + 1)
    lens = torch.randint(a.min_prompt_len, a.max_prompt_len + 1, (a.num_prompts,), generator=g).tolist()
    # ids 0-2 are pad/bos/eos in acb's tiny configs: keep prompts to ordinary tokens
    prompts = [torch.randint(3, a.vocab, (n,), generator=g).tolist() for n in lens]
    if a.fixed_output_len is not None:
        outs = [a.fixed_output_len] * a.num_prompts
    else:
        outs = torch.randint(a.min_new_tokens, a.max_new_tokens + 1, (a.num_prompts,), generator=g).tolist()
    return prompts, outs


def blocks_for_all(prompts: list[list[int]], outs: list[int], block_size: int) -> int:
    """KV blocks that hold every request at full length at once (so no side ever preempts)."""
    return sum(math.ceil((len(p) + o) / block_size) for p, o in zip(prompts, outs)) + 4


def _meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def patch_transformers_cpu_memory() -> str | None:
    """transformers sizes its paged cache from psutil on CPU and reports 0 bytes free without it.

    When psutil is missing, give its cache module the same figures psutil would (total RAM,
    this process's RSS) read from /proc. Returns a note when the patch was applied.
    """
    try:
        import psutil  # noqa: F401

        return None
    except ImportError:
        pass
    from transformers.generation.continuous_batching import cache as tf_cache

    def breakdown() -> tuple[torch.device, int, int, int]:
        total = _meminfo_bytes("MemTotal")
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return torch.device("cpu"), total, rss, rss

    tf_cache.get_device_and_memory_breakdown = breakdown
    return "psutil missing: transformers' CPU memory probe patched to read /proc (MemTotal, RSS)"


EOS_ID = 2  # acb.models.tiny_config's eos_token_id


def count_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- sides
def run_acb(a, prompts, outs) -> dict[str, Any]:
    model = build_model(a)
    cfg_kw = dict(num_blocks=None, max_batch_tokens=a.max_batch_tokens,
                  max_requests_per_batch=a.max_requests_per_batch, seed=a.seed)
    bs = a.acb_block_size or 32
    cfg_kw["block_size"] = bs
    cfg_kw["num_blocks"] = blocks_for_all(prompts, outs, bs) + 1  # + acb's scratch block 0

    # warm-up: two prompts, a few tokens
    acb.generate_batch(model, prompts[:2], sampling=acb.SamplingParams(max_new_tokens=4, ignore_eos=True),
                       progress_bar=False,
                       continuous_batching_config=acb.ContinuousBatchingConfig(**cfg_kw))
    setup = None
    if a.fixed_output_len is not None:
        c0 = time.process_time()
        t0 = time.perf_counter()
        res = acb.generate_batch(
            model, prompts, sampling=acb.SamplingParams(max_new_tokens=a.fixed_output_len, ignore_eos=True),
            progress_bar=False, continuous_batching_config=acb.ContinuousBatchingConfig(**cfg_kw),
        )
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
        results = [res[f"req_{i}"] for i in range(len(prompts))]
        api = "acb.generate_batch"
        steps = None
    else:
        t_setup = time.perf_counter()
        engine = acb.Engine(model, acb.ContinuousBatchingConfig(**cfg_kw))
        engine.start()
        setup = time.perf_counter() - t_setup
        try:
            c0 = time.process_time()
            t0 = time.perf_counter()
            handles = [engine.submit(p, acb.SamplingParams(max_new_tokens=o, ignore_eos=True, temperature=0.0))
                       for p, o in zip(prompts, outs)]
            results = [h.result() for h in handles]
            dt = time.perf_counter() - t0
            cpu = time.process_time() - c0
            steps = engine.stats.steps
        finally:
            engine.shutdown()
        api = "acb.Engine.submit (per-request SamplingParams)"
    bad = [r.request_id for r in results if r.status != acb.RequestStatus.FINISHED]
    if bad:
        raise RuntimeError(f"acb: requests not finished: {bad[:5]} ({results[0].error})")
    tokens = [list(r.generated_tokens) for r in results]
    settings = (f"block_size={bs} num_blocks={cfg_kw['num_blocks']} max_batch_tokens={a.max_batch_tokens} "
                f"max_requests_per_batch={a.max_requests_per_batch}")
    extra = {"steps": steps} if steps is not None else {}
    return dict(engine="acb", api=api, settings=settings, seconds=dt, cpu_s=cpu, setup_s=setup, tokens=tokens,
                attn_after=model.config._attn_implementation, **extra)


def run_transformers_cb(a, prompts, outs) -> dict[str, Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig as TfCBConfig

    model = build_model(a)
    bs = a.tf_block_size or TfCBConfig.block_size

    def cb_config(p, o) -> TfCBConfig:
        return TfCBConfig(block_size=bs, num_blocks=blocks_for_all(p, o, bs), max_batch_tokens=a.max_batch_tokens,
                          max_requests_per_batch=a.max_requests_per_batch, seed=a.seed)

    def gen_config(n: int) -> GenerationConfig:
        # eos_token_id=-1: transformers' "no EOS" value, so every request runs to max_new_tokens
        return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1)

    # warm-up: two prompts, a few tokens
    model.generate_batch(inputs=prompts[:2], generation_config=gen_config(4),
                         continuous_batching_config=cb_config(prompts[:2], [4, 4]), progress_bar=False)
    cfg = cb_config(prompts, outs)
    setup = None
    if a.fixed_output_len is not None:
        c0 = time.process_time()
        t0 = time.perf_counter()
        res = model.generate_batch(inputs=prompts, generation_config=gen_config(a.fixed_output_len),
                                   continuous_batching_config=cfg, progress_bar=False)
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
        results = [res.get(f"req_{i}") for i in range(len(prompts))]
        api = "model.generate_batch"
    else:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max(outs),
                              num_requests=len(prompts))
        t_setup = time.perf_counter()
        cm = model.continuous_batching_context_manager(
            generation_config=gen_config(max(outs)), continuous_batching_config=cfg, block=True, timeout=30,
            warmup=True, workload_hints=hints,
        )
        manager = cm.__enter__()
        setup = time.perf_counter() - t_setup
        try:
            c0 = time.process_time()
            t0 = time.perf_counter()
            ids = [manager.add_request(input_ids=p, request_id=f"req_{i}", max_new_tokens=o, eos_token_id=-1)
                   for i, (p, o) in enumerate(zip(prompts, outs))]
            got: dict[str, Any] = {}
            while len(got) < len(ids):
                r = manager.get_result(timeout=1)
                if r is not None:
                    if r.is_finished():
                        got[r.request_id] = r
                elif not manager.is_running():
                    raise RuntimeError("transformers' generation thread died")
            dt = time.perf_counter() - t0
            cpu = time.process_time() - c0
        finally:
            cm.__exit__(None, None, None)
        results = [got.get(f"req_{i}") for i in range(len(prompts))]
        api = "model.continuous_batching_context_manager + add_request(max_new_tokens=n)"
    missing = [i for i, r in enumerate(results) if r is None or r.error is not None]
    if missing:
        raise RuntimeError(f"transformers CB: requests missing or failed: {missing[:5]}")
    tokens = [list(r.generated_tokens) for r in results]
    settings = (f"paged|sdpa block_size={bs} num_blocks={cfg.num_blocks} max_batch_tokens={a.max_batch_tokens} "
                f"max_requests_per_batch={a.max_requests_per_batch}")
    return dict(engine="transformers CB", api=api, settings=settings, seconds=dt, cpu_s=cpu, setup_s=setup, tokens=tokens,
                attn_after=model.config._attn_implementation)


@torch.inference_mode()
def run_generate(a, prompts, outs) -> dict[str, Any]:
    model = build_model(a)
    pad = 0
    B = a.generate_batch_size

    def padded_generate(group: list[list[int]], n: int) -> torch.Tensor:
        L = max(map(len, group))
        ids = torch.full((len(group), L), pad, dtype=torch.long)
        mask = torch.zeros((len(group), L), dtype=torch.long)
        for r, p in enumerate(group):
            ids[r, L - len(p):] = torch.tensor(p)
            mask[r, L - len(p):] = 1
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=pad)
        return out[:, L:]

    padded_generate(prompts[:2], 4)  # warm-up
    tokens: list[list[int]] = []
    wasted = 0
    c0 = time.process_time()
    t0 = time.perf_counter()
    for s in range(0, len(prompts), B):
        group, targets = prompts[s:s + B], outs[s:s + B]
        n = max(targets)
        gen = padded_generate(group, n)
        if gen.shape[1] != n:
            raise RuntimeError(f"generate produced {gen.shape[1]} tokens, expected {n}")
        for r, o in enumerate(targets):
            tokens.append(gen[r, :o].tolist())  # only the request's own tokens are credited
            wasted += n - o
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    settings = f"sdpa batch_size={B} left-padded, min_new_tokens=max_new_tokens=max target of the batch"
    return dict(engine="padded generate", api="model.generate", settings=settings, seconds=dt, cpu_s=cpu, setup_s=None,
                tokens=tokens, wasted_tokens=wasted)


# ----------------------------------------------------------------------------- report
def machine_info() -> dict[str, Any]:
    import transformers

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return dict(
        platform=platform.platform(), processor=platform.processor() or platform.machine(),
        python=platform.python_version(), cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
        torch=torch.__version__, transformers=transformers.__version__, acb=acb.__version__,
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), loadavg_at_start=load,
    )


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ["engine", "requests", "output tokens", "seconds", "tokens/s", "ratio vs acb", "settings"]
    body = [[r["engine"], str(r["requests"]), str(r["output_tokens"]), f"{r['seconds']:.2f}",
             f"{r['tokens_per_s']:.1f}", f"{r['ratio_vs_acb']:.2f}" if r["ratio_vs_acb"] is not None else "-",
             r["settings"]] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.quiet_transformers:
        import transformers

        transformers.logging.set_verbosity_error()
    notes: list[str] = []
    patched = patch_transformers_cpu_memory()
    if patched:
        notes.append(patched)
    prompts, outs = make_workload(a)
    probe = build_model(a)
    n_params = count_params(probe)
    del probe
    info = machine_info()
    mode = "fixed" if a.fixed_output_len is not None else "per-request"
    workload = dict(
        num_prompts=len(prompts), prompt_len_range=[a.min_prompt_len, a.max_prompt_len],
        prompt_tokens=sum(map(len, prompts)), mean_prompt_len=sum(map(len, prompts)) / len(prompts),
        output_len_mode=mode,
        output_len_range=[a.fixed_output_len] * 2 if mode == "fixed" else [a.min_new_tokens, a.max_new_tokens],
        target_output_tokens=sum(outs), greedy=True, ignore_eos=True,
    )
    model_desc = dict(arch="llama", params=n_params, hidden=a.hidden, intermediate=a.intermediate, layers=a.layers,
                      heads=a.heads, kv_heads=a.kv_heads, vocab=a.vocab,
                      max_position_embeddings=a.max_position_embeddings, dtype="float32", seed=a.seed)
    print(f"model: random Llama, {n_params / 1e6:.1f}M parameters (hidden={a.hidden} intermediate={a.intermediate} "
          f"layers={a.layers} heads={a.heads} kv_heads={a.kv_heads} vocab={a.vocab}), float32", flush=True)
    print(f"workload: {len(prompts)} prompts, lengths in [{a.min_prompt_len}, {a.max_prompt_len}] "
          f"({workload['prompt_tokens']} prompt tokens), output lengths "
          + (f"fixed at {a.fixed_output_len}" if mode == "fixed" else f"per request in [{a.min_new_tokens}, "
             f"{a.max_new_tokens}]") + f" ({sum(outs)} output tokens), greedy, EOS ignored", flush=True)
    if mode == "per-request":
        notes.append("transformers' model.generate_batch takes one max_new_tokens for all requests, so its side "
                     "uses the manager generate_batch wraps, with add_request(max_new_tokens=n) per request")
    for n in notes:
        print("note:", n, flush=True)

    sides = [("acb", run_acb)]
    if not a.skip_transformers_cb:
        sides.append(("transformers CB", run_transformers_cb))
    if not a.skip_generate:
        sides.append(("padded generate", run_generate))
    runs: dict[str, dict[str, Any]] = {}
    for name, fn in sides:
        print(f"running {name} ...", flush=True)
        r = fn(a, prompts, outs)
        counts = [len(t) for t in r["tokens"]]
        r["counts_ok"] = counts == outs
        r["output_tokens"] = sum(counts)
        r["requests"] = len(counts)
        r["tokens_per_s"] = r["output_tokens"] / r["seconds"]
        print(f"  {name}: {r['output_tokens']} tokens in {r['seconds']:.2f}s = {r['tokens_per_s']:.1f} tok/s; "
              f"per-request counts {'== targets' if r['counts_ok'] else '!= targets (MISMATCH)'}"
              + (f"; setup {r['setup_s']:.2f}s (untimed)" if r.get("setup_s") is not None else ""), flush=True)
        runs[name] = r

    base = runs["acb"]["tokens_per_s"]
    rows = []
    for r in runs.values():
        r["ratio_vs_acb"] = r["tokens_per_s"] / base
        rows.append(r)

    checks: dict[str, Any] = {}
    k = min(4, len(prompts))
    acb_tok = runs["acb"]["tokens"][:k]
    for other, label in (("transformers CB", "acb vs transformers generate_batch"),
                         ("padded generate", "acb vs padded model.generate (info only)")):
        if other in runs:
            same = [x == y for x, y in zip(acb_tok, runs[other]["tokens"][:k])]
            verdict = "MATCH" if all(same) else "MISMATCH"
            first_diff = None
            if not all(same):
                i = same.index(False)
                x, y = acb_tok[i], runs[other]["tokens"][i]
                j = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                first_diff = dict(request=i, position=j)
                if j < len(x) and x[j] == EOS_ID and other == "padded generate":
                    first_diff["why"] = (f"acb greedily chose EOS (id {EOS_ID}) there; generate's min_new_tokens "
                                         "masks EOS until the last token")
            checks[label] = dict(verdict=verdict, per_request=same, first_diff=first_diff)

    try:
        info["loadavg_at_end"] = os.getloadavg()
    except OSError:
        pass

    table = format_table(rows)
    lines = [
        "",
        f"model: random Llama {n_params / 1e6:.1f}M params, hidden={a.hidden} intermediate={a.intermediate} "
        f"layers={a.layers} heads={a.heads}/{a.kv_heads}kv vocab={a.vocab}, float32",
        f"workload: {workload['num_prompts']} prompts, prompt len {a.min_prompt_len}-{a.max_prompt_len} "
        f"(mean {workload['mean_prompt_len']:.1f}), output len "
        + (f"fixed {a.fixed_output_len}" if mode == "fixed" else f"{a.min_new_tokens}-{a.max_new_tokens} per request")
        + f", {workload['target_output_tokens']} output tokens per side, greedy, EOS ignored",
        "",
        table,
        "",
    ]
    for r in rows:
        extra = []
        if r.get("setup_s") is not None:
            extra.append(f"setup {r['setup_s']:.2f}s untimed")
        if r.get("wasted_tokens"):
            extra.append(f"{r['wasted_tokens']} extra padded-batch tokens generated but not credited")
        extra.append(f"process CPU {r['cpu_s']:.1f}s = {r['cpu_s'] / r['seconds']:.2f} cores busy on average")
        if r.get("steps"):
            extra.append(f"{r['steps']} engine steps")
        lines.append(f"  {r['engine']}: {r['api']}; counts {'OK' if r['counts_ok'] else 'MISMATCH'}"
                     + ("; " + "; ".join(extra) if extra else ""))
    lines.append("")
    for label, c in checks.items():
        lines.append(f"{c['verdict']}: {label}, first {k} prompts"
                     + (f" (first difference: request {c['first_diff']['request']}, token {c['first_diff']['position']}"
                        + (f": {c['first_diff']['why']}" if c["first_diff"].get("why") else "") + ")"
                        if c["first_diff"] else ""))
    lines += [
        "",
        f"machine: {info['platform']}, {info['processor']}, {info['cpu_count']} CPUs, torch threads "
        f"{info['torch_threads']}, python {info['python']}",
        f"versions: torch {info['torch']}, transformers {info['transformers']}, acb {info['acb']}",
        f"date: {info['date']}, load average at start {info.get('loadavg_at_start')}, at end {info.get('loadavg_at_end')}",
    ]
    for n in notes:
        lines.append(f"note: {n}")
    print("\n".join(lines), flush=True)

    if a.json:
        out = dict(
            machine=info, model=model_desc, workload=workload, args=vars(a), notes=notes, checks=checks,
            results=[{k2: v for k2, v in r.items() if k2 != "tokens"} for r in rows],
        )
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
