"""A repository's optional second manifests of a version: folds (`folds/`) and bridges (`bridges/`).

Both are accelerators (manifests/FORMAT.md, "Folds" and "Bridges"): a fold is version N encoded against its full
version, a bridge is full version N encoded against its parent. Nothing needs them: every loader here returns None
for one that is missing, unreadable or made for another version, and callers take the ordinary path. Readers plan
with them (deltafs.read.chain), gc keeps or removes them, verify rebuilds from them, log shows them; none of that
needs more than this module, which reads manifests only (no numeric imports).
"""

from __future__ import annotations

import logging

from deltafs.errors import DeltafsError, ObjectNotFoundError, StoreError
from deltafs.format.keys import bridge_key, fold_key
from deltafs.format.manifest import Manifest
from deltafs.format.records import MANIFEST_MAX_BYTES
from deltafs.store.repo import Repository

log = logging.getLogger("deltafs")


def is_fold_of(fold: Manifest, target: Manifest) -> bool:
    """A fold is only usable for the exact version (digest) it was made for, with identical files."""
    return (fold.version == target.version and fold.store_id == target.store_id and fold.kind == "delta"
            and fold.stats.get("fold_of") == target.digest and fold.chunk_bytes == target.chunk_bytes
            and _same_files(fold, target))


def _same_files(a: Manifest, b: Manifest) -> bool:
    """The same files in the same order, with the same sizes and digests (a fold or bridge against its version)."""
    return [(f.path, f.size, f.digest) for f in a.files] == [(f.path, f.size, f.digest) for f in b.files]


def load_fold(repo: Repository, target: Manifest, *, strict: bool = False) -> Manifest | None:
    """The fold of `target`, or None if there is none or it is not usable (never an error; with strict, a store that
    cannot be read is one: gc, which deletes what it cannot use, must not take a timeout for "unusable")."""
    found = _load_accelerator(repo, fold_key(target.version), target.version, "fold", strict)
    return found[0] if found is not None and is_fold_of(found[0], target) else None


def read_accelerator(repo: Repository, key: str, version: int, what: str) -> Manifest:
    """The fold or bridge manifest under `key` for `version`, read and checked as any manifest of this store.

    Raises ObjectNotFoundError when there is none, another DeltafsError when it cannot be used."""
    return _checked(repo, repo.objects.get(key, limit=MANIFEST_MAX_BYTES), version, what)


def _checked(repo: Repository, data: bytes, version: int, what: str) -> Manifest:
    return repo.check_manifest(Manifest.decode(data, where=f"{what} of version {version}"), version, what)


def _load_accelerator(repo: Repository, key: str, version: int, what: str,
                      strict: bool = False) -> tuple[Manifest, int] | None:
    """(manifest, stored size) as read_accelerator reads it, or None if there is none or it is unusable (logged).

    strict (gc, which deletes what is unusable): a store error (a timeout after the retries, access denied) is
    raised, not taken for "unusable"; and a read that does not check is read again, and only the same bytes twice
    make it unusable. A transfer that damaged one read (a body cut short, a bit flipped on the way) made gc delete a
    kept version's intact bridge or fold, for good. Other bytes the second time: StoreError."""
    try:
        data = repo.objects.get(key, limit=MANIFEST_MAX_BYTES)
    except ObjectNotFoundError:
        return None
    except StoreError as exc:
        if strict:
            raise
        log.warning("ignoring the %s of version %s: %s", what, version, exc)
        return None
    except DeltafsError as exc:  # larger than any manifest, a link, not a file: what the store holds
        log.warning("%s the %s of version %s: %s", "removing" if strict else "ignoring", what, version, exc)
        return None
    try:
        return _checked(repo, data, version, what), len(data)
    except DeltafsError as exc:
        if strict:
            try:
                again = repo.objects.get(key, limit=MANIFEST_MAX_BYTES)
            except ObjectNotFoundError:
                return None
            if again != data:
                try:
                    return _checked(repo, again, version, what), len(again)  # the first read was damaged on the way
                except DeltafsError:
                    raise StoreError(f"{key} came back with other bytes when read again ({exc}): it may be intact "
                                     f"in {repo.url}") from None
        log.warning("%s the %s of version %s: %s", "removing" if strict else "ignoring", what, version, exc)
        return None


def is_bridge_of(bridge: Manifest, target: Manifest) -> bool:
    """A bridge is only usable for the exact full version (digest) it was made for, against that version's parent."""
    return (target.kind == "full" and target.parent is not None and bridge.kind == "delta"
            and bridge.version == target.version and bridge.store_id == target.store_id
            and bridge.parent == target.parent and bridge.parent_digest == target.parent_digest
            and bridge.stats.get("bridge_of") == target.digest and bridge.chunk_bytes == target.chunk_bytes
            and _same_files(bridge, target))


def load_bridge(repo: Repository, target: Manifest, *, strict: bool = False) -> Manifest | None:
    """The bridge of full version `target`, or None if there is none or it is not usable (never an error; strict:
    as for load_fold)."""
    found = load_bridge_sized(repo, target, strict=strict)
    return None if found is None else found[0]


def load_bridge_sized(repo: Repository, target: Manifest, *, strict: bool = False) -> tuple[Manifest, int] | None:
    """load_bridge, with the bridge manifest's stored size (from the same read: one request)."""
    if target.kind != "full" or target.parent is None:
        return None
    found = _load_accelerator(repo, bridge_key(target.version), target.version, "bridge", strict)
    return found if found is not None and is_bridge_of(found[0], target) else None


__all__ = ["is_bridge_of", "is_fold_of", "load_bridge", "load_bridge_sized", "load_fold", "read_accelerator"]
