"""Roles in certificates and the tables that admit them, short of a network: what a certificate names, what
`stepwire certs` issues, that every method of each internal service has its roles, and that refusals are
logged without flooding. The end-to-end refusals are in test_internal_security.py."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cryptography")
pytest.importorskip("grpc")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID  # noqa: E402

from security.dev_certs import issue, make_ca  # noqa: E402
from security.identity import ROLES, role_of  # noqa: E402
from security.peer_roles import Throttle  # noqa: E402
from stepwire.contract.settings import load  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


def pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def with_uris(ca, uris: list[str]) -> bytes:
    ca_cert, ca_key = ca
    cert, _ = issue(ca_cert, ca_key, "gateway")
    builder = x509.CertificateBuilder().subject_name(cert.subject).issuer_name(cert.issuer) \
        .public_key(cert.public_key()).serial_number(1).not_valid_before(cert.not_valid_before_utc) \
        .not_valid_after(cert.not_valid_after_utc)
    if uris:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]),
                                        critical=False)
    return pem(builder.sign(ca_key, hashes.SHA256()))


def test_a_certificate_names_its_role_in_its_trust_domain_and_nowhere_else():
    ca_cert, ca_key = make_ca()
    cert, _ = issue(ca_cert, ca_key, "executor", trust_domain="prod.example")
    assert role_of(pem(cert), "prod.example") == "executor"
    assert role_of(pem(cert), "stepwire.local") is None


def test_a_certificate_naming_no_role_or_two_is_nobody():
    ca = make_ca()
    assert role_of(with_uris(ca, []), "stepwire.local") is None
    assert role_of(with_uris(ca, ["spiffe://stepwire.local/gateway", "spiffe://stepwire.local/operator"]),
                   "stepwire.local") is None
    # A longer path or a look-alike domain is not a role here.
    assert role_of(with_uris(ca, ["spiffe://stepwire.local.evil/operator"]), "stepwire.local") is None
    assert role_of(with_uris(ca, ["spiffe://stepwire.local/ns/x/operator"]), "stepwire.local") == "ns/x/operator"


def test_stepwire_certs_issues_one_certificate_per_role_and_the_operators_only_authenticates(tmp_path):
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "certs", str(tmp_path), "--trust-domain", "lab.test"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for role in ROLES:
        data = (tmp_path / role / "tls.crt").read_bytes()
        assert role_of(data, "lab.test") == role
        cert = x509.load_pem_x509_certificate(data)
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        dns = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
        if role == "operator":
            # It can stand in for no service: no name a client checks, and no server use.
            assert dns == [] and usages == {ExtendedKeyUsageOID.CLIENT_AUTH}
        else:
            assert f"stepwire-{role}" in dns and ExtendedKeyUsageOID.SERVER_AUTH in usages


def test_a_bad_trust_domain_is_refused_where_it_is_given(tmp_path):
    from scheduler_service.settings import SchedulerSettings

    with pytest.raises(SystemExit) as e:
        load(SchedulerSettings, ["--trust-domain", "Stepwire/Local"])
    assert "trust_domain" in str(e.value)
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "certs", str(tmp_path), "--trust-domain", "a/b"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--trust-domain" in done.stderr
    assert not (tmp_path / "ca.crt").exists()


def test_every_method_of_each_internal_service_names_the_roles_it_admits():
    pytest.importorskip("torch")
    from executor_service import server as executor
    from scheduler_service import server as scheduler
    from stepwire.internal import executor_pb2, scheduler_pb2

    for module, proto, name in ((executor, executor_pb2, "Executor"), (scheduler, scheduler_pb2, "Scheduler")):
        service = proto.DESCRIPTOR.services_by_name[name]
        assert set(module.ROLES) == {f"/{service.full_name}/{m.name}" for m in service.methods}
        assert all(roles and roles <= set(ROLES) for roles in module.ROLES.values())
    # Only the scheduler drives an executor; a peer executor may only read KV blocks (for a pull it was asked for).
    assert {m: r for m, r in executor.ROLES.items() if r != {"scheduler"}} == \
        {"/stepwire.internal.Executor/ReadBlocks": {"executor"},
         "/stepwire.internal.Executor/ReadBlocksMapped": {"executor"}}
    assert scheduler.ROLES["/stepwire.internal.Scheduler/Stats"] == {"operator"}


def test_refusals_are_logged_once_a_window_per_role_and_method_and_counted_meanwhile():
    now = [0.0]
    throttle = Throttle(30, clock=lambda: now[0])
    assert throttle.due(("gateway", "/Step")) == 0
    assert throttle.due(("gateway", "/Step")) is None
    assert throttle.due(("operator", "/Step")) == 0        # another role: a line of its own
    now[0] = 10
    assert throttle.due(("gateway", "/Step")) is None
    now[0] = 31
    assert throttle.due(("gateway", "/Step")) == 2         # the next line says how many it stood for
    assert throttle.due(("gateway", "/Step")) is None

