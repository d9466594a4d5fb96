"""text/gguf_file.py reads what the `gguf` package writes exactly as the package's own reader
does (every value type, string arrays with non-ASCII and invalid bytes' neighbours, float and
quantized tensors, a non-default alignment), and a file cut anywhere is a GGUFFormatError."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from text.gguf_file import GGUFFile, GGUFFormatError


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "all_types.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_uint64("t.u64", 2**63 + 7)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", -2.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "Ġthe", "日本", "<|im_start|>"])
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -1.25])
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 64)).astype(np.float32)
    f16 = rng.standard_normal((2, 32)).astype(np.float16)
    q8 = quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("f32", f32)
    w.add_tensor("f16", f16)
    w.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_fields_and_tensors_equal_the_gguf_package_reader(written):
    ours, theirs = GGUFFile(written), GGUFReader(str(written))
    expected = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its pseudo-keys
    assert list(ours.fields) == list(expected)
    for key, field in expected.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert ours.get("t.strs") == ["a", "", "Ġthe", "日本", "<|im_start|>"]
    assert len(ours.fields["t.ints"]) == 5 and ours.get("t.u64") == 2**63 + 7
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors] == ["f32", "f16", "q8"]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(b.shape.tolist())
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        np.testing.assert_array_equal(a.data, b.data)
        np.testing.assert_array_equal(quants.dequantize(a.data, a.tensor_type),
                                      quants.dequantize(b.data, b.tensor_type))
    assert ours.tensors[0].data_offset % 64 == 0  # the custom alignment was honoured


def test_a_file_cut_anywhere_is_a_format_error(written, tmp_path):
    whole = written.read_bytes()
    last = GGUFFile(written).tensors[-1]
    end = last.data_offset + last.n_bytes  # the writer pads after it: cutting that loses nothing
    cut = tmp_path / "cut.gguf"
    for size in sorted({4, 8, 20, 30, 100, 350, 450, 600, 700, end // 2, end - 1}):
        cut.write_bytes(whole[:size])
        with pytest.raises(GGUFFormatError, match="past the end"):
            GGUFFile(cut)


def test_bad_headers_say_what_is_wrong(written, tmp_path):
    data = bytearray(written.read_bytes())
    bad = tmp_path / "bad.gguf"
    for patch, message in (((0, b"GGML"), "not a GGUF file"), ((4, b"\x09\0\0\0"), "version 9"),
                           ((8, b"\xff" * 8), "runs past the end")):
        changed = bytearray(data)
        offset, raw = patch
        changed[offset : offset + len(raw)] = raw
        bad.write_bytes(bytes(changed))
        with pytest.raises(GGUFFormatError, match=message):
            GGUFFile(bad)
