"""acb.telemetry (issue 15) against a real OTLP receiver (tests/otlp_receiver.py): an AsyncEngine
with ``configure()`` in a subprocess (tests/telemetry_run.py: the providers are set once per
process) over http/protobuf and over gRPC, ``acb generate --otlp-endpoint``, and telemetry off.
``acb serve``'s SERVER spans and /metrics are tested in tests/serve/test_openai_server.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
pytest.importorskip("opentelemetry.proto")

from acb import telemetry  # noqa: E402
from tests.otlp_receiver import Receiver  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    env.update(extra)
    return env


def _run_script(endpoint: str, protocol: str, **env: str) -> dict:
    p = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "telemetry_run.py"), endpoint, protocol],
        capture_output=True,
        text=True,
        env=_env(**env),
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def http_run():
    with Receiver() as r:
        results = _run_script(r.http_endpoint, "http/protobuf")
        # shutdown() exported everything before the process exited
        yield results, r.collected


def _engine_spans(collected) -> dict[str, dict]:
    """The engine's request spans by gen_ai.response.id."""
    return {s["attrs"]["gen_ai.response.id"]: s for s in collected.spans if s["scope"] == "acb"}


def _events(span) -> list[str]:
    return [name for name, _, _ in span["events"]]


def test_request_spans_carry_the_conventions_attributes(http_run):
    results, collected = http_run
    spans = _engine_spans(collected)
    outs = [results["text"], results["chat"], *results["preempt"], results["cancelled"], results["failed"]]
    assert set(spans) == {o["request_id"] for o in outs}
    for o in outs:
        s = spans[o["request_id"]]
        a = s["attrs"]
        assert s["kind"] == "INTERNAL" and s["via"] == "http"
        # the latest conventions by default (acb is a new instrumentation), not the v1.36 form
        assert a["gen_ai.provider.name"] == telemetry.PROVIDER_NAME and "gen_ai.system" not in a
        assert a["gen_ai.request.model"] == MODEL
        assert a["gen_ai.usage.input_tokens"] == o["prompt_len"]
        assert a["gen_ai.usage.output_tokens"] == o["output_tokens"]
        assert a["gen_ai.usage.cache_read.input_tokens"] == o["cached"]
        assert a["gen_ai.response.finish_reasons"] == o["finish_reasons"]
        assert a["acb.request.preemptions"] == o["preemptions"]
        assert s["resource"]["service.name"] == "acb-test"
        assert s["start"] < s["end"]
        ev = _events(s)
        assert ev[:2] == ["acb.queued", "acb.scheduled"] and "acb.first_token" in ev
        assert all(s["start"] <= t <= s["end"] for _, t, _ in s["events"])
    text = spans[results["text"]["request_id"]]
    assert text["name"] == f"text_completion {MODEL}"
    a = text["attrs"]
    assert (
        a["gen_ai.request.max_tokens"],
        a["gen_ai.request.temperature"],
        a["gen_ai.request.top_p"],
        a["gen_ai.request.top_k"],
        a["gen_ai.request.seed"],
    ) == (6, 0.7, 0.9, 20, 3)
    assert a["gen_ai.request.stop_sequences"] == ["never-appears"]
    # its parent is the user's span current at submit
    assert text["parent_span_id"] == results["user_span_id"] and text["trace_id"] == results["user_trace_id"]
    chat = spans[results["chat"]["request_id"]]
    assert chat["name"] == f"chat {MODEL}" and chat["attrs"]["gen_ai.request.choice.count"] == 2
    # content was asked for: the latest form puts it in attributes (JSON)
    a = chat["attrs"]
    assert json.loads(a["gen_ai.input.messages"]) == [{"role": "user", "parts": [{"type": "text", "content": "hi"}]}]
    out = json.loads(a["gen_ai.output.messages"])
    assert [m["parts"][0]["content"] for m in out] == results["chat"]["texts"]
    assert not any(e[0].startswith("gen_ai.content") for e in chat["events"])


def test_outcomes_status_and_error_type(http_run):
    results, collected = http_run
    spans = _engine_spans(collected)
    ok = spans[results["text"]["request_id"]]
    assert ok["status"] == 0 and "error.type" not in ok["attrs"] and _events(ok)[-1] == "acb.finished"
    cancelled = spans[results["cancelled"]["request_id"]]
    assert results["cancelled"]["status"] == "cancelled"
    assert cancelled["attrs"]["error.type"] == "cancelled" and cancelled["status"] == 0  # not a server error
    assert _events(cancelled)[-1] == "acb.cancelled"
    failed = spans[results["failed"]["request_id"]]
    assert results["failed"]["status"] == "failed"
    assert failed["attrs"]["error.type"] == results["failed"]["failure"] == "request"
    assert failed["status"] == 2 and "UnicodeDecodeError" in failed["status_message"]  # STATUS_CODE_ERROR
    assert _events(failed)[-1] == "acb.failed"


def test_preemption_is_in_the_span(http_run):
    results, collected = http_run
    assert results["stats"]["preemptions"] >= 1 and results["stats"]["swapped_out"] > 0
    spans = _engine_spans(collected)
    preempted = [o for o in results["preempt"] if o["preemptions"]]
    assert preempted
    for o in preempted:
        ev = _events(spans[o["request_id"]])
        assert ev.count("acb.preempted") == o["preemptions"] == ev.count("acb.resumed")
        assert ev.index("acb.preempted") < ev.index("acb.resumed") < ev.index("acb.finished")


def test_metrics_names_units_and_points(http_run):
    results, collected = http_run
    m = collected.latest_metrics()
    outs = [results["text"], results["chat"], *results["preempt"], results["cancelled"], results["failed"]]
    for name, unit in (
        ("gen_ai.server.request.duration", "s"),
        ("gen_ai.server.time_to_first_token", "s"),
        ("gen_ai.server.time_per_output_token", "s"),
        ("gen_ai.client.token.usage", "{token}"),
    ):
        assert m[name]["unit"] == unit and m[name]["kind"] == "histogram", m[name]
    bounds = {name: m[name]["points"][0]["bounds"] for name in telemetry.HISTOGRAMS}
    assert bounds == {name: list(b) for name, (_, b, _) in telemetry.HISTOGRAMS.items()}
    dur = m["gen_ai.server.request.duration"]["points"]
    assert sum(p["count"] for p in dur) == len(outs)
    errors: dict = {}
    for p in dur:
        errors[p["attrs"].get("error.type")] = errors.get(p["attrs"].get("error.type"), 0) + p["count"]
    assert errors == {None: 4, "cancelled": 1, "request": 1}
    assert all(
        p["attrs"]["gen_ai.operation.name"] in ("chat", "text_completion")
        and p["attrs"]["gen_ai.provider.name"] == "acb"
        and "gen_ai.system" not in p["attrs"]
        for p in dur
    )
    # TTFT and TPOT: the successful requests only
    assert sum(p["count"] for p in m["gen_ai.server.time_to_first_token"]["points"]) == 4
    usage = {
        p["attrs"]["gen_ai.token.type"]: p
        for p in m["gen_ai.client.token.usage"]["points"]
        if p["attrs"]["gen_ai.operation.name"] == "text_completion"
    }
    texts = [o for o in outs if o is not results["chat"]]
    assert usage["input"]["sum"] == sum(o["prompt_len"] for o in texts)
    assert usage["output"]["sum"] == sum(o["output_tokens"] for o in texts)
    # the engine's own, observed from its stats
    assert m["acb.preemptions"]["points"][0]["value"] == results["stats"]["preemptions"]
    assert m["acb.kv_cache.blocks.total"]["points"][0]["value"] == 13
    assert {p["attrs"]["acb.step.phase"] for p in m["acb.engine.step.time"]["points"]} == {
        "schedule",
        "stage",
        "compute",
        "process",
    }
    for name in (
        "acb.requests.running",
        "acb.requests.waiting",
        "acb.kv_cache.usage",
        "acb.prefix_cache.hit_rate",
        "acb.engine.steps",
        "acb.engine.batch.tokens",
    ):
        assert name in m


def test_grpc_and_the_v1_36_opt_out():
    """``ACB_OTEL_GENAI_CONVENTIONS=v1.36``: the v1.36 names, on spans and metrics; acb's own
    variable wins over a process-wide opt-in meant for the instrumentations that need one."""
    grpc = pytest.importorskip("grpc")
    assert grpc
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    with Receiver(grpc=True) as r:
        results = _run_script(
            r.grpc_endpoint,
            "grpc",
            ACB_OTEL_GENAI_CONVENTIONS="v1.36",
            OTEL_SEMCONV_STABILITY_OPT_IN="http,gen_ai_latest_experimental",
        )
        collected = r.collected
    spans = _engine_spans(collected)
    assert spans and all(s["via"] == "grpc" for s in collected.spans)
    for s in spans.values():
        assert s["attrs"]["gen_ai.system"] == "acb" and "gen_ai.provider.name" not in s["attrs"]
    chat = spans[results["chat"]["request_id"]]
    # content as span events in the v1.36 form
    assert not any(k.startswith(("gen_ai.input", "gen_ai.output")) for k in chat["attrs"])
    prompt_ev = next(e for e in chat["events"] if e[0] == "gen_ai.content.prompt")
    assert json.loads(prompt_ev[2]["gen_ai.prompt"]) == [{"role": "user", "parts": [{"type": "text", "content": "hi"}]}]
    done_ev = next(e for e in chat["events"] if e[0] == "gen_ai.content.completion")
    assert [m["parts"][0]["content"] for m in json.loads(done_ev[2]["gen_ai.completion"])] == results["chat"]["texts"]
    dur = collected.latest_metrics()["gen_ai.server.request.duration"]["points"]
    assert dur and all(p["attrs"]["gen_ai.system"] == "acb" and "gen_ai.provider.name" not in p["attrs"] for p in dur)


def test_which_conventions(monkeypatch, caplog):
    """The latest by default, whatever OTEL_SEMCONV_STABILITY_OPT_IN says; v1.36 on acb's opt-out;
    an unknown value is named in a warning and changes nothing."""
    monkeypatch.setattr(telemetry, "_conventions", None)
    monkeypatch.delenv(telemetry.CONVENTIONS_ENV, raising=False)
    for opt_in in (None, "http", "gen_ai_latest_experimental"):
        if opt_in is None:
            monkeypatch.delenv("OTEL_SEMCONV_STABILITY_OPT_IN", raising=False)
        else:
            monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", opt_in)
        assert telemetry.conventions() == "latest"
        assert telemetry._base_attrs("chat", "m")["gen_ai.provider.name"] == "acb"
    for value in ("v1.36", "1.36.0", " V1.36 "):
        monkeypatch.setenv(telemetry.CONVENTIONS_ENV, value)
        assert telemetry.conventions() == "v1.36" and telemetry._base_attrs("chat", "m")["gen_ai.system"] == "acb"
    monkeypatch.setenv(telemetry.CONVENTIONS_ENV, "v2")
    assert telemetry.conventions() == "latest" and "ACB_OTEL_GENAI_CONVENTIONS='v2'" in caplog.text
    with pytest.raises(ValueError, match="genai_conventions='1.36'"):
        telemetry.configure("http://127.0.0.1:9", genai_conventions="1.36")


def test_telemetry_off_imports_no_sdk_and_changes_nothing(http_run):
    results, _ = http_run
    off = _run_script("off", "-")
    assert off["sdk_imported"] == []
    # same tokens (greedy and seeded) with and without the SDK
    for key in ("text", "chat", "cancelled"):
        assert off[key]["tokens"][0][:1] == results[key]["tokens"][0][:1]
    assert [o["tokens"] for o in off["preempt"]] == [o["tokens"] for o in results["preempt"]]
    assert off["text"]["tokens"] == results["text"]["tokens"] and off["chat"]["tokens"] == results["chat"]["tokens"]


def test_content_is_not_captured_by_default(monkeypatch):
    monkeypatch.delenv(telemetry.CAPTURE_ENV, raising=False)
    monkeypatch.setattr(telemetry, "_capture_content", None)
    assert telemetry.begin("secret", "m", None).prompt is None  # type: ignore[arg-type]
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert telemetry.begin("secret", "m", None) is None  # type: ignore[arg-type]


def test_acb_generate_exports_over_otlp(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"prompt number {i}", "max_new_tokens": 3 + i}) + "\n" for i in range(4)),
        encoding="utf-8",
    )
    out = tmp_path / "out.jsonl"
    with Receiver() as r:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "acb",
                "generate",
                "--prompts",
                str(prompts),
                "-o",
                str(out),
                "--ignore-eos",
                "--no-progress",
                "--num-blocks",
                "64",
                "--page-size",
                "16",
                "--otlp-endpoint",
                r.http_endpoint,
            ],
            capture_output=True,
            text=True,
            env=_env(),
            cwd=tmp_path,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        collected = r.collected
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    spans = _engine_spans(collected)
    assert len(spans) == len(rows) == 4
    for row in rows:
        s = spans[row["id"]]
        assert s["name"] == "text_completion acb-default"
        assert s["attrs"]["gen_ai.usage.output_tokens"] == len(row["generated_ids"]) == 3 + row["index"]
        assert s["attrs"]["gen_ai.usage.input_tokens"] == row["prompt_len"]
        assert s["attrs"]["gen_ai.response.finish_reasons"] == [row["finish_reason"]]
    m = collected.latest_metrics()
    usage = {p["attrs"]["gen_ai.token.type"]: p for p in m["gen_ai.client.token.usage"]["points"]}
    assert usage["output"]["sum"] == sum(len(r["generated_ids"]) for r in rows)
    assert usage["output"]["count"] == 4
