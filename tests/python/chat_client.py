#!/usr/bin/env python3
"""A multi-turn chat with kvcache over gRPC, from Python.

Copy this file to call kvcache from a Python service. It shows the whole public
API flow for a conversation:

  1. generate Python stubs from kvcache's .proto files (grpc_tools.protoc),
  2. open a channel (plain or TLS) and wait until it connects,
  3. send turn 1 as a FULL_CONTEXT request with chat messages and a session id,
  4. send later turns either as APPEND (only the new user message; the server
     keeps the conversation in its KV cache) or as FULL_CONTEXT (the whole
     history again, as OpenAI-style clients do; the server finds the cached
     prefix itself),
  5. stream the reply tokens as they arrive and read the usage in the final
     message (prompt, cached, restored and generated tokens, time to first token),
  6. close the session when the conversation is over.

Requirements: Python 3.8+, `pip install grpcio==1.85.1 grpcio-tools==1.85.1`
(grpcio-tools brings the matching `protobuf` package). Nothing is committed
from the generated code: stubs are generated into a temporary folder at start,
or into --stubs_dir when given (reused if already there).

Usage:
  python3 chat_client.py --address=127.0.0.1:7000                  # the router
  python3 chat_client.py --address=127.0.0.1:7101 --target=worker  # one worker
  python3 chat_client.py --mode=full_context --check               # resend history

Options --token (sent as `authorization: Bearer <token>`) and --tls_ca (PEM
roots; TLS when set) match the router's --auth_tokens_file and --tls_cert.
Exit status: 0 success, 1 a call or --check failed, 2 the server is unreachable.
"""

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time
import uuid

try:
    import grpc
    from grpc_tools import protoc
except ImportError as e:  # pragma: no cover - depends on the machine
    sys.exit(f"chat_client.py needs grpcio and grpcio-tools ({e}); "
             "install them with: pip install grpcio==1.85.1 grpcio-tools==1.85.1")

# proto/ of this repository, relative to this file (tests/python/).
DEFAULT_PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto")
PROTO_FILES = ["kvcache/v1/common.proto", "kvcache/v1/worker.proto", "kvcache/v1/router.proto"]

QUESTIONS = [
    "Name three primary colours.",
    "Which of them is the colour of the sky?",
    "Write one short sentence about that colour.",
]


def load_stubs(proto_dir, stubs_dir=None):
    """Generates (if needed) and imports the kvcache stubs.

    Returns the generated modules (common_pb2, worker_pb2, worker_pb2_grpc,
    router_pb2_grpc), in the package `kvcache.v1` like the .proto files.
    GenerateRequest and friends are in common_pb2, SessionRequest in worker_pb2.
    """
    if stubs_dir is None:
        stubs_dir = tempfile.mkdtemp(prefix="kvcache_stubs_")
        atexit.register(shutil.rmtree, stubs_dir, ignore_errors=True)
    if not os.path.exists(os.path.join(stubs_dir, "kvcache", "v1", "router_pb2_grpc.py")):
        os.makedirs(stubs_dir, exist_ok=True)
        # The first argument is argv[0]; -I also makes protoc's bundled
        # well-known types available to imports.
        well_known = os.path.join(os.path.dirname(protoc.__file__), "_proto")
        rc = protoc.main(["grpc_tools.protoc", f"-I{proto_dir}", f"-I{well_known}",
                          f"--python_out={stubs_dir}", f"--grpc_python_out={stubs_dir}", *PROTO_FILES])
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc}) on {proto_dir}")
    if stubs_dir not in sys.path:
        sys.path.insert(0, stubs_dir)
    from kvcache.v1 import common_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402
    return common_pb2, worker_pb2, worker_pb2_grpc, router_pb2_grpc


def open_channel(address, tls_ca=None, connect_timeout=5.0):
    """Opens a channel and waits until it is connected (None when it does not)."""
    if tls_ca:
        with open(tls_ca, "rb") as f:
            channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=f.read()))
    else:
        channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=connect_timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        return None
    return channel


def generate(stub, request, metadata, timeout):
    """Runs one Generate call, printing token text as it streams in.

    Returns (reply_text, final) where `final` is GenerateResponse.Final.
    Raises grpc.RpcError when the call fails.
    """
    reply, final = [], None
    for msg in stub.Generate(request, metadata=metadata, timeout=timeout):
        if msg.HasField("token"):
            reply.append(msg.token.text)
            print(msg.token.text, end="", flush=True)
        elif msg.HasField("final"):
            final = msg.final
    print()
    return "".join(reply), final


def describe_usage(final):
    u = final.usage
    return (f"usage: worker={final.worker_id} prompt_tokens={u.prompt_tokens} "
            f"cached_tokens={u.cached_tokens} restored_tokens={u.restored_tokens} "
            f"generated_tokens={u.generated_tokens} "
            f"ttft={u.time_to_first_token_us / 1000:.1f}ms total={u.total_time_us / 1000:.1f}ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="127.0.0.1:7000", help="host:port of the router (or worker)")
    parser.add_argument("--target", choices=["router", "worker"], default="router",
                        help="router: kvcache.v1.KvCache; worker: kvcache.v1.Worker (direct)")
    parser.add_argument("--mode", choices=["append", "full_context"], default="append",
                        help="how turns after the first are sent")
    parser.add_argument("--turns", type=int, default=3, help=f"turns to run (at most {len(QUESTIONS)})")
    parser.add_argument("--system", default="You are a concise assistant.", help="system prompt")
    parser.add_argument("--max_tokens", type=int, default=32, help="tokens per reply at most")
    parser.add_argument("--session", default=None, help="session id (default: a random one)")
    parser.add_argument("--token", default=None, help="bearer token")
    parser.add_argument("--tls_ca", default=None, help="PEM CA file; TLS when set")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per call")
    parser.add_argument("--proto_dir", default=DEFAULT_PROTO_DIR, help="folder holding kvcache/v1/*.proto")
    parser.add_argument("--stubs_dir", default=None, help="where to generate stubs (default: a temp folder)")
    parser.add_argument("--check", action="store_true",
                        help="fail unless every turn after the first reports cached_tokens > 0")
    args = parser.parse_args()
    turns = max(1, min(args.turns, len(QUESTIONS)))

    common_pb2, worker_pb2, worker_pb2_grpc, router_pb2_grpc = load_stubs(args.proto_dir, args.stubs_dir)
    channel = open_channel(args.address, args.tls_ca)
    if channel is None:
        print(f"chat_client.py: cannot reach {args.target} at {args.address}", file=sys.stderr)
        return 2
    # The router's KvCache and the worker's Worker service take the same messages.
    stub = router_pb2_grpc.KvCacheStub(channel) if args.target == "router" else worker_pb2_grpc.WorkerStub(channel)
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else []
    session_id = args.session or f"py-{uuid.uuid4().hex[:12]}"

    history = [common_pb2.ChatMessage(role="system", content=args.system)]
    failures = []
    try:
        for turn in range(1, turns + 1):
            question = QUESTIONS[turn - 1]
            user = common_pb2.ChatMessage(role="user", content=question)
            if turn == 1 or args.mode == "full_context":
                mode, messages = common_pb2.FULL_CONTEXT, history + [user]
            else:
                mode, messages = common_pb2.APPEND, [user]
            request = common_pb2.GenerateRequest(
                session_id=session_id,
                mode=mode,
                input=common_pb2.Input(chat=common_pb2.ChatMessages(messages=messages)),
                sampling=common_pb2.SamplingParams(max_tokens=args.max_tokens),  # greedy
            )
            print(f"--- turn {turn} ({common_pb2.Mode.Name(mode)})")
            print(f"user: {question}")
            print("assistant: ", end="", flush=True)
            started = time.monotonic()
            reply, final = generate(stub, request, metadata, args.timeout)
            print(describe_usage(final) + f" wall={1000 * (time.monotonic() - started):.1f}ms")
            history += [user, common_pb2.ChatMessage(role="assistant", content=reply)]
            if args.check and turn > 1 and final.usage.cached_tokens <= 0:
                failures.append(f"turn {turn} reused no cached tokens")
    except grpc.RpcError as e:
        print(f"\nchat_client.py: Generate failed: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        # Free the session's KV pages; a conversation that continues later would
        # keep it instead.
        try:
            stub.CloseSession(worker_pb2.SessionRequest(session_id=session_id), metadata=metadata,
                              timeout=args.timeout)
        except grpc.RpcError:
            pass
        channel.close()
    for f in failures:
        print(f"chat_client.py: check failed: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
