"""How the OS backs a CPU stage's big buffers: 2 MiB pages for weights, 4 KiB pages for the KV pool.

A CPU decode step streams every weight from memory once, so it runs at the memory bandwidth one
core can draw, and 4 KiB pages cost some of it: a TLB walk every 4 KiB, and hardware prefetchers
that stop at each page boundary. PyTorch's CPU allocator backs every allocation of 2 MiB or more
with transparent huge pages when THP_MEM_ALLOC_ENABLE=1 is in the environment a program starts
with (c10/core/impl/alloc_cpu.cpp reads it once, at the first allocation). serve and bench set it
for themselves and the processes they start (programs/process.py); pods opt in: a cluster run with
it on everywhere failed an e2e test with a frontend that refused connections after the mesh was
ready, cause not established (direct compaction stalling a process on a busy node is one
candidate; two cluster runs with it on since passed). Measured on the 2-core AVX-512 EPYC (THP
"madvise", as most distributions ship it), llama-150m float32, the whole model's forward for
one token, one thread, 6 rounds interleaved: 16.64 -> 15.58 ms (medians; every round faster); its
48 matmuls alone 12.1 -> 11.6 ms.

The KV pool is the exception. It is allocated once and committed by the OS page by page as
blocks are written (kv_pool.py); its layout puts each (layer, head) region's slots together, so a
2 MiB page would commit the positions of many blocks nobody wrote yet: llama-150m's 12 layers x
2 x 12 heads would commit 576 MiB on the first token. `keep_small_pages` asks for 4 KiB pages
for such a buffer, whatever the process or the system's THP setting says (`always` included).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable
from typing import Protocol

MADV_NOHUGEPAGE = 15  # <asm-generic/mman-common.h>
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class HostBuffer(Protocol):
    """What keep_small_pages reads of a tensor (torch is not imported here)."""

    @property
    def device(self) -> object: ...
    def data_ptr(self) -> int: ...
    def numel(self) -> int: ...
    def element_size(self) -> int: ...


def keep_small_pages(buffer: HostBuffer) -> bool:
    """Back a CPU buffer nobody has written yet with 4 KiB pages (madvise MADV_NOHUGEPAGE on the
    whole pages it spans), so that the OS commits it as it is written. False where that cannot be
    asked (not Linux, not a CPU buffer, a libc without madvise): the buffer is then as allocated."""
    if sys.platform != "linux" or getattr(buffer.device, "type", None) != "cpu":
        return False
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    first, last = -(-start // PAGE_BYTES) * PAGE_BYTES, end // PAGE_BYTES * PAGE_BYTES
    if last <= first:
        return False
    madvise = _madvise()
    return madvise is not None and madvise(first, last - first, MADV_NOHUGEPAGE) == 0


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # this process's own symbols, libc's among them
    except OSError:
        return None
    madvise = getattr(libc, "madvise", None)
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
    return madvise


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing). Loading a
    CPU stage frees about as much as it keeps (each weight read, then packed or fused anew), and
    glibc keeps freed pages that lie between ones in use: 25 MB of a 57 MB float32 stage, resident
    until trimmed (tests/test_stage_loader.py's peak-memory model, 3 layers and the head)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
