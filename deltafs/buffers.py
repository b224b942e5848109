"""Page-aligned buffers for positional reads (pread/preadv/readinto).

Where the kernel copies a file's bytes into a buffer matters: on AMD EPYC hosts (measured on a KVM guest with
FSRM: `rep movsb` copy_to_user) a pread of 4 MiB into a buffer at a 16-byte offset from a page runs at ~1.7 GB/s,
and into a page-aligned (or 32-byte-aligned) one at ~7 GB/s. malloc, bytearray and numpy put large buffers
16 bytes past a page boundary, and `os.pread` returns a bytes object whose data is 48 bytes past one, so every
large read went the slow way. See docs/profile.md, "Round 4".
"""

from __future__ import annotations

import os

import numpy as np

PAGE = 4096


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

