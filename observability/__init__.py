"""What the three services share for observability: OpenTelemetry set-up from OTEL_* variables, the
Prometheus endpoint, and a small OTLP trace receiver for tests and benchmarks."""
