"""How the writers' bytes reach the disk (ckpt_tools.diskio): small writes, stepped kernel
copies, a flush that follows the file, and a failed flush that fails the write."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from safetensors.torch import save_file

import ckpt_tools
from ckpt_tools.storage import diskio
from ckpt_tools.storage.castio import CastSpan, blocks
from ckpt_tools.core.dtypes import DType
from ckpt_tools.errors import BadInput


@pytest.fixture
def writes(monkeypatch):
    """The size of every os.write."""
    sizes: list[int] = []
    real = os.write

    def write(fd, data):
        sizes.append(len(data))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    return sizes


def test_write_all_writes_everything_in_small_slices(tmp_path, writes):
    data = os.urandom(3 * diskio.WRITE_BYTES + 123)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert diskio.write_all(fd, data) == len(data)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data
    assert writes == [diskio.WRITE_BYTES] * 3 + [123]


def test_cast_blocks_come_in_write_sized_slices(tmp_path):
    a = torch.randn(3 * diskio.WRITE_BYTES // 2 + 7).to(torch.bfloat16)
    path = tmp_path / "raw"
    path.write_bytes(a.view(torch.int16).numpy().tobytes())
    got = [bytes(b) for b in blocks(CastSpan(((path, 0, path.stat().st_size),), DType("bfloat16"), DType("float32")))]
    assert max(len(b) for b in got) <= diskio.WRITE_BYTES and len(got) == -(-a.numel() * 4 // diskio.WRITE_BYTES)
    assert b"".join(got) == a.float().numpy().tobytes()


class _Syncs(list):
    """Every fdatasync's fd; with ``fail`` set, the next ones raise EIO."""

    fail = False


@pytest.fixture
def syncs(monkeypatch):
    calls = _Syncs()
    real = os.fdatasync

    def fdatasync(fd):
        calls.append(fd)
        if calls.fail:
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return calls


def test_flusher_flushes_while_the_file_grows(tmp_path, syncs):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        with diskio.Flusher(fd, every=1 << 20) as flusher:
            for _ in range(8):
                diskio.write_all(fd, b"x" * (512 << 10), flusher)
                flusher._sync.result() if flusher._sync else None  # let each flush end: the next may start
            assert len(syncs) == 4  # one per MiB written
            diskio.write_all(fd, b"x" * 100, flusher)
            assert len(syncs) == 4  # under `every`: no flush yet
    finally:
        os.close(fd)
    assert set(syncs) == {fd}


def test_a_failed_flush_fails_the_close(tmp_path, syncs):
    syncs.fail = True
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        flusher = diskio.Flusher(fd, every=1)
        diskio.write_all(fd, b"abc", flusher)
        with pytest.raises(OSError, match="Input/output"):
            flusher.close()
        flusher = diskio.Flusher(fd, every=1)
        diskio.write_all(fd, b"abc", flusher)
        flusher.close(check=False)  # after another error: stops, raises nothing more
    finally:
        os.close(fd)


def test_a_failed_flush_fails_the_command_and_publishes_nothing(tmp_path, syncs):
    """A flush error while a torch file is written (single file, no manifest) is the run's
    error, not a warning: no output appears, and no staging is left behind."""
    src = tmp_path / "hf"
    src.mkdir()
    save_file({"w": torch.randn(5000, 1024)}, src / "model.safetensors")  # 20 MiB: a flush starts
    syncs.fail = True
    with pytest.raises(OSError, match="Input/output"):
        ckpt_tools.convert(src, tmp_path / "out.pt", to="torch", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_copy_range_steps_falls_back_and_refuses_a_short_source(tmp_path, monkeypatch):
    data = os.urandom(5000)
    (tmp_path / "src").write_bytes(data)
    steps: list[int] = []
    real = os.copy_file_range

    def stepping(src, dst, count, offset_src=None, offset_dst=None):
        steps.append(count)
        return real(src, dst, count, offset_src)

    monkeypatch.setattr(diskio, "COPY_BYTES", 1000)
    monkeypatch.setattr(os, "copy_file_range", stepping)
    with open(tmp_path / "src", "rb") as s, open(tmp_path / "a", "wb") as d:
        diskio.copy_range(s.fileno(), d.fileno(), 10, 4990, what="src")
    assert (tmp_path / "a").read_bytes() == data[10:] and steps == [1000] * 4 + [990]

    def cross_device(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", cross_device)
    with open(tmp_path / "src", "rb") as s, open(tmp_path / "b", "wb") as d:
        diskio.copy_range(s.fileno(), d.fileno(), 0, 5000, what="src")
    assert (tmp_path / "b").read_bytes() == data
    with open(tmp_path / "src", "rb") as s, open(tmp_path / "c", "wb") as d, \
            pytest.raises(BadInput, match="src: ended 100 bytes early"):
        diskio.copy_range(s.fileno(), d.fileno(), 0, 5100, what="src")

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "copy_file_range", full_disk)  # not a reason to fall back: raised
    with open(tmp_path / "src", "rb") as s, open(tmp_path / "d", "wb") as d, pytest.raises(OSError, match="No space"):
        diskio.copy_range(s.fileno(), d.fileno(), 0, 5000, what="src")


def test_a_digest_reads_a_chunk_at_a_time_through_one_buffer(tmp_path, monkeypatch):
    """Hashing reads the file a small chunk at a time into one buffer (a mapping's pages
    counted in the process's RSS: a 64 MiB window raised a 256-rank reshard's peak by its
    .metadata's size), and the digest, from any start, is xxh3 of those bytes; a file cut
    short while it is hashed raises."""
    import xxhash

    from ckpt_tools.storage import manifest

    assert manifest.CHUNK <= 1 << 20
    monkeypatch.setattr(manifest, "CHUNK", 4096)
    data = os.urandom(7 * 4096 + 123)
    (tmp_path / "f").write_bytes(data)
    reads, buffers, real = [], set(), os.preadv

    def preadv(fd, views, offset):
        reads.append(len(views[0]))
        buffers.add(id(views[0].obj))
        return real(fd, views, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    for start in (0, 1, 4096 + 5, len(data) - 1):
        reads.clear()
        buffers.clear()
        assert manifest.range_digest(tmp_path / "f", start) == xxhash.xxh3_64(data[start:]).hexdigest()
        assert reads and max(reads) <= 4096 and len(buffers) == 1
    with open(tmp_path / "f", "rb") as f, pytest.raises(OSError, match="ends at"):
        manifest._hash_range(f.fileno(), xxhash.xxh3_64(), 0, len(data) + 10)
