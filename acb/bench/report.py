"""Turn benchmark results into PNG plots and the results tables (``benchmarks/RESULTS.md``).

The tables are generated from the JSON files (``acb bench report --update-readme FILE``),
between ``<!-- acb-bench:KIND:start -->`` and ``<!-- acb-bench:KIND:end -->`` markers, so
no figure in them is typed by hand.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from acb.bench.common import device_name

ORDER = ("offline", "offline-uniform", "shared-prefix", "online", "overhead", "serve", "eval")


def _mib(b: float | None) -> str:
    return "" if b is None else f"{b / 2**20:,.0f} MiB"


def markdown_for(doc: dict[str, Any]) -> str:
    """One workload's table in Markdown."""
    if doc["result"]["workload"] == "serve":  # its own tables (per load level, three engines)
        from acb.bench.serve import markdown

        return markdown(doc)
    if doc["result"]["workload"] == "eval":
        from acb.bench import eval as eval_

        m, model = doc["machine"], doc["model"]
        s = doc["result"]["settings"]
        head = (
            f"**eval** — {device_name(m)}, {m['date'][:10]}, torch {m['torch']}, transformers {m['transformers']}; "
            f"model: {model['arch']}, {model['params'] / 1e6:.1f}M params, {model['dtype']}; size `{doc['size']}`\n\n"
            f"lm-eval `simple_evaluate`, one call per task and backend ({s['timed']}); documents per task: "
            + ", ".join(f"{t} {n}" for t, n in s["docs"].items())
            + f"; max_gen_toks {s['max_gen_toks']}.\n\n"
        )
        return head + "\n".join(eval_.markdown(doc)) + "\n"
    r, m, model = doc["result"], doc["machine"], doc["model"]
    what = (
        f"{model['arch']}, {model['params'] / 1e6:.1f}M params, {model['dtype']}"
        if r["workload"] != "overhead"
        else "null model (a 1-layer tiny Llama whose forward is skipped)"
        if r.get("arch", "llama") == "llama"
        else f"null model (the tiny {r['arch']} whose forward is skipped); real steps: {model['arch']}"
    )
    head = (
        f"**{r['workload']}** — {device_name(m)}, {m['date'][:10]}, torch {m['torch']}, "
        f"transformers {m['transformers']}; model: {what}; size `{doc['size']}`\n\n"
    )
    w = r["workload"]
    lines: list[str] = []
    if w in ("offline", "offline-uniform", "shared-prefix"):
        s = r["settings"]
        if w == "offline":
            head += (
                f"{s['num_prompts']} prompts, lengths uniform in [{s['min_prompt_len']}, {s['max_prompt_len']}], "
                f"outputs uniform in [{s['min_new']}, {s['max_new']}], greedy, EOS ignored.\n\n"
            )
        elif w == "offline-uniform":
            head += (
                f"{s['num_prompts']} prompts of {s['min_prompt_len']} tokens, {s['min_new']} output tokens each "
                f"(padded generate's best case: no padding), greedy, EOS ignored.\n\n"
            )
        else:
            head += (
                f"{s['num_prompts']} prompts = {s['prefix_len']}-token shared prefix + {s['suffix_len']}-token "
                f"suffix, {s['max_new']} output tokens each, greedy.\n\n"
            )
        extra = "prefix hit rate" if w == "shared-prefix" else "peak memory"
        roof = r.get("roofline")
        lines.append(
            f"| engine | output tokens | seconds | tokens/s | requests/s | acb speed-up | {extra} |"
            + (" GFLOP/s (% of matmul peak) |" if roof else "")
        )
        lines.append("|---|---|---|---|---|---|---|" + ("---|" if roof else ""))
        for row in r["rows"]:
            tail = f"{row['prefix_hit_rate']:.1%}" if w == "shared-prefix" else _mib(row.get("peak_memory"))
            if row.get("state_snapshot_restores"):  # a model with state layers: hits resumed from snapshots
                tail += f" ({row['state_snapshot_restores']:,} state snapshots restored)"
            lines.append(
                f"| {row['engine']} | {row['output_tokens']:,} | {row['seconds']:.2f} | "
                f"{row['tokens_per_s']:,.1f} | {row['requests_per_s']:.2f} | {row['acb_speedup']:.2f}x | "
                f"{tail} |" + (f" {row['gflops']:.1f} ({row['roofline_pct']:.0f}%) |" if roof else "")
            )
        if roof:
            lines += [
                "",
                f"Roofline: the workload needs at least {roof['total'] / 1e12:.3f} TFLOP "
                f"({roof['linear'] / 1e12:.3f} in linear layers, {roof['attention'] / 1e12:.3f} attention, "
                f"{roof['lm_head'] / 1e12:.3f} LM head); this machine's float32 matmul peak, measured in the same "
                f"run, was {roof['matmul_peak_gflops']:.0f} GFLOP/s ({roof['threads']} threads), so the floor is "
                f"{roof['floor_s']:.1f} s.",
            ]
    elif w == "online":
        s = r["settings"]
        head += (
            f"{s['num_requests']} requests per rate, Poisson arrivals, streaming through `AsyncEngine`, prompts "
            f"[{s['min_prompt_len']}, {s['max_prompt_len']}], outputs [{s['min_new']}, {s['max_new']}].\n\n"
        )
        lines.append("| rate (req/s) | tokens/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) |")
        lines.append("|---|---|---|---|")
        for row in r["rows"]:

            def ms(d: dict) -> str:
                return " / ".join("–" if d[k] is None else f"{d[k] * 1e3:.1f}" for k in ("p50", "p90", "p99"))

            lines.append(f"| {row['rate']} | {row['tokens_per_s']:,.1f} | {ms(row['ttft_s'])} | {ms(row['itl_s'])} |")
    elif w == "overhead":
        head += (
            "Host time per decode step with a null model (median over steps where every request decodes); "
            "transformers: `prepare_next_batch` + `update_batch` on the same workload.\n\n"
        )
        lines.append(
            "| running | acb schedule / stage / process (µs) | acb host µs | transformers µs | transformers / acb |"
        )
        lines.append("|---|---|---|---|---|")
        for row in r["rows"]:
            a = row["acb"]
            tf = row.get("transformers")
            tf_us = f"{tf['host_us']:.0f}" if tf else ""
            ratio = f"{row['ratio']:.1f}x" if row.get("ratio") else ""
            lines.append(
                f"| {row['running']} | {a['schedule_us']:.0f} / {a['stage_us']:.0f} / {a['process_us']:.0f} | "
                f"{a['host_us']:.0f} | {tf_us} | {ratio} |"
            )
        if r.get("steps"):
            st = r["steps_settings"]
            lines += [
                "",
                f"A real model's decode step (the benchmark's model, B prompts of {st['prompt']} tokens; one step: "
                f"a call with 1 + {st['decode_steps']} new tokens less a call with 1, over {st['decode_steps']}), "
                "against `model.generate` on the same prompts: the step's ms, its matmuls' ms (linear layers and "
                "LM head, torch.profiler self time) and the rest (the unprofiled step less the matmuls); "
                "the other ops' self times by kind, as profiled (which inflates small ops).",
                "",
                "| B | engine | step ms | matmul ms | outside matmul ms | of it: attention (sdpa) / gather / copy / "
                "elementwise / other ops (profiled ms) | generate / acb: step / outside |",
                "|---|---|---|---|---|---|---|",
            ]
            for row in r["steps"]:
                for name in ("acb", "generate"):
                    e = row.get(name)
                    if not e:
                        continue
                    o = e["outside_ops_ms"]
                    split = " / ".join(
                        f"{o.get(k, 0.0):.2f}" for k in ("sdpa", "gather/scatter", "copy", "elementwise", "other")
                    )
                    ratio = ""
                    if name == "acb" and row.get("step_ratio"):
                        ratio = f"{row['step_ratio']:.2f}x / {row['outside_matmul_ratio']:.2f}x"
                    lines.append(
                        f"| {row['batch']} | {name} | {e['step_ms']:.2f} | {e['matmul_ms']:.2f} | "
                        f"{e['outside_matmul_ms']:.2f} | {split} | {ratio} |"
                    )
        if r.get("telemetry"):
            n = r["telemetry"][0]["running"]
            lines += [
                "",
                f"Telemetry's cost at {n} running requests (each mode in its own process): off "
                "(`OTEL_SDK_DISABLED=true`), the OpenTelemetry API alone (no SDK configured: the default), "
                "and the SDK exporting over OTLP/HTTP to a local receiver. Per step, and per ended request: "
                "what its thread spends to queue its record, and the time until the telemetry thread has "
                "built its span and measurements.",
                "",
                "| telemetry | host µs per step | vs off | µs per ended request: queued / recorded |",
                "|---|---|---|---|",
            ]
            labels = {"off": "off", "api": "API only (default)", "sdk": "SDK + OTLP exporter"}
            for t in r["telemetry"]:
                lines.append(
                    f"| {labels.get(t['mode'], t['mode'])} | {t['host_us']:.0f} | {t['vs_off']:+.1%} | "
                    f"{t.get('queue_us_per_request', 0):.1f} / {t['record_us_per_request']:.1f} |"
                )
    notes = "".join(f"\n_{n}_\n" for n in r.get("notes", []))
    return head + "\n".join(lines) + "\n" + notes


def load_results(results_dir: str, kind: str) -> list[dict[str, Any]]:
    docs = []
    for path in sorted(glob.glob(os.path.join(results_dir, f"{kind}_*.json"))):  # (a stable order)
        with open(path) as f:
            doc = json.load(f)
        if "result" in doc and "machine" in doc:
            docs.append(doc)
    docs.sort(key=lambda d: ORDER.index(d["result"]["workload"]) if d["result"]["workload"] in ORDER else 99)
    return docs


def update_readme(readme: str, results_dir: str, kind: str) -> bool:
    """Rewrite the README block for ``kind`` ("cpu" or "gpu") from the JSON results."""
    docs = load_results(results_dir, kind)
    start, end = f"<!-- acb-bench:{kind}:start -->", f"<!-- acb-bench:{kind}:end -->"
    with open(readme) as f:
        text = f.read()
    if start not in text or end not in text:
        return False
    body = "\n".join(markdown_for(d) for d in docs) if docs else "_No results yet._\n"
    note = f"<!-- generated by `acb bench report --update-readme` from {results_dir}/{kind}_*.json -->\n"
    new = text[: text.index(start) + len(start)] + "\n" + note + body + text[text.index(end) :]
    with open(readme, "w") as f:
        f.write(new)
    return True


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed (the
    ``bench`` extra); the one module that imports it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(doc: dict[str, Any], path: str) -> str | None:
    """A PNG for one workload; returns None (and the reason is printed by the caller) without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    if doc["result"]["workload"] == "serve":
        from acb.bench.serve import plot as serve_plot

        return serve_plot(doc, path, plt)
    r = doc["result"]
    w = r["workload"]
    fig, ax = plt.subplots(figsize=(7, 4))
    title = f"{w} — {device_name(doc['machine'])}"
    if w in ("offline", "offline-uniform", "shared-prefix"):
        names = [row["engine"] for row in r["rows"]]
        vals = [row["tokens_per_s"] for row in r["rows"]]
        bars = ax.bar(names, vals, color=["#2a7"] + ["#888"] * (len(vals) - 1))
        ax.bar_label(bars, fmt="%.0f")
        ax.set_ylabel("output tokens/s")
    elif w == "online":
        rates = [row["rate"] for row in r["rows"]]
        for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL")):
            for p, style in (("p50", "-o"), ("p99", "--o")):
                ax.plot(rates, [(row[key][p] or 0) * 1e3 for row in r["rows"]], style, label=f"{label} {p}")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel("latency (ms)")
        ax.set_yscale("log")
        ax.legend()
    elif w == "eval":  # seconds per task, one group of bars per backend
        tasks = list(r["rows"][0]["per_task"])  # the result's own
        width = 0.8 / len(r["rows"])
        for k, row in enumerate(r["rows"]):
            xs = [i + k * width for i in range(len(tasks))]
            bars = ax.bar(xs, [row["per_task"][t] for t in tasks], width, label=row["engine"])
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks([i + width * (len(r["rows"]) - 1) / 2 for i in range(len(tasks))], list(tasks))
        ax.set_ylabel("seconds (lower is better)")
        ax.legend()
    elif w == "overhead":
        n = [row["running"] for row in r["rows"]]
        ax.plot(n, [row["acb"]["host_us"] for row in r["rows"]], "-o", label="acb (schedule+stage+process)")
        if any(row.get("transformers") for row in r["rows"]):
            tf_us = [(row.get("transformers") or {}).get("host_us") for row in r["rows"]]
            ax.plot(
                n,
                [float("nan") if v is None else v for v in tf_us],
                "-o",  # a gap where it did not run
                label="transformers CB (prepare+update)",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("running requests")
        ax.set_ylabel("host µs per step")
        ax.legend()
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
