"""A kvcache server binary started for a test: listens on 127.0.0.1:0 and prints
`<name> listening grpc=HOST:PORT ...`; `fields` holds that line's KEY=VALUE pairs.
Shared by the Python tests of this folder."""

import queue
import signal
import subprocess
import sys
import threading
import time


def fail(message):
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


class Server:
    """The process runs in its own session; stop() sends SIGTERM, then kills."""

    def __init__(self, argv, timeout=120.0):
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
        lines = queue.Queue()
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + timeout
        self.fields = None
        while self.fields is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                fail(f"{argv[0]} printed no listening line within {timeout:.0f}s")
            if line is None:
                fail(f"{argv[0]} exited ({self.proc.wait()}) before listening")
            if " listening " in line:
                self.fields = dict(f.split("=", 1) for f in line.split() if "=" in f)

    @property
    def address(self):
        """The gRPC host:port."""
        return self.fields["grpc"]

    def _pump(self, lines):
        for line in self.proc.stdout:
            lines.put(line)
        lines.put(None)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
