"""Build an expert pack from a GGUF.

Streams: expert role slices are read from the GGUF with plain preads into a page-aligned gather
buffer of several blocks, hashed per block on two threads and written with one large O_DIRECT
pwrite on a third, while the next buffer is filled (three buffers in rotation). The pack and its manifest
are written under temporary names beside the output, under the writers' lock, and renamed into place when
complete (publish.py).
"""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
from tqdm import tqdm

from llamapack.errors import CapacityError, PackIOError

from .gguf_model import GgufModel, open_gguf
from .header import PackHeader
from .identity import SAMPLED, source_identity
from .layout import HEADER_SIZE, PackLayout
from .manifest import MANIFEST_SUFFIX, PACK_SUFFIX, Manifest, canonical_sha256, manifest_to_dict, write_manifest
from .odirect import DirectFile, aligned_buffer
from .publish import check_output, publish, remove_stale_temps, temp_path, writer_lock

GATHER_BYTES = 32 << 20  # target size of one pwrite
N_BUFFERS = 3


@dataclass(frozen=True)
class BuildResult:
    pack_path: str
    manifest_path: str
    manifest: Manifest
    seconds: float  # time spent streaming blocks (the write rate is pack bytes / seconds)


def default_pack_path(model: GgufModel) -> str:
    return os.path.join(os.path.dirname(model.paths[0]), model.stem + PACK_SUFFIX)


def check_free_space(folder: str, need: int, safety_margin: int) -> None:
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    if free < need + safety_margin:
        raise CapacityError(
            f"not enough free space in {folder}: the pack needs {need / 1e9:.2f} GB plus a "
            f"{safety_margin / 2**20:.0f} MiB safety margin, {free / 1e9:.2f} GB free"
        )


class _BlockGatherer:
    """Copies one expert's role slices from the GGUF into a block image (slot layout)."""

    def __init__(self, model: GgufModel, layout: PackLayout):
        self.layout = layout
        self.tensors = {(t.layer, t.role): t for t in model.expert_tensors}
        self.files = {p: DirectFile(p, direct_io=False) for p in model.paths}

    def fill(self, block: np.ndarray, layer: int, expert: int) -> None:
        for entry in self.layout.layer_layout(layer).roles:
            tensor = self.tensors[layer, entry.role]
            self.files[tensor.path].read_into(block[entry.offset:entry.end], tensor.expert_offset(expert),
                                              where=f"layer {layer} expert {expert} role {entry.role}")
        for start, end in self.layout.layer_layout(layer).gaps(self.layout.expert_stride):
            block[start:end] = 0

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _hash_blocks(buf: np.ndarray, stride: int) -> list[str]:
    return [hashlib.sha256(buf[i:i + stride]).hexdigest() for i in range(0, buf.nbytes, stride)]


def _stream_blocks(model: GgufModel, layout: PackLayout, out: DirectFile, bar: tqdm) -> list[str]:
    """Write every block to ``out``; returns the block sha256s in file order."""
    stride, total = layout.expert_stride, layout.num_blocks
    per_chunk = max(1, GATHER_BYTES // stride)
    buffers = [aligned_buffer(per_chunk * stride) for _ in range(N_BUFFERS)]
    in_flight: list[tuple[list[Future], Future, int] | None] = [None] * N_BUFFERS
    hash_jobs: list[Future] = []
    gatherer = _BlockGatherer(model, layout)
    hasher, writer = ThreadPoolExecutor(2), ThreadPoolExecutor(1)

    def settle(slot: int) -> None:
        if in_flight[slot] is not None:
            jobs, write_job, nbytes = in_flight[slot]
            write_job.result()
            for job in jobs:
                job.result()
            bar.update(nbytes)
            in_flight[slot] = None

    try:
        for chunk, first in enumerate(range(0, total, per_chunk)):
            slot = chunk % N_BUFFERS
            settle(slot)
            count = min(per_chunk, total - first)
            buf = buffers[slot][:count * stride]
            for i in range(count):
                gatherer.fill(buf[i * stride:(i + 1) * stride], *layout.block_at(first + i))
            split = (count + 1) // 2 * stride  # two hashing threads, one half each
            jobs = [hasher.submit(_hash_blocks, part, stride) for part in (buf[:split], buf[split:]) if part.nbytes]
            hash_jobs += jobs
            write_job = writer.submit(out.write_from, buf, layout.data_start + first * stride)
            in_flight[slot] = (jobs, write_job, buf.nbytes)
        for slot in range(N_BUFFERS):
            settle(slot)
    finally:
        hasher.shutdown(wait=True, cancel_futures=True)
        writer.shutdown(wait=True, cancel_futures=True)
        gatherer.close()
    return [h for job in hash_jobs for h in job.result()]


def _write_pack_file(model: GgufModel, path: str, manifest_stub: Manifest, direct_io: bool,
                     progress: bool) -> tuple[Manifest, float]:
    """Blocks, then the header page (it holds the finished manifest's hash); fsynced."""
    layout = model.layout
    with DirectFile(path, direct_io=direct_io, write=True) as f, \
            tqdm(total=layout.num_blocks * layout.expert_stride, unit="B", unit_scale=True, unit_divisor=1000,
                 desc=f"pack {manifest_stub.pack_file}", disable=not progress) as bar:
        started = time.perf_counter()
        hashes = _stream_blocks(model, layout, f, bar)
        seconds = time.perf_counter() - started
        n = layout.num_experts
        manifest = replace(manifest_stub, block_sha256=tuple(tuple(hashes[i:i + n]) for i in range(0, len(hashes), n)))
        header = aligned_buffer(HEADER_SIZE)
        digest = canonical_sha256(manifest_to_dict(manifest))
        header[:] = np.frombuffer(PackHeader.for_layout(layout, digest).encode(), dtype=np.uint8)
        f.write_from(header, 0)
        f.sync()
    return manifest, seconds


def build_pack(gguf: str | os.PathLike | GgufModel, out: str | os.PathLike | None = None, *,
               safety_margin_mib: int = 1024, progress: bool = True, direct_io: bool = True,
               fingerprint_mode: str = SAMPLED, force: bool = False) -> BuildResult:
    """Write ``out`` (default ``<stem>.expert-pack`` beside the GGUF) and ``out + ".manifest.json"``.

    Refused (PackIOError) while another build writes the same output, and for an output that would lose
    data (publish.check_output; ``force`` allows replacing a regular file that is not a pack)."""
    model = gguf if isinstance(gguf, GgufModel) else open_gguf(gguf)
    layout = model.layout
    pack_path = os.path.abspath(os.fspath(out)) if out is not None else default_pack_path(model)
    manifest_path = pack_path + MANIFEST_SUFFIX
    folder = os.path.dirname(pack_path)
    if not os.path.isdir(folder):
        raise PackIOError(f"output folder does not exist: {folder}")
    pack_tmp, manifest_tmp = temp_path(pack_path), temp_path(manifest_path)
    try:
        with writer_lock(pack_path):
            check_output(pack_path, model.paths, force)
            remove_stale_temps(pack_path)
            check_free_space(folder, layout.pack_size + (1 << 20), safety_margin_mib << 20)
            stub = Manifest(layout, (), os.path.basename(pack_path), model.hparams_sha256,
                            source_identity(model.paths, fingerprint_mode))
            try:
                manifest, seconds = _write_pack_file(model, pack_tmp, stub, direct_io, progress)
                write_manifest(manifest_tmp, manifest)
                publish(pack_tmp, pack_path, manifest_tmp, manifest_path)
            finally:
                for tmp in (pack_tmp, manifest_tmp):
                    if os.path.lexists(tmp):
                        os.unlink(tmp)
    except OSError as exc:
        raise PackIOError(f"writing {pack_path} failed: {exc}") from None
    return BuildResult(pack_path, manifest_path, manifest, seconds)
