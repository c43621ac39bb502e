"""The native read pool (native/llama-expert-io.cpp through llamapack.provider.native_reads), in process.

The C API directly: bytes land where asked, demand before prefetch, the prefetch cap, promote, cancel,
timeouts, errors (errno, short reads at the end of the file) and close. ``hold`` keeps queued reads from
starting, so that the order a batch starts in is decided by the queues alone; ``order`` says when each
read started. Then ``NativeReads`` over a pack: pieces rebuild blocks, errors name file, layer and expert.
"""
import errno
import os

import llama_cpp  # noqa: F401 - the patched libllama, before numpy (see docs/hook.md)
import numpy as np
import pytest

from llamapack import native
from llamapack.errors import PackIOError
from llamapack.pack import ALIGNMENT, PackReader, aligned_buffer
from llamapack.provider.native_reads import CANCELLED, DONE, FAILED, NativeReads
from llamapack.provider.reads import PackSource

ffi = native.ffi
CHUNK = 64 << 10


@pytest.fixture
def lib():
    return native.lib()


@pytest.fixture
def data_file(tmp_path):
    """(path, bytes): 16 chunks of distinct random bytes, on a filesystem with O_DIRECT (not tmpfs)."""
    payload = np.random.default_rng(7).integers(0, 256, 16 * CHUNK, dtype=np.uint8).tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(payload)
    return path, payload


class Pool:
    """A C pool over one file descriptor, with a buffer per chunk."""

    def __init__(self, lib, path, n_threads, max_prefetch, direct=True):
        self.lib = lib
        self.fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        self.pool = lib.llama_expert_read_pool_new(n_threads, max_prefetch)
        assert self.pool != ffi.NULL
        self.buffers = [aligned_buffer(CHUNK) for _ in range(16)]

    def submit(self, chunk, prefetch=False, nbytes=CHUNK, fd=None):
        buffer = self.buffers[chunk]
        return self.lib.llama_expert_read_submit(self.pool, self.fd if fd is None else fd,
                                                 ffi.cast("void *", buffer.ctypes.data), chunk * CHUNK, nbytes,
                                                 ALIGNMENT, prefetch)

    def status(self, read_id):
        out = ffi.new("struct llama_expert_read_status *")
        assert self.lib.llama_expert_read_get_status(self.pool, read_id, out) == 0
        return out.state, out.error, out.bytes, out.order

    def wait_all(self, ids):
        array = ffi.new("int64_t[]", ids)
        while self.lib.llama_expert_read_wait_any(self.pool, array, len(ids), 5.0) < len(ids):
            pass

    def close(self):
        self.lib.llama_expert_read_pool_free(self.pool)
        os.close(self.fd)


def test_reads_land_the_bytes_asked_for(lib, data_file):
    path, payload = data_file
    for direct in (True, False):
        pool = Pool(lib, path, n_threads=4, max_prefetch=1, direct=direct)
        ids = [pool.submit(chunk, prefetch=chunk % 3 == 0) for chunk in range(16)]
        pool.wait_all(ids)
        for chunk, read_id in enumerate(ids):
            assert pool.status(read_id)[:3] == (DONE, 0, CHUNK)
            assert pool.buffers[chunk].tobytes() == payload[chunk * CHUNK:(chunk + 1) * CHUNK]
        pool.close()


def test_demand_reads_start_before_prefetch_reads_and_prefetch_waits_for_them(lib, data_file):
    pool = Pool(lib, data_file[0], n_threads=3, max_prefetch=1)
    lib.llama_expert_read_pool_hold(pool.pool, True)
    prefetch = [pool.submit(c, prefetch=True) for c in range(3)]
    demand = [pool.submit(c) for c in range(3, 6)]
    lib.llama_expert_read_pool_hold(pool.pool, False)
    pool.wait_all(prefetch + demand)
    order = {read_id: pool.status(read_id)[3] for read_id in prefetch + demand}
    assert sorted(order[i] for i in demand) == [1, 2, 3]  # every demand read started first ...
    assert [order[i] for i in prefetch] == [4, 5, 6]      # ... then the prefetch reads, in queue order
    pool.close()


def test_promote_moves_a_queued_prefetch_read_to_the_demand_queue(lib, data_file):
    pool = Pool(lib, data_file[0], n_threads=2, max_prefetch=1)
    lib.llama_expert_read_pool_hold(pool.pool, True)
    first, second = pool.submit(0, prefetch=True), pool.submit(1, prefetch=True)
    assert lib.llama_expert_read_promote(pool.pool, second) == 1
    assert lib.llama_expert_read_promote(pool.pool, second) == 0  # a demand read now
    lib.llama_expert_read_pool_hold(pool.pool, False)
    pool.wait_all([first, second])
    assert pool.status(second)[3] == 1 and pool.status(first)[3] == 2
    pool.close()


def test_cancel_a_queued_read_and_time_out_waiting_for_one(lib, data_file):
    pool = Pool(lib, data_file[0], n_threads=2, max_prefetch=1)
    lib.llama_expert_read_pool_hold(pool.pool, True)
    kept, cancelled = pool.submit(0), pool.submit(1)
    array = ffi.new("int64_t[]", [kept])
    assert lib.llama_expert_read_wait_any(pool.pool, array, 1, 0.05) == 0  # held: nothing finishes
    assert lib.llama_expert_read_cancel(pool.pool, cancelled) == 1
    assert pool.status(cancelled)[0] == CANCELLED
    lib.llama_expert_read_pool_hold(pool.pool, False)
    pool.wait_all([kept])
    assert lib.llama_expert_read_cancel(pool.pool, kept) == 0  # finished: nothing to cancel
    assert not pool.buffers[1].any()  # the cancelled read never wrote
    lib.llama_expert_read_release(pool.pool, kept)
    assert lib.llama_expert_read_get_status(pool.pool, kept, ffi.new("struct llama_expert_read_status *")) == -1
    pool.close()


def test_errors_and_short_reads_are_reported(lib, data_file):
    pool = Pool(lib, data_file[0], n_threads=2, max_prefetch=0)
    pool.buffers[15] = aligned_buffer(2 * CHUNK)
    bad_fd = pool.submit(0, fd=9999)
    past_end = pool.submit(15, nbytes=2 * CHUNK)  # the file ends one chunk in
    pool.wait_all([bad_fd, past_end])
    assert pool.status(bad_fd)[:3] == (FAILED, errno.EBADF, 0)
    assert pool.status(past_end)[:3] == (DONE, 0, CHUNK)
    pool.close()


def test_close_cancels_the_queued_reads(lib, data_file):
    pool = Pool(lib, data_file[0], n_threads=2, max_prefetch=1)
    lib.llama_expert_read_pool_hold(pool.pool, True)
    [pool.submit(c) for c in range(4)]
    pool.close()  # returns: nothing queued runs, no thread is left waiting
    assert lib.llama_expert_read_pool_new(2, 2) == ffi.NULL  # demand reads must keep a thread


# ---------------------------------------------------------------- NativeReads over a pack
@pytest.mark.parametrize("splits", [1, 3])
def test_native_reads_rebuild_pack_blocks(splits, moe_pack):
    reader = PackReader(moe_pack.pack_path)
    source = PackSource(reader, direct_io=True, read_fn=None, splits=splits, verify_sha256=True)
    reads = NativeReads(source, n_threads=4, max_prefetch=1)
    layout = reader.layout
    keys = [(entry.layer, expert) for entry in layout.layers for expert in range(layout.num_experts)][:12]
    blocks = [aligned_buffer(layout.expert_stride) for _ in keys]
    pieces = [reads.start(key, block, source.pieces if i % 2 else source.prefetch_pieces, prefetch=i % 2 == 0)
              for i, (key, block) in enumerate(zip(keys, blocks))]
    for key, block, key_pieces in zip(keys, blocks, pieces):
        reads.promote(key_pieces[0])  # False unless a lookahead piece is still queued
        reads.wait_all(key_pieces)
        for piece in key_pieces:
            piece.result()
        source.check(*key, block)  # the manifest's sha256 of the block
    reads.close()
    reads.close()  # idempotent
    reader.close()


def test_native_read_errors_name_the_file_layer_and_expert(moe_pack):
    short_pack = moe_pack.pack_path  # this test's own copy
    reader = PackReader(short_pack)
    layout = reader.layout
    layer, expert = layout.layers[-1].layer, layout.num_experts - 1
    offset = layout.block_offset(layer, expert)
    source = PackSource(reader, direct_io=True, read_fn=None, splits=1, verify_sha256=False)
    reads = NativeReads(source, n_threads=2, max_prefetch=0)
    os.truncate(short_pack, offset + ALIGNMENT)  # the last block now ends one page in
    (piece,) = reads.start((layer, expert), aligned_buffer(layout.expert_stride), source.pieces)
    with pytest.raises(PackIOError) as failure:
        piece.result()
    message = str(failure.value)
    assert message == (f"short read from {short_pack} at offset {offset} (layer {layer} expert {expert}): "
                       f"got {ALIGNMENT} of {layout.expert_stride} bytes")
    reads.close()
    with pytest.raises(PackIOError, match="read pool is closed"):
        reads.start((layer, expert), aligned_buffer(layout.expert_stride), source.pieces)
    reader.close()
