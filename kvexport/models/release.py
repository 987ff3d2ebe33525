# SPDX-License-Identifier: Apache-2.0
"""Giving a model's memory back to the OS once it is dropped: :func:`free_memory` (collect, then trim glibc's
arenas) and :func:`drop_file_pages` (the resident pages of tensors memory-mapped from a checkpoint file)."""

from __future__ import annotations

from pathlib import Path

import torch


def free_memory() -> None:
    """Collect what was just dropped and give it back to the OS: glibc keeps freed blocks below its (adaptive) mmap
    threshold in its arenas, so without ``malloc_trim`` a released model's memory still counts in the RSS."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's file-backed mappings (Linux ``/proc/self/maps``; [] elsewhere)."""
    out = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/") and not parts[5].endswith("(deleted)") and parts[4] != "0":
            lo, hi = parts[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def drop_file_pages(tensors) -> int:
    """Give back the resident pages of tensors about to be dropped whose storage lies in a memory-mapped checkpoint
    file (a safetensors file loaded in place). The mapping holds the whole file, so freeing one tensor leaves the
    pages it was read from resident, counted in the RSS, for as long as any other tensor of the file lives; this
    tells the kernel they are not needed (``madvise(MADV_DONTNEED)``; a later read would fault them in again from
    the file). Only whole pages inside each tensor's own bytes are dropped. Call it only for tensors nothing reads
    any more: a private mapping's pages revert to the file's bytes. Returns the bytes advised (0 off Linux, or when
    no tensor is file-backed)."""
    import ctypes
    import mmap

    maps = _file_mappings()
    if not maps:
        return 0
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return 0
    page = mmap.PAGESIZE
    done = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
            continue
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        lo, hi = -(-start // page) * page, end // page * page
        if hi <= lo or not any(a <= lo and hi <= b for a, b in maps):
            continue
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4) == 0:  # MADV_DONTNEED
            done += hi - lo
    return done


__all__ = ["free_memory", "drop_file_pages"]
