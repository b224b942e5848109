"""A real S3 server on 127.0.0.1 for tests and benchmarks: moto's standalone server.

Two ways to run it: in a thread of this process (fast to start; what the test session shares),
or in a child process (its own interpreter, so it does not compete for our GIL, it can be killed
to simulate a dead server, and its settings such as authentication are its own).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

# Any key works on moto unless authentication is switched on; real-looking values keep botocore happy.
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def quiet_logs() -> None:
    """moto logs every request through werkzeug; keep test output readable."""
    for name in ("werkzeug", "moto", "botocore", "aiobotocore"):
        logging.getLogger(name).setLevel(logging.ERROR)


@dataclass
class S3Server:
    """A running moto server; storage_options() is what deltafs/s3fs need to reach it."""

    endpoint_url: str
    _thread_server: Any = field(default=None, repr=False)
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        options: dict[str, Any] = {
            "key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": self.endpoint_url,
            "client_kwargs": {"region_name": REGION},
        }
        options.update(extra)
        return options

    def client(self) -> Any:
        """A plain boto3 client, for setup steps that are not deltafs's business (buckets)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION)

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"deltafs-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API)."""
        import requests

        requests.post(f"{self.endpoint_url}/moto-api/reset", timeout=30).raise_for_status()

    def enable_auth(self) -> None:
        """Make the server check credentials (only for a server that runs in its own process)."""
        import requests

        if self._process is None:
            raise RuntimeError("enable_auth changes moto's global settings: use a process server")
        requests.post(f"{self.endpoint_url}/moto-api/reset-auth", data=b"0",
                      timeout=30).raise_for_status()

    def stop(self) -> None:
        if self._thread_server is not None:
            self._thread_server.stop()
            self._thread_server = None
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=30)
            self._process = None


def start_thread_server() -> S3Server:
    """moto in a daemon thread of this process, on a free port of 127.0.0.1."""
    from moto.server import ThreadedMotoServer

    quiet_logs()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return S3Server(endpoint_url=f"http://{host}:{port}", _thread_server=server)


def start_process_server(timeout: float = 60.0) -> S3Server:
    """moto in a child process (python -m moto.server), on a free port of 127.0.0.1."""
    port = free_port()
    env = dict(os.environ)
    env.setdefault("AWS_DEFAULT_REGION", REGION)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    server = S3Server(endpoint_url=f"http://127.0.0.1:{port}", _process=proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return server
        except OSError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"moto server did not listen on port {port} within {timeout:.0f}s")


class FlakyProxy:
    """A TCP proxy in front of a server that misbehaves on purpose, for fault tests.

    The first `drop` connections are closed as soon as the client has sent its request (a server
    that drops connections); the next `cut` are forwarded but closed after `cut_after` bytes of
    the answer (a transfer that breaks mid-way). Later connections are passed through, each block
    of an answer `delay` seconds late (a slow server). With `stall_puts_to`, a request of method
    `stall_method` (PUT) whose request line holds that marker is swallowed and its connection held open
    with no answer until close() (a server that stopped answering in the middle of uploads); `stalled`
    counts them.
    """

    def __init__(self, upstream_url: str, *, drop: int = 0, cut: int = 0, cut_after: int = 2048,
                 delay: float = 0.0, stall_puts_to: bytes | None = None, stall_method: bytes = b"PUT") -> None:
        host_port = upstream_url.split("://", 1)[-1].rstrip("/")
        host, _, port = host_port.partition(":")
        self.upstream = (host, int(port))
        self.drop, self.cut, self.cut_after, self.delay = drop, cut, cut_after, delay
        self.stall_puts_to, self.stall_method = stall_puts_to, stall_method + b" "
        self.stalled = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.endpoint_url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                n = self.connections
                self.connections += 1
            threading.Thread(target=self._serve, args=(client, n), daemon=True).start()

    def _serve(self, client: socket.socket, n: int) -> None:
        if n < self.drop:
            try:
                client.settimeout(5)
                client.recv(65536)
            except OSError:
                pass
            client.close()
            return
        limit = self.cut_after if n < self.drop + self.cut else None
        try:
            upstream = socket.create_connection(self.upstream, timeout=30)
        except OSError:
            client.close()
            return
        threading.Thread(target=_pipe, args=(client, upstream, None, 0.0, self._stalls), daemon=True).start()
        _pipe(upstream, client, limit, self.delay)

    def _stalls(self, block: bytes) -> bool:
        """Whether a block the client sends starts a request this proxy never answers (it then holds the line)."""
        if self.stall_puts_to is None or not block.startswith(self.stall_method):
            return False
        if self.stall_puts_to not in block.split(b"\r\n", 1)[0]:
            return False
        with self._lock:
            self.stalled += 1
        while not self._closed:
            time.sleep(0.05)
        return True

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def _pipe(src: socket.socket, dst: socket.socket, limit: int | None, delay: float = 0.0,
          stalls: Any = None) -> None:
    """Copy src to dst until EOF, or until limit bytes, then close both; stalls(block): True to stop there (the
    block is not forwarded)."""
    sent = 0
    try:
        while limit is None or sent < limit:
            data = src.recv(65536 if limit is None else min(65536, limit - sent))
            if not data:
                break
            if stalls is not None and stalls(data):
                break
            if delay:
                time.sleep(delay)
            dst.sendall(data)
            sent += len(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def hanging_endpoint() -> tuple[str, socket.socket]:
    """A port that accepts connections and never answers: (endpoint_url, listener to close)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    return f"http://127.0.0.1:{listener.getsockname()[1]}", listener
