"""mTLS for the internal links: certificate, key and CA from files, as a Kubernetes TLS Secret mounts them.

Servers require a client certificate from the same CA and pick up rotated files without a restart: grpc
asks the fetcher below at every new handshake, and it answers with the files' new contents only when they
changed (cert-manager and the kubelet swap a Secret's files at once, through a symlink). Connections
already open keep the certificate they were made with. Clients read the files each time they build a
channel, so a link that reconnects presents the current certificate.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from pydantic import Field, model_validator

from stepwire.contract.settings import ServiceSettings

log = logging.getLogger("stepwire.tls")
T = TypeVar("T")


class TLSSettings(ServiceSettings):
    """The TLS flags every service shares (STEPWIRE_<SERVICE>_TLS_DIR and so on)."""

    tls_dir: str = Field("", description="folder holding tls.crt, tls.key and ca.crt (a mounted Kubernetes TLS "
                         "Secret): mTLS on every internal link; empty: plaintext, loopback only")
    tls_cert: str = Field("", description="this service's certificate (PEM); default: tls.crt in --tls-dir")
    tls_key: str = Field("", description="its private key (PEM); default: tls.key in --tls-dir")
    tls_ca: str = Field("", description="the CA that signs every service's certificate; default: ca.crt in "
                        "--tls-dir")
    insecure: bool = Field(False, description="allow plaintext on an address other than loopback (anyone who "
                           "reaches the port can drive the service)")

    @model_validator(mode="after")
    def _all_or_nothing(self):
        given = [bool(self.tls_dir or getattr(self, f)) for f in ("tls_cert", "tls_key", "tls_ca")]
        if any(given) and not all(given):
            raise ValueError("TLS needs a certificate, a key and a CA: give --tls-dir, or all of --tls-cert, "
                             "--tls-key and --tls-ca")
        return self

    def tls_files(self) -> TLSFiles | None:
        if not (self.tls_dir or self.tls_cert):
            return None
        d = Path(self.tls_dir)
        return TLSFiles(Path(self.tls_cert or d / "tls.crt"), Path(self.tls_key or d / "tls.key"),
                        Path(self.tls_ca or d / "ca.crt"))


@dataclass(frozen=True)
class TLSFiles:
    cert: Path
    key: Path
    ca: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, key, CA), checked to belong together: a half-rotated pair is refused here
        rather than failing every handshake later."""
        cert, key, ca = self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()
        public = serialization.load_pem_private_key(key, password=None).public_key()
        if x509.load_pem_x509_certificate(cert).public_key() != public:
            raise ValueError(f"{self.key} is not the key of the certificate in {self.cert}")
        x509.load_pem_x509_certificates(ca)
        return cert, key, ca

    def stamp(self) -> tuple:
        """Changes whenever any of the three files is replaced or rewritten."""
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in map(os.stat, (self.cert, self.key, self.ca)))


def on_change(files: TLSFiles, build: Callable[[], T]) -> Callable[[], T | None]:
    """A poll that returns `build()` once the files have changed since the last poll that used them (or
    since now), and None otherwise. A change that cannot be used yet (mid-rotation, a key that does not
    match) is logged and tried again at the next poll, keeping what is in use."""
    seen = [files.stamp()]

    def poll() -> T | None:
        try:
            stamp = files.stamp()
            if stamp == seen[0]:
                return None
            built = build()
        except (OSError, ValueError) as e:
            log.warning("TLS files changed but cannot be used yet (%s); keeping the current certificate", e)
            return None
        seen[0] = stamp
        return built

    return poll


def server_credentials(files: TLSFiles, require_client_certificate: bool = True) -> grpc.ServerCredentials:
    """Credentials that follow the files: each handshake after a change uses the new certificate."""

    def configuration():
        cert, key, ca = files.read()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    changed = on_change(files, configuration)

    def fetch():
        config = changed()
        if config is not None:
            log.info("TLS certificate files changed: new connections use them")
        return config

    return grpc.dynamic_ssl_server_credentials(configuration(), fetch,
                                               require_client_authentication=require_client_certificate)


def link_options(keepalive_ms: int, reconnect_ms: int, max_reconnect_ms: int) -> list[tuple[str, int]]:
    """Options of a long-lived channel to another stepwire service. Keepalive pings, sent even while idle, find a
    peer that vanished without closing its connection (a node lost, a frozen process); grpc also bounds an
    unanswered ping by http2.ping_timeout_ms (60 s by default), whatever the keepalive timeout says. grpc's own
    reconnect backoff grows to two minutes, so a peer that was down a while would be picked up that late; it is
    kept near the pace at which a peer comes back."""
    return [("grpc.keepalive_time_ms", keepalive_ms), ("grpc.keepalive_timeout_ms", keepalive_ms),
            ("grpc.http2.ping_timeout_ms", keepalive_ms), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0), ("grpc.initial_reconnect_backoff_ms", reconnect_ms),
            ("grpc.min_reconnect_backoff_ms", reconnect_ms), ("grpc.max_reconnect_backoff_ms", max_reconnect_ms)]


def channel(address: str, files: TLSFiles | None, server_name: str, options: list | None = None) -> grpc.aio.Channel:
    """A channel to another stepwire service: mTLS when `files` is set (the peer's certificate must name
    `server_name`, since peers are dialled by pod IP), plaintext otherwise."""
    options = list(options or [])
    if files is None:
        return grpc.aio.insecure_channel(address, options=options)
    cert, key, ca = files.read()
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.aio.secure_channel(address, credentials, options=options + [("grpc.ssl_target_name_override",
                                                                            server_name)])
