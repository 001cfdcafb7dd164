"""The Helm chart in deploy/helm/stepwire, short of a cluster: rendered by Helm's own engine, validated against
a pinned Kubernetes version's schemas and by checkov, and its rendered commands started as local processes
that serve a request, with discovery through an API endpoint that enforces the chart's RBAC Role."""

import copy
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

from fake_discovery import FakeKubeAPI, allowed_by, request_attributes  # noqa: E402
from helpers import free_ports, grpc_health, stop_processes, wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "stepwire"
KUBERNETES = "1.33.0"             # the Kubernetes version whose OpenAPI schemas the objects must satisfy
CHECKOV = Path(os.environ.get("STEPWIRE_CHECKOV", ROOT / ".venv" / "checkov" / "bin" / "checkov"))
RELEASE, NAMESPACE = "demo", "llm"
CRDS = {("cert-manager.io/v1", "Certificate"), ("cert-manager.io/v1", "Issuer"), ("keda.sh/v1alpha1", "ScaledObject"),
        ("monitoring.coreos.com/v1", "PodMonitor")}

GPU_TP2 = {"executor": {"device": "cuda", "tensorParallelSize": 2, "replicas": 3,
                        "nodeSelector": {"nvidia.com/gpu.present": "true"},
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                        "resources": {"requests": {"cpu": "8", "memory": "32Gi"}, "limits": {"memory": "64Gi"}},
                        "shm": {"sizeLimit": "16Gi"}, "kvCacheMemory": 40_000_000_000},
           "model": {"source": "pvc", "name": "Llama-3.1-8B-Instruct", "pvc": {"claimName": "models"}}}
VALUE_SETS = {
    "default": {},
    "gpu-tp2": GPU_TP2,
    "keda": {"executor": {"keda": {"enabled": True}, "deterministic": True,
                          "speculative": {"method": "draft", "numTokens": 6, "model": "SmolLM2-135M-draft"}}},
    "disaggregated-keda": {"executor": {"keda": {"enabled": True}, "disaggregation": {
        "enabled": True, "prefill": {"replicas": 2}, "decode": {"replicas": 5}}}},
    "lora-image": {"lora": {"enabled": True, "initContainer": {"image": "example.com/adapters:1.0"},
                            "modules": {"sql": "sql-lora", "chat": "chat/v2"}}},
    "lora-pvc": {"lora": {"enabled": True, "maxLoras": 8, "maxCpuLoras": 32, "mountPath": "/data/adapters",
                          "volume": {"persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}}}},
    "cert-manager": {"tls": {"certManager": {"enabled": True}, "trustDomain": "prod.example"}},
    "ingress-public-tls": {"gateway": {"ingress": {"enabled": True, "className": "nginx",
                                                  "tls": [{"secretName": "public-tls",
                                                           "hosts": ["stepwire.example.com"]}]},
                                      "publicTls": {"secretName": "gateway-public-tls"}}},
    "two-models": {"model": {"source": "pvc", "pvc": {"claimName": "models"}}, "models": [
        {"name": "smollm2", "directory": "SmolLM2-135M-Instruct",
         "executor": {"replicas": 3, "keda": {"enabled": True, "maxReplicaCount": 12}}},
        {"name": "small", "directory": "SmolLM2-4-layers", "scheduler": {"executorWaitSeconds": 5},
         "executor": {"replicas": 1, "resources": {"requests": {"cpu": "1", "memory": "2Gi"}}}}]},
    "plaintext-hostpath-otel-podmonitor": {
        "tls": {"enabled": False}, "model": {"source": "hostPath", "hostPath": {"path": "/data/models"}},
        "otel": {"endpoint": "http://otel-collector.observability.svc:4317", "resourceAttributes": "env=test"},
        "metrics": {"podMonitor": {"enabled": True}},
        "gateway": {"apiKeys": {"existingSecret": "keys"}, "tenants": {"existingSecret": "team-tenants"}},
        "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]}},
}


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


def render(values: dict, name: str = RELEASE, namespace: str = NAMESPACE) -> list[dict]:
    out = helm.Chart.load(str(CHART)).render(values, name=name, namespace=namespace, is_install=True)
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def find(objects, kind: str, suffix: str = "") -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    return obj


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.fixture(scope="module")
def rendered():
    return {name: render(values) for name, values in VALUE_SETS.items()}


def test_the_chart_lints_clean_and_each_value_set_renders_what_it_asks_for(rendered):
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2]

    default = rendered["default"]
    kinds = sorted((o["kind"], o["metadata"]["name"].removeprefix(f"{RELEASE}-stepwire-")) for o in default)
    assert kinds == sorted([
        ("Deployment", "gateway"), ("Service", "gateway"), ("HorizontalPodAutoscaler", "gateway"),
        ("PodDisruptionBudget", "gateway"), ("Secret", "gateway-api-keys"), ("NetworkPolicy", "gateway"),
        ("Deployment", "scheduler"), ("Service", "scheduler"), ("NetworkPolicy", "scheduler"),
        ("ServiceAccount", "scheduler"), ("Role", "scheduler"), ("RoleBinding", "scheduler"),
        ("Deployment", "executor"), ("Service", "executor"), ("PodDisruptionBudget", "executor"),
        ("NetworkPolicy", "executor"), ("ServiceAccount", "workload")])
    assert all(o["metadata"]["namespace"] == NAMESPACE for o in default)
    scheduler = find(default, "Deployment", "scheduler")
    assert scheduler["spec"]["replicas"] == 1 and scheduler["spec"]["strategy"] == {"type": "Recreate"}
    assert find(default, "Service", "executor")["spec"]["clusterIP"] == "None"      # headless, for discovery
    executor = find(default, "Deployment", "executor")
    shm = {v["name"]: v for v in executor["spec"]["template"]["spec"]["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert [c["name"] for c in executor["spec"]["template"]["spec"]["initContainers"]] == ["prepare-model"]
    # torch threads: the pod's CPU request (2), not torch's one per core of the whole node.
    assert flag(container(executor)["args"], "--threads") == "2"
    gateway = container(find(default, "Deployment", "gateway"))
    assert gateway["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    # The slow-client limits reach the gateway as flags, with the gateway's own defaults.
    assert (flag(gateway["args"], "--read-timeout-seconds"), flag(gateway["args"], "--max-connections")) == \
        ("30", "4096")

    gpu = find(rendered["gpu-tp2"], "Deployment", "executor")
    c = container(gpu)
    assert (flag(c["args"], "--device"), flag(c["args"], "--tensor-parallel-size")) == ("cuda", "2")
    assert "--deterministic" not in c["args"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2 and c["resources"]["requests"]["nvidia.com/gpu"] == 2
    pod = gpu["spec"]["template"]["spec"]
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "initContainers" not in pod and volumes["model"]["persistentVolumeClaim"] == {"claimName": "models",
                                                                                          "readOnly": True}
    assert flag(c["args"], "--model") == "/models/Llama-3.1-8B-Instruct"
    assert flag(c["args"], "--threads") == "0"      # CUDA: torch's own choice

    keda = rendered["keda"]
    scaled = find(keda, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == find(keda, "Deployment", "executor")["metadata"]["name"]
    assert "replicas" not in find(keda, "Deployment", "executor")["spec"]      # KEDA owns the count
    keda_args = container(find(keda, "Deployment", "executor"))["args"]
    assert "--deterministic" in keda_args
    assert (flag(keda_args, "--speculative-method"), flag(keda_args, "--num-speculative-tokens"),
            flag(keda_args, "--speculative-max-batch")) == ("draft", "6", "4")
    beside = flag(keda_args, "--model").rsplit("/", 1)[0] + "/SmolLM2-135M-draft"
    assert flag(keda_args, "--speculative-model") == beside
    assert "--speculative-method" not in container(executor)["args"]      # off by default
    assert "stepwire:num_requests_waiting" in scaled["spec"]["triggers"][0]["metadata"]["query"]

    certs = rendered["cert-manager"]
    issued = {o["spec"]["secretName"] for o in certs if o["kind"] == "Certificate" and not o["spec"].get("isCA")}
    mounted = {v["secret"]["secretName"] for o in certs if o["kind"] == "Deployment"
               for v in o["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"}
    # Every service's mounted Secret is one cert-manager issues; the operator's is for people and scripts.
    assert issued == mounted | {f"{RELEASE}-stepwire-operator-tls"} and len(mounted) == 3
    names = {n for o in certs if o["kind"] == "Certificate" for n in o["spec"].get("dnsNames", [])}
    # The names the services check on each other's certificates (--executor-server-name and its like).
    assert {"stepwire-executor", "stepwire-scheduler", "stepwire-gateway"} <= names
    # Each certificate names its role in the trust domain the servers check, and only one role.
    roles = {o["metadata"]["name"].removeprefix(f"{RELEASE}-stepwire-"): o["spec"]["uris"] for o in certs
             if o["kind"] == "Certificate" and not o["spec"].get("isCA")}
    assert roles == {r: [f"spiffe://prod.example/{r}"] for r in ("gateway", "scheduler", "executor", "operator")}
    for name in ("scheduler", "executor"):
        assert flag(container(find(certs, "Deployment", name))["args"], "--trust-domain") == "prod.example"
    operator = find(certs, "Certificate", "operator")["spec"]
    assert "dnsNames" not in operator and operator["usages"] == ["digital signature", "client auth"]

    public = rendered["ingress-public-tls"]
    backend = find(public, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": f"{RELEASE}-stepwire-gateway", "port": {"name": "http"}}
    gateway = container(find(public, "Deployment", "gateway"))
    assert flag(gateway["args"], "--public-tls-cert") == "/etc/stepwire/public-tls/tls.crt"
    # Its ports speak TLS to clients now, which a kubelet gRPC probe cannot: readiness asks the plain port.
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert find(public, "Service", "gateway")["spec"]["ports"][0]["appProtocol"] == "https"
    assert "grpc" in container(find(default, "Deployment", "gateway"))["readinessProbe"]

    plain = rendered["plaintext-hostpath-otel-podmonitor"]
    for d in (o for o in plain if o["kind"] == "Deployment"):
        args, env = container(d)["args"], {e["name"]: e.get("value") for e in container(d)["env"]}
        assert "--tls-dir" not in args
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability.svc:4317"
        assert env["OTEL_RESOURCE_ATTRIBUTES"].endswith(",env=test")
    assert find(plain, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert not [o for o in plain if o["kind"] == "Secret"]          # the API keys come from an existing Secret


def test_a_tenants_secret_is_mounted_into_every_gateway_and_named_by_its_flag(rendered):
    gateway = find(rendered["plaintext-hostpath-otel-podmonitor"], "Deployment", "-gateway")
    c = container(gateway)
    assert flag(c["args"], "--tenants-file") == "/etc/stepwire/tenants/tenants.json"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "tenants")
    assert mount == {"name": "tenants", "mountPath": "/etc/stepwire/tenants", "readOnly": True}
    volume = next(v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "tenants")
    assert volume["secret"]["secretName"] == "team-tenants"
    default = container(find(rendered["default"], "Deployment", "-gateway"))
    assert "--tenants-file" not in default["args"] and all(m["name"] != "tenants" for m in default["volumeMounts"])


def test_lora_values_give_executors_slots_and_an_adapter_volume_and_the_scheduler_the_start_adapters(rendered):
    executor = find(rendered["lora-image"], "Deployment", "-executor")
    pod = executor["spec"]["template"]["spec"]
    args = container(executor)["args"]
    assert (flag(args, "--max-loras"), flag(args, "--max-lora-rank"), flag(args, "--lora-dir")) == ("4", "16",
                                                                                                "/adapters")
    assert "--max-cpu-loras" not in args
    mount = next(m for m in container(executor)["volumeMounts"] if m["name"] == "adapters")
    assert mount == {"name": "adapters", "mountPath": "/adapters", "readOnly": True}
    assert next(v for v in pod["volumes"] if v["name"] == "adapters")["emptyDir"] == {"sizeLimit": "2Gi"}
    # The model's init container stays, and the adapters' copies the image's folder into the emptyDir.
    inits = {c["name"]: c for c in pod["initContainers"]}
    assert set(inits) == {"prepare-model", "copy-adapters"}
    assert inits["copy-adapters"]["image"] == "example.com/adapters:1.0"
    assert inits["copy-adapters"]["command"] == ["cp", "-R", "/adapters/.", "/adapters"]
    sched = container(find(rendered["lora-image"], "Deployment", "-scheduler"))["args"]
    assert flag(sched, "--lora-modules") == "chat=/adapters/chat/v2,sql=/adapters/sql-lora"

    executor = find(rendered["lora-pvc"], "Deployment", "-executor")
    pod = executor["spec"]["template"]["spec"]
    args = container(executor)["args"]
    assert (flag(args, "--max-loras"), flag(args, "--max-cpu-loras"), flag(args, "--lora-dir")) == (
        "8", "32", "/data/adapters")
    assert next(v for v in pod["volumes"] if v["name"] == "adapters")["persistentVolumeClaim"] == {
        "claimName": "adapters", "readOnly": True}
    assert [c["name"] for c in pod["initContainers"]] == ["prepare-model"]
    assert "--lora-modules" not in container(find(rendered["lora-pvc"], "Deployment", "-scheduler"))["args"]
    # Off by default: no slot, no volume.
    default = find(rendered["default"], "Deployment", "-executor")
    assert "--max-loras" not in container(default)["args"]
    assert all(v["name"] != "adapters" for v in default["spec"]["template"]["spec"]["volumes"])


def test_disaggregation_makes_a_deployment_per_role_each_scaled_on_its_own_metric_behind_one_service(rendered):
    objects = rendered["disaggregated-keda"]
    deployments = {d["metadata"]["name"]: d for d in objects if d["kind"] == "Deployment"}
    prefill, decode = (deployments[f"{RELEASE}-stepwire-executor-{role}"] for role in ("prefill", "decode"))
    for d, role in ((prefill, "prefill"), (decode, "decode")):
        assert flag(container(d)["args"], "--role") == role
        labels = d["spec"]["selector"]["matchLabels"]
        assert labels["stepwire.io/role"] == role and d["spec"]["template"]["metadata"]["labels"] | labels == \
            d["spec"]["template"]["metadata"]["labels"]
    assert f"{RELEASE}-stepwire-executor" not in deployments          # no mixed executors beside them
    # One headless Service over both: the scheduler discovers every executor and learns its role from Describe.
    (service,) = [o for o in objects if o["kind"] == "Service" and "executor" in o["metadata"]["name"]]
    assert "stepwire.io/role" not in service["spec"]["selector"]
    assert service["spec"]["selector"].items() <= prefill["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= decode["spec"]["template"]["metadata"]["labels"].items()
    scaled = {o["spec"]["scaleTargetRef"]["name"]: o for o in objects if o["kind"] == "ScaledObject"}
    assert set(scaled) == {prefill["metadata"]["name"], decode["metadata"]["name"]}
    assert 'role_requests_waiting{role="prefill"' in scaled[prefill["metadata"]["name"]]["spec"]["triggers"][0][
        "metadata"]["query"]
    assert 'role_requests_running{role="decode"' in scaled[decode["metadata"]["name"]]["spec"]["triggers"][0][
        "metadata"]["query"]
    pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget" and "executor" in o["metadata"]["name"]]
    assert sorted(p["spec"]["selector"]["matchLabels"]["stepwire.io/role"] for p in pdbs) == ["decode", "prefill"]
    # Without KEDA each keeps its own count.
    plain = render({"executor": {"disaggregation": {"enabled": True, "prefill": {"replicas": 2},
                                                    "decode": {"replicas": 5}}}})
    counts = {d["metadata"]["name"]: d["spec"]["replicas"] for d in plain if d["kind"] == "Deployment"
              and "executor" in d["metadata"]["name"]}
    assert counts == {f"{RELEASE}-stepwire-executor-prefill": 2, f"{RELEASE}-stepwire-executor-decode": 5}
    scheduler = find(objects, "Deployment", "scheduler")
    assert "--kv-transfer" in container(scheduler)["args"]


def test_two_models_get_a_scheduler_and_executors_each_scaled_and_budgeted_alone_behind_one_gateway(rendered):
    objects = rendered["two-models"]
    named = lambda kind: {o["metadata"]["name"].removeprefix(f"{RELEASE}-stepwire-"): o  # noqa: E731
                          for o in objects if o["kind"] == kind}
    deployments = named("Deployment")
    assert set(deployments) == {"gateway", "scheduler-smollm2", "scheduler-small", "executor-smollm2",
                                "executor-small"}
    for model, directory in (("smollm2", "SmolLM2-135M-Instruct"), ("small", "SmolLM2-4-layers")):
        executor, scheduler = deployments[f"executor-{model}"], deployments[f"scheduler-{model}"]
        assert flag(container(executor)["args"], "--model") == f"/models/{directory}"
        assert executor["spec"]["selector"]["matchLabels"]["stepwire.io/model"] == model
        # Its scheduler watches only its own executors' Service, and refuses any other model's executor.
        service = named("Service")[f"executor-{model}"]
        assert service["spec"]["selector"] == executor["spec"]["selector"]["matchLabels"]
        assert flag(container(scheduler)["args"], "--kubernetes-label-selector") == \
            f"kubernetes.io/service-name={RELEASE}-stepwire-executor-{model}"
        assert flag(container(scheduler)["args"], "--served-model") == directory
        assert named("PodDisruptionBudget")[f"executor-{model}"]["spec"]["selector"]["matchLabels"] == \
            executor["spec"]["selector"]["matchLabels"]
        if model == "small":
            assert executor["spec"]["replicas"] == 1
            assert container(executor)["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}
            assert flag(container(scheduler)["args"], "--executor-wait-seconds") == "5"
    # KEDA where asked, on that model's own scheduler's queue; the other keeps its count.
    (scaled,) = named("ScaledObject").values()
    assert scaled["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-stepwire-executor-smollm2"
    assert scaled["spec"]["maxReplicaCount"] == 12
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert f'pod=~"{RELEASE}-stepwire-scheduler-smollm2-.*"' in query and "num_requests_waiting" in query
    assert "replicas" not in deployments["executor-smollm2"]["spec"]
    # The gateways read every model from one ConfigMap, each name paired with its own scheduler's Service.
    gateway = deployments["gateway"]
    assert flag(container(gateway)["args"], "--models-file") == "/etc/stepwire/models/models.json"
    assert "--scheduler" not in container(gateway)["args"]
    models = json.loads(named("ConfigMap")["gateway-models"]["data"]["models.json"])["models"]
    assert models == [{"name": n, "model": f"/models/{d}", "scheduler": f"{RELEASE}-stepwire-scheduler-{n}:50051"}
                      for n, d in (("smollm2", "SmolLM2-135M-Instruct"), ("small", "SmolLM2-4-layers"))]
    assert "checksum/models" in gateway["spec"]["template"]["metadata"]["annotations"]
    with pytest.raises(helm.HelmError, match="given twice"):
        render({"models": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(helm.HelmError, match="lower-case"):
        render({"models": [{"name": "Big_Model"}]})


def test_a_bad_model_source_fails_the_render_with_a_message_naming_the_value():
    with pytest.raises(helm.HelmError, match="model.pvc.claimName is required"):
        render({"model": {"source": "pvc"}})
    with pytest.raises(helm.HelmError, match="model.source must be embedded, pvc or hostPath"):
        render({"model": {"source": "s3"}})


def test_a_bad_trust_domain_fails_the_render_with_a_message_naming_the_value():
    with pytest.raises(helm.HelmError, match="tls.trustDomain must be lower-case"):
        render({"tls": {"trustDomain": "Prod/Example"}})


def test_every_rendered_object_is_valid_for_the_pinned_kubernetes_version(rendered):
    checked = set()
    for name, objects in rendered.items():
        for obj in objects:
            key = (obj["apiVersion"], obj["kind"])
            if key in CRDS:
                # kubernetes-validate knows the built-in kinds only; these are checked against the values above.
                with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                    kubernetes_validate.validate(obj, KUBERNETES, strict=True)
                continue
            try:
                kubernetes_validate.validate(obj, KUBERNETES, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {obj['kind']} {obj['metadata']['name']}: {e.message} at {list(e.path)}")
            checked.add(obj["kind"])
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy", "Role",
            "RoleBinding", "ServiceAccount", "Secret", "Ingress"} <= checked


def test_checkov_leaves_no_failed_check_without_a_reason_written_in_the_chart(rendered, tmp_path):
    if not CHECKOV.exists():
        pytest.skip(f"checkov is not installed at {CHECKOV} (`make test` installs it)")
    for name, objects in rendered.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(objects))
    dockerfile = ROOT / "deploy" / "docker" / "Dockerfile"
    for target in (["-d", str(tmp_path), "--framework", "kubernetes"],
                   ["-f", str(dockerfile), "--framework", "dockerfile"]):
        done = subprocess.run([str(CHECKOV), *target, "--skip-download", "--compact", "-o", "json"],
                              capture_output=True, text=True, timeout=300, env=dict(os.environ, BC_SKIP_MAPPING="TRUE"))
        results = json.loads(done.stdout)["results"]
        failed = [(f["check_id"], f["resource"]) for f in results["failed_checks"]]
        assert failed == [], failed
        assert len(results["passed_checks"]) > 20
        # Every skip carries its reason (the chart's annotations, the Dockerfile's comments).
        skipped = results["skipped_checks"]
        assert skipped and all(s["check_result"].get("suppress_comment", "").strip() for s in skipped)


def test_the_role_grants_exactly_the_discovery_calls_and_only_the_scheduler_holds_it(rendered):
    objects = rendered["default"]
    role, binding = find(objects, "Role"), find(objects, "RoleBinding")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["list", "watch"]}]
    scheduler = find(objects, "Deployment", "scheduler")["spec"]["template"]["spec"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": scheduler["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    others = [find(objects, "Deployment", n)["spec"]["template"]["spec"] for n in ("gateway", "executor")]
    assert all(o["serviceAccountName"] != scheduler["serviceAccountName"] and
               o["automountServiceAccountToken"] is False for o in others)
    # The fake API server used below authorizes by these rules as the real one would.
    ns = NAMESPACE
    assert allowed_by(role["rules"], ns, request_attributes(
        "GET", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", {"watch": "true"}))
    for method, path in (("GET", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/x"),   # get
                         ("GET", "/apis/discovery.k8s.io/v1/namespaces/other/endpointslices"),       # other namespace
                         ("GET", "/apis/discovery.k8s.io/v1/endpointslices"),                        # cluster-wide
                         ("GET", f"/api/v1/namespaces/{ns}/endpoints"), ("GET", f"/api/v1/namespaces/{ns}/pods"),
                         ("POST", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices")):
        assert not allowed_by(role["rules"], ns, request_attributes(method, path, {})), (method, path)


def test_the_drain_periods_nest_inside_the_grace_periods(rendered):
    objects = rendered["default"]
    executor, scheduler = (find(objects, "Deployment", n) for n in ("executor", "scheduler"))
    executor_drain = float(flag(container(executor)["args"], "--drain-seconds"))
    scheduler_drain = float(flag(container(scheduler)["args"], "--drain-seconds"))
    # The scheduler finishes or moves a draining executor's requests before the executor stops waiting for it,
    # and the executor stops before the kubelet's SIGKILL.
    assert scheduler_drain < executor_drain < executor["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


def test_executor_pods_keep_their_kv_cache_out_of_their_own_small_dev_shm(rendered):
    """A pod's /dev/shm is 64 MiB and no other pod maps it: the cache stays plain memory, read through gRPC."""
    for name, objects in rendered.items():
        for d in (o for o in objects if o["kind"] == "Deployment" and "executor" in o["metadata"]["name"]):
            assert flag(container(d)["args"], "--kv-shared-memory-dir") == "", name


def test_the_image_holds_every_package_the_services_import_and_the_extras_they_need():
    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = set(re.findall(r'"(\w+)\*"', pyproject.split("[tool.setuptools.packages.find]")[1].split("\n\n")[0]))
    first_party = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {"tests", "bench"}
    assert packages == first_party - {"tools"}          # every service package is installed...
    assert copied == first_party                        # ...and copied, with the converter the init container runs
    extras = re.search(r'pip install "\.\[([\w,]+)\]"', text).group(1).split(",")
    for extra in extras:
        assert re.search(rf"^{extra} = \[", pyproject, re.M), extra
    # The chart runs the CLI the image's entrypoint is.
    assert 'ENTRYPOINT ["stepwire"]' in text
    assert all(container(d)["command"][0] == "stepwire" for d in render({}) if d["kind"] == "Deployment")


# ---------------------------------------------------------------------------------- the rendered commands, run


class Pods:
    """The rendered Deployments' containers as local processes: ports remapped to loopback, mounts to local
    folders, Service names to the ports behind them."""

    def __init__(self, objects, tmp: Path, mounts: dict[str, Path]):
        self.objects, self.tmp, self.mounts = objects, tmp, mounts
        self.deployments = {d["metadata"]["name"].rsplit("-", 1)[1]: d for d in objects if d["kind"] == "Deployment"}
        self.ports: dict[tuple[str, int], int] = {}      # (component, container port) -> loopback port
        for component, d in self.deployments.items():
            declared = [p["containerPort"] for p in container(d)["ports"]]
            for port, local in zip(declared, free_ports(len(declared)), strict=True):
                self.ports[(component, port)] = local
        self.procs: dict[str, subprocess.Popen] = {}

    def port(self, component: str, name: str) -> int:
        c = container(self.deployments[component])
        return self.ports[(component, next(p["containerPort"] for p in c["ports"] if p["name"] == name))]

    def service_address(self, name: str, port: int) -> str:
        svc = next(o for o in self.objects if o["kind"] == "Service" and o["metadata"]["name"] == name)
        target = next(p["targetPort"] for p in svc["spec"]["ports"] if p["port"] == port)
        component = svc["spec"]["selector"]["app.kubernetes.io/component"]
        return f"127.0.0.1:{self.port(component, target)}"

    def local_args(self, component: str, args: list[str]) -> list[str]:
        out = []
        for a in args:
            if m := re.fullmatch(r"0\.0\.0\.0:(\d+)", a):
                a = f"127.0.0.1:{self.ports[(component, int(m.group(1)))]}"
            elif a == "0.0.0.0":
                a = "127.0.0.1"
            elif m := re.fullmatch(r"([a-z0-9-]+):(\d+)", a):
                a = self.service_address(m.group(1), int(m.group(2)))
            elif a.isdigit() and (component, int(a)) in self.ports and out and out[-1] in ("--port", "--health-port"):
                a = str(self.ports[(component, int(a))])
            for mount, local in self.mounts.items():
                if a.startswith(mount):
                    a = str(local) + a[len(mount):]
            out.append(a)
        return out

    def env(self, c: dict, pod: str) -> dict:
        env = dict(os.environ)
        for e in c.get("env", []):
            value = e.get("value")
            if "valueFrom" in e:
                assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
                value = pod
            # Kubernetes expands $(NAME) of the variables defined before.
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)
        return env

    def command(self, c: dict) -> list[str]:
        command = list(c["command"])
        if command[0] == "stepwire":
            command[0] = str(Path(sys.executable).parent / "stepwire")
        elif command[0] == "python":
            command[0] = sys.executable
        return command

    def run_init(self, component: str) -> None:
        for c in self.deployments[component]["spec"]["template"]["spec"].get("initContainers", []):
            done = subprocess.run([*self.command(c), *self.local_args(component, c["args"])], cwd=ROOT,
                                  env=self.env(c, f"{component}-init"), capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-2000:]

    def start(self, component: str, extra: tuple[str, ...] = ()) -> None:
        c = container(self.deployments[component])
        self.procs[component] = subprocess.Popen(
            [*self.command(c), *self.local_args(component, c["args"]), *extra], cwd=ROOT,
            env=self.env(c, f"{component}-0"), stdout=open(self.tmp / f"{component}.log", "w"),
            stderr=subprocess.STDOUT)

    def logs(self) -> list[Path]:
        return sorted(self.tmp.glob("*.log"))


def grpc_health_status(port: int) -> int | None:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return grpc_health(channel)


def test_the_rendered_commands_serve_a_chat_completion_with_discovery_held_to_the_role(tmp_path):
    from security.dev_certs import make_dev_certs

    key = "sk-chart-test"
    values = copy.deepcopy({"executor": {"replicas": 1, "threads": 1, "kvCacheMemory": 64 << 20},
                            "gateway": {"apiKeys": {"keys": [key]}}})
    objects = render(values)
    # Certificates as `stepwire certs` makes them for the trust domain the rendered servers check.
    trust_domain = flag(container(find(objects, "Deployment", "scheduler"))["args"], "--trust-domain")
    certs = make_dev_certs(tmp_path / "certs", trust_domain=trust_domain)
    secret = find(objects, "Secret", "api-keys")
    (tmp_path / "api-keys").mkdir()
    (tmp_path / "api-keys" / "api-keys").write_text(secret["stringData"]["api-keys"])
    role = find(objects, "Role")
    # Each mount path of the rendered pods, as a local folder (one per pod where they differ).
    pods = Pods(objects, tmp_path, {"/models": tmp_path / "models", "/etc/stepwire/api-keys": tmp_path / "api-keys"})
    api = FakeKubeAPI(namespace=NAMESPACE, rules=role["rules"])
    try:
        pods.run_init("executor")     # the embedded model, converted by the init container's own command
        assert (tmp_path / "models" / "SmolLM2-135M-Instruct" / "model.safetensors").exists()
        for component in ("executor", "scheduler", "gateway"):
            pods.mounts["/etc/stepwire/tls"] = certs / component
            extra = ()
            if component == "scheduler":
                # In a pod the service account's token and the API server's address come with it.
                extra = ("--kubeconfig", str(api.kubeconfig(tmp_path)))
            pods.start(component, extra)
        # What the executors' headless Service would publish: the one pod, on its grpc port.
        service = find(objects, "Service", "executor")["metadata"]["name"]
        api.put(f"{service}-abcde", pods.port("executor", "grpc"),
                [{"ip": "127.0.0.1", "ready": True, "serving": True, "terminating": False}], service=service)
        # The probes' targets: the plaintext gRPC health ports, and the gateway's gRPC port.
        wait_until(lambda: grpc_health_status(pods.port("scheduler", "health")) == 1 and
                   grpc_health_status(pods.port("executor", "health")) == 1 and
                   grpc_health_status(pods.port("gateway", "grpc")) == 1, 180,
                   "the probes of all three to pass", procs=pods.procs, logs=pods.logs())
        url = f"http://127.0.0.1:{pods.port('gateway', 'http')}/v1/chat/completions"
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
        request = urllib.request.Request(url, body, {"Content-Type": "application/json",
                                                     "Authorization": f"Bearer {key}"})
        reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert reply["choices"][0]["message"]["content"] and reply["usage"]["completion_tokens"] == 8
        with pytest.raises(urllib.error.HTTPError) as refused:       # the rendered Secret's key is the only one
            urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}), timeout=10)
        assert refused.value.code == 401
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{pods.port('gateway', 'metrics')}/metrics",
                                         timeout=10).read().decode()
        assert "stepwire" in metrics
        # The scheduler found its executor with nothing but the Role's calls: both of them, nothing refused.
        assert api.denied == []
        selector = f"kubernetes.io/service-name={service}"
        assert {c[0] for c in api.calls if c[2] == selector} == {"list", "watch"}
    finally:
        stop_processes(pods.procs)
        api.stop()
