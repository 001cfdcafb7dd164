"""The Executor gRPC servicer and what serves it: the Step stream's queue, spans and held replies, drain,
metrics.
Imports engine/ and below.
"""
