"""Errors the scheduler raises at its edge. The services map them to gRPC / HTTP status codes."""


class InvalidRequestError(ValueError):
    """A request that can never be served as sent. `field` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
