"""Which executors the scheduler drives: a static list, DNS, or Kubernetes EndpointSlices.
Imports settings only.
"""
