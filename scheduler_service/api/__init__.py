"""The Scheduler gRPC servicer: Submit, Session, Limits, Stats, admission over the fleet.
Imports fleet/, core/, telemetry/ and settings.
"""
