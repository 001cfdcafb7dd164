"""Build-time and test-time tooling: the GGUF converter behind `make model`, an OTLP trace receiver and a
span tree printer. No service imports from here, and nothing here is installed with the services: run it
from the repository root (`python -m tools.<module>`), with the `dev` extra installed."""
