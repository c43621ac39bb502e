"""Damaged, mismatched or unreadable packs fail closed with a clear LlamapackError (and a one-line CLI error)."""

import errno
import json
import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from ggufgen import MIXED, write_moe_gguf
from hookutil import flip_byte
from gguf import GGMLQuantizationType as T

from llamapack.cli import main
from llamapack.errors import (CapacityError, IntegrityError, ModelMismatchError, PackFormatError,
                              PackIOError)
from llamapack.pack import (DirectFile, GgufDirectReader, PackReader, alloc_slot, aligned_buffer, build_pack,
                            verify)
from llamapack.pack.identity import FULL


def run_cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # handled, not an uncaught exception
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def edit_manifest(path, change):
    with open(path) as f:
        obj = json.load(f)
    change(obj)
    with open(path, "w") as f:
        json.dump(obj, f)


# --- damaged pack or manifest: (how to break it, expected error, message) ------------------------

def truncate_pack(pack, gguf, tmp_path):
    with open(pack.pack_path, "r+b") as f:
        f.truncate(os.path.getsize(pack.pack_path) - 4096)


def misalign_offset(pack, gguf, tmp_path):
    edit_manifest(pack.manifest_path, lambda m: m["layers"][1]["roles"][2].update(offset=16384 + 100))


def missing_manifest(pack, gguf, tmp_path):
    os.unlink(pack.manifest_path)


def malformed_json(pack, gguf, tmp_path):
    with open(pack.manifest_path, "a") as f:
        f.write("}{ not json")


def other_version(pack, gguf, tmp_path):
    edit_manifest(pack.manifest_path, lambda m: m.update(version=2))


def manifest_of_other_model(pack, gguf, tmp_path):
    (tmp_path / "other").mkdir()
    layers = {**MIXED, 3: {**MIXED[3], "gate": (T.Q5_0, 64, 40)}}
    other = build_pack(write_moe_gguf(tmp_path / "other" / "o.gguf", layers)[0], progress=False, safety_margin_mib=0)
    shutil.copyfile(other.manifest_path, pack.manifest_path)
    edit_manifest(pack.manifest_path, lambda m: m.update(pack_file=os.path.basename(pack.pack_path)))


def missing_pack_file(pack, gguf, tmp_path):
    os.unlink(pack.pack_path)


def hand_edited_manifest(pack, gguf, tmp_path):
    edit_manifest(pack.manifest_path, lambda m: m["layers"][0]["block_sha256"].__setitem__(0, "0" * 64))


BROKEN = [
    (truncate_pack, PackFormatError, "truncated"),
    (misalign_offset, PackFormatError, "layer 2 role down: offset 16484 is not 4096-aligned"),
    (missing_manifest, PackFormatError, "manifest not found"),
    (malformed_json, PackFormatError, "not valid JSON"),
    (other_version, PackFormatError, "unsupported version 2"),
    (manifest_of_other_model, ModelMismatchError, "does not belong to this manifest"),
    (missing_pack_file, PackFormatError, "pack file not found"),
    (hand_edited_manifest, ModelMismatchError, "does not belong to this manifest"),
]


@pytest.mark.parametrize("breaker, error, message", BROKEN, ids=[b[0].__name__ for b in BROKEN])
def test_broken_pack_fails_closed(moe_pack, moe_gguf, tmp_path, breaker, error, message):
    breaker(moe_pack, moe_gguf, tmp_path)
    with pytest.raises(error, match=message):
        PackReader(moe_pack.pack_path)
    with pytest.raises(error, match=message):
        verify(moe_pack.pack_path, progress=False)
    assert message in run_cli("verify", moe_pack.pack_path, "-q")
    assert message in run_cli("inspect", moe_pack.pack_path)


def test_flipped_byte_names_layer_and_expert(moe_pack):
    layout = moe_pack.manifest.layout
    flip_byte(moe_pack.pack_path, layout.block_offset(2, 5) + layout.role_offset(2, "up") + 7)
    with pytest.raises(IntegrityError, match=r"1 of 24 blocks fail their sha256 check: layer 2 expert 5 "):
        verify(moe_pack.pack_path, progress=False)
    assert "layer 2 expert 5" in run_cli("verify", moe_pack.pack_path, "-q")
    with PackReader(moe_pack.pack_path, verify_sha256=True) as reader:
        slot = alloc_slot(layout)
        reader.read_expert(2, 4, slot)  # neighbours are fine
        with pytest.raises(IntegrityError, match="layer 2 expert 5"):
            reader.read_expert(2, 5, slot)


def test_flipped_padding_byte_is_caught_too(moe_pack):
    layout = moe_pack.manifest.layout
    flip_byte(moe_pack.pack_path, layout.block_offset(3, 7) + layout.expert_stride - 1)
    with pytest.raises(IntegrityError, match="layer 3 expert 7"):
        verify(moe_pack.pack_path, progress=False)


def test_verify_against_gguf_names_the_differing_role(tmp_path):
    gguf = write_moe_gguf(tmp_path / "m.gguf")[0]
    pack = build_pack(gguf, progress=False, safety_margin_mib=0, fingerprint_mode=FULL)
    from llamapack.pack import open_gguf
    down = open_gguf(gguf).tensor(1, "down")
    flip_byte(gguf, down.expert_offset(6) + 3)  # full-hash manifests only re-check sizes at load
    with pytest.raises(IntegrityError, match="layer 1 expert 6 role down"):
        verify(pack.pack_path, against=gguf, progress=False)


def test_pack_checked_against_another_gguf_names_field_layer_role(moe_pack, tmp_path):
    layers = {**MIXED, 3: {**MIXED[3], "down": (T.Q5_K, 256, 16)}}
    other = write_moe_gguf(tmp_path / "o.gguf", layers)[0]
    message = "at layer 3 role down: ggml type is Q4_K in the manifest but Q5_K in the GGUF"
    with pytest.raises(ModelMismatchError, match=message):
        PackReader(moe_pack.pack_path, model=other)
    assert message in run_cli("verify", moe_pack.pack_path, "--against", other, "-q")


def test_pack_checked_against_other_hyperparameters_or_bytes(moe_pack, tmp_path):
    other = write_moe_gguf(tmp_path / "h.gguf", extra_kv={"qwen3moe.expert_feed_forward_length": 40})[0]
    with pytest.raises(ModelMismatchError, match="hyperparameter hash"):
        PackReader(moe_pack.pack_path, model=other)
    reseeded = write_moe_gguf(tmp_path / "s.gguf", seed=99)[0]  # same shapes and KV, other weights
    with pytest.raises(ModelMismatchError, match="sampled fingerprint"):
        PackReader(moe_pack.pack_path, model=reseeded)


def test_not_enough_disk_space(moe_gguf):
    with pytest.raises(CapacityError, match="not enough free space"):
        build_pack(moe_gguf, progress=False, safety_margin_mib=1 << 40)
    assert "not enough free space" in run_cli("pack", moe_gguf, "--safety-margin-mib", 1 << 40)
    assert not [n for n in os.listdir(moe_gguf.parent) if n != moe_gguf.name]


def test_cli_dense_model_and_junk(tmp_path):
    from ggufgen import write_dense_gguf
    assert "pack mode does not apply" in run_cli("pack", write_dense_gguf(tmp_path / "d.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\0" * 64)
    assert "junk.gguf" in run_cli("inspect", junk)


# --- I/O failures ----------------------------------------------------------------------------------

def test_filesystem_refusing_o_direct_is_reported():
    with pytest.raises(PackIOError, match="refuses O_DIRECT"):
        DirectFile("/proc/version")  # procfs: EINVAL at open
    assert DirectFile("/proc/version", direct_io=False).size() == 0


def test_o_direct_refused_at_first_read_is_reported(moe_pack):
    def einval(fd, view, offset):
        raise OSError(errno.EINVAL, "Invalid argument")

    with pytest.raises(PackIOError, match="refuses O_DIRECT.*first read"):
        PackReader(moe_pack.pack_path, read_fn=einval)


def test_pack_on_tmpfs(moe_pack, moe_gguf):
    """/dev/shm: refused with a clear error on kernels whose tmpfs lacks O_DIRECT (< 6.6), else works."""
    folder = "/dev/shm/llamapack-test-%d" % os.getpid()
    os.makedirs(folder)
    try:
        for path in (moe_pack.pack_path, moe_pack.manifest_path):
            shutil.copy(path, folder)
        pack = os.path.join(folder, os.path.basename(moe_pack.pack_path))
        with PackReader(pack, direct_io=False) as reader:  # buffered always works
            reader.read_expert(1, 0, alloc_slot(reader.layout))
        try:
            reader = PackReader(pack)
        except PackIOError as exc:
            assert "O_DIRECT" in str(exc)
        else:
            reader.read_expert(1, 0, alloc_slot(reader.layout))
            reader.close()
    finally:
        shutil.rmtree(folder)


def test_eio_and_short_reads_name_file_offset_layer_expert(moe_pack, moe_gguf):
    layout = moe_pack.manifest.layout
    bad_offset = layout.block_offset(2, 5)

    def eio(fd, view, offset):
        if offset == bad_offset:
            raise OSError(errno.EIO, "Input/output error")
        return os.preadv(fd, [view], offset)

    def short(fd, view, offset):  # 4096 bytes, then end of file
        if offset >= bad_offset:
            return os.preadv(fd, [view[:4096]], offset) if offset == bad_offset else 0
        return os.preadv(fd, [view], offset)

    slot = alloc_slot(layout)
    with PackReader(moe_pack.pack_path, read_fn=eio) as reader:
        reader.read_expert(2, 4, slot)
        with pytest.raises(PackIOError, match=f"read error on .*tiny.expert-pack at offset {bad_offset} "
                                              r"\(layer 2 expert 5\): Input/output error"):
            reader.read_expert(2, 5, slot)
    with PackReader(moe_pack.pack_path, read_fn=short) as reader:
        with pytest.raises(PackIOError, match=r"short read .* \(layer 2 expert 5\): got 4096 of"):
            reader.read_expert(2, 5, slot)

    def gguf_eio(fd, view, offset):
        raise OSError(errno.EIO, "Input/output error")

    with GgufDirectReader(moe_gguf, read_fn=gguf_eio) as direct:
        with pytest.raises(PackIOError, match=r"tiny.gguf .*\(layer 3 expert 1 role gate\)"):
            direct.read_expert(3, 1, slot)


def test_staging_buffer_contract(moe_pack):
    with PackReader(moe_pack.pack_path) as reader:
        stride = reader.layout.expert_stride
        with pytest.raises(PackIOError, match="not 4096-aligned"):
            reader.read_expert(1, 0, aligned_buffer(stride + 4096)[16:16 + stride])
        with pytest.raises(PackIOError, match="less than expert_stride"):
            reader.read_expert(1, 0, aligned_buffer(stride - 4096))
        with pytest.raises(PackIOError, match="uint8"):
            reader.read_expert(1, 0, np.zeros(stride, dtype=np.float32))


def test_failed_build_leaves_nothing_behind(moe_gguf, monkeypatch):
    from llamapack.pack import odirect

    def disk_full(self, buf, offset):
        raise CapacityError(f"disk full while writing {self.path} at offset {offset}")

    monkeypatch.setattr(odirect.DirectFile, "write_from", disk_full)
    with pytest.raises(CapacityError, match="disk full"):
        build_pack(moe_gguf, progress=False, safety_margin_mib=0)
    assert os.listdir(moe_gguf.parent) == [moe_gguf.name]


def test_missing_output_folder(moe_gguf, tmp_path):
    assert "output folder does not exist" in run_cli("pack", moe_gguf, "-o", tmp_path / "nope" / "x.pack")
