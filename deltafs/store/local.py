"""A store in a local or network-mounted directory, written with temp file + fsync + rename."""

from __future__ import annotations

import errno
import os
import stat
import time
import uuid

from deltafs.errors import FormatError, StoreError, UsageError
from deltafs.store.base import Capabilities, ObjectStore, RetryPolicy

TEMP_PREFIX = ".tmp-"

# Mount types whose changes made on other machines are late in listings and raise no file events
# here (NFS attribute cache up to acdirmax=60 s, FUSE, cluster filesystems). Matched as prefixes.
NETWORK_FS = ("nfs", "cifs", "smb", "fuse", "9p", "ceph", "lustre", "gpfs", "beegfs", "glusterfs", "afs")


def mount_fstype(path: str, mounts: str | None = None) -> str | None:
    """The filesystem type of the mount holding path (from /proc/mounts), or None if unknown.

    A path that does not exist yet is judged by its nearest existing parent.
    """
    if mounts is None:
        try:
            with open("/proc/mounts", encoding="utf-8", errors="replace") as fh:
                mounts = fh.read()
        except OSError:
            return None
    path = os.path.realpath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    best, fstype = "", None
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, parts[2]
    return fstype


def is_network_fs(fstype: str | None) -> bool:
    return fstype is not None and fstype.startswith(NETWORK_FS)


def _check_name_lengths(root: str, url: str) -> None:
    """UsageError (exit 2) for a store path with a name longer than its filesystem allows: it was said as "cannot
    read deltafs.json at ...: File name too long" (exit 3), as if a store were there (adversarial pass)."""
    existing = root
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if limit <= 0:  # not known (-1), or a filesystem that reports none (some FUSE ones: 0)
        limit = 255
    for name in os.path.relpath(root, existing).split(os.sep):  # the names that exist fit their filesystem
        size = len(os.fsencode(name))
        if size > limit:
            raise UsageError(f"cannot use {url} as a store: a name in its path is {size} bytes long, and this "
                             f"filesystem allows at most {limit}")


class LocalObjectStore(ObjectStore):
    """A directory tree: key a/b/c is the file ROOT/a/b/c."""

    capabilities = Capabilities(atomic_put=True, atomic_create=True, file_events=True)

    def __init__(self, root: str, url: str, *, retry: RetryPolicy | None = None, max_workers: int | None = None) -> None:
        # A local disk is bandwidth-bound: about one request per core keeps it busy.
        super().__init__(url, retry=retry, max_workers=max_workers or os.cpu_count() or 1)
        self.root = os.path.abspath(root).rstrip("/") or "/"
        _check_name_lengths(self.root, url)
        self.fstype = mount_fstype(self.root)
        if is_network_fs(self.fstype):
            self.declare(read_after_write=False, file_events=False)

    def path(self, key: str) -> str:
        return os.path.join(self.root, key)

    @property
    def local_root(self) -> str | None:
        return self.root

    def event_dirs(self) -> list[str]:
        if not self.capabilities.file_events:
            return []
        # HEAD is replaced in the root and manifests are created in manifests/; chunks/ would
        # flood a watcher with events during every push.
        return [d for d in (self.root, os.path.join(self.root, "manifests")) if os.path.isdir(d)]

    def _denied_hint(self) -> str:
        return "check file permissions"

    # --- primitives ------------------------------------------------------------------------------
    def _read(self, key: str, limit: int | None) -> bytes:
        path = self.path(key)
        # O_NONBLOCK: opening a FIFO planted as HEAD must not hang; O_NOFOLLOW: never read through a planted link.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise FormatError(f"{key} in {self.url} is a symbolic link, not an object deltafs wrote") from None
            raise
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "a directory, not an object", path)  # a key prefix: not found
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{key} in {self.url} is not a regular file")
            # One byte past limit shows a file larger than limit; a file within it is read to its size (no extra
            # read to find the end: objects are immutable, and callers check what they read).
            want = st.st_size if limit is None or st.st_size <= limit else limit + 1
            parts, got = [], 0
            while got < want:
                block = os.read(fd, min(want - got, 16 << 20))
                if not block:
                    break
                parts.append(block)
                got += len(block)
            return b"".join(parts)
        finally:
            os.close(fd)

    def _parent_fd(self, key: str) -> tuple[int, str]:
        """(an fd of the directory that holds key, key's last component); the directory is created if missing.

        Opened one component at a time from the root, never following a symlink: nothing is written through a
        link planted anywhere below the root (say chunks/ab -> /etc), and a link planted after the check cannot
        redirect the write either (the writes go through this fd).
        """
        *parts, name = key.split("/")
        try:
            try:
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                os.makedirs(self.root, exist_ok=True)  # a store being created (its first object)
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError, FileExistsError) as exc:
            # Said as what it is (the root is a file, under a file, or somewhere nothing can be made: /proc/x), not
            # as a missing key, which the caller would report as "deltafs.json not found".
            raise StoreError(f"cannot use {self.root} as a store directory: {exc.strerror or exc}") from None
        probe = self.root
        try:
            for part in parts:
                probe = os.path.join(probe, part)
                try:
                    sub = _open_subdir(part, fd)
                except FileNotFoundError:
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass  # another writer made it meanwhile
                    sub = _open_subdir(part, fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(probe):
                        raise StoreError(f"{probe} is a symlink; deltafs writes only into real directories of the "
                                         "store (remove it)") from None
                    raise
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd, name

    @staticmethod
    def _write_temp(dir_fd: int, data: bytes) -> str:
        """A new temp file in the directory, holding data, fsynced; its name."""
        tmp = f"{TEMP_PREFIX}{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp, dir_fd)  # a failed write (disk full) leaves no temp file behind
            raise
        os.close(fd)
        return tmp

    def _write(self, key: str, data: bytes) -> None:
        dir_fd, name = self._parent_fd(key)
        try:
            tmp = self._write_temp(dir_fd, data)
            try:
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                _unlink_quietly(tmp, dir_fd)
                raise
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _create(self, key: str, data: bytes, equal_is_ours: bool = True) -> bool:
        dir_fd, name = self._parent_fd(key)
        try:
            tmp = self._write_temp(dir_fd, data)
            try:
                # link(2) fails with EEXIST if the name is taken: an atomic create of a complete file.
                try:
                    os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
                except FileExistsError:
                    # NFSv3 may retransmit a LINK that already succeeded and answer EEXIST; the link
                    # count of our temp file tells whether the name is ours (the classic NFS lock trick).
                    if os.stat(tmp, dir_fd=dir_fd, follow_symlinks=False).st_nlink != 2:
                        return False
            finally:
                _unlink_quietly(tmp, dir_fd)
            os.fsync(dir_fd)
            return True
        finally:
            os.close(dir_fd)

    def _isfile(self, key: str) -> bool:
        return os.path.isfile(self.path(key))

    def _stat(self, key: str) -> tuple[int, float | None]:
        # The entry itself, as reads see it (O_NOFOLLOW): a link planted under a key is a link, whose size and age
        # are its own (gc removes the link, never what it points at), and a dangling one is still there to remove.
        st = os.lstat(self.path(key))
        return st.st_size, st.st_mtime

    def _find(self, prefix: str) -> list[str]:
        base = self.path(prefix.rstrip("/"))
        keys = []

        def fail(exc: OSError) -> None:
            if not isinstance(exc, FileNotFoundError):
                raise exc

        for dirpath, _dirs, files in os.walk(base, onerror=fail):
            for name in files:
                if name.startswith(TEMP_PREFIX):
                    continue
                full = os.path.join(dirpath, name)
                keys.append(os.path.relpath(full, self.root).replace(os.sep, "/"))
        return keys

    def _remove(self, key: str) -> None:
        os.unlink(self.path(key))

    # --- leftovers of killed writers -----------------------------------------------------------
    def leftovers(self, older_than: float, written_before: float = float("inf")) -> dict[str, int]:
        """`.tmp-*` files (a writer killed mid-write) older than `older_than` seconds: path -> size."""
        now = time.time()
        out = {}
        dirs = [self.root]  # HEAD and the store config are written through temp files at the top
        for top in ("chunks", "manifests", "folds", "bridges", "locks", "fleet"):
            dirs += [d for d, _sub, _files in os.walk(os.path.join(self.root, top))]
        for directory in dirs:
            try:
                names = [n for n in os.listdir(directory) if n.startswith(TEMP_PREFIX)]
            except OSError:
                continue
            for name in names:
                path = os.path.join(directory, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if now - st.st_mtime >= older_than and st.st_mtime < written_before:
                    out[path] = st.st_size
        return out

    def remove_leftover(self, name: str) -> None:
        if os.path.basename(name).startswith(TEMP_PREFIX) and os.path.dirname(os.path.abspath(name)).startswith(self.root):
            _unlink_quietly(name)


def _open_subdir(name: str, dir_fd: int) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _unlink_quietly(path: str, dir_fd: int | None = None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass
