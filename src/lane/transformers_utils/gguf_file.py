"""A lean GGUF reader: metadata and tensor records from a memory map.

``gguf.GGUFReader`` builds a numpy view per metadata element, which takes
seconds for a 49k-token vocabulary; reading the same bytes with ``struct``
takes milliseconds. Tensor data stays a zero-copy view into the map. Only numpy
here (and the gguf package's size tables): the API server and the bench client read
a GGUF's config and tokenizer through it without loading any model code.
"""
from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF lists dimensions innermost first)
    tensor_type: int  # gguf.GGMLQuantizationType value
    data: np.ndarray  # raw bytes (uint8), a view into the file


class GGUFFile:
    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if self.version < 2:
            raise ValueError(f"{path}: GGUF version {self.version} is not supported")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            qtype, offset = self._unpack("<IQ")
            infos.append((name, dims, qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors = [GGUFTensor(name, tuple(int(d) for d in reversed(dims)), qtype,
                                   self._tensor_bytes(data_start + offset, dims, qtype))
                        for name, dims, qtype, offset in infos]

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return self._map[start:start + n].decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])[0]
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, count = self._unpack("<IQ")
            if item_type in _NUMPY:  # numbers: one frombuffer, not count unpacks
                dt = np.dtype(_NUMPY[item_type]).newbyteorder("<")
                arr = np.frombuffer(self._map, dtype=dt, count=count, offset=self._pos)
                self._pos += count * dt.itemsize
                return arr.tolist()
            return [self._value(item_type) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    def _tensor_bytes(self, start: int, dims, qtype: int) -> np.ndarray:
        import gguf

        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        n = int(np.prod(dims, dtype=np.int64)) if dims else 1
        nbytes = n // block * type_size
        return np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=start)


@functools.lru_cache(maxsize=4)
def open_gguf(path: str) -> GGUFFile:
    """Parsed once per process."""
    return GGUFFile(path)


def gguf_field(reader: GGUFFile, key: str, default=None):
    """One metadata value of a GGUF file, or ``default`` when it has none."""
    return reader.metadata.get(key, default)
