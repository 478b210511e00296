"""HF directories: ``*.safetensors`` read memory-mapped, several files at once. Over several
tensor-parallel ranks each tensor comes as a ``LazyTensor``: a rank's layer narrows it to its
slice, and only that slice's bytes are read from the mapped file."""
from __future__ import annotations

import contextlib
import glob
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class ReadCounter:
    """Bytes of tensor data a load has read from the checkpoint (what a rank pays for)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, t: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self.bytes += t.numel() * t.element_size()
        return t


class LazyTensor:
    """A checkpoint tensor not read yet: ``narrow`` or ``[index]`` read one slice (a rank's),
    ``full`` all of it. Valid while the load runs (its file stays open until every file is done)."""

    def __init__(self, st, name: str, counter: ReadCounter | None = None) -> None:
        self._st, self._name = st, name
        self._slice = st.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())
        self.dtype = _DTYPES.get(self._slice.get_dtype())
        self._counter = counter or ReadCounter()

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self[(slice(None),) * dim + (slice(start, start + length),)]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        """Basic slices only (no steps): the bytes of that block are all that is read."""
        return self._counter.add(self._slice[index])

    def full(self) -> torch.Tensor:
        return self._counter.add(self._st.get_tensor(self._name))


def materialize(t):
    """A checkpoint tensor as a torch tensor (a LazyTensor read whole)."""
    return t.full() if isinstance(t, LazyTensor) else t


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def count_tensors(files: list[str]) -> int:
    from safetensors import safe_open

    n = 0
    for f in files:
        with safe_open(f, framework="pt") as st:
            n += len(list(st.keys()))
    return n


def load_safetensors(files: list[str], consume: Callable[[str, torch.Tensor], None],
                     num_threads: int = 4, on_tensor: Callable[[], None] | None = None, lazy: bool = False,
                     counter: ReadCounter | None = None) -> None:
    """Call ``consume(name, tensor)`` for every tensor, one thread per file (``lazy``: as
    LazyTensors, every file open until all are done: a tensor may wait for its mate from
    another file, an fp8 weight for its scales). ``consume`` must be safe to call
    concurrently for different names. ``counter`` adds up the bytes read."""
    from safetensors import safe_open

    counter = counter or ReadCounter()
    lock = threading.Lock()

    def one_file(st) -> None:
        for name in st.keys():
            consume(name, LazyTensor(st, name, counter) if lazy else counter.add(st.get_tensor(name)))
            if on_tensor:
                with lock:
                    on_tensor()

    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(f, framework="pt")) for f in files]
        with ThreadPoolExecutor(max_workers=max(1, min(num_threads, len(files)))) as pool:
            for fut in [pool.submit(one_file, st) for st in handles]:
                fut.result()
