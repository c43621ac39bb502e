"""GGUF expert enumeration: types, split files, identity, bad inputs."""

import shutil

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from ggufgen import MIXED, expert_slices, write_dense_gguf, write_moe_gguf

from llamapack.errors import LlamapackError, PackFormatError
from llamapack.pack import open_gguf


def test_enumerates_expert_weights_only_with_types_and_shapes(moe_gguf):
    model = open_gguf(moe_gguf)
    found = {(t.layer, t.role): t for t in model.expert_tensors}
    assert set(found) == {(layer, role) for layer, roles in MIXED.items() for role in roles}  # no bias/router
    gate = found[1, "gate"]
    assert (gate.ggml_type, gate.ne, gate.expert_nbytes) == (12, (256, 40, 8), 40 * 144)
    assert found[2, "down"].ne == (40, 96, 8)
    assert model.arch == "qwen3moe" and model.stem == "tiny"
    slices = expert_slices([moe_gguf])
    with open(moe_gguf, "rb") as f:
        f.seek(found[1, "down"].expert_offset(5))
        assert f.read(found[1, "down"].expert_nbytes) == slices[1, "down", 5]


def test_split_gguf_is_read_as_one_model(tmp_path):
    shards = write_moe_gguf(tmp_path / "big.gguf", split_max_tensors=4)
    assert len(shards) > 2
    whole = open_gguf(write_moe_gguf(tmp_path / "whole.gguf")[0])
    model = open_gguf(shards[0])
    assert model.paths == tuple(str(s) for s in shards)
    assert model.stem == "big"
    assert len({t.path for t in model.expert_tensors}) > 1  # experts really are spread over shards
    assert model.layout == whole.layout
    assert model.hparams_sha256 == whole.hparams_sha256  # split.* keys are not hyperparameters
    assert open_gguf(shards[1]) == model  # any shard names the whole model


def test_missing_shard_is_named(tmp_path):
    shards = write_moe_gguf(tmp_path / "big.gguf", split_max_tensors=4)
    shards[-1].unlink()
    with pytest.raises(PackFormatError, match=shards[-1].name):
        open_gguf(shards[0])


def test_hparams_hash_ignores_tokenizer_but_not_hyperparameters(tmp_path):
    base = open_gguf(write_moe_gguf(tmp_path / "a.gguf", seed=1)[0]).hparams_sha256
    assert open_gguf(write_moe_gguf(tmp_path / "b.gguf", seed=2)[0]).hparams_sha256 == base
    changed = write_moe_gguf(tmp_path / "c.gguf", extra_kv={"qwen3moe.expert_feed_forward_length": 40})[0]
    assert open_gguf(changed).hparams_sha256 != base


def test_dense_model_says_pack_mode_does_not_apply(tmp_path):
    with pytest.raises(PackFormatError, match="pack mode does not apply"):
        open_gguf(write_dense_gguf(tmp_path / "dense.gguf"))


def test_not_a_gguf_and_truncated_gguf_name_the_file(tmp_path, moe_gguf):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(PackFormatError, match="junk.gguf"):
        open_gguf(junk)
    for keep in (100, moe_gguf.stat().st_size - 1000):
        cut = tmp_path / f"cut{keep}.gguf"
        shutil.copyfile(moe_gguf, cut)
        with open(cut, "r+b") as f:
            f.truncate(keep)
        with pytest.raises(PackFormatError, match=cut.name):
            open_gguf(cut)
    with pytest.raises(LlamapackError, match="nothere.gguf"):
        open_gguf(tmp_path / "nothere.gguf")


def test_header_parser_agrees_with_gguf_reader(tmp_path):
    from gguf import GGUFReader

    from llamapack.pack.gguf_file import read_gguf_header

    for shard in write_moe_gguf(tmp_path / "s.gguf", split_max_tensors=5):
        ours, theirs = read_gguf_header(str(shard)), GGUFReader(shard)
        assert [(t.name, t.ggml_type, t.ne, t.data_offset) for t in ours.tensors] == [
            (t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), t.data_offset) for t in theirs.tensors]
        for key, field in theirs.fields.items():
            if not key.startswith(("GGUF.", "tokenizer.")):
                assert ours.kv[key][1] == field.contents(), key


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=2500), flip=st.integers(min_value=0, max_value=2500),
       value=st.integers(min_value=0, max_value=255))
def test_damaged_headers_raise_only_llamapack_errors(moe_gguf, tmp_path, cut, flip, value):
    """Truncated at ``cut`` bytes (the header is ~2 KB) or with one header byte changed."""
    data = bytearray(moe_gguf.read_bytes())
    data[flip] = value
    for variant in (data[:cut], data):
        damaged = tmp_path / "damaged.gguf"
        damaged.write_bytes(bytes(variant))
        try:
            open_gguf(damaged)
        except LlamapackError:
            pass
