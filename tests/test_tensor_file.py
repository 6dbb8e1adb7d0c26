"""store.tensor_file: a safetensors file written tensor by tensor reads back, through the
safetensors library itself, as exactly the tensors given — every dtype a checkpoint holds,
scalars, empty and non-contiguous tensors — with aligned offsets and the header metadata."""

from __future__ import annotations

import itertools
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from otbrl.store.tensor_file import safetensors_order, write_safetensors


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "odd_bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes
        "f32": torch.randn(4, 7, generator=g),
        "mask": torch.rand(5, generator=g) > 0.5,
        "bytes": torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8),
        "i64": torch.randint(-(2**40), 2**40, (2, 3), generator=g),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "transposed": torch.randn(6, 3, generator=g).t(),  # not contiguous
        "f16": torch.randn(9, generator=g).half(),
        "i32": torch.arange(5, dtype=torch.int32),
    }


def _write(path, tensors, **kwargs):
    specs = safetensors_order((k, v.dtype, v.shape) for k, v in tensors.items())
    write_safetensors(path, specs, ((k, tensors[k]) for k, _, _ in specs), **kwargs)


def test_round_trip_through_the_safetensors_reader(tmp_path):
    tensors = _mixed()
    path = tmp_path / "t.safetensors"
    _write(path, tensors, metadata={"format": "pt", "note": "x"})
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape, name
        assert torch.equal(loaded[name], value), name
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}
    # the layout safetensors itself writes: data 8-byte aligned, each tensor at a multiple of
    # its element size, back to back with no gap, ending at the file's end
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    spans = sorted(entry["data_offsets"] for entry in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    for name, entry in header.items():
        assert entry["data_offsets"][0] % tensors[name].element_size() == 0, name


def test_tensors_come_from_an_iterator_one_at_a_time(tmp_path):
    """The writer takes each tensor as the iterator makes it (a gather, in a checkpoint) and
    keeps none: the iterator's tensors are released as the file is written."""
    import weakref

    specs = [(f"w{i}", torch.float32, (64,)) for i in range(4)]
    alive = []

    def made():
        for name, _, shape in specs:
            value = torch.full(shape, float(len(alive)))
            alive.append(weakref.ref(value))
            assert all(ref() is None for ref in alive[:-2]), "an earlier tensor is still held"
            yield name, value
            del value

    write_safetensors(tmp_path / "t.safetensors", specs, made())
    loaded = load_file(tmp_path / "t.safetensors")
    assert [float(loaded[f"w{i}"][0]) for i in range(4)] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "given, message",
    [
        ([("b", torch.zeros(2)), ("a", torch.zeros(2))], "b: expected 'a' next"),
        ([("a", torch.zeros(3)), ("b", torch.zeros(2))], r"a: got torch.float32 \[3\]"),
        ([("a", torch.zeros(2, dtype=torch.float64))], "a: got torch.float64"),
        ([("a", torch.zeros(2))], "b: listed in specs but never given"),
        (
            [("a", torch.zeros(2)), ("b", torch.zeros(2)), ("c", torch.zeros(2))],
            "c: expected no more tensors",
        ),
    ],
)
def test_a_tensor_that_does_not_match_its_spec_is_one_clear_error(tmp_path, given, message):
    specs = [("a", torch.float32, (2,)), ("b", torch.float32, (2,))]
    with pytest.raises(ValueError, match=message):
        write_safetensors(tmp_path / "t.safetensors", specs, iter(given))


def test_bad_specs_and_metadata(tmp_path):
    with pytest.raises(ValueError, match="a: listed twice"):
        write_safetensors(tmp_path / "t", [("a", torch.float32, ()), ("a", torch.float32, ())], [])
    with pytest.raises(ValueError, match=r"a: safetensors cannot hold dtype torch\.complex64"):
        write_safetensors(tmp_path / "t", [("a", torch.complex64, ())], [])
    with pytest.raises(TypeError, match="metadata: expected a dict of strings"):
        write_safetensors(tmp_path / "t", [], [], metadata={"n": 1})
