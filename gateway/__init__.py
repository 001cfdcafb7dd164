"""stepwire gateway: the client-facing edge. gRPC `stepwire.v1` and OpenAI-compatible HTTP over one `Backend`
(backend.py), and the scheduler session that carries their requests."""
