"""Who holds a certificate: the role it names as a SPIFFE ID in a URI SAN, `spiffe://<trust-domain>/<role>`.

The CA vouches that a certificate is ours; the URI says which service holds it, or the operator. A certificate
that names no role in this trust domain, or more than one, is nobody's: servers admit it to nothing but
health and reflection.
"""

from __future__ import annotations

import functools

from cryptography import x509

GATEWAY, SCHEDULER, EXECUTOR, OPERATOR = "gateway", "scheduler", "executor", "operator"
ROLES = (GATEWAY, SCHEDULER, EXECUTOR, OPERATOR)
DEFAULT_TRUST_DOMAIN = "stepwire.local"
# SPIFFE's characters for a trust domain name; checked where it is configured, so an ID is never ambiguous.
TRUST_DOMAIN_PATTERN = r"^[a-z0-9._-]+$"


def spiffe_id(trust_domain: str, role: str) -> str:
    return f"spiffe://{trust_domain}/{role}"


def roles_named(cert: x509.Certificate, trust_domain: str) -> list[str]:
    """Every role the certificate's URI SANs name in `trust_domain` (a path that is not one of ROLES too)."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    prefix = spiffe_id(trust_domain, "")
    return [u[len(prefix):] for u in sans.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(prefix)]


# Every RPC asks, and a peer presents the same few certificates for their lifetimes.
@functools.lru_cache(maxsize=256)
def role_of(pem: bytes, trust_domain: str) -> str | None:
    """The one role a PEM certificate names in `trust_domain`; None when it names none or several."""
    roles = roles_named(x509.load_pem_x509_certificate(pem), trust_domain)
    return roles[0] if len(roles) == 1 else None
