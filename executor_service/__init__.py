"""stepwire executor: model, KV-cache tensors, persistent batch, sampler (arrives with issue #3)."""
