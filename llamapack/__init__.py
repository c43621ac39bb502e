"""llamapack: run Mixture-of-Experts LLMs whose routed experts live on SSD, through a patched llama.cpp."""

from .errors import (CapacityError, IntegrityError, LlamapackError, ModelMismatchError, NativeError,
                     PackFormatError, PackIOError)

__all__ = ["CapacityError", "IntegrityError", "Llama", "LlamapackError", "ModelMismatchError", "NativeError",
           "PackFormatError", "PackIOError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``llamapack.Llama`` without importing llama_cpp at ``import llamapack`` time."""
    if name == "Llama":
        from .llama import Llama

        return Llama
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
