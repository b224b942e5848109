"""A deltafs repository on top of an ObjectStore: config, HEAD, manifests and chunks."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
import uuid
from typing import Any, Callable

from deltafs.errors import (
    ChunkNotFoundError,
    DeltafsError,
    FormatError,
    IntegrityError,
    ObjectNotFoundError,
    StoreError,
    StoreNotFoundError,
    UsageError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltafs.format.keys import CONFIG_KEY, HEAD_KEY, MANIFEST_PREFIX, chunk_key, manifest_key, parse_manifest_key
from deltafs.format.manifest import Manifest
from deltafs.format.versions import check_version
from deltafs.format.records import (
    CONFIG_MAX_BYTES,
    HEAD_MAX_BYTES,
    MANIFEST_MAX_BYTES,
    Head,
    StoreConfig,
    utcnow,
)
from deltafs.store.base import ObjectStore
from deltafs.store.open import open_objects

DEFAULT_CHUNK_BYTES = 4 << 20
log = logging.getLogger("deltafs")


class ForeignManifestError(FormatError):
    """A manifest of another store: the store at this URL was deleted and made again (a new run) since this
    Repository read its deltafs.json, or files were copied between stores."""


class Repository:
    """Typed access to one store. Writers: chunks, then manifest (the commit), then HEAD."""

    def __init__(self, objects: ObjectStore, config: StoreConfig) -> None:
        self.objects = objects
        self.config = config
        self._manifests: dict[int, Manifest] = {}
        self._stored: dict[int, int] = {}  # version -> stored size of its manifest object, from the read or the commit

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
            data = objects.get(CONFIG_KEY, limit=CONFIG_MAX_BYTES)
        except ObjectNotFoundError:
            if not create:
                root = objects.local_root
                if root is not None and os.path.lexists(root) and not os.path.isdir(root):
                    raise StoreNotFoundError(f"no deltafs store at {url}: it is not a directory") from None
                raise StoreNotFoundError(f"no deltafs store at {url} (push to it first)") from None
            if objects.exists(HEAD_KEY):
                # A HEAD but no deltafs.json: another tool's prefix, or a store whose config was deleted. Making a
                # config there would claim it (and gc would then call it an empty store).
                raise FormatError(f"{url} holds a HEAD but no deltafs.json: not a deltafs store (or a damaged one); "
                                 "push to an empty prefix") from None
            config = StoreConfig(store_id=uuid.uuid4().hex, chunk_bytes=chunk_bytes, created=utcnow())
            try:
                StoreConfig.from_bytes(config.to_bytes())  # a chunk size readers would refuse is never written
            except FormatError as exc:
                raise UsageError(str(exc).removeprefix("deltafs.json: ")) from None
            objects.put_if_absent(CONFIG_KEY, config.to_bytes())
            data = objects.get(CONFIG_KEY, referenced=True, limit=CONFIG_MAX_BYTES)  # another writer may have been first
        return cls(objects, StoreConfig.from_bytes(data))

    # --- HEAD and manifests ----------------------------------------------------------------
    def read_head(self) -> Head | None:
        try:
            return Head.from_bytes(self.objects.get(HEAD_KEY, limit=HEAD_MAX_BYTES))
        except ObjectNotFoundError:
            return None
        except FormatError as exc:
            raise FormatError(f"{exc} (in {self.url})") from None

    def head(self) -> Head | None:
        """The newest committed version.

        HEAD is written after the manifest commits, so it can lag behind by the versions whose
        pusher died in between (or could not write it); probing the next manifest keys finds those.
        """
        return self.heads()[0]

    def heads(self) -> tuple[Head | None, Head | None]:
        """(the newest committed version, as head() returns it; the HEAD object as stored, None when absent)."""
        stored = self.read_head()
        newer = self.versions(after=None if stored is None else stored.version)
        if not newer:
            return stored, stored
        man = self.manifest(newer[-1])
        return Head(man.version, man.digest), stored

    def head_error(self, head: Head) -> DeltafsError | None:
        """What is wrong with `head` (the HEAD object, or head()'s answer), or None: VersionNotFoundError (exit 4)
        when it names a version the store does not hold, FormatError (exit 5) when its digest is not that version's
        manifest's. Both say it is HEAD that is wrong and how to look further; pull raises them, status shows them.
        Errors reading the manifest itself propagate."""
        try:
            man = self.manifest(head.version)
        except VersionNotFoundError:
            return VersionNotFoundError(f"HEAD of {self.url} names version {head.version}, which is not in the store; "
                                        "run 'deltafs verify --all'")
        if man.digest != head.digest:
            return FormatError(f"HEAD of {self.url} names version {head.version} with digest {head.digest[:16]}..., but "
                               f"that manifest's digest is {man.digest[:16]}...; run 'deltafs verify --all'")
        return None

    def versions(self, after: int | None = None) -> list[int]:
        """Committed version numbers, ascending (from the manifest listing)."""
        found, _strays = self.list_manifests()
        return [v for v in found if after is None or v > after]

    def list_manifests(self) -> tuple[list[int], list[str]]:
        """(committed version numbers ascending, keys under manifests/ that name no version).

        Every number in the valid range is listed whatever its width; a stray key is something
        this release would not write there (a tool's leftover, a foreign file) and is reported,
        not guessed at: gc refuses to run while there are any.
        """
        versions, strays = [], []
        for key in self.objects.list(MANIFEST_PREFIX):
            v = parse_manifest_key(key)
            if v is None:
                strays.append(key)
            else:
                versions.append(v)
        return sorted(versions), strays

    def manifest(self, version: int) -> Manifest:
        cached = self._manifests.get(version)
        if cached is not None:
            return cached
        key = manifest_key(version)
        try:
            data = self.objects.get(key, referenced=True, limit=MANIFEST_MAX_BYTES)
        except ObjectNotFoundError:
            raise VersionNotFoundError(f"version {version} is not in {self.url}") from None
        man = self.check_manifest(Manifest.decode(data, where=f"manifest of version {version}"), version)
        self._manifests[version] = man
        self._stored[version] = len(data)
        return man

    def check_manifest(self, man: Manifest, version: int, what: str = "manifest") -> Manifest:
        """A manifest read from this store must be the version its key names, of this store, with its chunk size.

        The chunk size bounds every decompression of the version's chunks, so it is checked against
        deltafs.json before any chunk is read.
        """
        where = f"{what} of version {version}"
        if man.version != version:
            raise FormatError(f"{where} claims to be version {man.version}")
        if man.store_id != self.store_id:
            raise ForeignManifestError(f"{where} belongs to store {man.store_id}, not {self.store_id}")
        if man.chunk_bytes != self.config.chunk_bytes:
            raise FormatError(f"{where} declares chunk_bytes {man.chunk_bytes}, but the store's deltafs.json says "
                              f"{self.config.chunk_bytes}")
        return man

    def _read_back(self, key: str) -> bytes | None:
        """key's bytes as a remote store returns them right after a write (one GET of a small record), or None when
        not worth asking: local stores write through a temporary file, fsync and rename; a store declared without
        read-after-write may still return the previous object; a read that fails says nothing."""
        if self.objects.local_root is not None or not self.objects.capabilities.read_after_write:
            return None
        try:
            return self.objects.get(key)
        except DeltafsError as exc:
            log.debug("cannot read %s back: %s", key, exc)
            return None

    def _damaged(self, key: str, data: bytes, parse: Callable[[bytes], object]) -> bool:
        """Whether the store kept key damaged: read back, it is neither data nor a valid record of its kind (another
        writer's, on a store whose create is check-then-write, or a newer HEAD: never taken for damage)."""
        back = self._read_back(key)
        if back is None or back == data:
            return False
        try:
            parse(back)
        except (FormatError, ValueError):
            return True
        return False

    def _settle(self, key: str, data: bytes, failure: StoreError) -> bool:
        """Whether the manifest create that failed after its retries (timeouts, replies lost after the server stored
        it) committed all the same: one read of the key says so. Equal bytes are this push's (a manifest carries its
        creation time), other bytes another writer's (False); absent, the push did not commit (the failure is
        raised). A push that said "failed" for a version it had published was pushed again, and the step appeared
        twice (adversarial pass, S3 and GCS behind a proxy that lost the replies)."""
        try:
            stored = self.objects.get(key)
        except ObjectNotFoundError:
            raise failure from None
        except DeltafsError as again:
            raise StoreError(f"{failure}; whether {key} was committed is unknown (reading it back failed too: {again}); "
                             f"run 'deltafs log {self.url}' before pushing again") from failure
        if stored == data:
            log.warning("%s was written although its create failed (%s): the version is committed", key, failure)
        return stored == data

    def manifest_size(self, version: int) -> int:
        """The stored size of a version's manifest object: known without a request once this repository read it."""
        known = self._stored.get(version)
        return known if known is not None else self.objects.size(manifest_key(version))

    def commit(self, man: Manifest) -> int:
        """Create the manifest if its version is free (the commit point), then move HEAD.

        Returns the manifest's size in bytes. Raises VersionConflictError if another writer
        committed that version first. Once the manifest exists the version is published: readers
        look past HEAD for newer manifests, so a HEAD that cannot be written (a full disk, a
        store error) is a warning, not a failed commit (the next commit moves it).
        """
        check_version(man.version)
        data = man.encode()
        key = manifest_key(man.version)
        try:
            created = self.objects.put_if_absent(key, data)
        except StoreError as exc:
            created = self._settle(key, data, exc)
        parse = functools.partial(Manifest.decode, where=key)
        if created and self._damaged(key, data, parse):
            # Damaged on the way: a server that does not check what it receives kept a short or altered body, and
            # every reader would refuse this version, the newest, until someone removed it by hand. Not a valid
            # manifest, so no other writer's either: replace it, once.
            log.warning("%s came back damaged from the store; writing it again", key)
            self.objects.delete(key)
            created = self.objects.put_if_absent(key, data)
            if created and self._damaged(key, data, parse):
                self.objects.delete(key)
                raise StoreError(f"{self.url} stored {key} damaged twice (it reads back as no valid manifest); it was "
                                 "removed and nothing was committed: check the server")
        if not created:
            raise VersionConflictError(
                f"version {man.version} was committed by another writer; pull and push again"
            )
        self._manifests[man.version] = man
        self._stored[man.version] = len(data)
        try:
            self.advance_head(Head(man.version, man.digest))
        except (DeltafsError, OSError) as exc:
            log.warning("version %s is committed, but HEAD still names an older one (readers find version %s "
                        "by listing manifests/; the next push moves HEAD): %s", man.version, man.version, exc)
        return len(data)

    def advance_head(self, head: Head) -> None:
        """Move HEAD forward; never backwards, so a slow writer cannot hide a newer version."""
        try:
            current = self.read_head()
        except FormatError:  # a damaged HEAD (an older upload): readers refuse it, so it is replaced
            current = None
        if current is None or current.version < head.version:
            data = head.to_bytes()
            self.objects.put(HEAD_KEY, data)
            # Damaged on the way (see commit): readers would refuse it. Another writer's newer HEAD reads back valid.
            if self._damaged(HEAD_KEY, data, Head.from_bytes):
                self.objects.put(HEAD_KEY, data)
                if self._damaged(HEAD_KEY, data, Head.from_bytes):
                    self.objects.delete(HEAD_KEY)  # readers then list manifests/, which hold the version
                    raise StoreError(f"{self.url} stored HEAD damaged twice; it was removed (readers find the newest "
                                     "version by listing manifests/)")

    # --- chunks ------------------------------------------------------------------------------
    def put_chunk(self, data: bytes, oid: str | None = None) -> tuple[str, bool]:
        """Store a chunk under the sha256 of its bytes (oid, if the caller already hashed them); returns (id, newly_written)."""
        oid = oid or hashlib.sha256(data).hexdigest()
        return oid, self.objects.put_if_absent(chunk_key(oid), data, equal_is_ours=False)

    def get_chunk(self, oid: str, size: int | None = None) -> bytes:
        """The chunk's bytes, checked against its id (and its size, when the manifest gives it).

        A mismatch is first treated like a transient error (a bit flipped in transit, a torn
        read): fetched again with the store's backoff, then reported as an IntegrityError.
        """
        key = chunk_key(oid)
        attempts = max(1, self.objects.retry.attempts)
        for attempt in range(attempts):
            try:
                data = self.objects.get(key, referenced=True, limit=size)
            except ObjectNotFoundError:
                raise ChunkNotFoundError(f"chunk {oid} is missing from {self.url}") from None
            except FormatError as exc:
                # Larger than the manifest says, a link or not a file: not the chunk it names, and no transfer
                # error either (fetching again would find the same), so said at once, as what the store holds.
                raise IntegrityError(f"chunk {oid} in {self.url} is not the object its name says: {exc}") from None
            actual = hashlib.sha256(data).hexdigest()
            if actual == oid and (size is None or len(data) == size):
                return data
            if attempt + 1 < attempts:
                log.warning("chunk %s arrived damaged (attempt %d of %d); fetching it again", oid, attempt + 1, attempts)
                time.sleep(self.objects.retry.delay(attempt))
        raise IntegrityError(f"chunk {oid} in {self.url} is corrupt (checked {attempts} times)", expected=oid, actual=actual)

    def has_chunk(self, oid: str) -> bool:
        return self.objects.exists(chunk_key(oid))
