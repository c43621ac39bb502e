"""Small adapters around llama-cpp-python internals that llamapack relies on (all in one place)."""
from __future__ import annotations

import contextlib

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
