"""The public gRPC API, stepwire.v1.Generation.
Imports generation/, http_api/ (its rate-limit headers) and below.
"""
