# Sourced by scripts/test (ROOT and die are set). Installs what flock-cni's tests use,
# idempotently: Debian's CNI plugins (bridge, host-local, ... in /usr/lib/cni), Go and
# libcni's sources, iproute2; then builds the libcni driver (flock-cni/tests/cnitool)
# offline in GOPATH mode into target/cnitool. Exports:
#   FLOCK_CNI_PLUGIN_DIR  directory of the reference CNI plugins (/usr/lib/cni)
#   FLOCK_CNITOOL         the libcni driver binary
cni_packages=(containernetworking-plugins golang-go golang-github-appc-cni-dev iproute2)
cni_missing=()
for p in "${cni_packages[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || cni_missing+=("$p")
done
if ((${#cni_missing[@]})); then
    command -v apt-get >/dev/null || die "need Debian packages: ${cni_missing[*]} (no apt-get here)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${cni_missing[@]}" >/dev/null
fi
FLOCK_CNI_PLUGIN_DIR=/usr/lib/cni
for p in bridge host-local loopback; do
    [ -x "$FLOCK_CNI_PLUGIN_DIR/$p" ] || die "containernetworking-plugins installed but $FLOCK_CNI_PLUGIN_DIR/$p is missing"
done
# GOPATH mode wants the driver under $GOPATH/src/<import path>.
cni_gopath="$ROOT/target/gopath"
mkdir -p "$cni_gopath/src/flock-cnitool"
cp "$ROOT/flock-cni/tests/cnitool/main.go" "$cni_gopath/src/flock-cnitool/main.go"
GOCACHE="$ROOT/target/gocache" GO111MODULE=off GOPROXY=off GOFLAGS= \
    GOPATH="$cni_gopath:/usr/share/gocode" \
    go build -o "$ROOT/target/cnitool" flock-cnitool \
    || die "building the libcni driver (flock-cni/tests/cnitool) failed"
FLOCK_CNITOOL="$ROOT/target/cnitool"
export FLOCK_CNI_PLUGIN_DIR FLOCK_CNITOOL
echo "ok: CNI plugins in $FLOCK_CNI_PLUGIN_DIR, libcni driver $FLOCK_CNITOOL ($(go version | cut -d' ' -f3))"
