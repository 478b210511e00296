"""HF directories: ``*.safetensors`` read memory-mapped, several files at once."""
from __future__ import annotations

import glob
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch


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
                     num_threads: int = 4, on_tensor: Callable[[], None] | None = None) -> None:
    """Call ``consume(name, tensor)`` for every tensor, one thread per file.
    ``consume`` must be safe to call concurrently for different names."""
    from safetensors import safe_open

    lock = threading.Lock()

    def one_file(path: str) -> None:
        with safe_open(path, framework="pt") as st:
            for name in st.keys():
                consume(name, st.get_tensor(name))
                if on_tensor:
                    with lock:
                        on_tensor()

    with ThreadPoolExecutor(max_workers=max(1, min(num_threads, len(files)))) as pool:
        for fut in [pool.submit(one_file, f) for f in files]:
            fut.result()
