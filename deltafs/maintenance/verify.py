"""Check a store in layers: structure (config, HEAD, manifests, parent digests), chunks (present,
re-hashed), then contents (every version rebuilt in memory and its tensor and file digests compared).
With every version, keyframe bridges too: a broken one is a warning (readers fall back to the full version)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from deltafs.errors import DeltafsError, ObjectNotFoundError, VersionNotFoundError
from deltafs.format.manifest import Manifest, parse_manifest_key, referenced_objects
from deltafs.format.versions import MAX_VERSION, VERSION_DIGITS
from deltafs.format.keys import bridge_key
from deltafs.read.chain import Chain, plan_chain
from deltafs.store.accelerators import is_bridge_of, read_accelerator
from deltafs.read.dest import LocalCheckpoint, Placement, check_layout, extra_entries, file_digest_on_disk
from deltafs.read.rebuild import Builder, ChunkSource
from deltafs.store.repo import Repository


@dataclass
class VerifyReport:
    ok: bool = True
    versions: list[int] = field(default_factory=list)
    chunks_checked: int = 0  # stored objects checked (a pack of several small chunks counts once)
    files_checked: int = 0
    problems: list[str] = field(default_factory=list)
    bridges_checked: int = 0  # keyframe bridges rebuilt from their parent (verify --all)
    warnings: list[str] = field(default_factory=list)  # what costs readers time but loses nothing (a broken bridge)

    def fail(self, message: str) -> None:
        self.ok = False
        self.problems.append(message)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def verify(store: str | Repository, *, version: int | None = None, all_versions: bool = False, local: str | None = None,
           storage_options: dict[str, Any] | None = None, deep: bool = True, threads: int | None = None) -> VerifyReport:
    """Verify one version (default: HEAD), every version, or a local DEST against the store."""
    repo = store if isinstance(store, Repository) else Repository.open(store, storage_options)
    report = VerifyReport()
    if local is not None:
        _verify_local(repo, local, version, report)
        return report
    _check_structure(repo, report)
    try:
        head = repo.head()
    except DeltafsError as exc:
        report.fail(f"HEAD: {exc}")
        return report
    if head is None:
        report.fail(f"{repo.url} has no versions")
        return report
    versions = repo.versions() if all_versions else [version if version is not None else head.version]
    report.versions = versions
    seen: set[str] = set()
    bad: set[str] = set()  # chunks reported corrupt or missing: a rebuild that needs one is not tried (reported once)
    source = ChunkSource(repo, None)
    for v in versions:
        try:
            man = repo.manifest(v)
        except VersionNotFoundError:
            if version is not None and not all_versions:
                raise  # the version asked for does not exist: exit 4, as show, diff and pull say it
            report.fail(f"version {v} is not in {repo.url} (removed since it was listed)")
            continue
        except DeltafsError as exc:
            report.fail(_about(v, exc))
            continue
        try:
            check_layout(man)
        except DeltafsError as exc:
            report.fail(str(exc))
        for f in man.files:
            for seg in f.segments:
                for ch in seg.chunks:
                    if ch.object is None or ch.object in seen:
                        continue
                    seen.add(ch.object)
                    try:
                        data = repo.get_chunk(ch.object)
                        if len(data) != ch.object_bytes:
                            bad.add(ch.object)
                            report.fail(f"version {v}: {f.path}: chunk {ch.object} is {len(data)} bytes, manifest says "
                                        f"{ch.object_bytes}")
                    except DeltafsError as exc:
                        bad.add(ch.object)
                        report.fail(f"version {v}: {f.path}: {_seg_name(seg.key)}: {exc}")
                    report.chunks_checked += 1
        if not deep:
            continue
        try:
            chain = plan_chain(repo, v, None)
            needs_bad = sorted(referenced_objects(f for m in chain.steps for f in m.files) & bad)
            if needs_bad:
                # Fetching them again (with retries) would only report the same chunks a second time.
                report.fail(f"version {v}: not rebuilt: it needs {len(needs_bad)} chunk(s) reported above "
                            f"({needs_bad[0][:16]}...)")
                continue
            Builder(repo, chain, source, threads=threads).build(None)
            report.files_checked += len(man.files)
        except DeltafsError as exc:
            report.fail(_about(v, exc))
        if all_versions and man.kind == "full" and man.parent is not None:
            _check_bridge(repo, man, source, threads, report)
    return report


def _check_bridge(repo: Repository, man: Manifest, source: ChunkSource, threads: int | None,
                  report: VerifyReport) -> None:
    """The bridge of full version `man`, if it has one: usable, and rebuilding exactly `man` from its parent."""
    key = bridge_key(man.version)
    where = f"the bridge of version {man.version} ({key})"
    try:
        bridge = read_accelerator(repo, key, man.version, "bridge")  # as readers read it
    except ObjectNotFoundError:
        return
    except DeltafsError as exc:
        report.warnings.append(f"{where} is unusable, so hosts at version {man.parent} read the full version: {exc}")
        return
    if not is_bridge_of(bridge, man):
        report.warnings.append(f"{where} was made for another version {man.version} or parent (readers ignore it)")
        return
    assert bridge.parent is not None  # is_bridge_of: the full version's own parent
    try:
        below = plan_chain(repo, bridge.parent, None)
    except DeltafsError:
        return  # the parent is gone from the store (gc): only hosts that hold it can use the bridge, nothing to rebuild
    try:
        Builder(repo, Chain(below.steps + [bridge], None, final=man), source, threads=threads).build(None)
        report.bridges_checked += 1
    except DeltafsError as exc:
        report.warnings.append(f"{where} does not rebuild version {man.version} (hosts at version {man.parent} fall "
                               f"back to the full version): {exc}")


def _check_structure(repo: Repository, report: VerifyReport) -> None:
    """HEAD against the manifests, and every object under manifests/ placeable as a version."""
    for key in repo.objects.list("manifests"):
        if parse_manifest_key(key) is None:
            report.fail(f"{key} is not a manifest name deltafs can place (versions are 0..{MAX_VERSION}, "
                        f"{VERSION_DIGITS} digits); gc refuses to run until it is removed or renamed")
    try:
        head = repo.read_head()
    except DeltafsError:
        return  # an unreadable HEAD is reported once, below, where verify reads it to pick the version
    if head is None:
        return  # no HEAD yet, or its first writer died before writing it: readers use the newest manifest
    try:
        man = repo.manifest(head.version)
    except VersionNotFoundError:
        report.fail(f"HEAD names version {head.version}, which is not in the store")
        return
    except DeltafsError as exc:
        report.fail(f"HEAD names version {head.version}, whose manifest is unusable: {exc}")
        return
    if man.digest != head.digest:
        report.fail(f"HEAD names version {head.version} with digest {head.digest}, but that manifest's digest is {man.digest}")


def _verify_local(repo: Repository, dest: str, version: int | None, report: VerifyReport) -> None:
    state = LocalCheckpoint(dest).state()
    if state is None:
        report.fail(f"{dest} is not a checkpoint pulled by deltafs")
        return
    if state.store_id != repo.store_id:
        report.fail(f"{dest} holds a checkpoint of another store ({state.store_url})")
        return
    v = version if version is not None else state.version
    report.versions = [v]
    if v != state.version:
        report.fail(f"{dest} holds version {state.version}, not {v}")
        return
    try:
        man = repo.manifest(v)
    except VersionNotFoundError:
        # gc removed it from the store since the pull (a host a few versions behind): it was exit 6, "version 1 is not
        # in STORE", for intact files (adversarial pass). DEST's files are checked against the manifest the pull
        # recorded beside them, once the store vouches for that manifest: the next version names it by digest.
        child = _child_of(repo, v)
        if child is None:
            raise VersionNotFoundError(f"version {v} is no longer in {repo.url} (gc removed it), and no version there "
                                       f"names it as its parent: {dest}'s files cannot be checked against the store. "
                                       "The next pull updates it") from None
        man = state.manifest
        if child.parent_digest != man.digest:
            report.fail(f"{dest}: the manifest recorded for version {v} is not the one version {child.version} of "
                        f"{repo.url} names as its parent (digest {man.digest}, named {child.parent_digest})")
            return
        report.warnings.append(f"version {v} is no longer in {repo.url} (gc removed it); {dest}'s files are checked "
                               f"against the manifest recorded when it was pulled, which version {child.version} names "
                               "as its parent. The next pull updates it")
    except DeltafsError as exc:
        report.fail(_about(v, exc))
        return
    if man.digest != state.digest:
        report.fail(f"{dest}: version {v} in the store is not the one that was pulled (manifest digest differs)")
    listed = {f.path for f in man.files}
    placement = Placement(state.path)
    for f in man.files:
        path = os.path.join(state.path, f.path)
        report.files_checked += 1
        try:
            if not placement.holds(f.path):  # a symlink to the right bytes elsewhere is not them
                os.lstat(path)  # gone: said below as such
                report.fail(f"{dest}: {f.path} is not a regular file in {dest} (a symlink, a special file, or "
                            "reached through a symlinked directory)")
                continue
            size = os.path.getsize(path)
            digest = file_digest_on_disk(path, f, man.chunk_bytes)
        except OSError as exc:
            report.fail(f"{dest}: {f.path}: {exc.strerror or exc}")
            continue
        if size != f.size or digest is None:
            report.fail(f"{dest}: {f.path}: {size} bytes, version {v} has {f.size}")
        elif digest != f.digest:
            report.fail(f"{dest}: {f.path}: digest {digest[:24]}… differs from version {v}'s {f.digest[:24]}…")
    for rel in extra_entries(state.path, listed):
        report.fail(f"{dest}: {rel} is not part of version {v}")


def _child_of(repo: Repository, version: int) -> Manifest | None:
    """The first version after `version` in the store, if it names `version` as its parent (its parent_digest then
    vouches for version's manifest), else None."""
    for v in repo.versions(after=version):
        try:
            man = repo.manifest(v)
        except VersionNotFoundError:
            continue  # gc'd meanwhile
        return man if man.parent == version else None
    return None


def _about(version: int, exc: BaseException) -> str:
    """exc's message, starting with the version it is about (once: many messages name it already)."""
    text = str(exc)
    return text if text.startswith(f"version {version}:") else f"version {version}: {text}"


def _seg_name(key: str) -> str:
    return {"t": "tensor ", "h": "header of ", "f": "file "}[key[0]] + key[2:]
