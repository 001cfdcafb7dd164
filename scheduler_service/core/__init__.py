"""The torch-free vLLM v1 core: requests, queues, the unified token-budget schedule(), its phases, stopping,
the KV-cache manager and block pool (kv_cache/), tenants' fair share and LoRA slots as a core sees them.
Imports nothing else of the scheduler.
"""
