"""A CPU model's weights moved into one arena on transparent huge pages.

A decode step reads every weight once, after the KV cache's stream has pushed them out of the L3:
on 4 KiB pages that is a page walk per 4 KiB of weights, which the kernels' prefetches do not
hide (Sapphire Rapids under KVM, SmolLM2's gate_up at 64 rows with its 33 MB from DRAM: 6.0-6.4
ms on 4 KiB pages, 5.1-5.2 ms on 2 MiB ones; 4.5-4.8 ms from the L3). One arena, not a huge page
per tensor: most of a small model's tensors are under 2 MiB.

Only whole tensors move (a tensor that owns its storage; tensors sharing one, a tied embedding and
LM head, move together), each to a view of the arena with its dtype and shape, so the modules
hold the same values in the same places; nothing reads a pointer taken before this runs (the
fused decode plan is built at the first step). Where the kernel gives no huge pages the arena is
plain memory, and nothing else changes.
"""
from __future__ import annotations

import ctypes
import logging
import sys
import time

import torch
from torch import nn

from lane import platform

logger = logging.getLogger(__name__)

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MIN_BYTES = 256 << 10  # smaller tensors (norms, biases, scales) are not worth the copy
_ALIGN = 4096


def _owned(t: torch.Tensor) -> bool:
    """t is a CPU tensor that is all of its storage (no view into another's)."""
    return (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _slots(model: nn.Module):
    """(tensor, put) for every tensor a module holds: parameters, buffers, tensor attributes and
    a fused layer's GGUF parts; put(new) makes the holder hold new instead."""
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                yield p.data, (lambda new, p=p: setattr(p, "data", new))
        for name, b in m._buffers.items():
            if b is not None:
                yield b, (lambda new, m=m, name=name: m._buffers.__setitem__(name, new))
        for name, v in vars(m).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                yield v, (lambda new, m=m, name=name: setattr(m, name, new))
        for part in getattr(m, "qparts", None) or ():
            yield part.blocks, (lambda new, part=part: setattr(part, "blocks", new))


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Moves the model's CPU tensors of 256 KiB and more into one arena advised onto transparent
    huge pages (Linux; elsewhere nothing moves); returns the bytes moved."""
    if not sys.platform.startswith("linux"):
        return 0
    t0 = time.monotonic()
    groups: dict[int, list] = {}  # storage address -> its holders' (tensor, put)
    for t, put in _slots(model):
        if t.numel() * t.element_size() >= _MIN_BYTES and _owned(t):
            groups.setdefault(t.data_ptr(), []).append((t, put))
    if not groups:
        return 0
    sizes = [-(-holders[0][0].untyped_storage().nbytes() // _ALIGN) * _ALIGN for holders in groups.values()]
    total = sum(sizes)
    raw = torch.empty(total + _HUGE, dtype=torch.uint8)  # not touched yet: faulted in by the copies below
    start = (-raw.data_ptr()) % _HUGE
    arena = raw[start:start + total]
    madvise = platform.libc_madvise()
    advised = madvise is not None and madvise(arena.data_ptr(), -(-total // _HUGE) * _HUGE, _MADV_HUGEPAGE) == 0
    errno = ctypes.get_errno()
    offset = 0
    for holders, size in zip(groups.values(), sizes):
        first = holders[0][0]
        place = arena[offset:offset + first.untyped_storage().nbytes()]
        place.copy_(first.view(-1).view(torch.uint8))
        views: dict[int, torch.Tensor] = {}  # one new tensor for each old one: who shared a tensor still does
        for t, put in holders:  # (each its own dtype and shape of the same bytes)
            put(views.setdefault(id(t), place.view(t.dtype).view(t.shape)))
        offset += size
    logger.info("Weights: %.1f MiB moved into one arena in %.2f s, %s", total / 2**20, time.monotonic() - t0,
                "on transparent huge pages" if advised else f"on 4 KiB pages (madvise: errno {errno})")
    return total
