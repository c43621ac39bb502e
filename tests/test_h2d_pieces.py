"""bench/h2d_pieces.py: the pieces it times are a window's copies (every byte of every block, each once, into
its role's slot), so its three ways copy the same bytes to the same places."""
from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("h2d_pieces", Path(__file__).parent.parent / "bench" / "h2d_pieces.py")
h2d_pieces = importlib.util.module_from_spec(spec)
spec.loader.exec_module(h2d_pieces)


def test_pieces_cover_every_block_once_and_land_in_their_roles_slots():
    roles, n = [5, 3, 7], 4
    block, slot = sum(roles), max(roles) + 1  # a slot stride with padding, as the pool's
    plan = h2d_pieces.pieces(n, roles, block, slot)
    assert len(plan) == n * len(roles)
    covered = sorted((src, src + nbytes) for src, _, nbytes in plan)
    assert covered[0][0] == 0 and covered[-1][1] == n * block
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # contiguous, no overlap: every byte once
    for e in range(n):
        for r, nbytes in enumerate(roles):
            src, dst, size = plan[e * len(roles) + r]
            assert size == nbytes and src == e * block + sum(roles[:r]) and dst == (r * n + e) * slot
    # the 2D copy of role r (rows of nbytes at pitch block from its first source, pitch slot at its destination)
    # lands on the same bytes as the pieces
    for r, nbytes in enumerate(roles):
        rows = [(sum(roles[:r]) + e * block, r * n * slot + e * slot, nbytes) for e in range(n)]
        assert rows == [plan[e * len(roles) + r] for e in range(n)]
