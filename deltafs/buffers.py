"""Page-aligned buffers for positional reads (pread/preadv/readinto), and read-only views of a file's page cache.

Where the kernel copies a file's bytes into a buffer matters: on AMD EPYC hosts (measured on a KVM guest with
FSRM: `rep movsb` copy_to_user) a pread of 4 MiB into a buffer at a 16-byte offset from a page runs at ~1.7 GB/s,
and into a page-aligned (or 32-byte-aligned) one at ~7 GB/s. malloc, bytearray and numpy put large buffers
16 bytes past a page boundary, and `os.pread` returns a bytes object whose data is 48 bytes past one, so every
large read went the slow way. See docs/profile.md, "Round 4". A push reads its large chunks without any copy,
through mappings (mapped_range; docs/profile.md, "Round 16").
"""

from __future__ import annotations

import errno
import mmap
import os
import sys

import numpy as np

PAGE = 4096
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python 3.11's mmap lacks the name
# Linux only (22 is another advice, or none, elsewhere); cleared for the process when the kernel refuses the populate.
_mapping = {"ok": sys.platform.startswith("linux") and hasattr(mmap.mmap, "madvise")}


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


def mapped_range(fd: int, size: int, offset: int) -> memoryview | None:
    """size bytes of a regular file at offset as a read-only view of its page cache (no copy), or None where the
    file or the kernel cannot map it that way (the caller reads instead).

    The range's page tables are filled in one call (MADV_POPULATE_READ) before the view is returned, so bytes the
    file no longer has (it was cut short since it was opened) are an EOFError here rather than a SIGBUS on
    access; only a file cut short in the microseconds between that call and the access can still raise SIGBUS.
    The mapping lives as long as the view (and views of it): nothing to close.
    """
    if not _mapping["ok"] or size <= 0:
        return None
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        m = mmap.mmap(fd, size + offset - start, access=mmap.ACCESS_READ, offset=start)
    except ValueError:  # past the end of the file
        raise EOFError(f"{size} bytes at {offset} lie past the end of the file") from None
    except OSError:
        return None  # a file that cannot be mapped (a pipe, some FUSE filesystems): read it
    try:
        m.madvise(MADV_POPULATE_READ)
    except OSError as exc:
        m.close()
        if exc.errno == errno.EFAULT:
            raise EOFError(f"{size} bytes at {offset} lie past the end of the file") from None
        if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
            _mapping["ok"] = False  # a kernel before 5.14: without the populate a short file is a SIGBUS
        # Otherwise (a signal, memory pressure, an I/O error) the caller reads the range: a read retries what can
        # be retried and reports a real I/O error as one.
        return None
    return memoryview(m)[offset - start:]
