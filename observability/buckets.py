"""Histogram buckets the three services share, so their latency histograms line up on one dashboard."""

# 1 ms to 20 min: a CPU decode step is ~0.1 s, a queued request can wait minutes.
LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
           2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 1200.0)
BYTES = (4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
