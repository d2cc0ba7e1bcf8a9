"""Host memory: large tensors backed by transparent huge pages, and copies to the device that
do not wait for it.

The CPU kernels read the KV pool in scattered runs of a few KB (one block of one layer), and
each run on a 4 KB page costs a TLB miss and a cold start of the hardware prefetcher.
Backed by 2 MB pages, the same decode-step attention ran about 15% faster (BENCHMARKS.md).
Linux gives anonymous memory huge pages when asked with madvise (the usual
`transparent_hugepage=madvise` setting); elsewhere this is an ordinary zeroed allocation.
"""

from __future__ import annotations

import math
import mmap
import warnings
from pathlib import Path

import torch

_HUGE_PAGE = 2 << 20


def read_only_tensor(array) -> torch.Tensor:
    """A tensor over a read-only numpy array (a GGUF file's mapping) without a copy, for kernels
    that only read it: torch.from_numpy warns that writing to it would be undefined."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor on 2 MB-aligned anonymous memory advised MADV_HUGEPAGE.

    Pages are committed on first touch, so an unused part of a large pool costs no memory. The
    tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages: plain pages then
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE  # huge pages back only 2 MB-aligned ranges
    return raw[start:start + nbytes].view(dtype).view(shape)


def huge_page_slots(sizes: list[int]) -> list[torch.Tensor]:
    """Uint8 tensors of `sizes` bytes, each 64-byte aligned, one after another in one huge-page
    arena. One arena rather than one mapping each: a mapping's last 2 MB page is committed
    whole, which over a hundred matrices would waste a hundred MB."""
    if not sizes:
        return []
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + -(-size // 64) * 64)
    arena = huge_page_zeros((offsets[-1],), torch.uint8)
    return [arena[start:start + size] for start, size in zip(offsets, sizes)]


def huge_page_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of `tensors` in one huge-page arena (huge_page_slots)."""
    slots = huge_page_slots([t.numel() * t.element_size() for t in tensors])
    return [slot.view(t.dtype).view(t.shape).copy_(t) for slot, t in zip(slots, tensors)]


def memory_available(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process can still take: the kernel's MemAvailable (free memory and the page
    cache it can drop, such as a memory-mapped model file's pages), lowered to what the cgroup's
    limit leaves (cgroup v2 memory.max less memory.current) in a container. None where neither
    can be read."""
    found = []
    try:
        meminfo = dict(line.split(":", 1) for line in (proc / "meminfo").read_text().splitlines() if ":" in line)
        found.append(int(meminfo["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to a GPU without waiting for the work queued there: through pinned
    memory, non-blocking. A plain copy waits for the stream to drain, and under async scheduling
    the stream holds the last step, still running, while the next one is prepared. On a CPU the
    tensor itself."""
    if device.type != "cuda":
        return t
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # (t.pin_memory() first asks the driver
    pinned.copy_(t)                                                # whether t is pinned: 60 us a call)
    return pinned.to(device, non_blocking=True)
