#!/usr/bin/env python3
"""Real gRPC peers for flock-xds's proxyless tests (Python grpcio, C-core xDS resolver).

  grpc_peer.py serve NAME:PORT [NAME:PORT ...]
      One gRPC server per NAME:PORT on 127.0.0.1; method /flock.test.Echo/Who answers
      NAME. Prints "ready" once all listen; exits when stdin closes.
  grpc_peer.py client TARGET
      A channel to TARGET (e.g. xds:///greeter.default:50051; GRPC_XDS_BOOTSTRAP names
      the bootstrap file). For every line "call" on stdin, makes one call with a 5 s
      deadline and prints "ok NAME" or "error CODE DETAILS"; for "many N [KEY=VALUE]"
      makes N calls (with that metadata) and prints "tally NAME=COUNT ..." (errors
      as error:CODE=COUNT). Exits when stdin closes.

No generated code: the method uses raw bytes, so only grpcio is needed.
"""
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


def client(target):
    channel = grpc.insecure_channel(target)
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
    elif len(sys.argv) == 3 and sys.argv[1] == "client":
        client(sys.argv[2])
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
