"""The fleet ledger: each watcher records its host's status in the store under fleet/<host_id>.json.

One small JSON object per host, overwritten in place (the only objects besides HEAD that are ever
rewritten; nothing reads them to decide what weights to load). `deltafs status` reads them all
and compares each host with HEAD.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import socket
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from deltafs.errors import DeltafsError, UsageError
from deltafs.format.manifest import canonical_json
from deltafs.store.objects import ObjectStore
from deltafs.store.repo import Repository

log = logging.getLogger("deltafs.watch")

FLEET_PREFIX = "fleet"
LEDGER_FORMAT = "deltafs.fleet"
_HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# Watcher states, in the order a healthy cycle goes through them.
STATES = ("starting", "serving", "staging", "waiting", "switching", "degraded", "stopped")


def utcnow() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> _dt.datetime | None:
    if not text:
        return None
    try:
        return _dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc)
    except ValueError:
        return None


def default_host_id() -> str:
    """The host name, made safe for an object key."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "host"
    return name if name[0].isalnum() else "h" + name


def check_host_id(host_id: str) -> str:
    if not _HOST_ID.match(host_id):
        raise UsageError(f"host id {host_id!r} must be 1-128 letters, digits, '.', '_' or '-' and start with a letter or digit")
    return host_id


def ledger_key(host_id: str) -> str:
    return f"{FLEET_PREFIX}/{check_host_id(host_id)}.json"


@dataclass
class HostStatus:
    """What one rollout host serves and how its last sync went."""

    host_id: str
    dest: str
    engine: str  # "sglang", "torch", "none"
    engine_url: str | None = None
    store_id: str | None = None
    state: str = "starting"
    served_version: int | None = None
    staged_version: int | None = None
    last_error: str | None = None
    last_error_at: str | None = None
    failures: int = 0  # consecutive failed cycles; 0 when the last one went through
    last_sync: dict[str, Any] | None = None  # {"version", "pause_s", "sync_s", "at", "fallback"}
    started_at: str = field(default_factory=utcnow)
    updated_at: str = field(default_factory=utcnow)
    hostname: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)

    def to_bytes(self) -> bytes:
        body = {"format": LEDGER_FORMAT, "format_version": 1, **asdict(self)}
        return canonical_json(body)

    @classmethod
    def from_bytes(cls, data: bytes) -> HostStatus:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != LEDGER_FORMAT:
            raise ValueError("not a deltafs fleet record")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


def write_status(objects: ObjectStore, status: HostStatus) -> bool:
    """Record status in the store; a failure is logged, never raised (serving matters more)."""
    status.updated_at = utcnow()
    try:
        objects.put(ledger_key(status.host_id), status.to_bytes())
        return True
    except (DeltafsError, OSError) as exc:
        log.warning("cannot write the fleet ledger entry for %s: %s", status.host_id, exc)
        return False


@dataclass(frozen=True)
class FleetRow:
    status: HostStatus | None
    key: str
    lag: int | None  # versions behind HEAD (None: serves nothing known)
    stale: bool  # no update for longer than stale_after: the watcher may be dead
    problem: str | None  # unreadable record, failures, staleness, in words

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "lag": self.lag, "stale": self.stale, "problem": self.problem}
        out["host"] = asdict(self.status) if self.status else None
        return out


@dataclass(frozen=True)
class FleetReport:
    store_url: str
    head: int | None
    hosts: list[FleetRow]

    @property
    def healthy(self) -> bool:
        return all(r.problem is None for r in self.hosts)

    def to_json(self) -> dict[str, Any]:
        return {"store": self.store_url, "head": self.head, "healthy": self.healthy,
                "hosts": [r.to_json() for r in self.hosts]}


def fleet_report(repo: Repository, *, stale_after: float = 300.0, now: _dt.datetime | None = None) -> FleetReport:
    """Every host's ledger entry compared with HEAD."""
    head = repo.head()
    head_version = head.version if head else None
    now = now or _dt.datetime.now(_dt.timezone.utc)
    rows = []
    for key in repo.objects.list(FLEET_PREFIX):
        if not key.endswith(".json"):
            continue
        try:
            st = HostStatus.from_bytes(repo.objects.get(key))
        except (ValueError, TypeError, DeltafsError) as exc:
            rows.append(FleetRow(None, key, None, False, f"unreadable ledger entry: {exc}"))
            continue
        lag = head_version - st.served_version if head_version is not None and st.served_version is not None else None
        seen = parse_time(st.updated_at)
        stale = st.state != "stopped" and (seen is None or (now - seen).total_seconds() > stale_after)
        problem = None
        if st.store_id is not None and st.store_id != repo.store_id:
            problem = f"records store {st.store_id[:8]}, not this store"
        elif st.failures or st.state == "degraded":
            problem = f"{st.failures} failed sync(s): {st.last_error}"
        elif stale:
            problem = f"no report since {st.updated_at}"
        rows.append(FleetRow(st, key, lag, stale, problem))
    rows.sort(key=lambda r: r.status.host_id if r.status else r.key)
    return FleetReport(repo.url, head_version, rows)
