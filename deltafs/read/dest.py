"""A local checkpoint directory managed by deltafs: DEST is a symlink flipped atomically.

Layout beside DEST (for DEST=/models/current):
    /models/current                -> current.deltafs/v0000000042-1a2b3c4d   (symlink)
    /models/current.deltafs/
        v0000000042-1a2b3c4d/       a complete, verified HF checkpoint directory
        v0000000042-1a2b3c4d.json   its state: store id and URL, version, manifest
        staging-<random>/           a pull in progress (removed or reused later)
        chunks/                     fetched, verified chunk objects of an interrupted pull
        lock                        flock(2) of the pull in progress
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import stat
import shutil
import uuid
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator

from deltafs.errors import DestinationError, FormatError, LockHeldError
from deltafs.format.manifest import Manifest, canonical_json
from deltafs.format.records import DEST_STATE_MAX_BYTES, dest_state_bytes, parse_dest_state


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Sibling temp file, fsync, rename, fsync the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(directory)


@dataclass(frozen=True)
class LocalState:
    """What a managed DEST currently holds."""

    store_id: str
    store_url: str
    version: int
    digest: str
    path: str  # the version directory DEST points to
    manifest: Manifest


class LocalCheckpoint:
    """DEST plus its sidecar directory; see the module docstring for the layout."""

    def __init__(self, dest: str) -> None:
        self.dest = os.path.abspath(os.path.expanduser(dest)).rstrip("/")
        self.sidecar = self.dest + ".deltafs"

    # --- reading -------------------------------------------------------------------------
    def state(self) -> LocalState | None:
        """The state of the version DEST points to, or None if DEST is not managed by deltafs."""
        if not os.path.islink(self.dest):
            return None
        target = os.readlink(self.dest)
        name = os.path.basename(target.rstrip("/"))
        version_dir = os.path.join(self.sidecar, name)
        if os.path.dirname(os.path.normpath(os.path.join(os.path.dirname(self.dest), target))) != self.sidecar:
            return None
        try:
            manifest, raw = read_version_state(version_dir)
        except FormatError:
            return None
        if manifest.version != raw["version"]:
            return None
        return LocalState(raw["store_id"], raw["store_url"], int(raw["version"]), raw["digest"], version_dir, manifest)

    def describe_foreign(self) -> str | None:
        """Why DEST cannot simply be replaced, or None if it is absent, empty or ours."""
        if not os.path.lexists(self.dest):
            return None
        if os.path.islink(self.dest):
            return None if self.state() is not None else f"{self.dest} is a symlink deltafs did not make"
        if os.path.isdir(self.dest):
            return None if not os.listdir(self.dest) else f"{self.dest} is a directory with files deltafs did not write"
        return f"{self.dest} is a file"

    # --- writing -------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, *, wait: bool = True, name: str = "lock") -> Iterator[None]:
        """Exclusive per-DEST lock; flock is released by the kernel if the process dies."""
        os.makedirs(self.sidecar, exist_ok=True)
        fd = os.open(os.path.join(self.sidecar, name), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                what = "pushing with this cache" if name == "push.lock" else f"updating {self.dest}"
                raise LockHeldError(f"another deltafs process is {what}") from None
            yield
        finally:
            os.close(fd)

    def new_staging(self) -> str:
        path = os.path.join(self.sidecar, f"staging-{uuid.uuid4().hex[:12]}")
        os.makedirs(path)
        return path

    @property
    def chunk_cache(self) -> str:
        return os.path.join(self.sidecar, "chunks")

    def displace(self) -> None:
        """Move whatever DEST is out of the way into the sidecar (nothing is deleted)."""
        if not os.path.lexists(self.dest):
            return
        if os.path.isdir(self.dest) and not os.path.islink(self.dest) and not os.listdir(self.dest):
            os.rmdir(self.dest)
            return
        os.makedirs(self.sidecar, exist_ok=True)
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
        os.replace(self.dest, os.path.join(self.sidecar, f"displaced-{stamp}-{uuid.uuid4().hex[:6]}"))

    def install(self, staging: str, *, store_id: str, store_url: str, manifest: Manifest) -> str:
        """Make a fully written and verified staging directory the version DEST points to."""
        name = f"v{manifest.version:010d}-{uuid.uuid4().hex[:8]}"
        final = os.path.join(self.sidecar, name)
        state = dest_state_bytes(store_id=store_id, store_url=store_url, version=manifest.version,
                                 digest=manifest.digest, manifest_json=json.loads(manifest.to_bytes()))
        atomic_write(final + ".json", state)
        os.replace(staging, final)
        fsync_dir(self.sidecar)
        if os.path.lexists(self.dest) and not os.path.islink(self.dest):
            self.displace()
        link_tmp = os.path.join(os.path.dirname(self.dest), f".{os.path.basename(self.dest)}.tmp-{uuid.uuid4().hex[:8]}")
        os.symlink(os.path.relpath(final, os.path.dirname(self.dest)), link_tmp)
        os.replace(link_tmp, self.dest)  # the atomic flip
        fsync_dir(os.path.dirname(self.dest))
        return final

    def cleanup(self, keep: int = 2) -> list[str]:
        """Remove stale staging dirs and all but the newest `keep` versions (the current one always stays)."""
        if not os.path.isdir(self.sidecar):
            return []
        current = self.state()
        current_name = os.path.basename(current.path) if current else None
        versions = sorted(
            (n for n in os.listdir(self.sidecar) if n.startswith("v") and os.path.isdir(os.path.join(self.sidecar, n))),
            key=lambda n: os.path.getmtime(os.path.join(self.sidecar, n)),
        )
        keep_names = set(versions[-keep:]) if keep > 0 else set()
        if current_name:
            keep_names.add(current_name)
        removed = []
        for n in os.listdir(self.sidecar):
            full = os.path.join(self.sidecar, n)
            if n.startswith("staging-") or (n.startswith("v") and os.path.isdir(full) and n not in keep_names):
                shutil.rmtree(full, ignore_errors=True)
                removed.append(n)
            elif n.startswith("v") and n.endswith(".json") and n[:-5] not in keep_names:
                os.unlink(full)
            elif n.startswith(".tmp-"):
                os.unlink(full)
        return removed

    def version_dirs(self) -> list[str]:
        if not os.path.isdir(self.sidecar):
            return []
        return sorted(os.path.join(self.sidecar, n) for n in os.listdir(self.sidecar)
                      if n.startswith("v") and os.path.isdir(os.path.join(self.sidecar, n)))


def read_version_state(version_dir: str) -> tuple[Manifest, dict[str, Any]]:
    """The manifest and state record pull wrote beside a version directory (<dir>.json); FormatError if unusable."""
    path = version_dir.rstrip("/") + ".json"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise FormatError(f"no usable deltafs state at {path} ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FormatError(f"{path} is not a regular file")
        data = os.read(fd, DEST_STATE_MAX_BYTES + 1)
    finally:
        os.close(fd)
    raw = parse_dest_state(data)
    manifest = Manifest.from_bytes(canonical_json(raw["manifest"]), where=path)
    return manifest, raw


def weight_version(version: int) -> str:
    """The weight_version string an engine reports for a deltafs version (its number)."""
    return str(int(version))


def find_version_dir(dest: str, version: str) -> str | None:
    """The verified version directory beside DEST whose weight version is `version`, if pull kept it."""
    for path in reversed(LocalCheckpoint(dest).version_dirs()):
        try:
            if weight_version(read_version_state(path)[0].version) == version:
                return path
        except FormatError:
            continue
    return None


def refuse_foreign(local: LocalCheckpoint, store_id: str, force: bool) -> LocalState | None:
    """The usable local state, or an error if DEST holds something that is not ours to replace."""
    state = local.state()
    if state is not None and state.store_id != store_id:
        if not force:
            raise DestinationError(
                f"{local.dest} holds a checkpoint of another store ({state.store_url}, id {state.store_id[:8]}); use --force to replace it"
            )
        return None
    reason = local.describe_foreign()
    if reason and not force:
        raise DestinationError(f"{reason}; use --force to move it aside into {local.sidecar}")
    return state
