"""The bottom of the house: what every service shares, and nothing else. `contract` (value types, limits,
errors, settings loading) and the generated protos (`v1`, the public API; `internal`, between services).
It imports no service; the services, and `launcher` above them, import it."""
