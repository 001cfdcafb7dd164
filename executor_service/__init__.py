"""stepwire executor: the model, its KV-cache tensors, the persistent batch and the sampler, behind the Executor
gRPC service that runs the scheduler's steps."""
