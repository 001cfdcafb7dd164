"""Tenants: which team an API key belongs to, that team's weight in the scheduler's fair sharing, and its limits.

A tenants file (JSON, typically mounted from a Kubernetes Secret) names each tenant with its keys, its weight and
optional limits (requests and tokens per minute, concurrent requests, a priority ceiling; docs/tenants.md):

    {"tenants": {"search": {"keys": ["sk-s1", "sk-s2"], "weight": 3},
                 "batch-jobs": {"keys": ["sk-b1"], "models": {"big-model": {"weight": 0.5, "max_concurrent": 4}}}}}

A gateway of several models (docs/multimodel.md) gives each model's scheduler the tenant as `models` has it for
that model: its weight and limits there, where they differ from the tenant's own.

It is re-read when it changes, like the API key file, so keys rotate and weights change without a restart; a
file that no longer parses keeps the tenants read before (and says so in the log). Every key in it is an API
key. The gateway puts the key's tenant and weight on each request it submits; the scheduler shares each step's
tokens between tenants by weight (scheduler_service/core/fair_share.py). A key from the plain API key file or
STEPWIRE_API_KEY belongs to the default tenant, "", of weight 1, without limits. The limits travel with each
request; the scheduler counts them for all gateways (scheduler_service/fleet/tenant_limits.py).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.access.watched_file import WatchedFile

log = logging.getLogger("stepwire.gateway")

TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class ModelLimits(BaseModel):
    """A tenant's weight and limits for one model, where they differ from its own (unset: its own)."""
    model_config = ConfigDict(extra="forbid")

    weight: float | None = Field(None, gt=0, le=1000)
    requests_per_minute: int | None = Field(None, ge=0, le=2**32 - 1)
    tokens_per_minute: int | None = Field(None, ge=0, le=2**32 - 1)
    max_concurrent: int | None = Field(None, ge=0, le=2**32 - 1)
    max_priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)


class TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[str] = Field(min_length=1, description="its API keys")
    models: dict[str, ModelLimits] = Field(default_factory=dict, max_length=64, description="by served model name: "
                                           "its weight and limits on that model where they differ")
    weight: float = Field(1.0, gt=0, le=1000, description="its share of each step against the others' weights")
    requests_per_minute: int = Field(0, ge=0, le=2**32 - 1, description="0: no limit")
    tokens_per_minute: int = Field(0, ge=0, le=2**32 - 1, description="prompt plus max_tokens; 0: no limit")
    max_concurrent: int = Field(0, ge=0, le=2**32 - 1, description="requests at once; 0: no limit")
    max_priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1, description="the most urgent priority its "
                                     "requests may ask (lower is more urgent); None: any")


class TenantsSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: dict[str, TenantSpec]


@dataclass(frozen=True)
class Tenant:
    name: str             # "": the default tenant (keys from the API key file, or no keys at all)
    weight: float = 1.0
    requests_per_minute: int = 0     # limits the scheduler counts across gateways (0: none)
    tokens_per_minute: int = 0
    max_concurrent: int = 0
    max_priority: int | None = None  # checked here: the most urgent priority its requests may ask
    models: tuple[tuple[str, Tenant], ...] = ()   # (served model name, its weight and limits there)

    @property
    def limited(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute or self.max_concurrent)

    def for_model(self, name: str) -> Tenant:
        """The tenant as it is on model `name`: each model's scheduler shares that model's steps and counts its
        limits, so a tenant may weigh more, or be held tighter, on one model than on another."""
        return next((t for n, t in self.models if n == name), self)


DEFAULT = Tenant("")


class TenantsError(ValueError):
    """The file is not a valid tenants file; the text says where."""


def parse_tenants(text: str) -> dict[str, Tenant]:
    """Key -> its tenant. Raises TenantsError for malformed JSON, unknown fields, bad names or weights, and a
    key given to two tenants."""
    try:
        spec = TenantsSpec.model_validate(json.loads(text))
    except json.JSONDecodeError as e:
        raise TenantsError(f"not JSON: {e}") from None
    except ValidationError as e:
        raise TenantsError(str(e)) from None
    by_key: dict[str, Tenant] = {}
    for name, t in spec.tenants.items():
        if not re.match(TENANT_NAME, name):
            raise TenantsError(f"tenant name {name!r}: 1-64 letters, digits, '.', '_' or '-', not starting with "
                               f"a symbol")
        own = Tenant(name, t.weight, t.requests_per_minute, t.tokens_per_minute, t.max_concurrent, t.max_priority)
        per_model = tuple((model, replace(own, **m.model_dump(exclude_unset=True))) for model, m in t.models.items())
        tenant = replace(own, models=per_model)
        for key in t.keys:
            key = key.strip()
            if not key:
                raise TenantsError(f"tenant {name!r}: an empty key")
            if key in by_key and by_key[key].name != name:
                raise TenantsError(f"a key is given to both {by_key[key].name!r} and {name!r}")
            by_key[key] = tenant
    return by_key


class TenantsFile:
    """The tenants file as last read: (digest of a key, its tenant) pairs. `digest` is how the caller compares
    keys (auth.py)."""

    def __init__(self, path: str, digest):
        def parse(text: str) -> list[tuple[bytes, Tenant]]:
            return [(digest(k), t) for k, t in parse_tenants(text).items()]

        def changed(keys: list[tuple[bytes, Tenant]]) -> None:
            log.info("tenants file %s changed: %d tenants, %d keys", path, len({t.name for _, t in keys}), len(keys))

        self.file = WatchedFile(path, parse, "tenants file", (OSError, TenantsError), changed)

    def current(self) -> list[tuple[bytes, Tenant]]:
        return self.file.current()
