#!/usr/bin/env python3
"""Runs the Python client example (chat_client.py) against real kvcache processes.

--target=worker starts one kvcache-worker; --target=router starts two workers and
a kvcache-router over them. Each server listens on port 0 and is stopped at the
end. The example runs a 3-turn chat in APPEND and in FULL_CONTEXT mode with
--check (turns 2 and 3 must report cached tokens). Fails with a clear message
when grpcio or grpcio-tools are missing, or the model file is absent.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

from server_process import Server, fail

PIP_LINE = "pip install grpcio==1.85.1 grpcio-tools==1.85.1"
HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.path.join(HERE, "..", "..", "proto")


def wait_ready(address, timeout=60.0):
    """Polls grpc.health.v1 Check(`readiness`) until SERVING.

    The two tiny messages are encoded by hand: the `grpc` package name of
    health.proto clashes with grpcio's, so its generated stubs cannot be imported.
    """
    import grpc
    service = b"readiness"
    request = b"\x0a" + bytes([len(service)]) + service  # HealthCheckRequest{service}
    serving = b"\x08\x01"  # HealthCheckResponse{status: SERVING}
    channel = grpc.insecure_channel(address)
    check = channel.unary_unary("/grpc.health.v1.Health/Check")
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            resp = check(request, timeout=5, wait_for_ready=True)
            if resp == serving:
                channel.close()
                return
            last = resp.hex()
        except grpc.RpcError as e:
            last = e.code().name
        time.sleep(0.2)  # readiness of an external process: no event to wait on
    fail(f"{address} not ready within {timeout:.0f}s (last: {last})")


# The router's admin token (ListWorkers is an admin call); chat calls go without
# a token, as tenant "default" (--allow_unauthenticated).
ADMIN_TOKEN = "python-test-admin-token"


def wait_workers_serving(address, stubs_dir, count, timeout=60.0):
    """Polls the router's ListWorkers until `count` workers report SERVING."""
    import grpc
    sys.path.insert(0, stubs_dir)
    from kvcache.v1 import router_pb2, router_pb2_grpc
    channel = grpc.insecure_channel(address)
    stub = router_pb2_grpc.KvCacheAdminStub(channel)
    deadline = time.monotonic() + timeout
    health = []
    while time.monotonic() < deadline:
        try:
            workers = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5,
                                       metadata=[("authorization", f"Bearer {ADMIN_TOKEN}")]).workers
            health = [w.health for w in workers]
            if health.count("SERVING") >= count:
                channel.close()
                return
        except grpc.RpcError as e:
            health = [e.code().name]
        time.sleep(0.2)
    fail(f"router {address}: workers not SERVING within {timeout:.0f}s ({health})")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--build_dir", required=True)
    parser.add_argument("--target", choices=["worker", "router"], default="worker")
    parser.add_argument("--model", default=os.environ.get(
        "KVCACHE_MODEL", os.path.expanduser("~/.cache/kvcache/models/SmolLM2-135M-Instruct.Q4_1.gguf")))
    args = parser.parse_args()

    try:
        import grpc  # noqa: F401
        from grpc_tools import protoc
    except ImportError as e:
        fail(f"grpcio/grpcio-tools are not installed ({e}); run scripts/setup.sh or: {PIP_LINE}")
    if not os.path.isfile(args.model):
        fail(f"model {args.model} not found; run scripts/setup.sh")

    with tempfile.TemporaryDirectory(prefix="kvcache_py_test_") as stubs_dir:
        well_known = os.path.join(os.path.dirname(protoc.__file__), "_proto")
        rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{well_known}", f"--python_out={stubs_dir}",
                          f"--grpc_python_out={stubs_dir}", "kvcache/v1/common.proto", "kvcache/v1/worker.proto",
                          "kvcache/v1/router.proto"])
        if rc != 0:
            fail(f"protoc failed on {PROTO_DIR}")

        servers = []
        try:
            n_workers = 2 if args.target == "router" else 1
            for i in range(n_workers):
                w = Server([os.path.join(args.build_dir, "worker", "kvcache-worker"), "--listen=127.0.0.1:0",
                            "--metrics_listen=", f"--worker_id=py-w{i + 1}", f"--model={args.model}", "--threads=1",
                            "--allow_unauthenticated"])
                servers.append(w)
                wait_ready(w.address)
            address = servers[0].address
            if args.target == "router":
                tokens = os.path.join(stubs_dir, "tokens.txt")
                with open(tokens, "w") as f:
                    f.write(f"{ADMIN_TOKEN} default admin\n")
                r = Server([os.path.join(args.build_dir, "router", "kvcache-router"), "--listen=127.0.0.1:0",
                            "--metrics_listen=", "--workers=" + ",".join(s.address for s in servers),
                            "--allow_unauthenticated", f"--auth_tokens_file={tokens}"])
                servers.append(r)
                wait_ready(r.address)
                wait_workers_serving(r.address, stubs_dir, n_workers)
                address = r.address

            for mode in ("append", "full_context"):
                cmd = [sys.executable, os.path.join(HERE, "chat_client.py"), f"--address={address}",
                       f"--target={args.target}", f"--mode={mode}", "--check", f"--stubs_dir={stubs_dir}"]
                print("running:", " ".join(cmd), flush=True)
                result = subprocess.run(cmd, timeout=300)
                if result.returncode != 0:
                    fail(f"chat_client.py --mode={mode} exited {result.returncode}")
        finally:
            for s in reversed(servers):
                s.stop()
    print("PASS")


if __name__ == "__main__":
    main()
