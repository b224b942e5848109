"""A local checkpoint directory managed by deltafs: DEST is a symlink flipped atomically.

Layout beside DEST (for DEST=/models/current):
    /models/current                -> current.deltafs/v0000000042-1a2b3c4d   (symlink)
    /models/current.deltafs/
        v0000000042-1a2b3c4d/       a complete, verified HF checkpoint directory
        v0000000042-1a2b3c4d.json   its state: store id and URL, version, manifest, file sizes and mtimes
        staging-<random>/           a pull in progress (removed or reused later)
        chunks/                     fetched, verified chunk objects of an interrupted pull
        lock                        flock(2) of the pull in progress

DEST's parent may be writable by others (/tmp): everything deltafs writes beside DEST is created and
opened without following symlinks, and the sidecar must be a real directory owned by this user and
not writable by everyone, or deltafs refuses it (DestinationError, exit 9). Cleanup removes only
entries whose names match deltafs's own patterns and whose type (and, for versions, state file) is
what deltafs writes; anything else in the sidecar is left alone.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

from deltafs.buffers import aligned_empty, open_regular, pread_aligned
from deltafs.errors import DestinationError, ForeignStoreError, FormatError, LockHeldError, local_write_error
from deltafs.format import digests
from deltafs.format.manifest import FileEntry, Manifest, Segment, path_clash
from deltafs.format.records import (DEST_STATE_MAX_BYTES, dest_state_bytes, dest_state_record, embedded_manifest_span,
                                    embedded_manifest_text, parse_dest_state)
log = logging.getLogger("deltafs")

SIDECAR_SUFFIX = ".deltafs"
# Names deltafs gives the entries of its sidecar; cleanup touches nothing else.
VERSION_DIR = re.compile(r"^v\d{10}-[0-9a-f]{8}$")
# DEST.deltafs/<this> names the version an engine switch is loading while it runs (deltafs.engines.inflight).
SWITCH_RECORD = "engine-switch.json"
STATE_FILE = re.compile(r"^v\d{10}-[0-9a-f]{8}\.json$")
STAGING_DIR = re.compile(r"^staging-[0-9a-f]{12}$")
TEMP_FILE = re.compile(r"^\.tmp-[0-9a-f]{32}$")
# Longest file name component that common filesystems (ext4, xfs, btrfs, tmpfs) accept.
NAME_MAX = 255


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Sibling temp file (created, never followed), fsync, rename, fsync the directory.

    The temp file is removed on every failure (a full disk leaves nothing behind).
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def check_layout(man: Manifest) -> None:
    """FormatError (exit 5) if the version's files cannot all exist in one directory tree.

    A file and a directory of the same name ("a" and "a/b") cannot coexist, and a name component
    longer than NAME_MAX bytes is refused by every common filesystem: such a version can never be
    pulled, so verify reports it and pull refuses it before writing anything.
    """
    files = {f.path for f in man.files}
    for path in sorted(files):
        for part in path.split("/"):
            if len(part.encode("utf-8", "surrogatepass")) > NAME_MAX:
                raise FormatError(f"version {man.version}: file {path[:60]}...: a name component is "
                                  f"{len(part.encode('utf-8', 'surrogatepass'))} bytes, longer than the {NAME_MAX} filesystems allow")
    clash = path_clash(files)
    if clash is not None:
        raise FormatError(f"version {man.version}: {clash[0]} is both a file and the directory of {clash[1]}")


@dataclass(frozen=True)
class LocalState:
    """What a managed DEST currently holds."""

    store_id: str
    store_url: str
    version: int
    digest: str
    path: str  # the version directory DEST points to
    manifest: Manifest
    files: dict[str, Any] | None = None  # path -> [size, mtime_ns] recorded at install (None: older state)


class LocalCheckpoint:
    """DEST plus its sidecar directory; see the module docstring for the layout."""

    def __init__(self, dest: str) -> None:
        self.dest = os.path.abspath(os.path.expanduser(dest)).rstrip("/")
        if not os.path.basename(self.dest):
            raise DestinationError(f"DEST {dest!r} is a filesystem root; name a directory below it, e.g. /models/current")
        self.sidecar = self.dest + SIDECAR_SUFFIX
        self.deleting: threading.Thread | None = None  # cleanup(background=True)'s deletion, while it runs

    # --- ownership ------------------------------------------------------------------------
    def _check_own_dir(self, path: str, st: os.stat_result) -> None:
        """Refuse a directory deltafs would write into unless it is a real one of this user's."""
        if stat.S_ISLNK(st.st_mode):
            raise DestinationError(f"{path} is a symlink; deltafs never writes through one there (remove it)")
        if not stat.S_ISDIR(st.st_mode):
            raise DestinationError(f"{path} is not a directory deltafs made (remove or rename it)")
        if st.st_uid != os.geteuid():
            raise DestinationError(f"{path} belongs to uid {st.st_uid}, not to this user; deltafs did not make it")
        if st.st_mode & stat.S_IWOTH:
            raise DestinationError(f"{path} is writable by everyone; deltafs will not use it (chmod o-w, or remove it)")

    def _own_dir(self, path: str, *, create: bool) -> bool:
        """True if path is a directory deltafs may use (made now if create); False if absent."""
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o755)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        self._check_own_dir(path, st)
        return True

    def ensure_sidecar(self) -> str:
        """Create (or check) DEST.deltafs: a real directory of this user, never a symlink. A directory that cannot
        be made there (no permission, a /proc or /sys path) is a local write failure (exit 12) naming it."""
        parent = os.path.dirname(self.dest)
        try:
            os.makedirs(parent, exist_ok=True)
            self._own_dir(self.sidecar, create=True)
        except OSError as exc:  # (DestinationError, a refusal of what is there, is no OSError: it passes)
            raise local_write_error(exc, exc.filename or self.sidecar) from None
        return self.sidecar

    def check_safe(self) -> None:
        """Raise DestinationError if the sidecar exists and is not deltafs's own. Creates nothing."""
        self._own_dir(self.sidecar, create=False)

    # --- reading -------------------------------------------------------------------------
    def state(self) -> LocalState | None:
        """The state of the version DEST points to, or None if DEST is not managed by deltafs."""
        name = self.linked_name()
        return None if name is None else self.version_state(name)

    def version_state(self, name: str) -> LocalState | None:
        """The state of the version directory `name` beside DEST (linked or not), or None if it is not one."""
        version_dir = os.path.join(self.sidecar, name)
        try:
            self._check_own_dir(self.sidecar, os.lstat(self.sidecar))
            if not VERSION_DIR.match(name) or not stat.S_ISDIR(os.lstat(version_dir).st_mode):
                return None
            manifest, raw = read_version_state(version_dir)
            if manifest.version != raw["version"]:
                return None
            files = raw.get("files")
            return LocalState(raw["store_id"], raw["store_url"], int(raw["version"]), raw["digest"], version_dir, manifest,
                              files if isinstance(files, dict) else None)
        except (OSError, ValueError, KeyError, TypeError, FormatError, DestinationError):
            return None

    def linked_name(self) -> str | None:
        """The name of the sidecar entry DEST links to, whatever its state record says (None if DEST is no such
        link): cleanup and recycling never touch it, even when its record is damaged and state() is None."""
        try:
            target = os.readlink(self.dest)
        except OSError:
            return None
        name = os.path.basename(target.rstrip("/"))
        if os.path.dirname(os.path.normpath(os.path.join(os.path.dirname(self.dest), target))) != self.sidecar:
            return None
        return name

    def describe_foreign(self) -> str | None:
        """Why DEST cannot simply be replaced, or None if it is absent, empty or ours."""
        if not os.path.lexists(self.dest):
            return None
        if os.path.islink(self.dest):
            if self.state() is not None:
                return None
            linked = self.linked_name()
            if linked is not None and VERSION_DIR.match(linked):
                if not os.path.lexists(os.path.join(self.sidecar, linked)):
                    return None  # deltafs's own link, left dangling (the sidecar was deleted): nothing there to lose
                return (f"{self.dest} points to {os.path.join(self.sidecar, linked)}, whose state record "
                        f"({linked}.json) is missing or damaged")
            return f"{self.dest} is a symlink deltafs did not make"
        if os.path.isdir(self.dest):
            return None if not os.listdir(self.dest) else f"{self.dest} is a directory with files deltafs did not write"
        return f"{self.dest} is a file"

    def check_files(self, state: LocalState, *, full: bool = False) -> str | None:
        """What is wrong with the files of the current version, or None.

        The quick check compares each file's size (and, when recorded at install, its mtime) with the
        manifest; full=True re-hashes every file.
        """
        placement = Placement(state.path)
        for f in state.manifest.files:
            path = os.path.join(state.path, f.path)
            try:
                st = os.lstat(path)
            except OSError:
                return f"{f.path} is missing"
            if not stat.S_ISREG(st.st_mode):
                return f"{f.path} is not a regular file"
            if not placement.parent_in_place(f.path):
                return f"{f.path} is reached through a symlinked directory"
            if st.st_size != f.size:
                return f"{f.path} is {st.st_size} bytes, version {state.version} has {f.size}"
            recorded = (state.files or {}).get(f.path)
            if isinstance(recorded, list) and len(recorded) == 2 and recorded[1] != st.st_mtime_ns:
                return f"{f.path} was modified after it was installed"
            try:
                if full and file_digest_on_disk(path, f, state.manifest.chunk_bytes) != f.digest:
                    return f"{f.path} does not match version {state.version}'s digest"
            except OSError as exc:  # removed or replaced since the lstat above, or unreadable
                return f"{f.path} cannot be read: {exc.strerror or exc}"
        extra = extra_entries(state.path, {f.path for f in state.manifest.files})
        if extra:
            return f"{extra[0]} is not part of version {state.version}"
        return None

    # --- writing -------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, *, wait: bool = True, name: str = "lock") -> Iterator[None]:
        """Exclusive per-DEST lock; flock is released by the kernel if the process dies.

        Opened relative to the sidecar's descriptor with O_NOFOLLOW: a planted symlink is refused.
        """
        self.ensure_sidecar()
        dir_fd = os.open(self.sidecar, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self._check_own_dir(self.sidecar, os.fstat(dir_fd))
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise DestinationError(f"{os.path.join(self.sidecar, name)} is a symlink; deltafs never follows one there (remove it)") from None
                raise
        finally:
            os.close(dir_fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise DestinationError(f"{os.path.join(self.sidecar, name)} is not a lock file deltafs made (remove it)")
            what = "pushing with this cache" if name == "push.lock" else f"updating {self.dest}"
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    raise LockHeldError(f"another deltafs process is {what}") from None
                log.warning("another deltafs process is %s; waiting for it to finish", what)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def new_staging(self) -> str:
        self.ensure_sidecar()
        path = os.path.join(self.sidecar, f"staging-{uuid.uuid4().hex[:12]}")
        os.mkdir(path, 0o755)  # mkdir never follows: a planted name fails with EEXIST
        return path

    def adopt_as_staging(self, state: LocalState) -> str:
        """Turn the version directory DEST points to into a staging directory, to be rewritten in place.

        From the rename on it is no longer a version: DEST dangles and state() is None until the next
        install, so a process killed meanwhile leaves no version whose bytes are in doubt (the next push
        rebuilds its base from the store). Used by push to update its cache without copying a file.
        """
        if os.path.dirname(state.path) != self.sidecar or not VERSION_DIR.match(os.path.basename(state.path)):
            raise DestinationError(f"{state.path} is not a version directory of {self.dest}")
        return self._to_staging(state.path)

    def _to_staging(self, version_dir: str) -> str:
        staging = os.path.join(self.sidecar, f"staging-{uuid.uuid4().hex[:12]}")
        os.rename(version_dir, staging)  # same directory: atomic; the name pattern is ours (no planted link)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(version_dir + ".json")
        fsync_dir(self.sidecar)
        return staging

    def recycle_as_staging(self, keep: int, paths: set[str]) -> str | None:
        """A staging directory made of the version that installing one more version would make cleanup(keep)
        remove (the oldest such), or None if there is none.

        Its files are written over by the next build instead of being freed while the build allocates new
        ones: writing into pages a file already has is about 3x cheaper than into new pages (tmpfs;
        see docs/sync_bench.md, "Round 4"). Never the version DEST points to (the delta's base,
        and what engines load) nor one of the keep - 1 newest by mtime (what the watcher touches to protect
        the version its engine serves). Only regular files with one link whose path the next version has
        stay; everything else in it (other files, symlinks, hard-linked files shared with other versions,
        anything not a regular file or directory) is removed first, so no write can reach outside it.
        """
        try:
            self._check_own_dir(self.sidecar, os.lstat(self.sidecar))
        except FileNotFoundError:
            return None
        if self._engine_switching():
            # An engine is loading one of these versions right now (a watcher's or a cron run's switch holds
            # engine.lock): which one is not known here, so none is rewritten; the new version gets new files.
            log.info("an engine switch of %s is in progress: the new version gets new files, none is recycled", self.dest)
            return None
        versions = self._versions_by_age()
        survivors = set(versions[-(keep - 1):]) if keep > 1 else set()
        linked = self.linked_name()  # what state() reads, whatever its record says
        if linked is not None:
            survivors.add(linked)
        loading = self.switch_target()  # a switch record whose process is gone: its load may still read it
        if loading is not None:
            survivors.add(loading)
        old = [n for n in versions if n not in survivors]
        if not old:
            return None
        staging = self._to_staging(os.path.join(self.sidecar, old[0]))
        _prune_for_reuse(staging, paths)
        return staging

    def switch_record(self) -> dict[str, Any] | None:
        """The record an engine switch keeps beside DEST while it runs (SWITCH_RECORD, written by
        deltafs.engines.inflight): a JSON object, or None without one (missing, a planted link, unreadable)."""
        try:
            fd = os.open(os.path.join(self.sidecar, SWITCH_RECORD), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            with open(fd, "rb") as fh:
                record = json.loads(fh.read(1 << 16))  # its path may be up to PATH_MAX (4096 bytes) long
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def switch_target(self) -> str | None:
        """The name of the version directory the running switch asked its engine to load; None without one."""
        path = (self.switch_record() or {}).get("path")
        return os.path.basename(os.path.normpath(path)) if isinstance(path, str) and path else None

    def _engine_switching(self) -> bool:
        """Whether another process holds this DEST's engine.lock (see lock(name="engine.lock")) now."""
        try:
            fd = os.open(os.path.join(self.sidecar, "engine.lock"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False  # no switch ever ran here (or not one deltafs made the lock of)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # (closing the fd drops the lock taken for the test)
        return False

    @property
    def chunk_cache(self) -> str:
        return os.path.join(self.sidecar, "chunks")

    def open_chunk_cache(self) -> str:
        """The chunk cache directory, created if needed; refused unless it is deltafs's own."""
        self.ensure_sidecar()
        self._own_dir(self.chunk_cache, create=True)
        return self.chunk_cache

    def drop_chunk_cache(self) -> None:
        """Remove the chunk cache if it is a real directory (never through a symlink)."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(self.chunk_cache).st_mode):
                shutil.rmtree(self.chunk_cache, ignore_errors=True)

    def displace(self) -> None:
        """Move whatever DEST is out of the way into the sidecar (nothing is deleted)."""
        if not os.path.lexists(self.dest):
            return
        if os.path.isdir(self.dest) and not os.path.islink(self.dest) and not os.listdir(self.dest):
            os.rmdir(self.dest)
            return
        self.ensure_sidecar()
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
        os.replace(self.dest, os.path.join(self.sidecar, f"displaced-{stamp}-{uuid.uuid4().hex[:6]}"))

    def install(self, staging: str, *, store_id: str, store_url: str, manifest: Manifest) -> str:
        """Make a fully written and verified staging directory the version DEST points to."""
        name = f"v{manifest.version:010d}-{uuid.uuid4().hex[:8]}"
        final = os.path.join(self.sidecar, name)
        # Sizes and mtimes as installed: a later pull notices an edited file without re-hashing.
        record = dest_state_record(store_id=store_id, store_url=store_url, version=manifest.version,
                                   digest=manifest.digest, files=_file_stamps(staging, manifest))
        atomic_write(final + ".json", dest_state_bytes(record, manifest.to_bytes()))
        _remember_state(final + ".json", manifest, record)  # read right after (cleanup, the result): not parsed
        # Versions are ordered by mtime (cleanup, recycling): a recycled directory whose files were all rewritten
        # in place still has the mtime of the version it was, so the install dates it.
        os.utime(staging)
        os.replace(staging, final)
        fsync_dir(self.sidecar)
        self.point_to(name)
        return final

    def point_to(self, name: str) -> None:
        """Make DEST the link to the version directory `name` of the sidecar, in one atomic flip (what DEST was, if
        not a link, is moved aside first)."""
        if os.path.lexists(self.dest) and not os.path.islink(self.dest):
            self.displace()
        parent = os.path.dirname(self.dest)
        link_tmp = os.path.join(parent, f".{os.path.basename(self.dest)}.tmp-{uuid.uuid4().hex[:8]}")
        os.symlink(os.path.relpath(os.path.join(self.sidecar, name), parent), link_tmp)
        try:
            os.replace(link_tmp, self.dest)  # the atomic flip
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(link_tmp)  # never leave a dangling temporary link beside DEST
            raise
        fsync_dir(parent)

    def remove_stale_staging(self) -> list[str]:
        """Remove the staging directories a killed or failed run left (call it holding the lock: no other pull is
        writing one). A pull killed while it built its version leaves one, which may be the version it recycled:
        left there, it would hold a version's worth of space that the next pull needs on a DEST disk sized for
        two versions. Only real directories of deltafs's staging pattern go (lstat: a planted link is left)."""
        try:
            self._check_own_dir(self.sidecar, os.lstat(self.sidecar))
        except FileNotFoundError:
            return []
        stale = [n for n, st in _entries(self.sidecar).items() if _is_staging(n, st)]
        _remove_trees([os.path.join(self.sidecar, n) for n in stale])
        return stale

    def cleanup(self, keep: int = 2, *, background: bool = False, also_keep: str | None = None) -> list[str]:
        """Remove stale staging dirs and all but the newest `keep` versions (the current one always stays).

        Only entries deltafs provably made go: a name of its own pattern, the right type (lstat, so a
        planted symlink is never followed nor removed), and, for a version directory, its state file.

        background=True: each doomed version stops being one at once (renamed to a staging name, its state
        file removed), and the files are deleted by a thread, `self.deleting`, so the caller does not wait
        for the kernel to free them (~0.5 s per GB on ext4 when the cache held the only link). The thread is
        not a daemon: the interpreter waits for it at exit. A process killed meanwhile leaves a staging
        directory, which the next cleanup removes.

        also_keep: with keep >= 2, the name of a version directory that is one of the `keep` kept whatever the
        mtimes say (a pull passes the version DEST pointed to before it: an engine may still be reading it, and an
        older directory touched since must not outrank it); the rest are the newest by mtime.
        """
        try:
            self._check_own_dir(self.sidecar, os.lstat(self.sidecar))
        except FileNotFoundError:
            return []
        entries = _entries(self.sidecar)
        versions = self._versions_by_age(entries)
        linked = self.linked_name()  # the current version, also when its record is damaged: engines may read it
        keep_names = {n for n in (linked, also_keep if keep >= 2 else None) if n is not None and n in versions}
        for n in reversed(versions):  # then the newest by mtime, up to keep in all
            if len(keep_names) >= keep:
                break
            keep_names.add(n)
        if linked is not None:
            keep_names.add(linked)
        loading = self.switch_target()  # another process's engine may be reading it now, whatever the count says
        if loading is not None and loading in versions:
            keep_names.add(loading)
        removed, doomed = [], []
        for n, st in entries.items():
            full = os.path.join(self.sidecar, n)
            if _is_staging(n, st):
                doomed.append(full)
            elif n in versions and n not in keep_names:
                # Renamed first, in both modes: it stops being a version at once, so a reader comparing it (an
                # engine switch's restart check) finds it gone, never half-deleted.
                try:
                    full = self._to_staging(full)
                except OSError:
                    continue  # stays a version until the next cleanup; the caller's work is done already
                doomed.append(full)
            else:
                continue
            removed.append(n)
        if not background:
            _remove_trees(doomed)  # before the state files: a version's goes once its directory is gone
        for n, st in entries.items():
            full = os.path.join(self.sidecar, n)
            if STATE_FILE.match(n) and stat.S_ISREG(st.st_mode) and n[:-5] not in keep_names \
                    and not os.path.lexists(full[:-5]):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(full)
            elif TEMP_FILE.match(n) and stat.S_ISREG(st.st_mode):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(full)
        if background and doomed:
            self.deleting = threading.Thread(target=_remove_trees, args=(doomed,), name="deltafs-cleanup")
            self.deleting.start()
        return removed

    def _versions_by_age(self, entries: dict[str, os.stat_result] | None = None) -> list[str]:
        """Names of the sidecar's version directories (with their state file), oldest mtime first."""
        if entries is None:
            entries = _entries(self.sidecar)
        return sorted((n for n, st in entries.items() if VERSION_DIR.match(n) and stat.S_ISDIR(st.st_mode)
                       and _is_state(os.path.join(self.sidecar, n + ".json"))),
                      key=lambda n: entries[n].st_mtime)

    def version_dirs(self) -> list[str]:
        try:
            self._check_own_dir(self.sidecar, os.lstat(self.sidecar))
        except (FileNotFoundError, DestinationError):
            return []
        return sorted(os.path.join(self.sidecar, n) for n, st in _entries(self.sidecar).items()
                      if VERSION_DIR.match(n) and stat.S_ISDIR(st.st_mode))


def _is_staging(name: str, st: os.stat_result) -> bool:
    """A staging directory deltafs made: its name pattern, and a real directory (lstat: never a planted link)."""
    return bool(STAGING_DIR.match(name)) and stat.S_ISDIR(st.st_mode)


def extra_entries(root: str, paths: set[str]) -> list[str]:
    """Entries under a version directory that are not its files ('/'-separated, sorted): anything but the listed
    files and the directories that hold them (a planted file, a link, an extra .safetensors an engine would glob).
    Links are listed, never followed."""
    dirs: set[str] = set()
    for p in paths:
        parts = p.split("/")[:-1]
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    extra: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        prefix = "" if rel_dir == "." else rel_dir + "/"
        extra += [prefix + name for name in filenames if prefix + name not in paths]
        for name in list(dirnames):
            if prefix + name not in dirs:
                extra.append(prefix + name)
                dirnames.remove(name)  # reported whole (os.walk would not enter a linked one anyway)
    return sorted(extra)


def _remove_trees(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)  # rmtree never follows symlinks inside; a concurrent one is fine


def rewritable(st: os.stat_result) -> bool:
    """Whether a pull may write a new version into this file in place: a regular file with no other name (a hard
    link shared with a kept version would change that version too)."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _prune_for_reuse(root: str, paths: set[str]) -> None:
    """Leave in root only real directories and regular files with one link whose relative path is in paths."""
    for top, dirs, files in os.walk(root, topdown=False):  # never follows links; children before parents
        for name in files + dirs:
            full = os.path.join(top, name)
            st = os.lstat(full)
            if stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(OSError):
                    os.rmdir(full)  # only if empty: it holds a file of the next version otherwise
            elif not (rewritable(st) and os.path.relpath(full, root) in paths):
                os.unlink(full)  # another version shares it (hard link), or a link, socket, stray file


def file_sha256(path: str, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as fh:
        while data := fh.read(block):
            h.update(data)
    return h.hexdigest()


def file_digest_on_disk(path: str, entry: FileEntry, chunk_bytes: int) -> str | None:
    """The digest of the file at path in the scheme of entry.digest (v1 sha256 or v2 tree), or None if its size differs."""
    try:
        if os.path.getsize(path) != entry.size:
            return None
    except OSError:
        return None
    if not digests.is_tree_digest(entry.digest):
        return "sha256:" + file_sha256(path)
    seg_digests = []
    with os.fdopen(open_regular(path), "rb") as fh:
        for seg in entry.segments:
            digest = _tree_segment_digest(fh.fileno(), seg, chunk_bytes)
            if digest is None:
                return None
            seg_digests.append(digest)
    return digests.file_digest(seg_digests, entry.size)


def segment_digest_on_disk(path: str, seg: Segment, chunk_bytes: int) -> str | None:
    """A format-v2 segment digest computed from a file on disk, or None if the file is too short."""
    with os.fdopen(open_regular(path), "rb") as fh:
        return _tree_segment_digest(fh.fileno(), seg, chunk_bytes)


def _tree_segment_digest(fd: int, seg: Segment, chunk_bytes: int) -> str | None:
    chunk_digests = []
    buf = aligned_empty(min(chunk_bytes, seg.size))  # reused; page-aligned reads are up to 4x faster
    for i in range(len(seg.chunks)):
        size = seg.chunks[i].size
        data = pread_aligned(fd, size, seg.offset + i * chunk_bytes, buf)
        if data.size != size:
            return None
        chunk_digests.append(digests.chunk_digest(data.data))
    return digests.segment_digest(chunk_digests, seg.size)


def _entries(directory: str) -> dict[str, os.stat_result]:
    """lstat of every entry of directory; an entry gone between the listing and its lstat (another process's switch
    record or temporary file: a cron run beside a watcher) is left out."""
    out = {}
    for name in os.listdir(directory):
        try:
            out[name] = os.lstat(os.path.join(directory, name))
        except FileNotFoundError:
            continue
    return out


def _is_state(path: str) -> bool:
    """Whether path looks like a DEST state record deltafs wrote (a regular file, bounded, whose own members are of
    our format), for ordering versions.

    The record alone, not its manifest: ordering versions (cleanup, recycling) needs no manifest, and building and
    checking one costs ~0.7 s for a 70B model's; even parsing its JSON costs ~0.3 s, so a record as
    dest_state_bytes writes it is parsed with the manifest's text set aside. A version that is used is read in
    full (read_version_state), so a record whose embedded manifest is damaged (not JSON, too deep, a duplicate
    member inside it) still counts here (it can be removed or recycled as an old version) but is never served:
    DEST pointing at it reads as no state.
    """
    try:
        _key, hit, data = _read_state_file(path)
        # The record's own members, the manifest's text set aside: parsing it is most of the cost (a 70B model's is
        # 10 MB of JSON). A record this guess does not fit is parsed whole, as before.
        if hit is None and _members_beside_manifest(data) is None:
            parse_dest_state(data)
    except FormatError:
        return False
    return True


def _file_stamps(directory: str, manifest: Manifest) -> dict[str, list[int]]:
    out = {}
    for f in manifest.files:
        try:
            st = os.lstat(os.path.join(directory, f.path))
        except FileNotFoundError:
            continue  # a partial copy (a rank's push cache holds only its own files)
        out[f.path] = [st.st_size, st.st_mtime_ns]
    return out


class Placement:
    """Which files of a version directory are regular files reached without a symlink below it: a directory of a
    version replaced by a link to elsewhere would hand out a file outside DEST as the version's (a pull hard-linked
    it in). Each parent directory is resolved once (two realpath calls per file doubled a cron run's quick check of
    20,000 nested files)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._real_root: str | None = None
        self._dirs: dict[str, bool] = {}

    def holds(self, rel: str) -> bool:
        """Whether root/rel is such a file."""
        try:
            if not stat.S_ISREG(os.lstat(os.path.join(self.root, rel)).st_mode):
                return False
        except OSError:
            return False
        return self.parent_in_place(rel)

    def parent_in_place(self, rel: str) -> bool:
        """Whether the directory of root/rel is reached without a symlink below root (for callers that lstat'ed the
        file itself already)."""
        parent = os.path.dirname(os.path.normpath(rel))
        if not parent:
            return True
        known = self._dirs.get(parent)
        if known is None:
            if self._real_root is None:
                self._real_root = os.path.realpath(self.root)
            known = self._dirs[parent] = (os.path.realpath(os.path.join(self.root, parent))
                                          == os.path.join(self._real_root, parent))
        return known


def sidecar_holding(path: str) -> str | None:
    """The deltafs sidecar (DEST.deltafs, whose DEST is a symlink into it, or that holds DEST's lock file) that path
    lies in once links are resolved, or None: where deltafs keeps a DEST's verified versions, which nothing else may
    write into. A directory merely named X.deltafs beside a symlink X that points elsewhere is none."""
    parts = os.path.realpath(path).split(os.sep)
    for i in range(1, len(parts)):
        if parts[i].endswith(SIDECAR_SUFFIX) and len(parts[i]) > len(SIDECAR_SUFFIX):
            sidecar = os.sep.join(parts[:i + 1])
            dest = sidecar[:-len(SIDECAR_SUFFIX)]
            if (os.path.islink(dest) and os.path.dirname(os.path.realpath(dest)) == sidecar) \
                    or os.path.lexists(os.path.join(sidecar, "lock")):
                return sidecar
    return None


def refuse_nested(local: LocalCheckpoint, store_root: str | None) -> None:
    """Refuse a DEST inside the store it reads (its sidecar would be a foreign key there: gc stops on it, verify
    fails) or inside a deltafs sidecar (another DEST's verified versions, which nothing may write into), whatever
    --force says."""
    where = os.path.realpath(os.path.dirname(local.dest))
    if store_root is not None:
        root = os.path.realpath(store_root)
        if where == root or where.startswith(root.rstrip(os.sep) + os.sep):
            raise DestinationError(f"{local.dest} is inside the store {store_root}; pull into a directory outside it")
    sidecar = sidecar_holding(where)
    if sidecar is not None:
        raise DestinationError(f"{local.dest} is inside {sidecar}, where deltafs keeps the versions of "
                               f"{sidecar[:-len(SIDECAR_SUFFIX)]}; pull into a directory outside it")


def precheck(local: LocalCheckpoint, force: bool) -> None:
    """Refuse, before anything is created beside DEST, what is certainly not deltafs's to replace.

    Only checks that no concurrent pull can change: the sidecar's ownership, and a DEST that is a
    file, a non-empty directory, or a symlink pointing outside the sidecar. The full check
    (refuse_foreign) runs again under the lock.
    """
    local.check_safe()
    if force or not os.path.lexists(local.dest):
        return
    if os.path.islink(local.dest):
        target = os.path.normpath(os.path.join(os.path.dirname(local.dest), os.readlink(local.dest)))
        if os.path.dirname(target) != local.sidecar:
            raise DestinationError(f"{local.dest} is a symlink deltafs did not make; use --force to move it aside into {local.sidecar}")
        return
    reason = local.describe_foreign()
    if reason:
        raise DestinationError(f"{reason}; use --force to move it aside into {local.sidecar}")


def refuse_foreign(local: LocalCheckpoint, store_id: str, force: bool) -> LocalState | None:
    """The usable local state, or an error if DEST holds something that is not ours to replace."""
    local.check_safe()
    state = local.state()
    if state is not None and state.store_id != store_id:
        if not force:
            raise ForeignStoreError(
                f"{local.dest} holds a checkpoint of another store ({state.store_url}, id {state.store_id[:8]}); use --force to replace it"
            )
        return None
    reason = local.describe_foreign()
    if reason and not force:
        raise DestinationError(f"{reason}; use --force to move it aside into {local.sidecar}")
    return state


# path -> (its stat key, its Manifest, its other members). Not the parsed manifest JSON: for a 70B model that is
# ~100 MB of Python objects that nothing reads once the Manifest is built.
_STATE_MEMO: dict[str, tuple[tuple[int, ...], Manifest, dict[str, Any]]] = {}
_STATE_MEMO_LOCK = threading.Lock()
_STATE_MEMO_SIZE = 16


def _state_key(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _remember_state(path: str, manifest: Manifest, record: dict[str, Any], key: tuple[int, ...] | None = None) -> None:
    """Remember a state record as read, under its stat key. Install calls it for the one it just wrote (the key
    taken after the rename, so any later change to the file, which moves its ctime, makes it be read again)."""
    if key is None:
        key = _state_key(os.stat(path, follow_symlinks=False))
    with _STATE_MEMO_LOCK:
        if path not in _STATE_MEMO and len(_STATE_MEMO) >= _STATE_MEMO_SIZE:
            _STATE_MEMO.pop(next(iter(_STATE_MEMO)))
        _STATE_MEMO[path] = (key, manifest, dict(record))


def _read_state_file(path: str) -> tuple[tuple[int, ...], tuple[Manifest, dict[str, Any]] | None, bytes]:
    """(stat key, the memo's (manifest, members) if the file is unchanged since it was read, else None; its bytes,
    b"" on a memo hit). Opened without following a link or blocking; FormatError unless a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise FormatError(f"no usable deltafs state at {path} ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path} is not a regular file")
        key = _state_key(st)
        with _STATE_MEMO_LOCK:
            hit = _STATE_MEMO.get(path)
        if hit is not None and hit[0] == key:
            return key, (hit[1], dict(hit[2])), b""
        return key, None, os.read(fd, DEST_STATE_MAX_BYTES + 1)
    finally:
        os.close(fd)


def read_version_state(version_dir: str) -> tuple[Manifest, dict[str, Any]]:
    """The manifest and the other members of the state record pull wrote beside a version directory (<dir>.json);
    FormatError if unusable.

    A pull or push looks at the same few state files several times (state, cleanup, refuse_foreign); each is
    parsed and checked once per process while its inode, size, mtime and ctime stay the same (ctime cannot be
    set back, so an edited file is always read again).
    """
    path = version_dir.rstrip("/") + ".json"
    key, hit, data = _read_state_file(path)
    if hit is not None:
        return hit
    known = _known_embedded(data)
    if known is not None:
        _remember_state(path, known[0], known[1], key)
        return known
    raw = parse_dest_state(data)
    embedded = raw.pop("manifest")
    text = embedded_manifest_text(data)
    if text is not None and dest_state_bytes(raw, text) != data:
        # Not a record as deltafs writes it (a duplicate or nested "manifest" member, other spacing): the slice may
        # not be the member json.loads kept, so the parsed manifest is checked by encoding it instead.
        text = None
    # The manifest a push or pull has just checked (the store's, the one it installed) is embedded verbatim.
    manifest = (Manifest.known(text) if text is not None else None) \
        or Manifest.from_parsed(embedded, where=path, text=text)
    _remember_state(path, manifest, raw, key)
    return manifest, raw


def _known_embedded(data: bytes) -> tuple[Manifest, dict[str, Any]] | None:
    """The record's (manifest, other members) without parsing the manifest, when it embeds one this process has
    checked already (a push reads its cache's record after decoding the same version from the store): a 70B
    model's record is 10.5 MB of JSON, ~0.35 s to parse. None otherwise (parse it all).

    The members are parsed with a placeholder where the manifest's text is, and accepted only if they and the
    known manifest's canonical JSON encode back to exactly the record's bytes: then the record is one deltafs
    wrote (one "manifest" member, canonical), and json.loads of it would have given these members and this manifest.
    """
    span = embedded_manifest_span(data) if len(data) <= DEST_STATE_MAX_BYTES else None
    manifest = Manifest.known(data[span[0]:span[1]]) if span is not None else None
    beside = _members_beside_manifest(data, span) if manifest is not None else None
    if manifest is None or beside is None:
        return None
    return (manifest, beside) if dest_state_bytes(beside, manifest.to_bytes()) == data else None


def _members_beside_manifest(data: bytes, span: tuple[int, int] | None = None) -> dict[str, Any] | None:
    """A state record's members other than "manifest", parsed with a placeholder where embedded_manifest_span
    (given, or found here) guesses the manifest's text lies; None if there is no such guess or the rest is not a
    state record. A guess to check, as embedded_manifest_text's: the callers decide what it may stand for."""
    if span is None:
        span = embedded_manifest_span(data) if len(data) <= DEST_STATE_MAX_BYTES else None
        if span is None:
            return None
    try:
        raw = parse_dest_state(data[:span[0]] + b"{}" + data[span[1]:])
    except FormatError:
        return None
    raw.pop("manifest")
    return raw


def weight_version(version: int) -> str:
    """The weight_version string an engine reports for a deltafs version (its number)."""
    return str(int(version))


def labelled_version_dirs(dest: str, version: str) -> list[tuple[str, Manifest]]:
    """The verified version directories beside DEST whose weight version is `version`, newest name first, with their
    manifests. More than one store can have left one: a store deleted and pushed again by a new run starts over at
    version 1, and a pull (--force, or a watcher) keeps the old run's directories until cleanup."""
    found = []
    for path in reversed(LocalCheckpoint(dest).version_dirs()):
        try:
            manifest = read_version_state(path)[0]
        except FormatError:
            continue
        if weight_version(manifest.version) == version:
            found.append((path, manifest))
    return found


def find_version_dir(dest: str, version: str) -> str | None:
    """The verified version directory beside DEST whose weight version is `version`, if pull kept it; None also when
    directories of that number from two stores are there: the number alone does not say which one an engine holds."""
    found = labelled_version_dirs(dest, version)
    return found[0][0] if found and len({m.store_id for _, m in found}) == 1 else None
