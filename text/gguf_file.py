"""A GGUF file's metadata and tensor table, read straight from a memory map.

The `gguf` package's GGUFReader builds a numpy view per value (about 10^6 of them for a 49k-token
vocabulary with its merges): 6-10 s for the default model on a 2-core CPU, paid by every tokenizer
and model load. This reader parses the same layout with `struct` over the mapped bytes, decodes
string arrays in one pass, and reads numeric arrays with one `np.frombuffer` each (about 0.2 s).
Tensor data stays in the map: `GGUFTensor.data` is a view shaped as GGUFReader shapes it (typed
for float and integer tensors, bytes per row for quantized ones), so `gguf.quants.dequantize`
takes it as is. The `gguf` package stays the source of the type codes and block sizes, and the
writer tests use.

Layout (little-endian; versions 2 and 3): b"GGUF", uint32 version, uint64 tensor count, uint64
key/value count; the key/value pairs (string key, uint32 type, value; an array is uint32 item
type, uint64 count, items; a string is uint64 length + UTF-8 bytes); the tensor infos (string
name, uint32 n_dims, uint64 dims (fastest first), uint32 type, uint64 offset); then the data,
starting at the next multiple of `general.alignment` (default 32).

Every problem raises GGUFFormatError (a ValueError) saying what is wrong and where; callers add
the file's name.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALARS = {  # value type -> (struct format, numpy dtype)
    GGUFValueType.UINT8: ("<B", np.uint8), GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16), GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32), GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32), GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64), GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}
_TYPED_TENSORS = {  # tensor types whose data is viewed as numbers, not bytes
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file (truncated, corrupted, unsupported version)."""


@dataclasses.dataclass(frozen=True)
class GGUFField:
    name: str
    type: GGUFValueType
    value: Any  # a Python scalar or str; for arrays a list of str or a numpy array
    item_type: GGUFValueType | None = None  # arrays only

    def contents(self) -> Any:
        """The value as Python objects (arrays as lists), as gguf's ReaderField.contents()."""
        return self.value.tolist() if isinstance(self.value, np.ndarray) else self.value

    def __len__(self) -> int:
        if self.item_type is None:
            raise TypeError(f"GGUF field {self.name!r} is not an array")
        return len(self.value)


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # a read-only view of the map


class _Cursor:
    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFFormatError(f"{what} at byte {self.pos} runs past the end ({self.size} bytes)")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return out[0] if len(out) == 1 else out

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value_type(self, what: str) -> GGUFValueType:
        code = self.unpack("<I", what)
        try:
            return GGUFValueType(code)
        except ValueError:
            raise GGUFFormatError(f"{what}: unknown value type {code} at byte {self.pos - 4}") from None


def _read_value(cur: _Cursor, vtype: GGUFValueType, key: str):
    if vtype == GGUFValueType.STRING:
        return cur.string(f"string value of {key!r}"), None
    if vtype in _SCALARS:
        fmt, _ = _SCALARS[vtype]
        value = cur.unpack(fmt, f"value of {key!r}")
        return value, None
    if vtype != GGUFValueType.ARRAY:
        raise GGUFFormatError(f"{key!r}: unknown value type {vtype}")
    item = cur.value_type(f"array type of {key!r}")
    count = cur.unpack("<Q", f"array length of {key!r}")
    if item == GGUFValueType.STRING:
        cur.need(8 * count, f"{count} strings of {key!r}")  # each string has at least its length
        out = []
        buf, pos, size = cur.buf, cur.pos, cur.size
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                cur.pos = pos
                cur.need(8, f"a string of {key!r}")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > size:
                cur.pos = pos
                cur.need(n, f"a string of {key!r}")
            out.append(bytes(buf[pos : pos + n]).decode("utf-8", errors="replace"))
            pos += n
        cur.pos = pos
        return out, item
    if item not in _SCALARS:
        raise GGUFFormatError(f"{key!r}: arrays of {item.name} are not supported")
    dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
    cur.need(count * dtype.itemsize, f"{count} values of {key!r}")
    arr = np.frombuffer(cur.buf, dtype=dtype, count=count, offset=cur.pos).copy()
    cur.pos += count * dtype.itemsize
    return arr, item


class GGUFFile:
    """A parsed GGUF file: `fields` (name -> GGUFField), `tensors` (in file order), `version`."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4 or f.read(4) != MAGIC:
                raise GGUFFormatError("not a GGUF file (no GGUF magic bytes)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self._map, size)
        cur.pos = 4
        self.version = cur.unpack("<I", "version")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {self.version} is not supported (2 and 3 are)")
        n_tensors, n_fields = cur.unpack("<QQ", "tensor and key counts")
        # Every key/value takes at least 8 + 4 + 1 bytes, every tensor info 8 + 4 + 4 + 8.
        cur.need(13 * n_fields + 24 * n_tensors, f"{n_fields} keys and {n_tensors} tensor infos")
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_fields):
            key = cur.string("a metadata key")
            vtype = cur.value_type(f"type of {key!r}")
            value, item = _read_value(cur, vtype, key)
            self.fields[key] = GGUFField(key, vtype, value, item)
        infos = []
        for _ in range(n_tensors):
            name = cur.string("a tensor name")
            n_dims = cur.unpack("<I", f"dimension count of tensor {name!r}")
            if n_dims > 8:
                raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions")
            dims = cur.unpack(f"<{n_dims}Q", f"dimensions of tensor {name!r}") if n_dims else ()
            dims = (dims,) if isinstance(dims, int) else tuple(dims)
            code, offset = cur.unpack("<IQ", f"type and offset of tensor {name!r}")
            try:
                ttype = GGMLQuantizationType(code)
            except ValueError:
                raise GGUFFormatError(f"tensor {name!r} has unknown type {code}") from None
            infos.append((name, dims, ttype, offset))
        alignment = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields \
            else DEFAULT_ALIGNMENT
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        seen = set()
        for name, dims, ttype, offset in infos:
            if name in seen:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            seen.add(name)
            self.tensors.append(_tensor(self._map, size, name, dims, ttype, data_start + offset))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()


def _tensor(buf, size: int, name: str, dims: tuple[int, ...], ttype, start: int) -> GGUFTensor:
    if ttype not in GGML_QUANT_SIZES:
        raise GGUFFormatError(f"tensor {name!r}: type {ttype.name} has no known block size")
    block, type_size = GGML_QUANT_SIZES[ttype]
    n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if dims and dims[0] % block:
        raise GGUFFormatError(f"tensor {name!r}: row of {dims[0]} is not a multiple of {ttype.name}'s {block}")
    n_bytes = n_elements // block * type_size
    if start + n_bytes > size:
        raise GGUFFormatError(
            f"tensor {name!r} ({n_bytes} bytes at byte {start}) runs past the end ({size} bytes)")
    numpy_shape = tuple(reversed(dims))
    if ttype in _TYPED_TENSORS:
        dtype = np.dtype(_TYPED_TENSORS[ttype]).newbyteorder("<")
        data = np.frombuffer(buf, dtype=dtype, count=n_elements, offset=start).reshape(numpy_shape)
    else:
        byte_shape = (*numpy_shape[:-1], numpy_shape[-1] // block * type_size) if dims else (n_bytes,)
        data = np.frombuffer(buf, dtype=np.uint8, count=n_bytes, offset=start).reshape(byte_shape)
    return GGUFTensor(name, ttype, dims, n_elements, n_bytes, start, data)
