"""Weight formats against hand-built vectors from docs/design.md section 5 and gguf's reference code."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from bitnet.errors import ModelError
from bitnet.modelfile.formats import (
    bf16_to_float32,
    float32_to_bf16,
    float_to_ternary,
    i2s_nbytes,
    i2s_to_ternary,
    ternary_to_i2s,
    ternary_to_tq1_0,
    ternary_to_tq2_0,
    tq1_0_to_ternary,
    tq2_0_to_ternary,
)
from bitnet.modelfile.ternary import pack_values

ZERO_BYTE = 0b01010101  # four codes 0b01 (value 0), in either layout


def random_ternary(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-1, 2, size=(rows, cols), dtype=np.int8)


def i2s_position(k: int) -> tuple[int, int]:
    """(byte, bit shift) of value k in an I2_S tensor, written out from the docs/design.md text:
    blocks of 128 values in 32 bytes; byte g of a block holds values g, g+32, g+64, g+96 at
    bit shifts 6, 4, 2, 0."""
    block, within = divmod(k, 128)
    return 32 * block + within % 32, 6 - 2 * (within // 32)


# -- I2_S ------------------------------------------------------------------------------------------

def test_i2s_literal_first_byte() -> None:
    t = np.zeros((1, 256), dtype=np.int8)
    t[0, 0], t[0, 32], t[0, 64], t[0, 96] = -1, 0, 1, -1  # codes 00, 01, 10, 00 at shifts 6, 4, 2, 0
    raw = ternary_to_i2s(t, 0.5)
    assert raw.dtype == np.uint8 and raw.size == 256 // 4 + 32
    assert raw[0] == 0b00_01_10_00
    assert np.all(raw[1:64] == ZERO_BYTE)
    assert raw[64:68].tobytes() == struct.pack("<f", 0.5)
    assert np.all(raw[68:] == 0)


@pytest.mark.parametrize("k", [0, 1, 31, 32, 63, 64, 95, 96, 127, 128, 129, 160, 200, 255, 256, 300, 511])
def test_i2s_encoder_puts_value_k_where_design_says(k: int) -> None:
    t = np.zeros((2, 256), dtype=np.int8)
    t.reshape(-1)[k] = 1
    expected = np.full(512 // 4, ZERO_BYTE, dtype=np.uint8)
    byte, shift = i2s_position(k)
    expected[byte] ^= 0b11 << shift  # code 01 -> 10
    raw = ternary_to_i2s(t, 2.0)
    assert np.array_equal(raw[:128], expected)
    assert raw.size == i2s_nbytes(512) == 160


@pytest.mark.parametrize("k", [0, 5, 33, 70, 100, 127, 128, 250, 256 + 97, 511])
def test_i2s_decoder_reads_hand_built_bytes(k: int) -> None:
    raw = np.zeros(i2s_nbytes(512), dtype=np.uint8)
    raw[:128] = ZERO_BYTE
    byte, shift = i2s_position(k)
    raw[byte] &= ~np.uint8(0b11 << shift)  # code 00 = -1
    raw[128:132] = np.frombuffer(struct.pack("<f", 0.25), dtype=np.uint8)
    m = i2s_to_ternary(raw, 2, 256)
    expected = np.zeros(512, dtype=np.int8)
    expected[k] = -1
    assert np.array_equal(m.values().reshape(-1), expected)
    assert m.scales.shape == (2, 1) and np.all(m.scales == np.float32(0.25))


def test_i2s_to_canonical_matches_the_canonical_packer() -> None:
    t = random_ternary(8, 768, seed=1)
    m = i2s_to_ternary(ternary_to_i2s(t, 0.125), 8, 768)
    assert np.array_equal(m.packed(), pack_values(t))
    assert np.array_equal(m.values(), t)


@pytest.mark.parametrize("bad_byte", [0b11_01_01_01, 0b01_01_01_11, 0xFF])
def test_i2s_code_3_is_invalid(bad_byte: int) -> None:
    raw = ternary_to_i2s(np.zeros((1, 256), dtype=np.int8), 1.0)
    raw[17] = bad_byte
    with pytest.raises(ModelError, match="invalid code"):
        i2s_to_ternary(raw, 1, 256)


def test_i2s_nan_scale_and_bad_size() -> None:
    raw = ternary_to_i2s(np.zeros((1, 256), dtype=np.int8), float("nan"))
    with pytest.raises(ModelError, match="NaN"):
        i2s_to_ternary(raw, 1, 256)
    with pytest.raises(ModelError, match="bytes"):
        i2s_to_ternary(raw[:-1], 1, 256)
    with pytest.raises(ModelError, match="multiple of 128 values"):
        i2s_to_ternary(np.zeros(100 // 4 + 32, np.uint8), 1, 100)


@pytest.mark.parametrize("rows, cols", [(1, 128), (3, 3200), (2, 8640), (5, 100 * 32)])
def test_i2s_rows_of_any_width(rows: int, cols: int) -> None:
    """1bitLLM 3B's widths: I2_S's 128-value blocks run over the flat tensor, across rows; the
    matrix is zero-extended to whole 256-blocks, and the padding holds zeros."""
    t = np.random.default_rng(cols).integers(-1, 2, size=(rows, cols), dtype=np.int8)
    m = i2s_to_ternary(ternary_to_i2s(t, 0.5), rows, cols)
    assert m.cols == -(-cols // 256) * 256 and m.rows == rows
    assert np.array_equal(m.values()[:, :cols], t) and not m.values()[:, cols:].any()
    assert np.all(m.scales == 0.5)
    bad = ternary_to_i2s(t, 0.5)
    bad[7] |= 0b11  # one invalid code
    with pytest.raises(ModelError, match="0b11"):
        i2s_to_ternary(bad, rows, cols)


# -- TQ2_0 / TQ1_0 -------------------------------------------------------------------------------

def test_tq2_0_layout_matches_design() -> None:
    # Value e sits in byte 32*(e//128) + e%32 at bit shift 2*((e%128)//32); code c means c-1.
    t = np.zeros((1, 256), dtype=np.int8)
    t[0, 200] = 1
    raw = ternary_to_tq2_0(t, 1.0).reshape(-1)
    assert raw.size == 66
    assert raw[40] == ZERO_BYTE ^ (0b11 << 4)
    assert np.sum(raw[:64] != ZERO_BYTE) == 1
    assert raw[64:].tobytes() == np.float16(1.0).tobytes()


@pytest.mark.parametrize("encode, decode, qtype", [
    (ternary_to_tq2_0, tq2_0_to_ternary, GGMLQuantizationType.TQ2_0),
    (ternary_to_tq1_0, tq1_0_to_ternary, GGMLQuantizationType.TQ1_0),
])
@pytest.mark.parametrize("scale", [0.0390625, 0.0371])  # f16-exact, and not
def test_tq_round_trip(encode, decode, qtype, scale: float) -> None:
    t = random_ternary(16, 512, seed=2)
    raw = encode(t, scale)
    m = decode(raw, 16, 512)
    assert np.array_equal(m.values(), t)
    assert np.all(m.scales == np.float32(np.float16(scale)))  # d is stored as f16
    assert np.array_equal(m.dequantize(), dequantize(raw, qtype))


def test_tq_zero_block_has_zero_scale() -> None:
    t = random_ternary(2, 512, seed=3)
    t[1, 256:] = 0
    for encode, decode in ((ternary_to_tq2_0, tq2_0_to_ternary), (ternary_to_tq1_0, tq1_0_to_ternary)):
        m = decode(encode(t, 0.5), 2, 512)
        assert np.array_equal(m.values(), t)
        assert m.scales.tolist() == [[0.5, 0.5], [0.5, 0.0]]


def test_tq1_0_large_enough_to_chunk() -> None:
    t = random_ternary(80, 65536, seed=4)  # 5.2M values, more than one conversion chunk
    m = tq1_0_to_ternary(ternary_to_tq1_0(t, 0.25), 80, 65536)
    assert np.array_equal(m.packed(), pack_values(t))


def test_tq2_0_codes_stay_in_place_and_are_checked_in_every_chunk() -> None:
    rows, cols = 600, 1024  # several check chunks, of whole 64-bit words and a ragged last one
    t = random_ternary(rows, cols, seed=5)
    raw = ternary_to_tq2_0(t, 1.999).reshape(rows, -1)  # f16 0x3FFF: every 2-bit field of d is 0b11
    m = tq2_0_to_ternary(raw, rows, cols)
    assert np.shares_memory(m.codes, raw) and m.codes.strides[1] == 66  # a view, not a copy
    assert np.array_equal(m.packed(), pack_values(t))
    for row in (0, 255, rows - 1):
        bad = raw.copy()
        bad[row, 66 * 3 + 63] |= 0b11 << 6  # one field of the last byte of block 3
        with pytest.raises(ModelError, match="invalid code"):
            tq2_0_to_ternary(bad, rows, cols)


def test_tq2_0_invalid_code_and_nan_scale() -> None:
    raw = ternary_to_tq2_0(np.zeros((1, 256), dtype=np.int8), 1.0).reshape(-1)
    bad = raw.copy()
    bad[3] = 0xFF
    with pytest.raises(ModelError, match="invalid code"):
        tq2_0_to_ternary(bad, 1, 256)
    bad = raw.copy()
    bad[64:] = np.frombuffer(np.float16("inf").tobytes(), dtype=np.uint8)
    with pytest.raises(ModelError, match="infinite"):
        tq2_0_to_ternary(bad, 1, 256)
    bad = ternary_to_tq1_0(np.zeros((1, 256), dtype=np.int8), 1.0).reshape(-1)
    bad[52:] = np.frombuffer(np.float16("nan").tobytes(), dtype=np.uint8)
    with pytest.raises(ModelError, match="NaN"):
        tq1_0_to_ternary(bad, 1, 256)


# -- float weights -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_exact_ternary_float_keeps_its_scale(dtype: type) -> None:
    t = random_ternary(4, 256, seed=5)
    s = 0.0371  # not a round number: the scale must survive exactly, not be re-estimated
    m = float_to_ternary((t.astype(np.float32) * np.float32(s)).astype(dtype))
    assert np.array_equal(m.values(), t)
    assert np.all(m.scales == np.float32(dtype(s)))
    # absmean would have shrunk it to about 2/3 of s: the exact path is what keeps it
    assert abs(np.mean(np.abs(t)) - 2 / 3) < 0.05


def test_bf16_exact_ternary_keeps_its_scale() -> None:
    t = random_ternary(2, 256, seed=6)
    w = bf16_to_float32(float32_to_bf16(t.astype(np.float32) * np.float32(0.0371)))
    m = float_to_ternary(w)
    assert np.array_equal(m.values(), t)
    assert np.all(m.scales == np.abs(w).max())


def test_master_weights_use_absmean() -> None:
    w = np.zeros((1, 256), dtype=np.float32)
    w[0, :4] = [0.8, -0.4, 0.1, -0.04]  # mean |w| = 1.34 / 256
    m = float_to_ternary(w)
    scale = np.float32(1.34 / 256)
    assert m.scales[0, 0] == pytest.approx(scale, rel=1e-6)
    expected = np.zeros(256, dtype=np.int8)
    expected[:4] = [1, -1, 1, -1]  # round(w/scale) clamped: 0.04/scale = 7.6 -> 1
    assert np.array_equal(m.values()[0], expected)
    w2 = np.full((1, 256), 0.01, dtype=np.float32)
    w2[0, 0] = 0.004  # 0.004 / mean(~0.01) = 0.4 -> 0
    assert float_to_ternary(w2).values()[0, 0] == 0


def test_all_zero_and_bad_float_weights() -> None:
    m = float_to_ternary(np.zeros((2, 256), dtype=np.float16))
    assert np.all(m.values() == 0) and np.all(m.scales == 0)
    for bad in (np.nan, np.inf, -np.inf):
        w = np.zeros((2, 256), dtype=np.float32)
        w[1, 7] = bad
        with pytest.raises(ModelError, match="NaN or infinite"):
            float_to_ternary(w)
    odd = float_to_ternary(np.full((2, 100), -0.25, dtype=np.float32))  # any width, zero-extended
    assert odd.cols == 256 and np.all(odd.values()[:, :100] == -1) and not odd.values()[:, 100:].any()
    with pytest.raises(ModelError, match="not ternary"):
        float_to_ternary(np.linspace(-1, 1, 512, dtype=np.float32).reshape(2, 256), master_ok=False)


def test_bf16_conversion_is_exact_for_representable_values() -> None:
    x = np.array([0.0, 1.0, -2.5, 0.0390625, 2.0**100, -(2.0**-100)], dtype=np.float32)
    assert np.array_equal(bf16_to_float32(float32_to_bf16(x)), x)
    assert bf16_to_float32(np.array([0x3F80, 0xC020], dtype=np.uint16)).tolist() == [1.0, -2.5]
