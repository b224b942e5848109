"""Reader side: plan the cheapest chain (folds too), rebuild chunks, pull into DEST, and DEST's layout."""

from deltafs.read.pull import PullResult, local_version, pull

__all__ = ["PullResult", "local_version", "pull"]
