"""deploy/ (Prometheus scrape config, Grafana dashboard and provisioning) agrees with the code and
with compose.yaml.

No Prometheus or Grafana runs here, so the files are parsed and checked against what the code
registers with prometheus_client (found by reading the source, not by importing the services)
and against the services compose.yaml runs. Where `promtool` is installed it checks the scrape
config as well.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_compose import argv, environment

REPO_ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "tessera.json"
PROMETHEUS = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
PROVISIONING = REPO_ROOT / "deploy" / "grafana" / "provisioning"
COMPOSE = REPO_ROOT / "compose.yaml"
OBSERVABILITY = ("prometheus", "grafana")

REGISTRATION = re.compile(r"\b(Counter|Gauge|Histogram|Summary|Info|Enum)\(\s*[\"']([A-Za-z_:][\w:]*)[\"']")
METRIC_IN_QUERY = re.compile(r"\btessera_\w+")
# Base units Prometheus names carry (https://prometheus.io/docs/practices/naming/).
BASE_UNITS = ("_seconds", "_bytes", "_ratio", "_celsius", "_volts", "_amperes", "_joules", "_grams", "_meters")


def registered_metrics() -> dict[str, str]:
    """Every metric the code registers with prometheus_client: name as written -> type."""
    found: dict[str, str] = {}
    for path in [*(REPO_ROOT / "services").rglob("*.py"), *(REPO_ROOT / "shared").rglob("*.py")]:
        for kind, name in REGISTRATION.findall(path.read_text()):
            found[name] = kind
    assert found, "no prometheus_client metric found in services/ or shared/"
    return found


def exposed_series(name: str, kind: str) -> set[str]:
    """The sample names prometheus_client exposes for one metric (as the dashboard queries them)."""
    if kind == "Counter":
        return {name if name.endswith("_total") else f"{name}_total"}
    if kind == "Histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    if kind == "Summary":
        return {name, f"{name}_sum", f"{name}_count"}
    if kind == "Info":
        return {f"{name}_info"}
    return {name}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict) and data.get("panels"), "the dashboard has no panels"
    return data


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels") or []


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every query of every panel."""
    return [(p["title"], t["expr"]) for p in panels(dashboard) for t in p.get("targets") or []]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def metrics_services(compose: dict[str, Any]) -> dict[str, int]:
    """Compose services that serve /metrics -> their HTTP port: every Tessera service does
    (shared/health.py); NATS and Valkey do not."""
    found = {}
    for name, service in compose["services"].items():
        command = argv(service.get("command"))
        if command[:2] == ["python", "-m"] and command[2].startswith("services."):
            found[name] = int(environment(service)["TESSERA_HTTP_PORT"])
    assert found, "compose.yaml runs no Tessera service"
    return found


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    data = yaml.safe_load(PROMETHEUS.read_text())
    assert isinstance(data, dict) and data.get("scrape_configs"), "prometheus.yml has no scrape_configs"
    return data


def scraped(prometheus: dict[str, Any]) -> dict[str, str]:
    """host:port -> the metrics path it is scraped on, over every static target."""
    targets = {}
    for job in prometheus["scrape_configs"]:
        path = job.get("metrics_path", "/metrics")
        for group in job.get("static_configs") or []:
            for target in group["targets"]:
                targets[target] = path
    return targets


# --- the dashboard ----------------------------------------------------------------------------


def test_every_metric_the_dashboard_queries_is_registered_in_the_code(dashboard: dict[str, Any]) -> None:
    exposed = {s for name, kind in registered_metrics().items() for s in exposed_series(name, kind)}
    missing = {
        (title, m) for title, expr in queries(dashboard) for m in METRIC_IN_QUERY.findall(expr) if m not in exposed
    }
    assert not missing, f"the dashboard queries metrics no code registers: {sorted(missing)}"


def test_every_dashboard_query_reads_a_tessera_metric(dashboard: dict[str, Any]) -> None:
    found = queries(dashboard)
    assert found
    for title, expr in found:
        assert METRIC_IN_QUERY.search(expr), f"{title!r} queries no tessera_ metric: {expr}"


def test_every_quantile_is_taken_over_buckets_summed_by_le(dashboard: dict[str, Any]) -> None:
    for title, expr in queries(dashboard):
        if "histogram_quantile" in expr:
            assert "_bucket[" in expr and re.search(r"by \([^)]*\ble\b", expr), (
                f"{title!r}: histogram_quantile needs rate(..._bucket[..]) summed by le: {expr}"
            )


def test_the_dashboard_shows_latency_cold_starts_instances_caches_and_tier_ups(dashboard: dict[str, Any]) -> None:
    queried = {m for _, expr in queries(dashboard) for m in METRIC_IN_QUERY.findall(expr)}
    needed = {
        "tessera_gateway_ttft_seconds_bucket",
        "tessera_gateway_tpot_seconds_bucket",
        "tessera_gateway_placement_seconds_bucket",
        "tessera_coldstart_phase_seconds_sum",
        "tessera_coldstart_phase_seconds_count",
        "tessera_engine_instances",
        "tessera_engine_resident_model_bytes",
        "tessera_loader_host_cache_bytes",
        "tessera_engine_tier_ups_total",
    }
    assert needed <= queried, f"the dashboard lacks {sorted(needed - queried)}"
    stacked = [p for p in panels(dashboard) if "phase" in p["title"].lower()]
    assert stacked and all(p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal" for p in stacked), (
        "the cold-start phases are not stacked"
    )


def test_dashboard_panels_have_unique_ids_and_read_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "two panels share an id"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in panels(dashboard):
        for ref in [p.get("datasource"), *(t.get("datasource") for t in p.get("targets") or [])]:
            if ref is not None:
                assert ref == {"type": "prometheus", "uid": "${datasource}"}, f"{p['title']!r} uses {ref}"
    assert dashboard.get("uid"), "a dashboard without a uid gets a new URL on every provisioning"


# --- metric names -----------------------------------------------------------------------------


def test_metric_names_follow_prometheus_conventions() -> None:
    """tessera_ namespace; counters end in _total; histograms of a quantity carry its base unit."""
    offenders = []
    for name, kind in registered_metrics().items():
        if not name.startswith("tessera_"):
            offenders.append(f"{name}: no tessera_ prefix")
        if kind == "Counter" and not name.endswith("_total"):
            offenders.append(f"{name}: a counter without _total")
        if kind in ("Histogram", "Summary") and not name.endswith(BASE_UNITS):
            offenders.append(f"{name}: a {kind.lower()} without a base unit")
        if kind == "Gauge" and name.endswith("_total"):
            offenders.append(f"{name}: a gauge named like a counter")
        if re.search(r"_(ms|milliseconds|kb|mb|gb|kib|mib|gib)(_|$)", name):
            offenders.append(f"{name}: not a base unit")
    assert not offenders, offenders


# --- Prometheus -------------------------------------------------------------------------------


def test_prometheus_scrapes_every_compose_service_that_serves_metrics(
    prometheus: dict[str, Any], compose: dict[str, Any]
) -> None:
    targets = scraped(prometheus)
    for name, port in metrics_services(compose).items():
        assert targets.get(f"{name}:{port}") == "/metrics", f"{name}:{port}/metrics is not scraped: {targets}"


def test_prometheus_scrapes_only_services_compose_runs(prometheus: dict[str, Any], compose: dict[str, Any]) -> None:
    running = metrics_services(compose)
    for target in scraped(prometheus):
        host, _, port = target.partition(":")
        assert running.get(host) == int(port), f"{target} is not a compose service serving /metrics"
    jobs = [job["job_name"] for job in prometheus["scrape_configs"]]
    assert len(jobs) == len(set(jobs)), f"two scrape jobs share a name: {jobs}"


def test_promtool_accepts_the_scrape_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    result = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(PROMETHEUS)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- compose ----------------------------------------------------------------------------------


def test_prometheus_and_grafana_are_optional_and_nothing_else_is(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        if name in OBSERVABILITY:
            assert service.get("profiles") == ["observability"], f"{name} is not in the observability profile"
            assert service.get("image", "").startswith(("prom/prometheus:", "grafana/grafana:"))
        elif name.endswith("-gpu"):  # the GPU node's services (compose.yaml: `--profile gpu`)
            assert service.get("profiles") == ["gpu"], f"{name} is not in the gpu profile"
        else:
            assert not service.get("profiles"), f"{name} would no longer start with a plain `docker compose up`"


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> repo path of each bind mount from the repo (`./...`)."""
    mounts = {}
    for volume in service.get("volumes") or []:
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = REPO_ROOT / source
    return mounts


def test_prometheus_mounts_the_scrape_config(compose: dict[str, Any]) -> None:
    service = compose["services"]["prometheus"]
    config = next(a.split("=", 1)[1] for a in argv(service.get("command")) if a.startswith("--config.file="))
    assert bind_mounts(service).get(config) == PROMETHEUS


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(
    compose: dict[str, Any], dashboard: dict[str, Any]
) -> None:
    mounts = bind_mounts(compose["services"]["grafana"])
    assert mounts.get("/etc/grafana/provisioning") == PROVISIONING
    for path in mounts.values():
        assert path.exists(), f"grafana mounts {path}, which is not in the repo"

    sources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    source = next(s for s in sources if s["type"] == "prometheus")
    port = int(compose["services"]["prometheus"]["ports"][0].split(":")[-1])
    assert source["url"] == f"http://prometheus:{port}"
    assert dashboard["templating"]["list"][0]["current"]["value"] == source["uid"]

    providers = yaml.safe_load((PROVISIONING / "dashboards" / "tessera.yml").read_text())["providers"]
    folder = Path(providers[0]["options"]["path"])
    mounted = {Path(target).parent for target, path in mounts.items() if path == DASHBOARD}
    assert folder in mounted, f"the dashboard is mounted in {mounted}, Grafana reads {folder}"
