"""Small adapters around llama-cpp-python internals that llamapack relies on (all in one place)."""
from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import llama_cpp.llama_cpp as llama_cpp_lib


@contextlib.contextmanager
def model_params_override(**fields):
    """Models loaded inside get these llama_model_params fields (``llama_cpp.Llama`` exposes only some).

    Used for ``use_extra_bufts=False``: llama.cpp's CPU repack buffers re-layout Q4_0/Q4_K/IQ4_NL/Q8_0
    weights for other SIMD kernels whose sums round differently, while a slot pool holds the GGUF's bytes.
    """
    original = llama_cpp_lib.llama_model_default_params

    def patched():
        params = original()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    llama_cpp_lib.llama_model_default_params = patched
    try:
        yield
    finally:
        llama_cpp_lib.llama_model_default_params = original


# llama.cpp's --cpu-moe (common/common.h LLM_FFN_EXPS_REGEX): routed expert weights stay in host memory
CPU_MOE_PATTERN = rb"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def cpu_buffer_type() -> int:
    """``ggml_backend_cpu_buffer_type()`` from the libggml-cpu beside the libllama llama_cpp loaded."""
    lib_dir = Path(llama_cpp_lib._lib._name).resolve().parent
    candidates = sorted(lib_dir.glob("libggml-cpu*.so*")) + sorted(lib_dir.glob("libggml.so*"))
    for path in candidates:
        function = getattr(ctypes.CDLL(str(path)), "ggml_backend_cpu_buffer_type", None)
        if function is not None:
            function.restype = ctypes.c_void_p
            return function()
    raise RuntimeError(f"no libggml-cpu with ggml_backend_cpu_buffer_type in {lib_dir}")


@contextlib.contextmanager
def cpu_moe(use_extra_bufts: bool = True):
    """Models loaded inside keep routed experts in host memory and compute them on the CPU, as llama.cpp's
    ``--cpu-moe`` does (the rest follows n_gpu_layers). ``use_extra_bufts=False`` is ``--no-repack``: the
    experts stay mmapped instead of being copied into repacked buffers."""
    overrides = (_BuftOverride * 2)(_BuftOverride(CPU_MOE_PATTERN, cpu_buffer_type()), _BuftOverride(None, None))
    with model_params_override(tensor_buft_overrides=ctypes.cast(overrides, ctypes.c_void_p).value,
                               use_extra_bufts=use_extra_bufts):
        yield  # ``overrides`` stays alive until the load is done
