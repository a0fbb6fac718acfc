# Sourced by scripts/test (ROOT and die are set). Installs nftables (Debian `nftables`:
# /usr/sbin/nft) only if it is missing, for flock-capture's tests (the capture table
# applied in real network namespaces). nsenter and unshare come with util-linux.
if ! dpkg -s nftables >/dev/null 2>&1; then
    command -v apt-get >/dev/null || die "need the Debian package nftables (no apt-get here)"
    # Wait for another apt/dpkg (unattended upgrades, a parallel job) instead of failing.
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq nftables >/dev/null
fi
for tool in nft nsenter unshare; do
    PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null || die "$tool is missing (nftables / util-linux)"
done
echo "ok: $(PATH="$PATH:/usr/sbin:/sbin" nft --version)"
