"""Expert pack v1: routed-expert weights laid out for O_DIRECT streaming into slots.

Runtime entry points: ``compute_layout`` / ``PackLayout`` (slot layout), ``PackReader`` (pack on
disk) and ``GgufDirectReader`` (straight from the GGUF), both ``read_expert(layer, expert, out)``.
"""

from .builder import BuildResult, build_pack, default_pack_path
from .contract import check_manifest_matches_model
from .gguf_direct import GgufDirectReader, RoleRead, plan_role_read
from .gguf_model import GgufModel, open_gguf
from .layout import (ALIGNMENT, ExpertTensor, LayerLayout, PackLayout, RoleEntry, check_layout,
                     compute_layout)
from .manifest import Manifest, load_manifest, parse_manifest
from .odirect import DirectFile, aligned_buffer
from .pack_reader import PackReader
from .readers import ExpertReader, alloc_slot
from .summary import PackSummary, inspect
from .verify import VerifyReport, verify

__all__ = [
    "ALIGNMENT", "BuildResult", "DirectFile", "ExpertReader", "ExpertTensor", "GgufDirectReader", "GgufModel",
    "LayerLayout", "Manifest", "PackLayout", "PackReader", "PackSummary", "RoleEntry", "RoleRead",
    "VerifyReport", "aligned_buffer", "alloc_slot", "build_pack", "check_layout", "check_manifest_matches_model",
    "compute_layout", "default_pack_path", "inspect", "load_manifest", "open_gguf", "parse_manifest", "plan_role_read",
    "verify",
]
