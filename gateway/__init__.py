"""stepwire gateway: client gRPC API and OpenAI-compatible HTTP (arrives with issue #4)."""
