"""The contract's value types: what the three services share besides the generated protos.

Sampling parameters and the one set of rules that validates them, the widths of the wire's number
fields, and the error every edge raises for a request that can never be served. No service imports
another; each imports this package, the generated protos (`stepwire.v1`, `stepwire.internal`) and
`observability`. It needs protobuf, and pydantic-settings for `settings`: the scheduler image imports
it too, so nothing here may pull torch or a service.
"""

from stepwire.contract.errors import InvalidRequestError
from stepwire.contract.request_fields import CHAT_ROLES, check_chat, check_priority, check_prompt
from stepwire.contract.sampling import SamplingParams, as_proto, check_sampling, check_stop

__all__ = ["CHAT_ROLES", "InvalidRequestError", "SamplingParams", "as_proto", "check_chat",
           "check_priority", "check_prompt", "check_sampling", "check_stop"]
