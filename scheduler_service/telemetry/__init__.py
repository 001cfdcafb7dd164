"""Each request's life as a span and as metrics, and the scheduler's Prometheus metrics.
Imports core/ only.
"""
