"""``init_tracing``: a process's tracer provider is made whole, with its exporter, or not at
all."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from kv_transfer import tracing


def test_an_exporter_that_cannot_be_made_fails_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``OTEL_EXPORTER_OTLP_PROTOCOL=http/json`` (an OpenTelemetry value this exporter does not
    speak) fails the first call. The second call must fail too: it got a tracer of the provider
    the first call had left without an exporter, and every span of the process went nowhere
    (a worker under ``transport: auto`` had meanwhile fallen back to ray on the first error)."""
    monkeypatch.setattr(tracing, "_provider", None)
    monkeypatch.setattr(tracing, "_tracers", {})
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    config = tracing.TracingConfig(enabled=True)
    for _ in range(2):
        with pytest.raises(ValueError, match="http/json"):
            tracing.init_tracing(config, "worker")
    assert tracing._provider is None and tracing._tracers == {}
