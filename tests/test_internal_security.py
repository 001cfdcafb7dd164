"""The internal links under mTLS, as real processes: the scheduler and the executor take only clients with a
certificate from their CA, admit to each method only the roles that need it, follow rotated certificate files
without a restart, answer undecodable messages with INVALID_ARGUMENT, keep a plaintext port on loopback
unless told otherwise, and let only the caller that submitted a request abort it."""

import itertools
import os
import socket
import ssl
import time
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("torch")
pytest.importorskip("cryptography")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes  # noqa: E402
from google.protobuf.message import Message  # noqa: E402
from helpers import free_ports  # noqa: E402
from tiny_model import kv_bytes, reference_greedy, write_tiny_llama  # noqa: E402

from launcher.processes import Service, Stack  # noqa: E402
from security.dev_certs import issue, load_ca, make_dev_certs, write_secret  # noqa: E402
from stepwire.internal import executor_pb2, executor_pb2_grpc, sampling_pb2, scheduler_pb2, scheduler_pb2_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 6, 7, 8]


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


def greedy(max_tokens: int, **kw) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=-1, **kw)


def credentials(folder: Path, with_client_certificate: bool = True, ca: Path | None = None):
    """Client credentials from a `stepwire certs` service folder; `ca` overrides whom the client trusts."""
    key = (folder / "tls.key").read_bytes() if with_client_certificate else None
    cert = (folder / "tls.crt").read_bytes() if with_client_certificate else None
    return grpc.ssl_channel_credentials(root_certificates=(ca or folder / "ca.crt").read_bytes(), private_key=key,
                                        certificate_chain=cert)


def secure_channel(address: str, creds, name: str):
    return grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", name)])


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtls")
    certs = make_dev_certs(tmp / "certs")
    model = write_tiny_llama(tmp / "llama")
    (health_port,) = free_ports(1)
    # Each waited for over mTLS with its own certificate (health answers any from the CA).
    with Stack([Service("executor", flags={
                    "--model": model, "--block-size": 4, "--kv-cache-memory": kv_bytes(64), "--max-num-seqs": 8,
                    "--max-model-len": 128, "--metrics-address": "", "--threads": 1, "--tls-dir": certs / "executor",
                    "--health-address": f"127.0.0.1:{health_port}"}),
                Service("scheduler", flags={"--metrics-address": "", "--retry-seconds": 0.2,
                                            "--tls-dir": certs / "scheduler"})], tmp) as processes:
        ex, sc = processes["executor"].address, processes["scheduler"].address
        # The test speaks to the scheduler as the gateway does, with the gateway's certificate, and reads Stats
        # as the operator.
        channel = secure_channel(sc, credentials(certs / "gateway"), "stepwire-scheduler")
        operator = secure_channel(sc, credentials(certs / "operator"), "stepwire-scheduler")
        yield {"expected": reference_greedy(model, [PROMPT], 8)[0], "tmp": tmp, "certs": certs, "model": model,
               "executor": ex, "scheduler": sc, "processes": processes,
               "stub": scheduler_pb2_grpc.SchedulerStub(channel),
               "operator": scheduler_pb2_grpc.SchedulerStub(operator), "health_port": health_port}
        channel.close()
        operator.close()


def submit(stub, max_tokens: int = 8, rid: str = ""):
    return stub.Submit(scheduler_pb2.SubmitRequest(
        request_id=rid, prompt_token_ids=PROMPT, params=greedy(max_tokens, ignore_eos=True)))


def test_the_services_with_certificates_from_the_dev_ca_serve_a_request_over_mtls(stack):
    tokens = [t for out in submit(stack["stub"]) for t in out.token_ids]
    assert tokens == stack["expected"]


@pytest.mark.parametrize("target", ["scheduler", "executor"])
@pytest.mark.parametrize("client", ["plaintext", "no certificate", "another CA"])
def test_a_client_without_a_certificate_from_the_ca_is_refused(stack, tmp_path, target, client):
    certs, address = stack["certs"], stack[target]
    if client == "plaintext":
        channel = grpc.insecure_channel(address)
    elif client == "no certificate":
        channel = secure_channel(address, credentials(certs / "gateway", with_client_certificate=False),
                                 f"stepwire-{target}")
    else:
        # It trusts the real CA (so only the server's check can refuse it) but holds another CA's certificate.
        other = make_dev_certs(tmp_path / "other")
        channel = secure_channel(address, credentials(other / "scheduler", ca=certs / "ca.crt"), f"stepwire-{target}")
    with channel:
        with pytest.raises(grpc.RpcError) as e:
            if target == "scheduler":
                scheduler_pb2_grpc.SchedulerStub(channel).Stats(scheduler_pb2.StatsRequest(), timeout=5)
            else:
                executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def channel_as(stack, folder: Path, target: str):
    """A channel to `target` ("scheduler" or "executor") with the certificate in `folder`."""
    return secure_channel(stack[target], credentials(folder), f"stepwire-{target}")


def refusal(call) -> grpc.RpcError:
    """The error `call()` ends with: a unary reply, or every message of a stream, must not come."""
    with pytest.raises(grpc.RpcError) as e:
        reply = call()
        if not isinstance(reply, Message):
            list(reply)
    return e.value


def executor_seen_by_the_scheduler(stack):
    """The scheduler's view of its executor: the stream it drives (epoch), and the requests it routed there."""
    e = stack["operator"].Stats(scheduler_pb2.StatsRequest(), timeout=5).executors[0]
    return {"connected": e.connected, "epoch": e.epoch, "num_routed": e.num_routed}


def executor_call(stub, method: str, epoch: int):
    if method == "Describe":
        return lambda: stub.Describe(executor_pb2.DescribeRequest(), timeout=5)
    if method == "PullBlocks":    # were it taken, the executor would write blocks its scheduler never reserved
        pull = executor_pb2.PullBlocksRequest(source="127.0.0.1:9", source_blocks=[1], target_blocks=[1],
                                              epoch=epoch, after_step=-1)
        return lambda: stub.PullBlocks(pull, timeout=5)
    if method == "ReadBlocks":    # were it taken, a stranger would read other tenants' KV
        return lambda: list(stub.ReadBlocks(executor_pb2.ReadBlocksRequest(blocks=[1]), timeout=5))
    if method == "ReadBlocksMapped":     # the same, from the executor's cache in shared memory
        return lambda: list(stub.ReadBlocksMapped(executor_pb2.ReadBlocksRequest(blocks=[1]), timeout=5))
    # A newer epoch than the scheduler's: were it taken, the executor would drop its batch and end the
    # scheduler's stream, and the scheduler would come back with a new epoch.
    step = executor_pb2.StepRequest(epoch=epoch + 1000, step=1)
    return lambda: stub.Step(iter([step]), timeout=5)


def scheduler_call(stub, method: str):
    submit_request = scheduler_pb2.SubmitRequest(request_id="intruder", prompt_token_ids=PROMPT,
                                                 params=greedy(4, ignore_eos=True))
    return {"Submit": lambda: stub.Submit(submit_request, timeout=5),
            "Session": lambda: stub.Session(iter([scheduler_pb2.SessionRequest(submit=submit_request)]), timeout=5),
            "Limits": lambda: stub.Limits(scheduler_pb2.LimitsRequest(), timeout=5),
            "Stats": lambda: stub.Stats(scheduler_pb2.StatsRequest(), timeout=5)}[method]


def logged(stack, service: str, *parts: str) -> bool:
    return any(all(p in line for p in parts) for line in (stack["tmp"] / f"{service}.log").read_text().splitlines())


@pytest.mark.parametrize(("method", "role"), [
    *((m, r) for m in ("Describe", "Step", "PullBlocks") for r in ("gateway", "executor", "operator")),
    *((m, r) for m in ("ReadBlocks", "ReadBlocksMapped") for r in ("gateway", "scheduler", "operator"))])
def test_an_executor_refuses_every_role_but_the_one_a_method_serves_and_nothing_changes(stack, role, method):
    before = executor_seen_by_the_scheduler(stack)
    with channel_as(stack, stack["certs"] / role, "executor") as channel:
        error = refusal(executor_call(executor_pb2_grpc.ExecutorStub(channel), method, before["epoch"]))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"role {role}" in error.details()
    assert logged(stack, "executor", f"/stepwire.internal.Executor/{method}", f"names role {role}")
    # The scheduler's stream is still the one the executor serves: a request goes through on the same epoch.
    assert [t for out in submit(stack["stub"]) for t in out.token_ids] == stack["expected"]
    after = executor_seen_by_the_scheduler(stack)
    assert after["connected"] and after["epoch"] == before["epoch"]


@pytest.mark.parametrize("method", ["Submit", "Session", "Limits"])
@pytest.mark.parametrize("role", ["executor", "scheduler", "operator"])
def test_the_scheduler_takes_requests_from_gateways_only_and_admits_nothing_else(stack, role, method):
    before = executor_seen_by_the_scheduler(stack)
    with channel_as(stack, stack["certs"] / role, "scheduler") as channel:
        error = refusal(scheduler_call(scheduler_pb2_grpc.SchedulerStub(channel), method))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"role {role}" in error.details()
    assert logged(stack, "scheduler", f"/stepwire.internal.Scheduler/{method}", f"names role {role}")
    assert executor_seen_by_the_scheduler(stack) == before      # no request was routed
    assert stack["operator"].Stats(scheduler_pb2.StatsRequest(), timeout=5).num_requests == 0


@pytest.mark.parametrize("role", ["gateway", "executor", "scheduler"])
def test_stats_answers_the_operator_alone(stack, role):
    with channel_as(stack, stack["certs"] / role, "scheduler") as channel:
        error = refusal(scheduler_call(scheduler_pb2_grpc.SchedulerStub(channel), "Stats"))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert logged(stack, "scheduler", "/stepwire.internal.Scheduler/Stats", f"names role {role}")
    stats = stack["operator"].Stats(scheduler_pb2.StatsRequest(), timeout=5)
    assert [e.address for e in stats.executors] == [stack["executor"]]


def test_a_gateway_learns_the_context_limit_without_stats(stack):
    assert stack["stub"].Limits(scheduler_pb2.LimitsRequest(), timeout=5).max_model_len == 128


@pytest.mark.parametrize("uri", ["spiffe://elsewhere.example/gateway", "spiffe://stepwire.local/gateway-admin",
                                 None])
def test_a_certificate_from_the_ca_without_a_role_here_is_refused(stack, tmp_path, uri):
    """Same CA, but the role is in another trust domain, is not a role, or is missing (a certificate from before
    roles): the handshake passes, the methods do not."""
    ca_cert, ca_key = load_ca(stack["certs"])
    cert, key = issue(ca_cert, ca_key, "gateway")
    builder = (x509.CertificateBuilder().subject_name(cert.subject).issuer_name(cert.issuer)
               .public_key(cert.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(cert.not_valid_before_utc).not_valid_after(cert.not_valid_after_utc))
    for ext in cert.extensions:
        if isinstance(ext.value, x509.SubjectAlternativeName):
            names = [n for n in ext.value if not isinstance(n, x509.UniformResourceIdentifier)]
            names += [x509.UniformResourceIdentifier(uri)] if uri else []
            builder = builder.add_extension(x509.SubjectAlternativeName(names), ext.critical)
        else:
            builder = builder.add_extension(ext.value, ext.critical)
    write_secret(tmp_path / "odd", builder.sign(ca_key, hashes.SHA256()), key, ca_cert)
    with channel_as(stack, tmp_path / "odd", "scheduler") as channel:
        error = refusal(scheduler_call(scheduler_pb2_grpc.SchedulerStub(channel), "Session"))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert stack["operator"].Stats(scheduler_pb2.StatsRequest(), timeout=5).num_requests == 0


@pytest.mark.parametrize("target", ["scheduler", "executor"])
def test_health_and_reflection_answer_any_certificate_from_the_ca(stack, target):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    # Roles that may call none of the target's own methods.
    for role in ("operator", "gateway" if target == "executor" else "executor"):
        with channel_as(stack, stack["certs"] / role, target) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            listing = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert f"stepwire.internal.{target.capitalize()}" in {s.name for s in listing.list_services_response.service}


@pytest.mark.parametrize("kind,role", [("scheduler", "gateway"), ("executor", "scheduler")])
def test_a_service_given_another_roles_certificate_refuses_to_start(stack, launch, kind, role):
    done = launch(Service(kind, flags={"--metrics-address": "", "--tls-dir": stack["certs"] / role}), wait=False)
    assert done.wait(kind, 120) != 0
    stderr = done.log(kind).read_text()
    assert "must name this service's role" in stderr and f"it names {role}" in stderr


def presented_names(port: int, certs: Path) -> set[str]:
    """The DNS names in the certificate the server at `port` presents to a new connection."""
    ctx = ssl.create_default_context(cafile=certs / "ca.crt")
    ctx.check_hostname = False
    ctx.load_cert_chain(certs / "scheduler" / "tls.crt", certs / "scheduler" / "tls.key")
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as conn:
        cert = x509.load_der_x509_certificate(conn.getpeercert(binary_form=True))
    return set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
               .get_values_for_type(x509.DNSName))


def test_a_rotated_certificate_is_used_without_a_restart(stack):
    certs, port = stack["certs"], int(stack["executor"].rsplit(":", 1)[1])
    assert "rotated.stepwire.test" not in presented_names(port, certs)
    # As the kubelet updates a mounted Secret: the new files appear at once (written aside, then renamed).
    staging = stack["tmp"] / "rotation"
    write_secret(staging, *issue(*load_ca(certs), "executor", ("rotated.stepwire.test",)), load_ca(certs)[0])
    for name in ("tls.key", "tls.crt"):
        os.replace(staging / name, certs / "executor" / name)
    assert "rotated.stepwire.test" in presented_names(port, certs)
    assert stack["processes"].alive("executor")
    # Connections already open go on; the service keeps serving.
    tokens = [t for out in submit(stack["stub"]) for t in out.token_ids]
    assert tokens == stack["expected"]


@pytest.mark.parametrize("target,method", [("scheduler", "/stepwire.internal.Scheduler/Submit"),
                                           ("scheduler", "/stepwire.internal.Scheduler/Session"),
                                           ("executor", "/stepwire.internal.Executor/Describe"),
                                           ("executor", "/stepwire.internal.Executor/Step")])
def test_a_message_that_does_not_decode_is_invalid_argument(stack, target, method):
    certs = stack["certs"]
    me = "gateway" if target == "scheduler" else "scheduler"
    with secure_channel(stack[target], credentials(certs / me), f"stepwire-{target}") as channel:
        garbage = b"\xff\xff\xff\xff\x0f"
        if method.endswith(("Session", "Step")):
            call = channel.stream_stream(method)(iter([garbage]), timeout=5)
            with pytest.raises(grpc.RpcError) as e:
                list(call)
        elif method.endswith("Submit"):
            with pytest.raises(grpc.RpcError) as e:
                list(channel.unary_stream(method)(garbage, timeout=5))
        else:
            with pytest.raises(grpc.RpcError) as e:
                channel.unary_unary(method)(garbage, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not decode" in e.value.details()
    assert stack["processes"].alive(target)


def test_the_plaintext_health_port_answers_probes_while_the_service_port_needs_a_certificate(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{stack['health_port']}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        # Health is all it serves.
        with pytest.raises(grpc.RpcError) as e:
            executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def drain(outbox: list):
    """A Session's requests: whatever the test appends to `outbox`, until it appends "end"."""
    while True:
        item = outbox.pop(0) if outbox else None
        if item == "end":
            return
        if item is not None:
            yield item
        time.sleep(0.01)


def test_only_the_session_that_submitted_a_request_can_abort_it(stack):
    stub = stack["stub"]
    mine, theirs = [], []

    def session(outbox):
        return stub.Session(drain(outbox), timeout=60)

    params = greedy(100, ignore_eos=True)
    mine.append(scheduler_pb2.SessionRequest(submit=scheduler_pb2.SubmitRequest(
        request_id="owned", prompt_token_ids=PROMPT, params=params)))
    outputs = session(mine)
    first = next(outputs)
    assert first.outputs[0].request_id == "owned" and not first.outputs[0].HasField("error")
    # Another session names the request: nothing happens to it.
    other = session(theirs)
    theirs.append(scheduler_pb2.SessionRequest(abort=scheduler_pb2.AbortRequest(request_ids=["owned"])))
    time.sleep(0.5)
    theirs.append("end")
    assert list(other) == []
    # Every delta of every message counts: a message carries all that piled up while the writer waited.
    received, reason = 0, ""
    for msg in itertools.chain([first], outputs):
        for out in msg.outputs:
            assert out.request_id == "owned" and out.finish_reason in ("", "length")
            received += len(out.token_ids)
            reason = reason or out.finish_reason
        if reason:
            break
    assert reason == "length" and received == 100   # it ran to its end: the stranger's abort did nothing
    mine.append("end")
    list(outputs)


def test_its_own_session_can_abort_it(stack):
    stub = stack["stub"]
    outbox = [scheduler_pb2.SessionRequest(submit=scheduler_pb2.SubmitRequest(
        request_id="mine", prompt_token_ids=PROMPT,
        params=greedy(100, ignore_eos=True)))]

    outputs = stub.Session(drain(outbox), timeout=60)
    # A message carries every delta that piled up while the writer waited, so read them all, not the first.
    first = next(outputs).outputs
    received = sum(len(o.token_ids) for o in first)
    assert not any(o.finish_reason for o in first)
    outbox.append(scheduler_pb2.SessionRequest(abort=scheduler_pb2.AbortRequest(request_ids=["mine"])))
    reason = ""
    while not reason:
        for out in next(outputs).outputs:
            received += len(out.token_ids)
            reason = reason or out.finish_reason
    assert reason == "abort" and received < 100
    outbox.append("end")
    assert list(outputs) == []


def test_plaintext_on_a_non_loopback_address_is_refused_unless_insecure(launch):
    (port,) = free_ports(1)
    for kind in ("executor", "scheduler"):
        done = launch(Service(kind, flags={"--address": f"0.0.0.0:{port}", "--metrics-address": ""}), wait=False)
        assert done.wait(kind, 60) != 0
        stderr = done.log(kind).read_text()
        assert "refusing to serve" in stderr and "--insecure" in stderr


def test_an_explicit_insecure_flag_allows_a_plaintext_wildcard_address(launch):
    (port,) = free_ports(1)
    s = launch(Service("scheduler", flags={"--address": f"0.0.0.0:{port}", "--metrics-address": "",
                                           "--executors": "127.0.0.1:1", "--insecure": True}), wait=False)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        from helpers import grpc_health
        s.wait_until(lambda: grpc_health(channel) is not None, "the scheduler to answer", 30)


def test_the_gateway_can_serve_clients_over_tls_on_both_ports(tmp_path, launch):
    import httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    model = ROOT / "models" / "SmolLM2-135M-Instruct"
    if not (model / "tokenizer.json").exists():
        pytest.skip("embedded model not prepared (make model): the gateway needs its tokenizer")
    certs = make_dev_certs(tmp_path / "certs")
    (sc,) = free_ports(1)
    me = certs / "gateway"
    gateway = launch(Service("gateway", flags={"--model": model, "--scheduler": f"127.0.0.1:{sc}", "--public-tls-cert":
                                               me / "tls.crt", "--public-tls-key": me / "tls.key"}), wait=False)
    http, gw = gateway["gateway"].flags["--port"], gateway["gateway"].address.rsplit(":", 1)[1]
    with httpx.Client(verify=ssl.create_default_context(cafile=certs / "ca.crt"), timeout=2) as client:

        def health():
            try:
                return client.get(f"https://localhost:{http}/health").status_code
            except httpx.HTTPError:
                return None
        # No scheduler runs: not ready (503), but answered over TLS.
        assert gateway.wait_until(health, "the gateway to answer over https", 60) == 503
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{http}/health", timeout=2)
    creds = grpc.ssl_channel_credentials((certs / "ca.crt").read_bytes())
    with grpc.secure_channel(f"localhost:{gw}", creds) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
