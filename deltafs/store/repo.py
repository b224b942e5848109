"""A deltafs repository on top of an ObjectStore: config, HEAD, manifests and chunks."""

from __future__ import annotations

import datetime as _dt
import hashlib
import uuid
from typing import Any

from deltafs.errors import (
    ChunkNotFoundError,
    FormatError,
    IntegrityError,
    ObjectNotFoundError,
    StoreNotFoundError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltafs.format.manifest import (
    Head,
    Manifest,
    StoreConfig,
    chunk_key,
    manifest_key,
    parse_manifest_key,
)
from deltafs.store.objects import ObjectStore
from deltafs.store.open import open_objects

CONFIG_KEY = "deltafs.json"
HEAD_KEY = "HEAD"
DEFAULT_CHUNK_BYTES = 4 << 20


def utcnow() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Repository:
    """Typed access to one store. Writers: chunks, then manifest (the commit), then HEAD."""

    def __init__(self, objects: ObjectStore, config: StoreConfig) -> None:
        self.objects = objects
        self.config = config
        self._manifests: dict[int, Manifest] = {}

    @property
    def url(self) -> str:
        return self.objects.url

    @property
    def store_id(self) -> str:
        return self.config.store_id

    # --- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any] | None = None, *, create: bool = False,
             chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Repository:
        """Open the store at url; with create=True make it if it does not exist yet."""
        objects = open_objects(url, storage_options)
        try:
            data = objects.get(CONFIG_KEY)
        except ObjectNotFoundError:
            if not create:
                raise StoreNotFoundError(f"no deltafs store at {url} (push to it first)") from None
            config = StoreConfig(store_id=uuid.uuid4().hex, chunk_bytes=chunk_bytes, created=utcnow())
            objects.put_if_absent(CONFIG_KEY, config.to_bytes())
            data = objects.get(CONFIG_KEY, referenced=True)  # another writer may have created it first
        return cls(objects, StoreConfig.from_bytes(data))

    # --- HEAD and manifests ----------------------------------------------------------------
    def read_head(self) -> Head | None:
        try:
            return Head.from_bytes(self.objects.get(HEAD_KEY))
        except ObjectNotFoundError:
            return None

    def head(self) -> Head | None:
        """The newest committed version.

        HEAD is written after the manifest commits, so it can lag behind by the versions whose
        pusher died in between; probing the next manifest keys finds those.
        """
        head = self.read_head()
        if head is None:
            versions = self.versions()
            if not versions:
                return None
            newest = self.manifest(versions[-1])
            return Head(newest.version, newest.digest)
        newer = [v for v in self.versions(after=head.version)]
        if newer:
            man = self.manifest(newer[-1])
            return Head(man.version, man.digest)
        return head

    def versions(self, after: int | None = None) -> list[int]:
        """Committed version numbers, ascending (from the manifest listing)."""
        out = []
        for key in self.objects.list("manifests"):
            v = parse_manifest_key(key)
            if v is not None and (after is None or v > after):
                out.append(v)
        return sorted(out)

    def manifest(self, version: int) -> Manifest:
        cached = self._manifests.get(version)
        if cached is not None:
            return cached
        key = manifest_key(version)
        try:
            data = self.objects.get(key, referenced=True)
        except ObjectNotFoundError:
            raise VersionNotFoundError(f"version {version} is not in {self.url}") from None
        man = Manifest.from_bytes(data, where=f"manifest of version {version}")
        if man.version != version:
            raise FormatError(f"manifest of version {version} claims to be version {man.version}")
        if man.store_id != self.store_id:
            raise FormatError(f"manifest of version {version} belongs to store {man.store_id}, not {self.store_id}")
        self._manifests[version] = man
        return man

    def manifest_size(self, version: int) -> int:
        return self.objects.size(manifest_key(version))

    def commit(self, man: Manifest) -> int:
        """Create the manifest if its version is free (the commit point), then move HEAD.

        Returns the manifest's size in bytes. Raises VersionConflictError if another writer
        committed that version first.
        """
        data = man.to_bytes()
        if not self.objects.put_if_absent(manifest_key(man.version), data):
            raise VersionConflictError(
                f"version {man.version} was committed by another writer; pull and push again"
            )
        self._manifests[man.version] = man
        self.advance_head(Head(man.version, man.digest))
        return len(data)

    def advance_head(self, head: Head) -> None:
        """Move HEAD forward; never backwards, so a slow writer cannot hide a newer version."""
        current = self.read_head()
        if current is None or current.version < head.version:
            self.objects.put(HEAD_KEY, head.to_bytes())

    # --- chunks ------------------------------------------------------------------------------
    def put_chunk(self, data: bytes, oid: str | None = None) -> tuple[str, bool]:
        """Store a chunk under the sha256 of its bytes (oid, if the caller already hashed them); returns (id, newly_written)."""
        oid = oid or hashlib.sha256(data).hexdigest()
        return oid, self.objects.put_if_absent(chunk_key(oid), data)

    def get_chunk(self, oid: str) -> bytes:
        try:
            data = self.objects.get(chunk_key(oid), referenced=True)
        except ObjectNotFoundError:
            raise ChunkNotFoundError(f"chunk {oid} is missing from {self.url}") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != oid:
            raise IntegrityError(f"chunk {oid} is corrupt", expected=oid, actual=actual)
        return data

    def has_chunk(self, oid: str) -> bool:
        return self.objects.exists(chunk_key(oid))
