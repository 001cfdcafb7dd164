"""The error every edge raises for a request that can never be served as sent.

The gateway maps it to HTTP 400 or INVALID_ARGUMENT, the scheduler to INVALID_ARGUMENT; `field` names
the offending input so the client learns which one.
"""


class InvalidRequestError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
