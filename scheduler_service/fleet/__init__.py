"""The executors a scheduler drives: a link per executor and its Step loop, routing, one model's weights per
fleet, requests moved (migration, KV moves, rebalance), adapters and tenant limits across the fleet.
Imports core/, telemetry/ and settings.
"""
