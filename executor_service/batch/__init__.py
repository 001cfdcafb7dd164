"""One step's rows: the persistent batch, the step as the executor sees it (wire, checks, KV-block rights),
the sampler and the constrained rows.
Imports only kernels/ of the executor.
"""
