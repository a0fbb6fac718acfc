"""Runs the commands deploy/daemonset.yaml gives its containers against the built
binaries (scripts/validate-manifests --bin-dir DIR), so a flag the binaries do not know
fails here rather than in a crash-looping pod.

Each container's command and args are expanded as the kubelet does: $(VAR) from the
container's env (ConfigMap keys from deploy/configmap.yaml, downward-API fields from
sample values). The envoy-bootstrap init container's script runs for real, into a
temporary directory, and its output must be an Envoy bootstrap naming the agent's xDS
socket. The long-running containers get `--help` appended after their own arguments
(before a `--`): clap parses every argument before it, so an unknown flag or a bad
value exits 2 instead of printing the help (values the binaries read from the
environment are not checked this way).
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import yaml

SAMPLE_FIELDS = {"spec.nodeName": "node-1", "metadata.name": "flock-node-x7k2p"}


def expand(value, env):
    # The kubelet's rule: $(VAR) from the env, $$ escapes, an unknown $(VAR) stays.
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        value,
    )


QUANTITY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
                     "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}


def quantity_bytes(q):
    # A Kubernetes quantity as the downward API gives it with the default divisor 1.
    m = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T|)", str(q))
    if not m:
        sys.exit(f"unsupported quantity {q!r}")
    return str(int(m.group(1)) * QUANTITY_SUFFIXES[m.group(2)])


def resource_field(pod, ref):
    # `resourceFieldRef: {containerName, resource: limits.memory}`: the named
    # container's value from the manifest, in bytes.
    kind, name = ref["resource"].split(".", 1)
    for c in pod.get("initContainers", []) + pod["containers"]:
        if c["name"] == ref["containerName"]:
            return quantity_bytes(c["resources"][kind][name])
    sys.exit(f"resourceFieldRef: no container {ref['containerName']!r}")


def container_env(c, config, pod=None):
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        src = e["valueFrom"]
        if "configMapKeyRef" in src:
            env[e["name"]] = config[src["configMapKeyRef"]["key"]]
        elif "fieldRef" in src:
            env[e["name"]] = SAMPLE_FIELDS[src["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in src and pod is not None:
            env[e["name"]] = resource_field(pod, src["resourceFieldRef"])
        else:
            sys.exit(f"{c['name']}: env {e['name']}: unsupported source {src}")
    return env


def main():
    bin_dir = os.path.abspath(sys.argv[1])
    with open("deploy/daemonset.yaml") as f:
        ds = yaml.safe_load(f)
    with open("deploy/configmap.yaml") as f:
        config = yaml.safe_load(f)["data"]
    pod = ds["spec"]["template"]["spec"]
    agent = next(c for c in pod["containers"] if c["name"] == "agent")
    agent_env = container_env(agent, config, pod)
    agent_args = [expand(a, agent_env) for a in agent["args"]]
    xds = next(a.split("=", 1)[1] for a in agent_args if a.startswith("--xds-socket="))
    failures = []
    for c in pod.get("initContainers", []) + pod["containers"]:
        env = container_env(c, config, pod)
        command = [expand(a, env) for a in c["command"]]
        args = [expand(a, env) for a in c.get("args", [])]
        run_env = dict(os.environ, **env, PATH=f"{bin_dir}:{os.environ['PATH']}")
        if command[0] == "/bin/sh":
            # The bootstrap script, writing into a temporary directory instead of the
            # emptyDir mount.
            mount = next(m["mountPath"] for m in c["volumeMounts"])
            with tempfile.TemporaryDirectory() as tmp:
                script = args[0].replace(mount, tmp)
                r = subprocess.run(["sh", "-c", script], env=run_env, capture_output=True, text=True)
                out = os.path.join(tmp, "envoy.json")
                if r.returncode != 0 or not os.path.exists(out):
                    failures.append(f"{c['name']}: exit {r.returncode}: {r.stderr.strip()}")
                    continue
                with open(out) as f:
                    bootstrap = json.load(f)
                if xds not in json.dumps(bootstrap) or bootstrap["node"]["id"] != SAMPLE_FIELDS["spec.nodeName"]:
                    failures.append(f"{c['name']}: the bootstrap does not name {xds} and node-1: {bootstrap}")
                    continue
                # The envoy container's memory limit reached the overload manager.
                monitors = bootstrap.get("overload_manager", {}).get("resource_monitors", [])
                heap = [m for m in monitors if m["name"] == "envoy.resource_monitors.fixed_heap"]
                limit = env.get("FLOCK_ENVOY_MEMORY_LIMIT")
                if limit and (not heap or heap[0]["typed_config"]["max_heap_size_bytes"] != int(limit) // 100 * 90):
                    failures.append(f"{c['name']}: no heap monitor at 90% of the envoy container's {limit} bytes: {monitors}")
                    continue
            print(f"ok: {c['name']}: writes Envoy's bootstrap for {xds}")
            continue
        if command[0] == "install":
            # Envoy's state directory on the host (envoy-dirs): run for real into a
            # temporary directory; it must end up Envoy's uid's, mode 0700.
            mount = next(m["mountPath"] for m in c["volumeMounts"])
            with tempfile.TemporaryDirectory() as tmp:
                target = os.path.join(tmp, "dir")
                argv = [a.replace(mount, target) for a in command + args]
                r = subprocess.run(argv, capture_output=True, text=True)
                st = os.stat(target) if os.path.isdir(target) else None
                if r.returncode != 0 or st is None or (st.st_uid, st.st_gid, st.st_mode & 0o777) != (1337, 1337, 0o700):
                    failures.append(f"{c['name']}: {argv}: exit {r.returncode} {r.stderr.strip()}, result {st}")
                    continue
            print(f"ok: {c['name']}: makes {mount} uid 1337's, 0700")
            continue
        binary = os.path.join(bin_dir, command[0])
        own = args[: args.index("--")] if "--" in args else args
        r = subprocess.run([binary] + command[1:] + own + ["--help"], env=run_env, capture_output=True, text=True)
        if r.returncode != 0:
            failures.append(f"{c['name']}: {command[0]} refuses its arguments {own}: {r.stderr.strip()}")
            continue
        print(f"ok: {c['name']}: {command[0]} accepts {len(own)} arguments")
    if failures:
        print("\n".join(f"FAILED: {f}" for f in failures), file=sys.stderr)
        sys.exit(1)


main()
