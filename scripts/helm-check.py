"""Checks the Helm chart deploy/helm/flock against the kustomize base deploy/
(scripts/validate-manifests runs it; scripts/prereqs/50-kubernetes-validate.sh installs
what it needs).

Rendering is Helm's own template engine (helm-python-sdk: Helm's Go SDK as a library)
and kustomize's (`kubectl kustomize`), nothing of flock's:

1. `helm lint` finds no error;
2. with the chart's default values it renders exactly the objects of `kubectl
   kustomize deploy/`: the same (apiVersion, kind, namespace, name) set, each object
   equal field for field (comments and key order aside);
3. with every value changed, each lands where it must (namespace of every object, the
   images, the ConfigMap's keys, the CNI plugin's excluded namespaces, the admission
   policy's service account) and the result is valid against the Kubernetes schemas
   (kubernetes-validate --strict);
4. `capture.mode: off` drops the agent's capture flags (the agent refuses them without
   capture), and a mode outside the schema is refused at render time.

Usage: python scripts/helm-check.py   (exit 1 with the difference on failure)
"""

import difflib
import json
import os
import subprocess
import sys
import tempfile

import helm_python as helm
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHART = os.path.join(ROOT, "deploy", "helm", "flock")
BASE = os.path.join(ROOT, "deploy")


def fail(msg):
    sys.exit(f"helm-check: {msg}")


def objects(texts):
    out = {}
    for text in texts:
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            meta = doc.get("metadata", {})
            key = (doc.get("apiVersion"), doc.get("kind"), meta.get("namespace"), meta.get("name"))
            if key in out:
                fail(f"{key} rendered twice")
            out[key] = doc
    return out


def render(values):
    with helm.Chart.load(CHART) as chart:
        return objects(chart.render(values, name="flock", namespace=values.get("namespace", "flock-system")).values())


def kustomize():
    out = subprocess.run(["kubectl", "kustomize", BASE], capture_output=True, text=True)
    if out.returncode != 0:
        fail(f"kubectl kustomize {BASE}: {out.stderr.strip()}")
    return objects([out.stdout])


def dump(o):
    return json.dumps(o, indent=1, sort_keys=True).splitlines()


def containers(objs):
    ds = next(o for k, o in objs.items() if k[1] == "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def main():
    lint = helm.lint(CHART)
    if lint.get("errors") or any(m.get("severity", 0) >= 3 for m in lint.get("messages", [])):
        fail(f"helm lint: {lint}")

    # 2. Defaults: the kustomize base, object for object.
    chart, base = render({}), kustomize()
    if set(chart) != set(base):
        fail(f"objects differ: only in the chart {sorted(set(chart) - set(base))}, "
             f"only in kustomize {sorted(set(base) - set(chart))}")
    for key in sorted(base, key=str):
        if chart[key] != base[key]:
            diff = "\n".join(difflib.unified_diff(dump(base[key]), dump(chart[key]), "kustomize", "helm", lineterm=""))
            fail(f"{key} differs:\n{diff}")
    print(f"ok: helm template (defaults) = kubectl kustomize deploy/: {len(base)} objects")

    # 3. Every value where it belongs.
    values = {
        "namespace": "mesh",
        "image": {"repository": "registry.example/flock", "tag": "1.2.3"},
        "capture": {"mode": "permissive", "kubeletCgroup": "kubepods.slice/kubelet.service"},
        "registry": "etcds://etcd-0.etcd:2379",
        "identity": "spire:/run/spire/sockets/admin.sock",
        "trustDomain": "example.org",
        "excludeNamespaces": ["kube-system", "mesh", "monitoring"],
    }
    objs = render(values)
    for (api, kind, ns, name), o in objs.items():
        if kind in ("Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                    "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
            continue
        if ns != "mesh":
            fail(f"{kind}/{name} is in namespace {ns!r}, not the chart's 'mesh'")
    if ("v1", "Namespace", None, "mesh") not in objs:
        fail("no Namespace 'mesh'")
    images = {c["image"] for o in objs.values() if o["kind"] in ("DaemonSet", "Deployment")
              for c in o["spec"]["template"]["spec"].get("initContainers", []) + o["spec"]["template"]["spec"]["containers"]}
    if images != {"registry.example/flock:1.2.3"}:
        fail(f"images {images}")
    data = objs[("v1", "ConfigMap", "mesh", "flock-agent")]["data"]
    want = {"registry": "etcds://etcd-0.etcd:2379", "identity": "spire:/run/spire/sockets/admin.sock",
            "trust-domain": "example.org", "capture": "permissive",
            "kubelet-cgroup": "kubepods.slice/kubelet.service"}
    if {k: data.get(k) for k in want} != want:
        fail(f"ConfigMap data {data}")
    cs = containers(objs)
    plugin = [a for a in cs["install-cni"]["args"] if a.startswith("--plugin-config=")]
    if len(plugin) != 1 or json.loads(plugin[0].split("=", 1)[1]) != {
            "type": "flock-cni", "agent_socket": "/run/flock/cni.sock",
            "exclude_namespaces": ["kube-system", "mesh", "monitoring"]}:
        fail(f"install-cni plugin config {plugin}")
    binding = objs[("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", None, "flock-agent")]
    if binding["subjects"][0]["namespace"] != "mesh":
        fail(f"ClusterRoleBinding subjects {binding['subjects']}")
    policy = next(o for o in objs.values() if o["kind"] == "ValidatingAdmissionPolicy")
    if "system:serviceaccount:mesh:flock-agent" not in json.dumps(policy):
        fail("the node-patch policy does not name mesh's flock-agent")
    default_signer = render({"namespace": "mesh"})[("v1", "ConfigMap", "mesh", "flock-agent")]["data"]["identity"]
    if default_signer != "flock-ca:https://flock-ca.mesh.svc:8443":
        fail(f"default identity in namespace mesh: {default_signer}")
    excluded = [a for a in containers(render({"namespace": "mesh"}))["install-cni"]["args"]
                if a.startswith("--plugin-config=")]
    if [json.loads(a.split("=", 1)[1])["exclude_namespaces"] for a in excluded] != [["kube-system", "mesh"]]:
        fail(f"in namespace mesh the plugin does not exclude it: {excluded}")
    validate = os.environ.get("FLOCK_KUBE_VALIDATE", os.path.join(ROOT, ".venv-kube", "bin", "kubernetes-validate"))
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, o in enumerate(objs.values()):
            path = os.path.join(tmp, f"{i}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(o, f)
            files.append(path)
        out = subprocess.run([validate, "--strict", "--kubernetes-version", "1.33.0", *files],
                             capture_output=True, text=True)
        if out.returncode != 0:
            fail(f"kubernetes-validate on the non-default render:\n{out.stdout}{out.stderr}")
    print(f"ok: every value lands where it belongs, and the result validates ({len(objs)} objects)")

    # 4. Capture off: no capture flags for the agent; a bad mode is refused.
    agent_args = containers(render({"capture": {"mode": "off", "kubeletCgroup": "x"}}))["agent"]["args"]
    if any(a.startswith("--capture") for a in agent_args):
        fail(f"capture off still passes {[a for a in agent_args if a.startswith('--capture')]}")
    try:
        render({"capture": {"mode": "maybe", "kubeletCgroup": "x"}})
    except Exception as e:  # the SDK raises its own error types
        if "maybe" not in str(e) and "mode" not in str(e):
            fail(f"a bad capture mode was refused for another reason: {e}")
    else:
        fail("capture.mode 'maybe' rendered")
    print("ok: capture.mode off drops the capture flags; a bad mode is refused")


if __name__ == "__main__":
    main()
