"""One exception hierarchy for llamapack.

Every failure the project reports on purpose is a ``LlamapackError``; callers (CLI, server) map the
subclasses to exit codes / HTTP statuses by type, never by message text.
"""


class LlamapackError(Exception):
    """Root of every error llamapack raises on purpose."""


class PackFormatError(LlamapackError):
    """A pack, manifest or GGUF is malformed, misaligned or of an unsupported version."""


class IntegrityError(LlamapackError):
    """Bytes do not match what the manifest or the source model says they should be."""


class ModelMismatchError(LlamapackError):
    """A pack (or pool layout) belongs to another model, quantization or configuration."""


class PackIOError(LlamapackError):
    """Reading or writing expert bytes failed (EIO, short read, timeout, no O_DIRECT)."""


class CapacityError(LlamapackError):
    """A memory budget (slots, VRAM, RAM, disk) is too small for what was asked."""


class InputError(LlamapackError):
    """A prompt or request the model cannot take: empty, longer than the context, not UTF-8."""


class NativeError(LlamapackError):
    """The patched llama.cpp library is missing, unpatched, or reported a failure."""
