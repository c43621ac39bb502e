"""The manifest parser accepts any JSON value and either parses it or raises PackFormatError."""

import copy
import os
import tempfile

from gguf import GGMLQuantizationType as T
from hypothesis import given, settings, strategies as st

from llamapack.errors import PackFormatError
from llamapack.pack.identity import SourceFile, SourceIdentity
from llamapack.pack.layout import ExpertTensor, compute_layout, expert_nbytes
from llamapack.pack.manifest import Manifest, load_manifest, manifest_to_dict, parse_manifest


def _valid_manifest() -> dict:
    def tensor(layer, role, kind, ne0, ne1):
        ne = (ne0, ne1, 4)
        return ExpertTensor("t", layer, role, int(kind), ne, expert_nbytes(int(kind), ne) * 4, "m.gguf", 0)

    layout = compute_layout([tensor(1, "gate", T.Q4_K, 256, 40), tensor(1, "up", T.Q4_K, 256, 40),
                             tensor(1, "down", T.Q6_K, 256, 24), tensor(2, "gate_up", T.F16, 96, 80),
                             tensor(2, "down", T.F16, 40, 96)])
    hashes = tuple(tuple(f"{i:064x}" for i in range(4)) for _ in layout.layers)
    source = SourceIdentity("sampled-v1", (SourceFile("m.gguf", 123, "ab" * 32),))
    return manifest_to_dict(Manifest(layout, hashes, "m.expert-pack", "cd" * 32, source))


VALID = _valid_manifest()
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _paths(obj, prefix=()):
    yield prefix
    children = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in children:
        yield from _paths(value, prefix + (key,))


PATHS = [p for p in _paths(VALID) if p]


def parses_or_format_error(obj) -> None:
    try:
        manifest = parse_manifest(obj)
    except PackFormatError:
        return
    assert isinstance(manifest, Manifest)


def test_valid_manifest_round_trips():
    manifest = parse_manifest(copy.deepcopy(VALID))
    assert manifest_to_dict(manifest) == VALID


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_arbitrary_json(obj):
    parses_or_format_error(obj)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(PATHS), JSON | st.integers(min_value=-2**70, max_value=2**70), st.booleans())
def test_valid_manifest_with_one_field_replaced_or_removed(path, value, remove):
    obj = copy.deepcopy(VALID)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if remove:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    parses_or_format_error(obj)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_manifest_file_bytes(raw):
    with tempfile.NamedTemporaryFile("wb", suffix=".manifest.json", delete=False) as f:
        f.write(raw)
    try:
        try:
            load_manifest(f.name)
        except PackFormatError:
            pass
    finally:
        os.unlink(f.name)
