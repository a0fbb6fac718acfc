#!/usr/bin/env python3
"""Real gRPC peers for flock-xds's proxyless tests (Python grpcio, C-core xDS resolver).

  grpc_peer.py serve NAME:PORT [NAME:PORT ...]
      One gRPC server per NAME:PORT on 127.0.0.1; method /flock.test.Echo/Who answers
      NAME. Prints "ready" once all listen; exits when stdin closes.
  grpc_peer.py serve-xds NAME ADDRESS
      One proxyless xDS server (gRPC's XdsServer: GRPC_XDS_BOOTSTRAP names its
      bootstrap, which holds server_listener_resource_name_template) on ADDRESS
      (ip:port), with xDS server credentials (TLS as its listener says, plaintext
      fallback); method /flock.test.Echo/Who answers NAME. It serves only once the
      control plane sent its listener. Prints "ready" once started; exits when stdin
      closes.
  grpc_peer.py client TARGET [xds-creds]
      A channel to TARGET (e.g. xds:///greeter.default:50051; GRPC_XDS_BOOTSTRAP names
      the bootstrap file). For every line "call" on stdin, makes one call with a 5 s
      deadline and prints "ok NAME" or "error CODE DETAILS"; for "many N [KEY=VALUE]"
      makes N calls (with that metadata) and prints "tally NAME=COUNT ..." (errors
      as error:CODE=COUNT). Exits when stdin closes. GRPC_PEER_AUTHORITY, if set, is
      the :authority a plain channel sends.

No generated code: the method uses raw bytes, so only grpcio is needed.
"""
import os
import sys
from concurrent import futures

import grpc

METHOD = "/flock.test.Echo/Who"


def serve(specs):
    servers = []
    for spec in specs:
        name, port = spec.rsplit(":", 1)
        handler = grpc.method_handlers_generic_handler(
            "flock.test.Echo",
            {"Who": grpc.unary_unary_rpc_method_handler(
                lambda req, ctx, name=name: name.encode())},
        )
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((handler,))
        bound = server.add_insecure_port("127.0.0.1:%s" % port)
        if bound == 0:
            print("error cannot bind %s" % port, flush=True)
            sys.exit(1)
        server.start()
        servers.append(server)
    print("ready", flush=True)
    sys.stdin.read()
    for s in servers:
        s.stop(0)


def serve_xds(name, address):
    handler = grpc.method_handlers_generic_handler(
        "flock.test.Echo",
        {"Who": grpc.unary_unary_rpc_method_handler(lambda req, ctx: name.encode())},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), xds=True)
    server.add_generic_rpc_handlers((handler,))
    creds = grpc.xds_server_credentials(grpc.insecure_server_credentials())
    if server.add_secure_port(address, creds) == 0:
        print("error cannot bind %s" % address, flush=True)
        sys.exit(1)
    server.start()
    print("ready", flush=True)
    sys.stdin.read()
    server.stop(0)


def client(target, xds_creds=False):
    if xds_creds:
        # TLS as the cluster says (certificates from the bootstrap's providers),
        # plaintext where it says nothing.
        from grpc import experimental

        creds = grpc.xds_channel_credentials(experimental.insecure_channel_credentials())
        channel = grpc.secure_channel(target, creds)
    else:
        # GRPC_PEER_AUTHORITY: the :authority to send (to call through Envoy's
        # outbound listener, which routes by it).
        authority = os.environ.get("GRPC_PEER_AUTHORITY")
        options = [("grpc.default_authority", authority)] if authority else []
        channel = grpc.insecure_channel(target, options=options)
    who = channel.unary_unary(METHOD)
    for line in sys.stdin:
        words = line.split()
        if words and words[0] == "many":
            metadata = [tuple(w.split("=", 1)) for w in words[2:]]
            tally = {}
            for _ in range(int(words[1])):
                try:
                    key = who(b"", timeout=5, metadata=metadata).decode()
                except grpc.RpcError as e:  # noqa: PERF203
                    key = "error:%s" % e.code().name
                tally[key] = tally.get(key, 0) + 1
            print("tally " + " ".join("%s=%d" % kv for kv in sorted(tally.items())), flush=True)
            continue
        if line.strip() != "call":
            print("error INVALID_ARGUMENT unknown command %r" % line.strip(), flush=True)
            continue
        try:
            reply = who(b"", timeout=5)
            print("ok %s" % reply.decode(), flush=True)
        except grpc.RpcError as e:  # noqa: PERF203
            details = (e.details() or "").replace("\n", " ")
            print("error %s %s" % (e.code().name, details), flush=True)
    channel.close()


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "serve":
        serve(sys.argv[2:])
    elif len(sys.argv) == 4 and sys.argv[1] == "serve-xds":
        serve_xds(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "client":
        client(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "client" and sys.argv[3] == "xds-creds":
        client(sys.argv[2], xds_creds=True)
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
