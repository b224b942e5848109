"""Rollout-host side: subscriber loop, task boundaries, fleet ledger.

    from deltafs.watch import Subscriber
    from deltafs.engines import make_engine
    sub = Subscriber(store_url, dest, make_engine("sglang", "http://127.0.0.1:30000"))
"""

from deltafs.watch.boundary import Idle, Immediate, Signal, make_boundary
from deltafs.watch.group import GroupNotReadyError
from deltafs.watch.ledger import FleetReport, HostStatus, fleet_report
from deltafs.watch.subscriber import Applied, NothingVerifiableError, Staged, Subscriber

__all__ = [
           "Applied",
           "FleetReport",
           "GroupNotReadyError",
           "HostStatus",
           "Idle",
           "Immediate",
           "NothingVerifiableError",
           "Signal",
           "Staged",
           "Subscriber",
           "fleet_report",
           "make_boundary",
]
