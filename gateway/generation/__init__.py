"""What both client APIs share: a generation's parameters and checks, the Session stream to the scheduler,
the journal that resubmits, adapters, structured output, telemetry, the backend.
Imports access/, text/ and tools/.
"""
