"""Metrics reach an OpenTelemetry SDK reader when one is configured (skipped without the SDK)."""

from __future__ import annotations

import pytest

import acb
from tests.conftest import get_model


def test_request_metrics_recorded():
    sdk = pytest.importorskip("opentelemetry.sdk.metrics")
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    import acb.telemetry as tel

    reader = InMemoryMetricReader()
    provider = sdk.MeterProvider(metric_readers=[reader])
    meter = provider.get_meter("acb")
    saved = tel._instruments
    tel._instruments = (
        meter.create_counter("acb.requests"), meter.create_counter("acb.generated_tokens"),
        meter.create_histogram("acb.time_to_first_token"), meter.create_histogram("acb.request_duration"),
    )
    try:
        acb.generate_batch(get_model("llama"), [[5, 6], [7]], max_new_tokens=3, progress_bar=False,
                           sampling=acb.SamplingParams(ignore_eos=True),
                           continuous_batching_config=acb.ContinuousBatchingConfig(page_size=8, num_blocks=32))
    finally:
        tel._instruments = saved
    data = reader.get_metrics_data()
    points = {m.name: m.data.data_points for rm in data.resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics}
    assert sum(p.value for p in points["acb.requests"]) == 2
    assert sum(p.value for p in points["acb.generated_tokens"]) == 6
    assert sum(p.count for p in points["acb.time_to_first_token"]) == 2
