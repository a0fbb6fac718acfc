# Sourced by scripts/test (ROOT and die are set). Installs etcd 3.4 (Debian
# `etcd-server`, which also brings etcdctl via `etcd-client`) only if `etcd` is missing,
# and exports FLOCK_ETCD_BIN for flock-bird's registry tests (each test starts its own
# etcd on free ports in a temp data dir).
if ! command -v etcd >/dev/null 2>&1; then
    command -v apt-get >/dev/null || die "need the Debian package etcd-server (no apt-get here)"
    # Wait for another apt/dpkg (unattended upgrades, a parallel job) instead of failing.
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq etcd-server >/dev/null
    # The package enables a system etcd on the default ports; the tests start their own.
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        systemctl disable --now etcd >/dev/null 2>&1 || true
    fi
fi
FLOCK_ETCD_BIN=$(command -v etcd) || die "etcd-server installed but etcd is not on PATH"
export FLOCK_ETCD_BIN
echo "ok: etcd $("$FLOCK_ETCD_BIN" --version | sed -n 's/^etcd Version: //p') at $FLOCK_ETCD_BIN"
