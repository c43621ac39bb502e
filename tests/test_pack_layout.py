"""Pure layout policy: offsets, alignment, stride, errors."""

import pytest
from gguf import GGMLQuantizationType as T

from llamapack.errors import PackFormatError
from llamapack.pack.layout import ALIGNMENT, ExpertTensor, check_layout, compute_layout, expert_nbytes


def tensor(layer, role, kind, ne0, ne1, n_expert=4):
    nbytes = expert_nbytes(kind, (ne0, ne1, n_expert)) * n_expert
    return ExpertTensor(f"blk.{layer}.ffn_{role}_exps.weight", layer, role, int(kind), (ne0, ne1, n_expert),
                        nbytes, "/m.gguf", 0)


def test_roles_are_aligned_in_block_order_and_stride_is_the_largest_block():
    layout = compute_layout([
        tensor(5, "down", T.Q6_K, 256, 24), tensor(5, "up", T.Q4_K, 256, 40), tensor(5, "gate", T.Q4_K, 256, 40),
        tensor(7, "gate", T.F16, 96, 100), tensor(7, "up", T.F16, 96, 100), tensor(7, "down", T.F16, 100, 96),
    ])
    assert layout.moe_layers == (5, 7)
    assert [r.role for r in layout.layer_layout(5).roles] == ["gate", "up", "down"]
    # Q4_K: 40 rows * 144 B = 5760 B -> next role at 8192
    assert [(r.offset, r.nbytes) for r in layout.layer_layout(5).roles] == [(0, 5760), (8192, 5760), (16384, 5040)]
    # F16: 100 * 96 * 2 = 19200 B per role -> 20480 aligned, block = 3 * 20480
    assert layout.layer_layout(7).block_nbytes == 3 * 20480
    assert layout.expert_stride == 3 * 20480
    assert layout.role_offset(7, "down") == 2 * 20480
    for layer in layout.layers:
        assert all(r.offset % ALIGNMENT == 0 for r in layer.roles)


def test_block_offset_formula_uses_moe_index_not_model_layer():
    layout = compute_layout([tensor(3, "gate_up", T.Q8_0, 64, 80), tensor(3, "down", T.Q8_0, 64, 64),
                             tensor(9, "gate_up", T.Q8_0, 64, 80), tensor(9, "down", T.Q8_0, 64, 64)])
    stride = layout.expert_stride
    assert stride % ALIGNMENT == 0
    assert layout.block_offset(3, 0) == layout.data_start
    assert layout.block_offset(9, 2) == layout.data_start + (1 * 4 + 2) * stride
    assert layout.block_at(6) == (9, 2)
    assert layout.pack_size == layout.data_start + 8 * stride
    assert [r.role for r in layout.layer_layout(3).roles] == ["gate_up", "down"]
    with pytest.raises(KeyError):
        layout.block_offset(4, 0)
    with pytest.raises(IndexError):
        layout.block_offset(3, 4)


def test_gaps_cover_everything_outside_the_payloads():
    layout = compute_layout([tensor(0, "gate", T.Q4_K, 256, 40), tensor(0, "down", T.Q6_K, 256, 24)])
    gaps = list(layout.layers[0].gaps(layout.expert_stride))
    assert gaps == [(5760, 8192), (8192 + 5040, layout.expert_stride)]


@pytest.mark.parametrize("tensors, message", [
    ([], "dense"),
    ([tensor(0, "gate", T.F16, 64, 8, n_expert=4), tensor(1, "gate", T.F16, 64, 8, n_expert=8)], "expert count"),
    ([tensor(0, "gate_up", T.F16, 64, 8), tensor(0, "up", T.F16, 64, 8)], "both merged"),
    ([tensor(0, "gate", T.F16, 64, 8), tensor(0, "gate", T.F16, 64, 8)], "two gate"),
])
def test_bad_expert_sets_raise_pack_format_error(tensors, message):
    with pytest.raises(PackFormatError, match=message):
        compute_layout(tensors)


def test_check_layout_rejects_misaligned_and_overlapping_roles():
    from dataclasses import replace

    layout = compute_layout([tensor(0, "gate", T.Q4_K, 256, 40), tensor(0, "down", T.Q6_K, 256, 24)])
    check_layout(layout)
    gate, down = layout.layers[0].roles
    misaligned = replace(layout, layers=(replace(layout.layers[0], roles=(gate, replace(down, offset=4100))),))
    with pytest.raises(PackFormatError, match="not 4096-aligned"):
        check_layout(misaligned)
    overlapping = replace(layout, layers=(replace(layout.layers[0], roles=(gate, replace(down, offset=0))),))
    with pytest.raises(PackFormatError, match="overlaps"):
        check_layout(overlapping)
    with pytest.raises(PackFormatError, match="expert_stride"):
        check_layout(replace(layout, expert_stride=layout.expert_stride + 512))
