"""llamapack: run Mixture-of-Experts LLMs whose routed experts live on SSD, through a patched llama.cpp."""

from .errors import (CapacityError, IntegrityError, LlamapackError, ModelMismatchError, NativeError,
                     PackFormatError, PackIOError)

__all__ = ["CapacityError", "IntegrityError", "LlamapackError", "ModelMismatchError", "NativeError",
           "PackFormatError", "PackIOError"]
__version__ = "0.1.0"
