"""The strict GGUF reader: gguf's GGUFReader, hardened against hostile files, for a file read whole.

A file the load cache (bitnet.modelfile.load_cache) knows is loaded without it, and without
importing gguf at all (~0.05 s of a warm load).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor

from bitnet.errors import ModelError
from bitnet.modelfile import formats

_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ELEMENTS = 1 << 40  # far beyond any model this engine could hold; larger is a corrupt header
_FLOAT_TYPES = {formats.GGML_F32, formats.GGML_F16, formats.GGML_BF16}
# bitnet.cpp's TL1/TL2 (its code generator's kernel-specific layouts) store each projection with a
# companion "<name>.weight_scale" tensor; their type ids also moved between versions of its fork.
_TL_HINT = ("a bitnet.cpp TL1/TL2 file (a layout tied to the kernels its code generator built for one "
            "model and CPU); convert the model again with bitnet.cpp's setup_env.py -q i2_s (or "
            "convert-hf-to-gguf-bitnet.py --outtype f32 then llama-quantize ... I2_S) to get an I2_S file")

_SCALAR_SIZES = {t: np.dtype(d).itemsize for t, d in GGUFReader.gguf_scalar_to_np.items()}
_MIN_SIZE = {**_SCALAR_SIZES, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}


class Reader(GGUFReader):
    """gguf's reader, made strict: reads past the end, counts that cannot fit in the file and
    absurd tensor headers raise instead of yielding short views or looping for ages, and
    I2_S (ggml type 36) tensors are accepted."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        count = int(count)
        end = int(offset) + np.dtype(dtype).itemsize * count
        if count < 0 or end > len(self.data):
            raise ModelError(f"truncated file: {count} x {np.dtype(dtype).name} at byte {offset} "
                             f"runs past the end ({len(self.data)} bytes)")
        # A plain ndarray view of the map: slicing np.memmap runs Python hooks per view, and a
        # GGUF header takes thousands of them.
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        arr = plain[int(offset):end].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    def _fits(self, offs: int, count: int, min_size: int, what: str) -> None:
        if int(count) * min_size > len(self.data) - offs:
            raise ModelError(f"truncated or corrupt file: {int(count)} {what} at byte {offs} "
                             f"cannot fit in {len(self.data)} bytes")

    def _build_fields(self, offs: int, count: int) -> int:
        self._fits(offs, count, 8 + 4 + 1, "metadata entries")
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[ReaderField]]:
        self._fits(offs, count, 8 + 4 + 8 + 4 + 8, "tensor infos")
        return super()._build_tensor_info(offs, count)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
        try:
            vtype = GGUFValueType(int(raw_type))
        except ValueError:
            raise ModelError(f"unknown metadata value type {int(raw_type)} at byte {orig_offs}") from None
        if vtype == GGUFValueType.ARRAY:
            item_type = int(self._get(orig_offs, np.uint32)[0])
            if item_type not in {int(t) for t in _MIN_SIZE}:
                raise ModelError(f"unknown metadata array type {item_type} at byte {orig_offs}")
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            self._fits(orig_offs + 12, count, _MIN_SIZE[GGUFValueType(item_type)], "array items")
            if item_type != GGUFValueType.ARRAY:
                return self._array_parts(orig_offs, GGUFValueType(item_type), count)
        return super()._get_field_parts(orig_offs, raw_type)

    def _array_parts(self, orig_offs: int, item_type: GGUFValueType,
                     count: int) -> tuple[int, list[Any], list[int], list[Any]]:
        """A scalar or string array without gguf's one-view-per-item loop (which takes ~20 s for a
        128k-token vocabulary). The parts are laid out so ReaderField.contents() still returns the
        whole list: a scalar array is one part, a string array one part per string."""
        head = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        offs = orig_offs + 12
        if item_type != GGUFValueType.STRING:
            values = self._get(offs, self.gguf_scalar_to_np[item_type], count)
            return 12 + int(values.nbytes), [*head, values], [2], [GGUFValueType.ARRAY, item_type]
        # Parts are memoryview slices (contents() only calls .tobytes() on them): a third of the
        # cost of one ndarray view per string, which matters for 400k tokens and merges.
        buf, end = memoryview(self.data).cast("B"), len(self.data)
        unpack_length = struct.Struct("<Q").unpack_from
        strings = []
        append = strings.append
        try:  # a length past the end makes the next unpack fail, or the final check
            for _ in range(count):
                start = offs + 8
                offs = start + unpack_length(buf, offs)[0]
                append(buf[start:offs])
        except struct.error:
            offs = end + 1
        if offs > end:
            raise ModelError(f"truncated file: string array at byte {orig_offs} runs past the end")
        parts = [*head, *strings]
        return offs - orig_offs, parts, list(range(2, len(parts))), [GGUFValueType.ARRAY, item_type]

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        file_size = len(self.data)
        tensors, names = [], set()
        all_names = {bytes(f.parts[1]).decode("utf-8", errors="replace") for f in fields}
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            if name in names:
                raise ModelError(f"tensor {name} appears twice")
            names.add(name)
            shape = [int(d) for d in dims]  # GGUF order: innermost (row length) first
            if not 1 <= len(shape) <= _MAX_DIMS or any(d < 1 for d in shape):
                raise ModelError(f"tensor {name} has invalid dimensions {shape}")
            n = math.prod(shape)
            if n > _MAX_ELEMENTS:
                raise ModelError(f"tensor {name} has absurd dimensions {shape}")
            ggml_type = int(raw_dtype[0])
            if f"{name}_scale" in all_names and ggml_type not in _FLOAT_TYPES | {formats.GGML_I2_S}:
                raise ModelError(f"tensor {name} (ggml type {ggml_type}) is {_TL_HINT}")
            np_shape: tuple[int, ...] = tuple(reversed(shape))
            item: type = np.uint8
            if ggml_type == formats.GGML_I2_S:  # unknown to gguf: n/4 bytes of codes, then the scale slot
                if n % formats.I2S_BLOCK:
                    raise ModelError(f"tensor {name}: I2_S needs a multiple of {formats.I2S_BLOCK} values")
                qtype: Any = ggml_type
                n_bytes = formats.i2s_nbytes(n)
                np_shape = (n_bytes,)
            else:
                try:
                    qtype = GGMLQuantizationType(ggml_type)
                except ValueError:
                    raise ModelError(f"tensor {name} has unknown ggml type {ggml_type}") from None
                block, size = GGML_QUANT_SIZES[qtype]
                if shape[0] % block:
                    raise ModelError(f"tensor {name}: row of {shape[0]} is not a multiple of "
                                     f"the {qtype.name} block of {block}")
                n_bytes = n // block * size
                if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                    item = np.float32 if qtype == GGMLQuantizationType.F32 else np.float16
                else:  # raw bytes, rows kept: [..., bytes per row]
                    np_shape = (*np_shape[:-1], shape[0] // block * size)
            offset = int(offset_tensor[0])
            if offset % self.alignment:
                raise ModelError(f"tensor {name}: data offset {offset} is not aligned to {self.alignment}")
            data_offs = start_offs + offset
            if data_offs + n_bytes > file_size:
                raise ModelError(f"tensor {name}: data (bytes {data_offs}..{data_offs + n_bytes}) "
                                 f"runs past the end of the file ({file_size} bytes)")
            data = self._get(data_offs, item, n_bytes // np.dtype(item).itemsize).reshape(np_shape)
            tensors.append(ReaderTensor(name, qtype, dims, n, n_bytes, data_offs, data, field))
        self.tensors = tensors
