"""Page-aligned buffers for positional reads (pread/preadv/readinto), and read-only views of a file's page cache.

Where the kernel copies a file's bytes into a buffer matters: on AMD EPYC hosts (measured on a KVM guest with
FSRM: `rep movsb` copy_to_user) a pread of 4 MiB into a buffer at a 16-byte offset from a page runs at ~1.7 GB/s,
and into a page-aligned (or 32-byte-aligned) one at ~7 GB/s. malloc, bytearray and numpy put large buffers
16 bytes past a page boundary, and `os.pread` returns a bytes object whose data is 48 bytes past one, so every
large read went the slow way. See docs/profile.md, "Round 4". A push reads its large chunks without any copy,
through mappings (mapped_range; docs/profile.md, "Round 16"), made by deltafs/_mapped.c so that a file cut short
while a view of it is read is a mark on the view, not a SIGBUS (docs/profile.md, "Round 17").
"""

from __future__ import annotations

import errno
import os
import stat

import numpy as np

PAGE = 4096
MADV_POPULATE_READ = 22  # Linux 5.14; Python 3.11's mmap lacks the name
try:  # the guarded mappings (deltafs/_mapped.c, Linux; optional): without them large chunks are read, not mapped
    from deltafs import _mapped
except ImportError:  # pragma: no cover - depends on the build
    _mapped = None  # type: ignore[assignment]
# Cleared for the process when the kernel refuses the populate (Linux before 5.14).
_mapping = {"ok": _mapped is not None}


def aligned_empty(size: int) -> np.ndarray:
    """An uninitialized uint8 array of `size` bytes whose first byte is page-aligned (keeps its base alive)."""
    raw = np.empty(size + PAGE, dtype=np.uint8)
    skip = -raw.ctypes.data % PAGE
    return raw[skip:skip + size]


def pread_aligned(fd: int, size: int, offset: int, buf: np.ndarray | None = None) -> np.ndarray:
    """Up to `size` bytes of fd at offset, read into buf (page-aligned, at least size bytes) or a new aligned array.

    Returns the bytes read as a view of the buffer: shorter than size only at the end of the file.
    """
    out = aligned_empty(size) if buf is None else buf[:size]
    got = 0
    while got < size:
        n = os.preadv(fd, [out[got:].data], offset + got)
        if n == 0:
            break
        got += n
    return out[:got]


def open_regular(path: str) -> int:
    """A read-only fd of path, which must be a regular file (links followed): opened without blocking, then checked,
    so a FIFO or device planted where a file belongs (in DEST, in a push cache) is an OSError here, not an open or
    a read that blocks forever. Reads of a regular file do not heed O_NONBLOCK."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def mapped_range(fd: int, size: int, offset: int) -> memoryview | None:
    """size bytes of a regular file at offset as a read-only view of its page cache (no copy), or None where the
    file, the kernel or the build cannot map it that way (the caller reads instead).

    The range's page tables are filled in one call (MADV_POPULATE_READ) before the view is returned, so bytes the
    file no longer has (it was cut short since it was opened) are an EOFError here. A file cut short later, while
    the view is read, does not kill the process with SIGBUS: deltafs/_mapped.c maps zeros over what is gone and
    marks the view (`faulted`), and the caller, having used the bytes, must ask `cut_short(view, fd)` before it
    trusts what it computed from them. The mapping lives as long as the view (and views of it): nothing to close.
    """
    if not _mapping["ok"] or size <= 0:
        return None
    try:
        rng = _mapped.map(fd, size, offset, MADV_POPULATE_READ)
    except OSError as exc:
        if exc.errno == errno.EFAULT:
            raise EOFError(f"{size} bytes at {offset} lie past the end of the file") from None
        if exc.filename == "MADV_POPULATE_READ" and exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
            _mapping["ok"] = False  # a kernel before 5.14: without the populate a short file is not seen up front
        # Otherwise (a file that cannot be mapped, such as a pipe or some FUSE files; a signal, memory pressure or
        # an I/O error during the populate) the caller reads the range: a read retries what can be retried and
        # reports a real I/O error as one.
        return None
    return None if rng is None else memoryview(rng)


def mapping_on() -> bool:
    """Whether mapped_range maps (the module is built and the kernel populates), or every caller reads."""
    return _mapping["ok"]


def is_mapped(view: object) -> bool:
    """Whether view comes from mapped_range (or is a slice of such a view)."""
    return isinstance(view, memoryview) and _mapped is not None and isinstance(view.obj, _mapped.Range)


def faulted(view: object) -> bool:
    """Whether view (from mapped_range, or a slice of one) met bytes its file no longer had: they read as zeros, so
    nothing computed from it may be used. False for anything that is not such a view (a read cannot fault)."""
    return is_mapped(view) and view.obj.faulted  # type: ignore[attr-defined]


def mapped_end(view: object) -> int | None:
    """The file offset where the mapping behind view ends (for a slice, its whole mapping's), or None."""
    return view.obj.end if is_mapped(view) else None  # type: ignore[attr-defined]


def cut_short(view: object, fd: int) -> bool:
    """Whether the file fd was cut short into view's range while the view was used (faulted, or the file now ends
    before the range does: a cut inside the range's last page reads as zeros there without a fault). Ask after the
    last use of the bytes. False for a view that is not a mapping's (a read comes back short instead)."""
    if not is_mapped(view):
        return False
    rng = view.obj  # type: ignore[attr-defined]
    return bool(rng.faulted) or os.fstat(fd).st_size < rng.end
