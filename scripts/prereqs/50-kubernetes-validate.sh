# Sourced by scripts/test. Installs `kubernetes-validate` from PyPI into .venv-kube,
# idempotently, and exports FLOCK_KUBE_VALIDATE. It validates manifests against the
# Kubernetes OpenAPI schemas it bundles (one per minor version), so it needs no network
# and no cluster: scripts/test checks deploy/ with it.
venv="$ROOT/.venv-kube"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check 'kubernetes-validate>=1.33,<2'
fi
FLOCK_KUBE_VALIDATE="$venv/bin/kubernetes-validate"
[ -x "$FLOCK_KUBE_VALIDATE" ] || die "kubernetes-validate installed but $FLOCK_KUBE_VALIDATE is not executable"
export FLOCK_KUBE_VALIDATE
echo "ok: kubernetes-validate $("$FLOCK_KUBE_VALIDATE" --version)"

# The Helm chart's check (scripts/helm-check.py): Helm's own template engine, through
# helm-python-sdk (Apache-2.0; its wheel bundles Helm's Go SDK as a C library: no helm
# binary, no network), and `kubectl kustomize` (kustomize inside kubectl) to render the
# base the chart must match. Debian's kubectl is old (1.20) but its kustomize reads
# what deploy/kustomization.yaml uses (resources, images).
if ! "$venv/bin/python" -c 'import helm_python' 2>/dev/null; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check 'helm-python-sdk==0.2.2'
fi
if ! kubectl kustomize --help >/dev/null 2>&1; then
    command -v apt-get >/dev/null || die "need the Debian package kubernetes-client (no apt-get here)"
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq kubernetes-client >/dev/null
fi
kubectl kustomize --help >/dev/null 2>&1 || die "kubectl kustomize unavailable after installing kubernetes-client"
echo "ok: helm-python-sdk $("$venv/bin/python" -c 'import helm_python as h; print(h.helm_sdk_version())'), kubectl $(kubectl version --client 2>/dev/null | head -1)"
