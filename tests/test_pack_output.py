"""``llamapack pack`` loses no data: outputs it refuses, the writers' lock, stale temporary files, publication.

The CLI cases run ``python -m llamapack`` as a subprocess (one-line error, exit status, files left as they were).
"""

import fcntl
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from ggufgen import write_moe_gguf

from llamapack.pack import PackReader, build_pack
from llamapack.pack.publish import lock_path, temp_path

REPO = Path(__file__).resolve().parent.parent


def llamapack(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "llamapack", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd)


def pack(gguf, out, *extra):
    return llamapack("pack", gguf, "-o", out, "--safety-margin-mib", "0", "-q", *extra)


def one_line_error(proc) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("Error: "), proc.stderr
    return proc.stderr


def digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_output_that_is_the_source_is_refused(moe_gguf, tmp_path):
    before = digest(moe_gguf)
    link = tmp_path / "link.expert-pack"
    link.symlink_to(moe_gguf)
    for out in (moe_gguf, link):
        error = one_line_error(pack(moe_gguf, out))
        assert "over its source" in error and str(moe_gguf) in error
    assert digest(moe_gguf) == before
    assert not Path(str(moe_gguf) + ".manifest.json").exists()


def test_non_regular_output_is_refused(moe_gguf, tmp_path):
    fifo = tmp_path / "fifo.expert-pack"
    os.mkfifo(fifo)
    error = one_line_error(pack(moe_gguf, fifo, "--force"))  # --force never replaces a non-regular file
    assert "not a regular file" in error and str(fifo) in error
    assert fifo.is_fifo()
    manifest_fifo = tmp_path / "m.expert-pack.manifest.json"
    os.mkfifo(manifest_fifo)
    error = one_line_error(pack(moe_gguf, tmp_path / "m.expert-pack"))
    assert "not a regular file" in error and str(manifest_fifo) in error
    assert manifest_fifo.is_fifo() and not (tmp_path / "m.expert-pack").exists()


def test_existing_file_that_is_not_a_pack_needs_force(moe_gguf, tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("my notes\n")
    error = one_line_error(pack(moe_gguf, out))
    assert "is not an expert pack" in error and "--force" in error and str(out) in error
    assert out.read_text() == "my notes\n"

    manifest = tmp_path / "p.expert-pack.manifest.json"
    manifest.write_text("{}")
    error = one_line_error(pack(moe_gguf, tmp_path / "p.expert-pack"))
    assert "is not a pack manifest" in error and str(manifest) in error
    assert manifest.read_text() == "{}"

    proc = pack(moe_gguf, out, "--force")
    assert proc.returncode == 0, proc.stderr
    with PackReader(out, model=moe_gguf, verify_sha256=True):
        pass
    proc = pack(moe_gguf, out)  # now it is a pack: rebuilding over it needs no --force
    assert proc.returncode == 0, proc.stderr


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_files_of_dead_writers_are_removed(moe_gguf, tmp_path):
    out = tmp_path / "x.expert-pack"
    pid = dead_pid()
    stale = [Path(temp_path(str(out), pid)), Path(temp_path(str(out) + ".manifest.json", pid)),
             Path(f"{out}.manifest.json.tmp-{pid}")]  # older builds named the manifest's temp so
    live = Path(temp_path(str(out), os.getpid()))  # a writer still running: kept
    other = tmp_path / f".y.expert-pack.tmp-{pid}"  # another output's: not this build's business
    for path in (*stale, live, other):
        path.write_bytes(b"\0" * 4096)
    proc = pack(moe_gguf, out)
    assert proc.returncode == 0, proc.stderr
    assert not any(path.exists() for path in stale)
    assert live.exists() and other.exists()
    leftovers = {p.name for p in tmp_path.iterdir()} - {moe_gguf.name, live.name, other.name}
    assert leftovers == {"x.expert-pack", "x.expert-pack.manifest.json"}  # no lock file, no temp file of its own


def test_a_second_writer_is_refused_while_the_lock_is_held(moe_gguf, tmp_path):
    out = tmp_path / "x.expert-pack"
    fd = os.open(lock_path(str(out)), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242\n")
        error = one_line_error(pack(moe_gguf, out))
        assert "another `llamapack pack` (pid 4242) is writing" in error and str(out) in error
        assert not out.exists()
    finally:
        os.close(fd)


def test_concurrent_writers_leave_a_matching_pair(tmp_path):
    ggufs = [write_moe_gguf(tmp_path / f"m{i}.gguf", seed=i)[0] for i in range(2)]
    out = tmp_path / "x.expert-pack"
    for _ in range(3):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        procs = [subprocess.Popen([sys.executable, "-m", "llamapack", "pack", str(g), "-o", str(out),
                                   "--safety-margin-mib", "0", "-q", "--force"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for g in ggufs]
        results = [(p.wait(), p.stderr.read()) for p in procs]
        for p in procs:
            p.stdout.close()
            p.stderr.close()
        assert any(rc == 0 for rc, _ in results), results
        for rc, err in results:
            assert rc == 0 or "is writing" in err, err
        winner = [g for g, (rc, _) in zip(ggufs, results) if rc == 0][-1]
        proc = llamapack("verify", out, "--against", winner, "-q")
        if proc.returncode != 0:  # both succeeded one after the other: the later one won
            proc = llamapack("verify", out, "--against", ggufs[0], "-q")
        assert proc.returncode == 0, proc.stderr


def test_reader_waits_out_a_publication_between_its_two_renames(tmp_path):
    """The pack is renamed first, its manifest second: a reader in between sees a pair that differs and
    opens them again."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    old = build_pack(write_moe_gguf(tmp_path / "a" / "m.gguf", seed=1)[0], tmp_path / "a" / "x.expert-pack",
                     progress=False, safety_margin_mib=0)
    new = build_pack(write_moe_gguf(tmp_path / "b" / "m.gguf", seed=2)[0], tmp_path / "b" / "x.expert-pack",
                     progress=False, safety_margin_mib=0)
    os.replace(new.pack_path, old.pack_path)  # the first rename of a publication
    second = threading.Timer(0.02, os.replace, (new.manifest_path, old.manifest_path))
    second.start()
    started = time.perf_counter()
    with PackReader(old.pack_path, verify_sha256=True) as reader:
        assert reader.manifest == new.manifest
    second.join()
    assert time.perf_counter() - started < 1
