"""S3 through s3fs: conditional create with If-None-Match, so two writers cannot claim one version."""

from __future__ import annotations

from deltafs.store.objects import ObjectStore


class S3ObjectStore(ObjectStore):
    """s3:// buckets (AWS, MinIO, moto, any S3-compatible server)."""
