"""Multi-node engines: one SGLang engine spread over N hosts (--nnodes N) that each load model_path from their own disk.

Every host runs a watcher with the same --engine-group NAME and --engine-hosts N, and the same DEST
path. Each stages versions and records them in the fleet ledger; the one watcher with --engine-url
(the host serving SGLang's HTTP API) switches only once all N hosts have the version staged, and
sends a path that is the same on every host: DEST.deltafs/by-version/v<N>, a symlink each watcher
keeps to its own verified version directory.
"""

from __future__ import annotations

import datetime as _dt
import os
import uuid

from deltafs.errors import NotReadyError
from deltafs.read.dest import LocalCheckpoint
from deltafs.store.base import ObjectStore
from deltafs.watch.ledger import CLOCK_AHEAD_TOLERANCE, HostStatus, parse_time, read_statuses

BY_VERSION = "by-version"


class GroupNotReadyError(NotReadyError):
    """Not every host of the engine group has staged the version yet (exit 11)."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        self.timed_out = timed_out
        super().__init__(message)


def by_version(dest: str, version: int | None = None) -> str:
    """DEST.deltafs/by-version, or with a version its link there, DEST.deltafs/by-version/v<version>."""
    links = os.path.join(LocalCheckpoint(dest).sidecar, BY_VERSION)
    return links if version is None else os.path.join(links, f"v{int(version)}")


def stable_path(dest: str, version: int, version_dir: str) -> str:
    """DEST.deltafs/by-version/v<version>, a symlink to version_dir; the same path on every host."""
    links = by_version(dest)
    os.makedirs(links, exist_ok=True)
    link = by_version(dest, version)
    rel = os.path.relpath(os.path.realpath(version_dir), os.path.realpath(links))
    if not (os.path.islink(link) and os.readlink(link) == rel):
        tmp = os.path.join(links, f".tmp-{uuid.uuid4().hex[:8]}")
        os.symlink(rel, tmp)
        os.replace(tmp, link)
    for name in os.listdir(links):  # versions pull has cleaned up since
        path = os.path.join(links, name)
        if os.path.islink(path) and not os.path.exists(path):
            os.unlink(path)
    return link


def held_versions(dest: str) -> list[int]:
    """The versions DEST.deltafs/by-version/ links to a version directory that is still there, ascending."""
    links = by_version(dest)
    try:
        names = os.listdir(links)
    except OSError:
        return []
    return sorted(int(n[1:]) for n in names if n[:1] == "v" and n[1:].isdigit() and os.path.isdir(os.path.join(links, n)))


def group_members(objects: ObjectStore, group: str, *, store_id: str | None, fresh_within: float = 300.0,
                  now: _dt.datetime | None = None) -> list[HostStatus]:
    """The group's hosts with a live ledger entry of this store: not stopped, heard from within fresh_within
    seconds, and not dated in the future (a clock running ahead cannot vouch that it is alive)."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    members: list[HostStatus] = []
    for _, st, _ in read_statuses(objects):
        if st is None or st.engine_group != group or (store_id and st.store_id and st.store_id != store_id):
            continue
        seen = parse_time(st.updated_at)
        age = (now - seen).total_seconds() if seen is not None else None
        if st.state == "stopped" or age is None or age > fresh_within or age < -CLOCK_AHEAD_TOLERANCE:
            continue
        members.append(st)
    return members


def ready_hosts(objects: ObjectStore, group: str, version: int, *, store_id: str | None,
                fresh_within: float = 300.0, now: _dt.datetime | None = None) -> tuple[set[str], list[HostStatus]]:
    """Hosts of the group (live ledger entries of this store) whose DEST.deltafs/by-version/v<version> is there to
    load, and all members. A host that holds a newer version only is not ready: it may have skipped this one, or
    cleaned it up, and the engine would load a path that host does not have. (A record without `held`, from an
    older watcher, counts when it has this very version staged or served.)"""
    members = group_members(objects, group, store_id=store_id, fresh_within=fresh_within, now=now)
    ready = {st.host_id for st in members
             if version in (st.held if st.held is not None else (st.staged_version, st.served_version))}
    return ready, members
