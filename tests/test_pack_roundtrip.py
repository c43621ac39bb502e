"""Build a pack, read every expert back (pack and GGUF-direct) and compare with the GGUF's bytes."""

import hashlib
import os

import numpy as np
import pytest
from ggufgen import MERGED, expert_slices, write_moe_gguf

from llamapack.pack import GgufDirectReader, PackReader, alloc_slot, build_pack, open_gguf, verify
from llamapack.pack.header import MAGIC
from llamapack.pack.layout import ALIGNMENT


def assert_reader_matches(reader, slices):
    layout = reader.layout
    slot = alloc_slot(layout)
    for layer in layout.moe_layers:
        for expert in range(layout.num_experts):
            slot[:] = 0xAB  # stale bytes must be overwritten, gaps zeroed
            reader.read_expert(layer, expert, slot)
            covered = np.zeros(layout.expert_stride, dtype=bool)
            for role in layout.layer_layout(layer).roles:
                assert slot[role.offset:role.end].tobytes() == slices[layer, role.role, expert]
                covered[role.offset:role.end] = True
            assert not slot[~covered].any(), f"gap bytes not zero at layer {layer} expert {expert}"


@pytest.mark.parametrize("spec, split", [("mixed", 0), ("merged", 0), ("mixed", 3)])
def test_pack_and_gguf_direct_return_the_gguf_bytes(tmp_path, spec, split):
    kwargs = {"layers": MERGED} if spec == "merged" else {}
    shards = write_moe_gguf(tmp_path / "m.gguf", split_max_tensors=split, **kwargs)
    slices = expert_slices(shards)
    result = build_pack(shards[0], progress=False, safety_margin_mib=0)
    assert result.pack_path == str(tmp_path / "m.expert-pack")
    assert result.manifest_path == str(tmp_path / "m.expert-pack.manifest.json")
    with PackReader(result.pack_path, model=shards[0], verify_sha256=True) as reader:
        assert_reader_matches(reader, slices)
    with GgufDirectReader(shards[0]) as direct:
        assert direct.layout == result.manifest.layout
        assert_reader_matches(direct, slices)
    verify(result.pack_path, against=shards[0], progress=False)


def test_pack_file_geometry(moe_pack):
    layout = moe_pack.manifest.layout
    size = os.path.getsize(moe_pack.pack_path)
    assert size == layout.pack_size == layout.data_start + 3 * 8 * layout.expert_stride
    assert layout.data_start % ALIGNMENT == 0 and layout.expert_stride % ALIGNMENT == 0
    for layer in layout.moe_layers:
        for expert in range(layout.num_experts):
            assert layout.block_offset(layer, expert) % ALIGNMENT == 0
    with open(moe_pack.pack_path, "rb") as f:
        assert f.read(len(MAGIC)) == MAGIC
        f.seek(layout.block_offset(2, 3))
        block = f.read(layout.expert_stride)
    assert hashlib.sha256(block).hexdigest() == moe_pack.manifest.block_hash(2, 3)
    assert sorted(os.listdir(os.path.dirname(moe_pack.pack_path))) == [
        "tiny.expert-pack", "tiny.expert-pack.manifest.json", "tiny.gguf"]  # no temp files left


def test_reader_accepts_manifest_path_and_explicit_output(tmp_path, moe_gguf):
    out = tmp_path / "elsewhere" / "x.pack"
    out.parent.mkdir()
    result = build_pack(moe_gguf, out, progress=False, safety_margin_mib=0)
    assert result.manifest_path == str(out) + ".manifest.json"
    with PackReader(result.manifest_path) as reader:
        assert reader.pack_path == str(out)


def test_buffered_mode_reads_the_same(moe_pack, moe_gguf):
    slices = expert_slices([moe_gguf])
    with PackReader(moe_pack.pack_path, direct_io=False) as reader:
        assert_reader_matches(reader, slices)
    with GgufDirectReader(open_gguf(moe_gguf), direct_io=False) as direct:
        assert_reader_matches(direct, slices)


def test_rebuild_over_an_existing_pack(moe_pack, moe_gguf):
    again = build_pack(moe_gguf, progress=False, safety_margin_mib=0)
    assert again.manifest == moe_pack.manifest
    verify(again.pack_path, progress=False)
