import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # import llamapack without installing
# no test warm-starts from another's expert counts (nor writes to ~/.cache): tests of the warm start opt in
os.environ.setdefault("LLAMAPACK_WARM_START", "0")

from ggufgen import write_moe_gguf  # noqa: E402


@pytest.fixture
def moe_gguf(tmp_path) -> Path:
    """A tiny MoE GGUF with mixed expert types (see ggufgen.MIXED)."""
    return write_moe_gguf(tmp_path / "tiny.gguf")[0]


@pytest.fixture
def moe_pack(moe_gguf):
    """A freshly built pack of ``moe_gguf`` (a BuildResult), safe to tamper with."""
    from llamapack.pack import build_pack

    return build_pack(moe_gguf, progress=False, safety_margin_mib=0)
