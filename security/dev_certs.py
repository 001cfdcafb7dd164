"""`stepwire certs DIR`: a development CA and one certificate per role (each service, and the operator), in the
layout of a Kubernetes TLS Secret (`tls.crt`, `tls.key`, `ca.crt` in each role's folder), so the same flags
work on a laptop and in a cluster.

Every certificate names its role as the URI `spiffe://<trust-domain>/<role>`, which servers check on every
RPC (peer_roles.py). A service's certificate serves and authenticates: every service is a server to one peer
and a client of another (the scheduler listens to gateways and dials executors). Executors and schedulers are
dialled by pod IP, which no shared certificate can name, so clients check a fixed service name instead
(`--executor-server-name`, `--scheduler-server-name`); that name, `localhost` and the loopback addresses are
in every service's certificate. The operator's (for Stats: scripts, grpcurl) only authenticates: it names no
host and is good for client authentication alone, so it cannot stand in for a service.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from security.identity import DEFAULT_TRUST_DOMAIN, OPERATOR, ROLES, spiffe_id


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "stepwire development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(common_name: str = "stepwire development CA", days: int = 365):
    """A self-signed CA: (certificate, private key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def issue(ca_cert, ca_key, role: str, extra_names: tuple[str, ...] = (), days: int = 90,
          trust_domain: str = DEFAULT_TRUST_DOMAIN):
    """A leaf certificate for `stepwire-<role>` naming its role, signed by the CA: (certificate, private key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_id(trust_domain, role))]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if role != OPERATOR:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        names += [x509.DNSName(f"stepwire-{role}"), x509.DNSName("localhost"),
                  x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("::1"))]
        for n in extra_names:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                names.append(x509.DNSName(n))
    cert = (x509.CertificateBuilder().subject_name(_name(f"stepwire-{role}")).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def write_secret(folder: Path, cert, key, ca_cert) -> None:
    """One service's files as a Kubernetes TLS Secret mounts them; the key readable by its owner only."""
    folder.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    (folder / "tls.crt").write_bytes(cert.public_bytes(pem))
    key_path = folder / "tls.key"
    key_path.touch(mode=0o600)
    key_path.write_bytes(_pem_key(key))
    (folder / "ca.crt").write_bytes(ca_cert.public_bytes(pem))


def make_dev_certs(directory: str | Path, extra_names: tuple[str, ...] = (),
                   trust_domain: str = DEFAULT_TRUST_DOMAIN) -> Path:
    """DIR/ca.crt and ca.key, and DIR/<role>/{tls.crt,tls.key,ca.crt} for each role. Returns DIR."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = make_ca()
    (d / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (d / "ca.key").touch(mode=0o600)
    (d / "ca.key").write_bytes(_pem_key(ca_key))
    for role in ROLES:
        write_secret(d / role, *issue(ca_cert, ca_key, role, extra_names, trust_domain=trust_domain), ca_cert)
    return d


def load_ca(directory: str | Path):
    """The CA `make_dev_certs` wrote, to issue more certificates (a rotation, another service)."""
    d = Path(directory)
    cert = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), password=None)
    return cert, key
