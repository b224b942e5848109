"""The fleet ledger: each watcher records its host's status in the store under fleet/<host_id>.json.

One small JSON object per host, overwritten in place (the only objects besides HEAD that are ever
rewritten; nothing reads them to decide what weights to load). `deltafs status` reads them all
and compares each host with HEAD.
"""

from __future__ import annotations

import datetime as _dt
import logging
import re
import socket
from dataclasses import asdict, dataclass
from typing import Any

from deltafs.defaults import DEFAULT_HOST_STALE_AFTER
from deltafs.errors import DeltafsError, UsageError
from deltafs.format.keys import FLEET_PREFIX, check_host_id, fleet_key
from deltafs.format.records import FLEET_FORMAT, FLEET_MAX_BYTES, HostStatus, parse_timestamp, utcnow
from deltafs.store.base import ObjectStore
from deltafs.store.repo import Repository

log = logging.getLogger("deltafs.watch")

LEDGER_FORMAT = FLEET_FORMAT

# Watcher states, in the order a healthy cycle goes through them, then the ones that need attention.
STATES = ("starting", "serving", "staging", "waiting", "waiting-group", "switching", "needs-restart", "degraded",
          "stopped")
CHECKSUMS_KEPT = 8  # loaded-weight checksums per host, newest versions


def parse_time(text: str | None) -> _dt.datetime | None:
    seconds = parse_timestamp(text)  # the one timestamp format (older records: whole seconds)
    return None if seconds is None else _dt.datetime.fromtimestamp(seconds, _dt.timezone.utc)


def default_host_id() -> str:
    """The host name, made safe for an object key."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "host"
    return name if name[0].isalnum() else "h" + name


def ledger_key(host_id: str) -> str:
    return fleet_key(host_id)


def record_checksum(status: HostStatus, version: int, checksum: str | None) -> None:
    """Keep the engine's loaded-weight checksum of a version (the newest CHECKSUMS_KEPT)."""
    if not checksum:
        return
    status.checksums[str(version)] = checksum
    for old in sorted(status.checksums, key=int)[:-CHECKSUMS_KEPT]:
        del status.checksums[old]


def read_statuses(objects: ObjectStore) -> list[tuple[str, HostStatus | None, str | None]]:
    """Every ledger entry: (key, status or None, why it is unreadable)."""
    out: list[tuple[str, HostStatus | None, str | None]] = []
    for key in objects.list(FLEET_PREFIX):
        if not key.endswith(".json"):
            continue
        try:
            out.append((key, HostStatus.from_bytes(objects.get(key, limit=FLEET_MAX_BYTES)), None))
        except (ValueError, TypeError, DeltafsError) as exc:
            out.append((key, None, str(exc)))
    return out


def prune_statuses(objects: ObjectStore, older_than: float, *, now: _dt.datetime | None = None) -> list[str]:
    """Delete the ledger entries of hosts silent for more than older_than seconds; their host ids.

    Retired hosts otherwise stay in `deltafs status` forever. Unreadable entries are left for a person.
    """
    if not older_than > 0:
        raise UsageError("--prune-after must be a positive number of seconds")
    now = now or _dt.datetime.now(_dt.timezone.utc)
    pruned = []
    for key, st, _ in read_statuses(objects):
        if st is None:
            continue
        seen = parse_time(st.updated_at)
        if seen is not None and (now - seen).total_seconds() > older_than:
            objects.delete(key)
            pruned.append(st.host_id)
    return pruned


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
    head_object: int | None = None  # the version the HEAD object names: below head while it lags (a push that
    #                                  committed but died or could not write HEAD after its manifest)
    head_problem: str | None = None  # HEAD names a version that is not in the store, or another manifest's digest

    @property
    def healthy(self) -> bool:
        return self.head_problem is None and all(r.problem is None for r in self.hosts)

    def to_json(self) -> dict[str, Any]:
        return {"store": self.store_url, "head": self.head, "head_object": self.head_object,
                "head_problem": self.head_problem, "healthy": self.healthy, "hosts": [r.to_json() for r in self.hosts]}


# How far in the future a record's time may be (clocks of different hosts never agree exactly) before the record
# no longer counts as a sign of life: a host whose clock runs an hour ahead would otherwise look alive for an hour
# after it died.
CLOCK_AHEAD_TOLERANCE = 60.0


def fleet_report(repo: Repository, *, stale_after: float = DEFAULT_HOST_STALE_AFTER, now: _dt.datetime | None = None) -> FleetReport:
    """Every host's ledger entry compared with HEAD."""
    head, stored = repo.heads()
    head_version = head.version if head else None
    head_problem = None
    if head is not None:  # as pull checks it (exit 4 or 5 there): a fleet cannot follow a HEAD that is wrong
        wrong = repo.head_error(head)
        head_problem = str(wrong) if wrong is not None else None
    now = now or _dt.datetime.now(_dt.timezone.utc)
    rows = []
    statuses = read_statuses(repo.objects)
    disagree = _checksum_disagreements([st for _, st, _ in statuses if st is not None])
    for key, st, unreadable in statuses:
        if st is None:
            rows.append(FleetRow(None, key, None, False, f"unreadable ledger entry: {unreadable}"))
            continue
        lag = head_version - st.served_version if head_version is not None and st.served_version is not None else None
        seen = parse_time(st.updated_at)
        age = (now - seen).total_seconds() if seen is not None else None
        ahead = age is not None and age < -CLOCK_AHEAD_TOLERANCE  # "fresh" until this host's clock catches up
        stale = st.state != "stopped" and (age is None or age > stale_after or ahead)
        problem = None
        if ahead:
            assert age is not None
            problem = (f"its last report is dated {-age:.0f}s in the future ({st.updated_at}): its clock runs ahead, "
                       "so whether it is alive cannot be told (synchronize the clocks, e.g. chrony)")
        elif st.store_id is not None and st.store_id != repo.store_id:
            problem = f"records store {st.store_id[:8]}, not this store"
        elif st.needs_restart:
            problem = (f"version {st.needs_restart.get('version')} needs an engine restart "
                       f"({st.needs_restart.get('reason')}); start it with: deltafs launch-args {st.dest}")
        elif st.failures or st.state == "degraded":
            problem = f"{st.failures} failed sync(s): {st.last_error}"
        elif stale:
            problem = f"no report since {st.updated_at}"
        elif st.host_id in disagree:
            problem = disagree[st.host_id]
        rows.append(FleetRow(st, key, lag, stale, problem))
    rows.sort(key=lambda r: r.status.host_id if r.status else r.key)
    return FleetReport(repo.url, head_version, rows, stored.version if stored else None, head_problem)


def _checksum_disagreements(statuses: list[HostStatus]) -> dict[str, str]:
    """host_id -> problem, for hosts whose loaded weights differ from another host's for the version both serve."""
    by_version: dict[int, dict[str, list[str]]] = {}
    for st in statuses:
        if st.served_version is None:
            continue
        checksum = st.checksums.get(str(st.served_version))
        if checksum:
            by_version.setdefault(st.served_version, {}).setdefault(checksum, []).append(st.host_id)
    out: dict[str, str] = {}
    for version, groups in by_version.items():
        if len(groups) < 2:
            continue
        for checksum, hosts in groups.items():
            others = sorted(h for c, hs in groups.items() if c != checksum for h in hs)
            out.update({h: f"loaded weights of version {version} differ from {', '.join(others)} "
                           f"(checksum {checksum[:12]})" for h in hosts})
    return out


# Keys, the timestamp and host-id rules live in deltafs.format; the watcher's callers use them from here.
__all__ = ["CHECKSUMS_KEPT", "CLOCK_AHEAD_TOLERANCE", "FLEET_PREFIX", "LEDGER_FORMAT", "STATES", "FleetReport", "FleetRow", "HostStatus",
           "check_host_id", "default_host_id", "fleet_report", "ledger_key", "parse_time", "prune_statuses",
           "read_statuses", "record_checksum", "utcnow", "write_status"]
