"""deploy/k8s: every object is valid against the Kubernetes API schemas (offline: `kubernetes-validate` ships them)
and agrees with the mesh file it ships, as the pods will run it: names and ports of the Services the mesh file
dials, replica counts, the config and certificate mounts, the Envoy bootstrap (accepted by the real Envoy), the
images and the Dockerfile."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from mesh.certs import ensure_certs
from mesh.config import MeshConfig, load_mesh_config
from mesh.up import envoy_binary
from tandem.netaddr import split_host_port
from tandem.tls import file_stem
from tandem.version import __version__
from tests.helpers import assert_envoy_accepts

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
#: Validated against the oldest Kubernetes with the pod-index label the StatefulSets read, and the newest schemas.
VERSIONS = ["1.28.0", kubernetes_validate.utils.latest_version()]


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def resources() -> list[dict]:
    """The objects of the kustomization's resources, in its namespace (as `kubectl apply -k` sends them)."""
    kust = kustomization()
    objects = []
    for name in kust["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc["kind"] != "Namespace":
                doc["metadata"].setdefault("namespace", kust["namespace"])
            objects.append(doc)
    return objects


def generated() -> list[dict]:
    """The ConfigMap and Secrets the kustomization generates (one key per file, named after it)."""
    kust = kustomization()
    objects = []
    for kind, entries in (("ConfigMap", kust["configMapGenerator"]), ("Secret", kust["secretGenerator"])):
        for entry in entries:
            data = {Path(f).name: "" for f in entry["files"]}
            meta = {"name": entry["name"], "namespace": kust["namespace"]}
            objects.append({"apiVersion": "v1", "kind": kind, "metadata": meta, "data": data})
    return objects


def find(kind: str, name: str) -> dict:
    return next(o for o in resources() if o["kind"] == kind and o["metadata"]["name"] == name)


def pod_spec(kind: str, name: str) -> dict:
    return find(kind, name)["spec"]["template"]["spec"]


def container(spec: dict, name: str | None = None) -> dict:
    return next(c for c in spec["containers"] if name is None or c["name"] == name)


def mount_of(spec: dict, c: dict, predicate) -> str:
    """The mount path in container `c` of the pod volume matching `predicate`."""
    volume = next(v for v in spec["volumes"] if predicate(v))
    return next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == volume["name"])


def projected_files(spec: dict, volume: str) -> dict[str, set[str]]:
    """Secret name -> file names a projected volume gives the pod (every key of a secret projected whole)."""
    sources = next(v for v in spec["volumes"] if v["name"] == volume)["projected"]["sources"]
    secrets = {s["name"]: {Path(f).name for f in s["files"]} for s in kustomization()["secretGenerator"]}
    return {
        s["secret"]["name"]: {i["path"] for i in s["secret"]["items"]}
        if "items" in s["secret"]
        else secrets[s["secret"]["name"]]
        for s in sources
    }


@pytest.fixture(scope="module")
def mesh() -> MeshConfig:
    return load_mesh_config(K8S / "mesh.yaml")


def test_the_kustomization_lists_every_manifest():
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "mesh.yaml"}
    assert set(kustomization()["resources"]) == manifests


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas(version):
    objects = resources() + generated()
    assert {o["kind"] for o in objects} >= {"StatefulSet", "Deployment", "DaemonSet", "Service", "ConfigMap"}
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_a_mistake_in_a_manifest_is_caught():
    broken = find("StatefulSet", "tandem-coordinator")
    container(broken["spec"]["template"]["spec"])["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolcy"):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def test_the_pods_run_the_mesh_file_of_the_configmap():
    (mesh_map,) = kustomization()["configMapGenerator"]
    assert mesh_map["files"] == ["mesh.yaml"]
    for obj in resources():
        if obj["kind"] not in ("StatefulSet", "Deployment", "DaemonSet"):
            continue
        spec = obj["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            words = shlex.split(" ".join(c.get("command", []) + c.get("args", [])))
            if "--config" not in words:
                continue
            path = Path(words[words.index("--config") + 1])
            at = mount_of(spec, c, lambda v: v.get("configMap", {}).get("name") == mesh_map["name"])
            assert path == Path(at) / "mesh.yaml", (obj["metadata"]["name"], c["name"])


@pytest.mark.parametrize("role", ["coordinator", "conductor"])
def test_each_replica_is_reached_where_the_mesh_file_says(mesh, role):
    section = getattr(mesh, role)
    sts = find("StatefulSet", f"tandem-{role}")
    service = find("Service", sts["spec"]["serviceName"])
    namespace = kustomization()["namespace"]
    assert service["spec"]["clusterIP"] == "None"  # a headless Service: one DNS name per pod
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["replicas"] == section.replicas
    port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    expected = [
        f"{sts['metadata']['name']}-{i}.{service['metadata']['name']}.{namespace}.svc.cluster.local:{port['port']}"
        for i in range(section.replicas)
    ]
    assert section.replica_endpoints == expected
    c = container(sts["spec"]["template"]["spec"])
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == port["targetPort"])
    assert grpc_port == port["port"] == split_host_port(section.listen)[1]
    # Every replica runs as the replica of its pod ordinal (name c<i>, its own metaserver callbacks).
    assert c["args"][c["args"].index("--replica") + 1] == "$(REPLICA)"
    (env,) = [e for e in c["env"] if e["name"] == "REPLICA"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"


def test_envoy_services_carry_the_listeners_the_mesh_file_names(mesh):
    namespace = kustomization()["namespace"]
    c = container(pod_spec("Deployment", "tandem-envoy"), "envoy")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}

    def service_port(service: str, name: str) -> tuple[str, int]:
        port = next(p for p in find("Service", service)["spec"]["ports"] if p["name"] == name)
        return f"{service}.{namespace}.svc.cluster.local", port["port"], ports[port["targetPort"]]

    host, port, target = service_port("tandem-envoy", "grpc")
    assert mesh.control_address == f"{host}:{port}" and target == split_host_port(mesh.envoy.grpc_listen)[1]
    host, port, target = service_port("tandem-envoy", "callback")
    assert mesh.coordinator.metaserver_address == f"{host}:{port}"
    assert target == split_host_port(mesh.envoy.callback_listen)[1]
    _, port, target = service_port("tandem-ingress", "http")
    assert target == split_host_port(mesh.envoy.http_listen)[1]
    etcd = next(p for p in find("Service", "tandem-etcd")["spec"]["ports"] if p["name"] == "client")
    assert mesh.coordinator.etcd.endpoint == f"tandem-etcd.{namespace}.svc.cluster.local:{etcd['port']}"


def test_envoy_reads_the_bootstrap_and_descriptor_its_init_container_renders(mesh, tmp_path):
    spec = pod_spec("Deployment", "tandem-envoy")
    (render,) = spec["initContainers"]
    words = shlex.split(render["command"][-1])
    rendered = mount_of(spec, render, lambda v: "emptyDir" in v)
    descriptor = Path(words[words.index("--descriptor") + 1])
    output = Path(words[words.index(">") + 1])
    assert descriptor.parent == output.parent == Path(rendered)
    assert words[words.index("cp") + 1 :] == ["/opt/tandem/build/tandem_descriptor.pb", f"{rendered}/"]
    envoy = container(spec, "envoy")
    assert envoy["args"][envoy["args"].index("-c") + 1] == str(output)
    assert mount_of(spec, envoy, lambda v: "emptyDir" in v) == rendered
    # The bootstrap that mesh file renders is one the real Envoy accepts (names resolved by DNS clusters), with the
    # container's flags.
    assert_envoy_accepts(mesh, tmp_path)
    args = [str(tmp_path / "envoy.yaml") if a == str(output) else a for a in envoy["args"]]
    result = subprocess.run([envoy_binary(), "--mode", "validate", *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_each_pod_gets_the_ca_and_its_own_certificate_only(mesh, tmp_path):
    roles = {
        ("StatefulSet", "tandem-coordinator"): ["coordinator"],
        ("StatefulSet", "tandem-conductor"): ["conductor"],
        ("Deployment", "tandem-envoy"): ["envoy"],
        ("DaemonSet", "tandem-node-agent"): [f"agent/{a.node_id}" for a in mesh.node_agents],
    }
    for (kind, name), role_list in roles.items():
        spec = pod_spec(kind, name)
        for c in spec["containers"]:
            assert mount_of(spec, c, lambda v: v["name"] == "certs") == mesh.security.certs_dir
        files = set().union(*projected_files(spec, "certs").values())
        wanted = {"ca.pem"} | (
            {"ca-bundle.pem"} if kind == "DaemonSet" else set()  # engines trust Envoy's callback listener
        )
        for role in role_list:
            wanted |= {f"{file_stem(role)}.pem", f"{file_stem(role)}-key.pem"}  # what TlsFiles.for_role reads
        assert files == wanted, name
    # `tandem certs` for this mesh file writes every file the Secrets are generated from.
    ensure_certs(tmp_path, mesh)
    for entry in kustomization()["secretGenerator"]:
        for f in entry["files"]:
            assert f.startswith("certs/") and (tmp_path / Path(f).name).is_file(), f


def test_node_agents_run_on_the_host_network_as_their_node(mesh):
    spec = pod_spec("DaemonSet", "tandem-node-agent")
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    c = container(spec)
    assert c["args"][c["args"].index("--node") + 1] == "$(NODE_NAME)"
    (env,) = [e for e in c["env"] if e["name"] == "NODE_NAME"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    state = mount_of(spec, c, lambda v: v.get("hostPath", {}).get("path") == "/run/tandem")
    assert {a.runtime_dir for a in mesh.node_agents} == {state}
    devices = max(len(e.devices) for a in mesh.node_agents for e in a.engines)
    assert c["resources"]["limits"]["huawei.com/Ascend910"] >= devices


def test_images_are_pinned_and_the_dockerfile_builds_every_package():
    images = {i["name"]: i for i in kustomization()["images"]}
    for obj in resources():
        if obj["kind"] not in ("StatefulSet", "Deployment", "DaemonSet"):
            continue
        spec = obj["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            image = c["image"]
            if image in images:
                assert images[image]["newTag"] == __version__
            else:
                assert re.fullmatch(r"[\w./-]+:v?\d+(\.\d+)+", image), image
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r"^include = \[(.*)\]", pyproject, re.M).group(1)
    wanted = {p.strip().strip('"').rstrip("*") for p in packages.split(",")}
    copied = set(re.findall(r"^COPY (\w+) \1$", (K8S / "Dockerfile").read_text(), re.M))
    assert wanted | {"protos", "envoy"} == copied


def test_the_keda_example_scales_each_role_on_its_utilisation_gauge(mesh):
    docs = list(yaml.safe_load_all((K8S / "autoscaling" / "keda-pd.yaml").read_text()))
    models = {m.name for m in mesh.models}
    roles = set()
    for doc in docs:
        assert (doc["apiVersion"], doc["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
        assert doc["spec"]["minReplicaCount"] >= 1  # a P/D model keeps one instance of each role
        (trigger,) = doc["spec"]["triggers"]
        assert (trigger["type"], trigger["metricType"]) == ("prometheus", "Value")
        query = trigger["metadata"]["query"]
        found = re.fullmatch(
            r'sum\(tandem_coordinator_pd_utilisation\{model="([^"]+)", role="(prefill|decode)"\}\)', query
        )
        assert found and found.group(1) in models, query
        roles.add(found.group(2))
        assert 0 < float(trigger["metadata"]["threshold"]) <= 1
    assert roles == {"prefill", "decode"}
