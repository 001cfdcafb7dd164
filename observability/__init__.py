"""What the three services share for observability: OpenTelemetry set-up from OTEL_* variables and the
Prometheus endpoint. The OTLP trace receiver that tests and benchmarks use is in tools/, with the tooling."""
