# Sourced by scripts/test (ROOT and die are set). Installs Prometheus (Debian
# `prometheus`) only if `prometheus` is missing, and exports FLOCK_PROMETHEUS_BIN for
# the telemetry test (it starts its own Prometheus on a free port in a temp dir, with
# the shipped recording rules, scraping the agent it starts).
if ! command -v prometheus >/dev/null 2>&1; then
    command -v apt-get >/dev/null || die "need the Debian package prometheus (no apt-get here)"
    # Wait for another apt/dpkg (unattended upgrades, a parallel job) instead of failing.
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    # Only the server: no recommended exporters or web assets beyond the package's own.
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
        --no-install-recommends prometheus >/dev/null
    # The package enables a system Prometheus on :9090; the test starts its own.
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
fi
FLOCK_PROMETHEUS_BIN=$(command -v prometheus) || die "prometheus installed but not on PATH"
export FLOCK_PROMETHEUS_BIN
echo "ok: $("$FLOCK_PROMETHEUS_BIN" --version 2>&1 | head -1) at $FLOCK_PROMETHEUS_BIN"
