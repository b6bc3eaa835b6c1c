"""The deployment files: Dockerfile, compose stacks, Kubernetes manifests.

Offline throughout. Kubernetes objects are validated against the API schemas that
kubernetes-validate ships; the ServiceMonitor (a CRD) structurally. Compose files go
through `docker compose config` when the compose plugin is installed, and through the
structural checks here always: every mounted file exists, every referenced service is
defined, settings are names the proxy knows.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from proxy.settings import SPECS
from tests.paths import ROOT
from tests.servers import free_port, serve

COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE_FILES = [COMPOSE_DIR / "compose.yaml", COMPOSE_DIR / "compose.sim.yaml"]
K8S_DIR = ROOT / "deploy" / "kubernetes"
#: The oldest Kubernetes the manifests support, and the newest schema at hand.
K8S_VERSIONS = ("1.27", kubernetes_validate.latest_version())
KNOWN_ENV = {spec.env for spec in SPECS}
SHARED_SERVICES = ("prometheus", "grafana", "otel-collector", "tempo-init", "tempo")


# --- Dockerfile ---------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text()
    kept = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(kept))
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip() if " " in line else "")
        for line in text.splitlines()
        if line.strip()
    ]


def instructions(name: str) -> list[str]:
    return [args for instruction, args in dockerfile() if instruction == name]


def test_dockerfile_base_is_a_pinned_python_slim() -> None:
    (base,) = [a for a in instructions("ARG") if a.startswith("PYTHON_IMAGE=")]
    image = base.split("=", 1)[1]
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", image), image
    assert all(a.startswith("${PYTHON_IMAGE}") for a in instructions("FROM"))


def test_dockerfile_runs_as_a_numeric_non_root_user() -> None:
    user = instructions("USER")[-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user


def test_dockerfile_entrypoint_is_exec_form_tokenprobe_serve() -> None:
    assert json.loads(instructions("ENTRYPOINT")[-1]) == ["tokenprobe"]
    assert json.loads(instructions("CMD")[-1]) == ["serve"]


def test_dockerfile_installs_the_tokenizer_extra() -> None:
    assert any('".[tokenizer]"' in a for a in instructions("RUN"))


def test_dockerfile_sets_only_known_settings() -> None:
    names = set()
    for args in instructions("ENV"):
        names |= {m for m in re.findall(r"(TOKENPROBE_\w+)=", args)}
    assert names and names <= KNOWN_ENV, names - KNOWN_ENV


def healthcheck_command() -> list[str]:
    (args,) = instructions("HEALTHCHECK")
    exec_form = args[args.index("CMD") + 3 :].strip()
    command: list[str] = json.loads(exec_form)
    return command


def test_healthcheck_is_python_against_healthz() -> None:
    command = healthcheck_command()
    assert command[0] == "python" and "/healthz" in command[-1]


def test_healthcheck_passes_when_healthz_answers_and_fails_when_nothing_listens() -> None:
    async def healthz(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        status = 200 if scope["path"] == "/healthz" else 404
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    command = [sys.executable, *healthcheck_command()[1:]]
    with serve(healthz) as server:
        ok = subprocess.run(command, env={"TOKENPROBE_PORT": str(server.port)}, timeout=10)
    down = subprocess.run(
        command, env={"TOKENPROBE_PORT": str(free_port())}, capture_output=True, timeout=10
    )
    # serving TLS (the image's TOKENPROBE_SSL_CERTFILE): the check asks over https
    tls = ROOT / "tests" / "fixtures" / "tls"
    cert, key = str(tls / "test-only.crt"), str(tls / "test-only.key")
    with serve(healthz, ssl_certfile=cert, ssl_keyfile=key) as server:
        env = {"TOKENPROBE_PORT": str(server.port), "TOKENPROBE_SSL_CERTFILE": cert}
        secure = subprocess.run(command, env=env, capture_output=True, timeout=10)
    assert ok.returncode == 0
    assert down.returncode != 0
    assert secure.returncode == 0, secure.stderr


def test_dockerignore_keeps_only_the_build_inputs() -> None:
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    rules = [line for line in lines if line and not line.startswith("#")]
    assert rules[0] == "*", "allowlist: ignore everything, then re-include"
    for needed in ("pyproject.toml", "setup.py", "proxy/"):
        assert f"!{needed}" in rules
    copied = [a.split()[0] for a in instructions("COPY") if not a.startswith("--from")]
    assert set(copied) <= {"pyproject.toml", "setup.py", "proxy"}, copied


# --- Compose ------------------------------------------------------------------------


def compose(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def _compose_plugin() -> str | None:
    try:
        result = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "docker" if result.returncode == 0 else None


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=[p.name for p in COMPOSE_FILES])
def test_docker_compose_accepts_the_file(path: Path) -> None:
    if _compose_plugin() is None:
        pytest.skip("the docker compose plugin is not installed (`docker compose version` fails)")
    # `config` parses, interpolates and validates against the compose spec; no engine needed.
    result = subprocess.run(
        ["docker", "compose", "-f", str(path), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=path.parent,
    )
    assert result.returncode == 0, result.stderr


def _mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    pairs = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        pairs.append((source, target))
    return pairs


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=[p.name for p in COMPOSE_FILES])
class TestComposeFile:
    def test_services_have_an_image_and_existing_build_inputs(self, path: Path) -> None:
        for name, service in compose(path)["services"].items():
            assert "image" in service or "build" in service, name
            build = service.get("build")
            if build:
                context = path.parent / build["context"]
                assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name

    def test_bind_mounts_exist_and_named_volumes_are_declared(self, path: Path) -> None:
        data = compose(path)
        for name, service in data["services"].items():
            for source, _ in _mounts(service):
                if source.startswith("."):
                    assert (path.parent / source).exists(), f"{name}: {source}"
                else:
                    assert source in data.get("volumes", {}), f"{name}: volume {source}"

    def test_dependencies_are_defined_services(self, path: Path) -> None:
        services = compose(path)["services"]
        for name, service in services.items():
            for dependency in service.get("depends_on", []):
                assert dependency in services, f"{name} depends on unknown {dependency}"

    def test_tokenprobe_settings_are_known_and_point_at_services(self, path: Path) -> None:
        services = compose(path)["services"]
        env = services["tokenprobe"]["environment"]
        unknown = {k for k in env if k.startswith("TOKENPROBE_")} - KNOWN_ENV
        assert not unknown, unknown
        assert re.match(r"http://([\w-]+):\d+$", env["TOKENPROBE_UPSTREAM"])[1] in services
        assert re.match(r"http://([\w-]+):\d+$", env["OTEL_EXPORTER_OTLP_ENDPOINT"])[1] in services
        prices = env["TOKENPROBE_PRICES"]
        mounted = {target: source for source, target in _mounts(services["tokenprobe"])}
        assert (path.parent / mounted[prices].split(":")[0]).is_file(), prices

    def test_every_service_of_the_image_but_serve_sets_its_own_healthcheck(
        self, path: Path
    ) -> None:
        # The image's HEALTHCHECK asks serve's /healthz on :4000: a container of the same
        # image running sim or bench must override it, or Docker marks it unhealthy.
        for name, service in compose(path)["services"].items():
            command = service.get("command", ["serve"])  # the image's own: serve
            if service.get("image") == "tokenprobe:local" and command[0] != "serve":
                assert "healthcheck" in service, f"{name} ({command[0]})"

    def test_tokenprobe_waits_longer_than_its_drain(self, path: Path) -> None:
        tokenprobe = compose(path)["services"]["tokenprobe"]
        drain = float(tokenprobe["environment"]["TOKENPROBE_DRAIN_TIMEOUT"])
        assert float(tokenprobe["stop_grace_period"].rstrip("s")) > drain

    def test_prometheus_keeps_exemplars_and_scrapes_services_of_this_stack(
        self, path: Path
    ) -> None:
        services = compose(path)["services"]
        prometheus = services["prometheus"]
        assert "--enable-feature=exemplar-storage" in prometheus["command"]
        mounted = {target: source for source, target in _mounts(prometheus)}
        config = yaml.safe_load(
            (path.parent / mounted["/etc/prometheus/prometheus.yml"]).read_text()
        )
        jobs = {}
        for job in config["scrape_configs"]:
            for static in job["static_configs"]:
                for target in static["targets"]:
                    host = target.split(":")[0]
                    assert host in services, f"job {job['job_name']} scrapes unknown {host}"
                    jobs[job["job_name"]] = host
        assert jobs["tokenprobe"] == "tokenprobe"  # the alerts select job="tokenprobe"
        rules_dir = path.parent / mounted["/etc/prometheus/rules"]
        assert sorted(rules_dir.glob("*.yaml")), "no rules mounted"

    def test_grafana_mounts_what_its_provisioning_expects(self, path: Path) -> None:
        grafana = compose(path)["services"]["grafana"]
        mounted = {target: path.parent / source for source, target in _mounts(grafana)}
        assert mounted["/etc/grafana/provisioning"].resolve() == ROOT / "grafana" / "provisioning"
        # The provisioning reads its folder and URLs from Grafana's environment
        # (tests/deploy/test_grafana_env.py): as this stack sets it.
        environ = grafana["environment"]
        providers = yaml.safe_load(
            (ROOT / "grafana/provisioning/dashboards/dashboards.yaml").read_text()
        )
        for provider in providers["providers"]:
            folder = provider["options"]["path"].replace(
                "${DASHBOARDS_PATH}", environ["DASHBOARDS_PATH"]
            )
            assert (mounted[folder] / "tokenprobe.json").is_file()

    def test_traces_flow_to_tempo(self, path: Path) -> None:
        services = compose(path)["services"]
        collector = services["otel-collector"]
        mounted = {target: source for source, target in _mounts(collector)}
        config = yaml.safe_load((path.parent / mounted["/etc/otelcol/config.yaml"]).read_text())
        exporters = config["service"]["pipelines"]["traces"]["exporters"]
        for exporter in exporters:
            assert config["exporters"][exporter]["endpoint"].split(":")[0] in services
        assert "tempo" in services


def test_gpu_stack_runs_vllm_with_traces_and_the_sim_stack_needs_no_gpu() -> None:
    gpu, sim = (compose(p)["services"] for p in COMPOSE_FILES)
    vllm = gpu["vllm"]
    assert any(
        a.startswith("--otlp-traces-endpoint=grpc://otel-collector:") for a in vllm["command"]
    )
    # the dashboard's "Where the first token's time goes" row reads vLLM's per-request
    # metrics (vLLM 0.32, as the docs and tests/vllm have it), in both places the tag is
    assert "--enable-per-request-metrics" in vllm["command"]
    image = "vllm/vllm-openai:v0.32.0"
    assert vllm["build"]["args"]["VLLM_IMAGE"] == "${VLLM_IMAGE:-" + image + "}"
    assert f"ARG VLLM_IMAGE={image}" in (COMPOSE_DIR / "vllm.Dockerfile").read_text()
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert "vllm" not in sim and sim["sim"]["command"][:1] == ["sim"]
    assert not any("deploy" in service for service in sim.values())


def test_both_stacks_share_the_observability_services() -> None:
    gpu, sim = (compose(p)["services"] for p in COMPOSE_FILES)
    for name in SHARED_SERVICES:
        a, b = dict(gpu[name]), dict(sim[name])
        if name == "prometheus":  # each stack has its own scrape config
            a.pop("volumes"), b.pop("volumes")
        assert a == b, name


# --- Kubernetes ---------------------------------------------------------------------


def manifests() -> dict[str, dict[str, Any]]:
    """kind/name -> object, from every YAML file in deploy/kubernetes but kustomization."""
    objects = {}
    for path in sorted(K8S_DIR.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                objects[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return objects


CORE = sorted(k for k, v in manifests().items() if not v["apiVersion"].startswith("monitoring."))


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("key", CORE)
def test_manifest_is_valid_against_the_kubernetes_schema(key: str, version: str) -> None:
    kubernetes_validate.validate(manifests()[key], version, strict=True)


def test_kustomization_lists_the_core_manifests() -> None:
    listed = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())["resources"]
    files = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml", "servicemonitor.yaml"}
    assert set(listed) == files


def _pod(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = objects["Deployment/tokenprobe"]["spec"]["template"]["spec"]
    return spec


def test_selectors_and_ports_line_up() -> None:
    objects = manifests()
    deployment = objects["Deployment/tokenprobe"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = [
        deployment["spec"]["selector"]["matchLabels"],
        objects["Service/tokenprobe"]["spec"]["selector"],
        objects["PodDisruptionBudget/tokenprobe"]["spec"]["selector"]["matchLabels"],
    ]
    for selector in selectors:
        assert selector.items() <= pod_labels.items(), selector
    # The replay Job's pods share the name label: the Service would send clients to them
    # and the PDB count them, unless the selectors name the proxies' component too.
    job = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "replay" / "job.yaml").read_text())
    job_labels = job["spec"]["template"]["metadata"]["labels"]
    spread = _pod(objects)["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"]
    for selector in [*selectors[1:], spread]:
        assert not selector.items() <= job_labels.items(), selector
    container = _pod(objects)["containers"][0]
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = objects["ConfigMap/tokenprobe-env"]["data"]
    assert port_names["http"] == int(env["TOKENPROBE_PORT"])
    service_port = objects["Service/tokenprobe"]["spec"]["ports"][0]
    assert service_port["targetPort"] in port_names
    hpa = objects["HorizontalPodAutoscaler/tokenprobe"]["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "tokenprobe",
    }
    assert hpa["minReplicas"] >= 2, "one pod left by the PDB must still serve"


def test_probes_use_readyz_and_healthz() -> None:
    container = _pod(manifests())["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_grace_period_covers_prestop_sleep_and_drain() -> None:
    objects = manifests()
    pod = _pod(objects)
    drain = float(objects["ConfigMap/tokenprobe-env"]["data"]["TOKENPROBE_DRAIN_TIMEOUT"])
    command = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    sleep = float(command[1])
    assert pod["terminationGracePeriodSeconds"] >= sleep + drain + 5


def test_pod_runs_non_root_on_a_read_only_root_filesystem() -> None:
    pod = _pod(manifests())
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    container = pod["containers"][0]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]


def test_configmap_holds_known_settings_and_a_valid_price_table() -> None:
    from proxy.sinks.cost import parse_prices

    objects = manifests()
    env = objects["ConfigMap/tokenprobe-env"]["data"]
    unknown = {k for k in env if k.startswith("TOKENPROBE_")} - KNOWN_ENV
    assert not unknown, unknown
    pod = _pod(objects)
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    prices_dir, prices_file = env["TOKENPROBE_PRICES"].rsplit("/", 1)
    (volume,) = [name for name, path in mounts.items() if path == prices_dir]
    configmap = objects[f"ConfigMap/{volumes[volume]['configMap']['name']}"]
    parse_prices(yaml.safe_load(configmap["data"][prices_file]), source="prices ConfigMap")


def test_servicemonitor_scrapes_the_service_port() -> None:
    objects = manifests()
    monitor = objects["ServiceMonitor/tokenprobe"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    service = objects["Service/tokenprobe"]
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert spec["endpoints"], "a ServiceMonitor needs at least one endpoint"
    for endpoint in spec["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint.get("path", "/metrics") == "/metrics"
        interval = int(endpoint["interval"].rstrip("s"))
        assert int(endpoint.get("scrapeTimeout", "10s").rstrip("s")) <= interval
    # The alerts select job="tokenprobe": the operator names the job after the Service.
    assert service["metadata"]["name"] == "tokenprobe" and "jobLabel" not in spec


#: The commented lines that turn HTTPS and the /metrics token on (docs/deployment.md).
OPT_IN_LINES = re.compile(
    r"^( *)# ( *(?:- )?(?:scheme|tlsConfig|ca|secret|name|key|serverName|mountPath|readOnly"
    r"|secretName|authorization|type|credentials|TOKENPROBE_SSL_CERTFILE"
    r"|TOKENPROBE_SSL_KEYFILE|TOKENPROBE_ENABLE_SSL_REFRESH):.*?)(?:  +#.*)?$",
    re.M,
)


def _opted_in(name: str) -> list[dict[str, Any]]:
    """The manifests in a file as an operator who uncomments its TLS and token lines has
    them."""
    return list(yaml.safe_load_all(OPT_IN_LINES.sub(r"\1\2", (K8S_DIR / name).read_text())))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_commented_tls_and_token_lines_make_valid_manifests_that_agree(
    version: str,
) -> None:
    """Once the port serves HTTPS, a plain HTTP probe or scrape gets no answer, and once
    /metrics takes a token, a scrape without it gets 401: the commented lines of the three
    files must fit together, and stay valid."""
    (env, _prices) = _opted_in("configmap.yaml")
    (deployment,) = _opted_in("deployment.yaml")
    (monitor,) = _opted_in("servicemonitor.yaml")
    kubernetes_validate.validate(deployment, version, strict=True)
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS", probe
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    for variable in ("TOKENPROBE_SSL_CERTFILE", "TOKENPROBE_SSL_KEYFILE"):
        assert env["data"][variable].rsplit("/", 1)[0] == mount["mountPath"], variable
    assert env["data"]["TOKENPROBE_ENABLE_SSL_REFRESH"] == "true"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"]["name"] == volume["secret"]["secretName"]
    (token,) = [e for e in container["env"] if e["name"] == "TOKENPROBE_METRICS_TOKEN"]
    ref = token["valueFrom"]["secretKeyRef"]
    credentials = {"name": ref["name"], "key": ref["key"]}
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": credentials}
    # as shipped: plain HTTP, and a token only where its Secret exists
    shipped = manifests()
    assert "scheme" not in _pod(shipped)["containers"][0]["readinessProbe"]["httpGet"]
    (scrape,) = shipped["ServiceMonitor/tokenprobe"]["spec"]["endpoints"]
    assert "scheme" not in scrape and "authorization" not in scrape
    assert ref["optional"] is True


def test_readme_commands_in_comments_name_existing_files() -> None:
    # Paths quoted in the compose and Kubernetes comments ("deploy/...") exist.
    for path in [*COMPOSE_FILES, *K8S_DIR.glob("*.yaml")]:
        for token in shlex.split(path.read_text().replace("#", " "), posix=False):
            if token.startswith("deploy/"):
                assert any(ROOT.glob(token.rstrip(".,:)"))), f"{path.name}: {token}"


def test_dockerfile_builds_the_compiled_per_chunk_path() -> None:
    """The image runs the mypyc build (setup.py, proxy/build.py): its build stage has a C
    compiler and setup.py; the stage that runs has neither the compiler nor its cache."""
    stages: list[str] = []
    for instruction, args in dockerfile():
        if instruction == "FROM":
            stages.append("")
        elif stages:
            stages[-1] += f"{instruction} {args}\n"
    build, run = stages
    assert "gcc" in build and "COPY pyproject.toml setup.py" in build
    assert "gcc" not in run and "apt-get" not in run
