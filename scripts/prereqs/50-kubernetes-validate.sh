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
