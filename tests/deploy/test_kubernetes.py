"""deploy/kubernetes/ (issue 31): each overlay rendered by kustomize and held against the official
Kubernetes API schemas of the three newest minor versions kubernetes-validate ships, and against
the console itself: selectors and labels, images and the version, GPUs, volumes, secrets as files,
security contexts, the network policy's ports. Settings and probes: tests/deploy/test_settings_and_probes.py.
"""
from __future__ import annotations

import copy
import tomllib

import kubernetes_validate
import pytest
from kubernetes_validate import utils as kv_utils

from tests.conftest import REPO
from tests.deploy.manifests import OVERLAYS, containers, find, one, pod_specs, rendered, secret_example

# The three newest minor versions kubernetes-validate 1.37.0 ships schemas for (the first test
# below fails when an upgrade of the package brings newer ones: then move this list).
K8S_VERSIONS = ["1.35.0", "1.36.0", "1.37.0"]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
KINDS = {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "Job",
         "DaemonSet", "NetworkPolicy"}
NAME_LABEL = "app.kubernetes.io/name"
COMPONENT = "app.kubernetes.io/component"


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_the_versions_checked_are_the_three_newest_the_validator_ships():
    shipped = sorted({_minor(v) for v in kv_utils.all_versions()})
    assert [_minor(v) for v in K8S_VERSIONS] == shipped[-3:], f"kubernetes-validate ships {shipped[-5:]}"


@pytest.mark.parametrize("k8s", K8S_VERSIONS, ids=[f"k8s-{v.rsplit('.', 1)[0]}" for v in K8S_VERSIONS])
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_holds_against_the_kubernetes_schemas(overlay, k8s):
    docs = rendered(overlay)
    assert {d["kind"] for d in docs} == KINDS
    for doc in docs:
        # strict: an unknown field (a typo, a field of another version) is an error, not ignored.
        kubernetes_validate.validate(doc, k8s, strict=True)


@pytest.mark.parametrize("k8s", K8S_VERSIONS, ids=[f"k8s-{v.rsplit('.', 1)[0]}" for v in K8S_VERSIONS])
def test_the_secret_example_holds_against_the_kubernetes_schemas(k8s):
    kubernetes_validate.validate(secret_example(), k8s, strict=True)


def test_the_validator_refuses_what_a_cluster_would_refuse():
    # The check itself: a misspelt field, a wrong type and a missing required field are each refused.
    web = one("cpu", "Deployment", "xgen-web")
    typo = copy.deepcopy(web)
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/readyz", "port": 8000}}
    wrong_type = copy.deepcopy(web)
    wrong_type["spec"]["replicas"] = "two"
    no_selector = copy.deepcopy(web)
    del no_selector["spec"]["selector"]
    for broken in (typo, wrong_type, no_selector):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_labels_and_references_agree(overlay):
    pods = pod_specs(overlay)
    assert set(pods) == {"xgen-web", "xgen-agent", "xgen-migrate"}
    components = {name: pod["metadata"]["labels"][COMPONENT] for name, pod in pods.items()}
    assert components == {"xgen-web": "web", "xgen-agent": "agent", "xgen-migrate": "migrate"}
    for doc in rendered(overlay):
        assert doc["metadata"]["labels"][NAME_LABEL] == "xgen-console", doc["metadata"]["name"]
        if doc["kind"] in ("Deployment", "DaemonSet"):
            assert _selects(doc["spec"]["selector"]["matchLabels"], doc["spec"]["template"]["metadata"]["labels"])
    web_labels = pods["xgen-web"]["metadata"]["labels"]

    def selected(selector: dict) -> set[str]:
        return {name for name, pod in pods.items() if _selects(selector, pod["metadata"]["labels"])}

    assert selected(one(overlay, "Service", "xgen-web")["spec"]["selector"]) == {"xgen-web"}
    assert selected(one(overlay, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]) == {"xgen-web"}
    hpa = one(overlay, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "xgen-web"}
    assert hpa["minReplicas"] >= one(overlay, "PodDisruptionBudget")["spec"]["minAvailable"] + 1
    policy = one(overlay, "NetworkPolicy")["spec"]
    assert selected(policy["podSelector"]["matchLabels"]) == {"xgen-agent"}
    assert [selected(peer["podSelector"]["matchLabels"]) for peer in policy["ingress"][0]["from"]] == [{"xgen-web"}]
    assert _selects(policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"], web_labels)
    # The Service's target port is the web container's named port, the probes' too.
    web = pods["xgen-web"]["spec"]["containers"][0]
    port_names = {p["name"] for p in web["ports"]}
    assert one(overlay, "Service")["spec"]["ports"][0]["targetPort"] in port_names
    config = one(overlay, "ConfigMap")["metadata"]["name"]
    secret = secret_example()["metadata"]["name"]
    for name, pod in pods.items():
        for c in containers(pod, init=False):
            assert [src["configMapRef"]["name"] for src in c.get("envFrom", [])] == [config], name
        assert [v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v] == [secret], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_name_this_version(overlay):
    tags = {}
    for name, pod in pod_specs(overlay).items():
        for c in containers(pod):
            repo, _, tag = c["image"].rpartition(":")
            assert repo.endswith("/xgen-console"), f"{name}/{c['name']}: {c['image']} (an image name kustomize left unset?)"
            tags[f"{name}/{c['name']}"] = tag
    # The web and the migration run the CPU image of this version; the agents the overlay's flavour.
    assert tags["xgen-web/web"] == tags["xgen-migrate/migrate"] == VERSION
    flavour = {"cpu": VERSION, "nvidia": f"{VERSION}-cuda", "amd": f"{VERSION}-rocm"}[overlay]
    assert tags["xgen-agent/agent"] == tags["xgen-agent/node-dirs"] == flavour


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_runs_unprivileged(overlay):
    for name, pod in pod_specs(overlay).items():
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] == 10001, name  # the images' USER
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec.get("hostNetwork", False) is False and spec.get("hostPID", False) is False, name
        assert spec["automountServiceAccountToken"] is False, name
        for c in containers(pod):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc.get("privileged", False) is False, (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            if c["name"] == "node-dirs":  # the one root step: give the node's folders to the agent's user
                assert sc["runAsUser"] == 0 and sorted(sc["capabilities"]["add"]) == ["CHOWN", "FOWNER"]
                assert c["command"][:2] == ["install", "-d"] and "10001" in c["command"]
            else:
                assert "runAsUser" not in sc and "add" not in sc["capabilities"], (name, c["name"])
            assert "resources" in c and c["resources"].get("requests"), (name, c["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_web_is_a_scalable_deployment_and_migrations_a_job(overlay):
    web = one(overlay, "Deployment", "xgen-web")["spec"]
    pod = web["template"]["spec"]
    assert "initContainers" not in pod  # the migration is the Job's, once, not every web pod's
    (c,) = pod["containers"]
    assert c["args"][:2] == ["serve", "--no-agent"]
    assert set(c["resources"]["requests"]) == set(c["resources"]["limits"]) == {"cpu", "memory"}
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert web["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    job = one(overlay, "Job", "xgen-migrate")["spec"]
    assert job["template"]["spec"]["containers"][0]["args"] == ["migrate", "--noinput"]
    assert job["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_agent_takes_its_nodes_accelerators(overlay):
    agent = one(overlay, "DaemonSet", "xgen-agent")["spec"]["template"]["spec"]
    c = next(c for c in agent["containers"] if c["name"] == "agent")
    env = {e["name"]: e for e in c["env"]}
    resources = {k for part in c["resources"].values() for k in part}
    # The node's own name and the pod's address (the backends listen there, web pods connect there).
    assert env["XGEN_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["XGEN_NODE_ADDRESS"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    if overlay == "nvidia":
        # Every GPU of the node through the runtime, whatever their number; no count asked.
        assert agent["runtimeClassName"] == "nvidia"
        assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
        assert not any(r.startswith("nvidia.com/") for r in resources)
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in agent["tolerations"]
    elif overlay == "amd":
        assert c["resources"]["requests"]["amd.com/gpu"] == c["resources"]["limits"]["amd.com/gpu"]
        assert "runtimeClassName" not in agent
        # /dev/kfd and /dev/dri/renderD* belong to the nodes' render and video groups: the agent's
        # non-root user needs them (Ubuntu's ids).
        assert agent["securityContext"]["supplementalGroups"] == [44, 109]
        assert agent["securityContext"]["runAsUser"] == 10001
    else:
        assert not any("gpu" in r for r in resources) and "runtimeClassName" not in agent
    # No memory limit: the backends run in this container, and a limit would kill one mid-load.
    assert "memory" not in c["resources"].get("limits", {})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_state_lives_where_it_outlives_the_pod(overlay):
    agent = one(overlay, "DaemonSet", "xgen-agent")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in agent["volumes"]}
    c = next(c for c in agent["containers"] if c["name"] == "agent")
    env = {e["name"]: e.get("value") for e in c["env"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    for setting in ("XGEN_DATA_DIR", "XGEN_MODELS_DIR"):
        volume = volumes[mounts[env[setting]]]
        assert "hostPath" in volume, f"{setting} is on {volume}: it would vanish with the pod"
    # The init container prepares exactly those folders.
    init = next(c for c in agent["initContainers"] if c["name"] == "node-dirs")
    assert {env["XGEN_DATA_DIR"], env["XGEN_MODELS_DIR"]} <= set(init["command"])
    assert {m["mountPath"] for m in init["volumeMounts"]} == {env["XGEN_DATA_DIR"], env["XGEN_MODELS_DIR"]}
    # A read-only root: every other folder a process writes to is a volume.
    assert {"/tmp", "/home/xgen"} <= set(mounts)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_reach_every_process_as_files(overlay):
    from tests.xgenconsole.test_docs_settings import SECRETS

    keys = set(secret_example()["stringData"])
    # Every key is a secret the console reads with env_secret (NAME or NAME_FILE); the ones cluster
    # mode always needs are there (optional ones, e.g. sign-in providers', may be added the same way).
    assert keys <= SECRETS
    assert keys >= {"DATABASE_URL", "REDIS_URL", "XGEN_SECRET_KEY", "MINIO_ACCESS_KEY", "MINIO_SECRET_KEY"}
    for name, pod in pod_specs(overlay).items():
        mount = {v["name"]: v for v in pod["spec"]["volumes"] if "secret" in v}
        for c in containers(pod, init=False):
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            secret_dirs = {m["mountPath"] for m in c["volumeMounts"] if m["name"] in mount and m.get("readOnly")}
            assert len(secret_dirs) == 1, (name, c["name"])
            assert {f"{key}_FILE" for key in keys} <= set(env), (name, c["name"])
            for key in keys:
                assert key not in env, f"{name}: {key} in plain env"
                assert env[f"{key}_FILE"] == f"{next(iter(secret_dirs))}/{key}", (name, c["name"], key)
        assert not any(key in find(overlay, "ConfigMap")[0]["data"] for key in keys)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_web_pods_reach_the_backend_ports(overlay, settings):
    config = one(overlay, "ConfigMap")["data"]
    low = int(config.get("XGEN_BACKEND_PORT_MIN", settings.BACKEND_PORT_MIN))
    high = int(config.get("XGEN_BACKEND_PORT_MAX", settings.BACKEND_PORT_MAX))
    policy = one(overlay, "NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": low, "endPort": high}]
    agent = one(overlay, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert [p["containerPort"] for p in agent["ports"]] == [low]
