"""A remote DST is uploaded while it is written, against the real S3 server of test_objstore.py
(SeaweedFS on 127.0.0.1), seen through a proxy that logs every request in the order it comes:

- bucket -> bucket, the output's multipart parts go out before the source's last ranged GET
  (the upload overlaps the download), and the objects are the bytes of a local run;
- a single safetensors file whose header is patched once its data is written: the part
  holding the header is sent again, the object is still byte for byte the local file;
- a part the store refuses, or a Ctrl-C, while the parts go out: exit 4 / 130, nothing
  visible under DST and no unfinished multipart upload left (ListMultipartUploads empty);
- a run killed while sending parts over an old checkpoint (``--overwrite``) leaves that
  checkpoint whole, and ``ckpt clean`` removes only the dead run's lease and parts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from dist import terminal_sigint
from s3server import LoggingProxy
from test_objstore import FIXTURES, big_dcp, ckpt, download, keys, s3, upload  # noqa: F401 - fixtures


def _proxy(s3, **kw):  # noqa: F811
    return LoggingProxy(int(s3.endpoint.rsplit(":", 1)[1]), **kw)


def _uploads(reqs):
    """(time, path, part number) of each UploadPart request among ``reqs``."""
    for t, m, target in reqs:
        path, _, query = target.partition("?")
        if m == "PUT" and "partNumber=" in query:
            yield t, path, int(query.split("partNumber=")[1].split("&")[0])


def _parts(reqs, key: str) -> list[tuple[float, int]]:
    """(time, part number) of each UploadPart request of object ``key`` (``bucket/path``)."""
    return [(t, n) for t, path, n in _uploads(reqs) if path == f"/{key}"]


def _source_gets(reqs, prefix: str) -> list[float]:
    return [t for t, m, target in reqs if m == "GET" and target.startswith(f"/{prefix}/")]


def _pending(url: str) -> list:
    from ckpt_tools.storage.objstore import Store

    return Store(url, role="destination").pending_uploads()


def test_parts_go_out_before_the_source_is_read(s3, big_dcp, tmp_path):  # noqa: F811
    path, src = big_dcp
    proxy = _proxy(s3)
    try:
        r = ckpt("convert", src, "s3://ckpt/out/streamed_hf", "--to", "hf", "--quiet",
                 env={"AWS_ENDPOINT_URL": proxy.endpoint})
        reqs = list(proxy.requests)
    finally:
        proxy.close()
    assert r.returncode == 0, r.stderr
    parts = _parts(reqs, "ckpt/out/streamed_hf/model.safetensors")
    gets = _source_gets(reqs, "ckpt/src/big_dcp")
    size = sum(p.stat().st_size for p in path.iterdir())
    assert len(parts) >= size // (8 << 20) - 1, parts  # a multipart upload of many parts
    after = [t for t in gets if t > parts[0][0]]
    print(f"first part sent at {parts[0][0]:.2f}s, {len(after)} of {len(gets)} ranged GETs of the "
          f"{size / 2**20:.0f} MiB source after it, the last at {gets[-1]:.2f}s")
    assert parts[0][0] < gets[-1] and after, "the upload began only once the source was read"
    # the same bytes as a local run; nothing left over
    r = ckpt("convert", path, tmp_path / "local", "--to", "hf")
    assert r.returncode == 0, r.stderr
    got = download("s3://ckpt/out/streamed_hf", tmp_path / "got")
    assert keys("s3://ckpt/out/streamed_hf") == {"model.safetensors", ".ckpt-manifest.json"}
    assert (got / "model.safetensors").read_bytes() == (tmp_path / "local" / "model.safetensors").read_bytes()
    manifest = json.loads((got / ".ckpt-manifest.json").read_text())
    assert manifest["files"] == json.loads((tmp_path / "local" / ".ckpt-manifest.json").read_text())["files"]
    assert _pending("s3://ckpt/out/streamed_hf") == []


def test_a_part_rewritten_after_it_was_sent_is_sent_again(s3, big_dcp, tmp_path):  # noqa: F811
    """A single safetensors file gets its data checksum in its header once the data is
    written: the first part, sent while the rest was written, is sent again."""
    path, src = big_dcp
    dst = "s3://ckpt/out/streamed_one/model.safetensors"
    proxy = _proxy(s3)
    try:
        r = ckpt("convert", src, dst, "--to", "hf", "--quiet", env={"AWS_ENDPOINT_URL": proxy.endpoint})
        reqs = list(proxy.requests)
    finally:
        proxy.close()
    assert r.returncode == 0, r.stderr
    numbers = [n for _, n in _parts(reqs, "ckpt/out/streamed_one/model.safetensors")]
    assert numbers.count(1) == 2 and len(numbers) > 10, numbers
    r = ckpt("convert", path, tmp_path / "local.safetensors", "--to", "hf")
    assert r.returncode == 0, r.stderr
    got = download("s3://ckpt/out/streamed_one", tmp_path / "got")
    assert (got / "model.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    r = ckpt("verify", dst, tmp_path / "local.safetensors")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _pending("s3://ckpt/out/streamed_one") == []


def test_a_refused_part_leaves_nothing(s3, big_dcp, tmp_path):  # noqa: F811
    _, src = big_dcp
    dst = "s3://ckpt/out/refused"
    proxy = _proxy(s3, refuse=lambda m, t: m == "PUT" and t.startswith("/ckpt/out/refused/")
                   and "partNumber=3&" in t)
    try:
        r = ckpt("convert", src, dst, "--to", "hf", "--quiet", env={"AWS_ENDPOINT_URL": proxy.endpoint})
        refused = proxy.refused
    finally:
        proxy.close()
    assert r.returncode == 4, (r.returncode, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "access refused" in errors[0] and "model.safetensors" in errors[0], r.stderr
    assert refused >= 1
    assert keys(dst) == set()
    assert _pending(dst) == []


def _completion_held(s3):  # noqa: F811
    """A proxy that never answers a CompleteMultipartUpload: a client sending DST's parts cannot
    finish (and publish) before the test has killed it, however fast it runs."""
    return _proxy(s3, hold=lambda m, t: m == "POST" and "uploadId=" in t)


def _started(args: list[str], tmp_path, dst: str, proxy) -> subprocess.Popen:
    """The CLI in a process of its own, through ``proxy`` (a LoggingProxy), returned as soon as
    the proxy passes its first part of DST. The CLI starts with SIGINT at its default: a suite
    started in a shell's background would hand it SIGINT ignored, and a Ctrl-C test would see the
    convert run to the end."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "AWS_ENDPOINT_URL": proxy.endpoint}
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", *args, "--quiet"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=terminal_sigint)
    prefix = "/" + dst.removeprefix("s3://") + "/"
    deadline = time.monotonic() + 240
    while not any(path.startswith(prefix) for _, path, _ in _uploads(list(proxy.requests))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no upload seen: {proc.communicate()}")
        time.sleep(0.01)
    return proc


def test_ctrl_c_while_parts_go_out_aborts_them(s3, big_dcp, tmp_path):  # noqa: F811
    _, src = big_dcp
    dst = "s3://ckpt/out/interrupted"
    proxy = _proxy(s3)
    try:
        proc = _started(["convert", src, dst, "--to", "hf"], tmp_path, dst, proxy)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proxy.close()
    assert proc.returncode == 130, err
    assert err.startswith("error: interrupted"), err
    assert keys(dst) == set()
    assert _pending(dst) == []


def test_killed_over_an_old_checkpoint_keeps_it_and_clean_removes_the_parts(s3, big_dcp, tmp_path):  # noqa: F811
    _, src = big_dcp
    dst = "s3://ckpt/out/killed_over_old"
    upload(FIXTURES / "llama_dcp", dst)  # a checkpoint without a manifest of ckpt's
    old = keys(dst)
    before = ckpt("inspect", dst, "--json")
    assert before.returncode == 0, before.stderr
    proxy = _completion_held(s3)
    try:
        proc = _started(["convert", src, dst, "--to", "hf", "--overwrite"], tmp_path, dst, proxy)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proxy.close()
    assert keys(dst) == old | {".ckpt-writing"}  # nothing published: the old markers are there
    assert json.loads(download(dst, tmp_path / "got").joinpath(".ckpt-writing").read_text())["phase"] == "parts"
    r = ckpt("clean", dst)
    assert r.returncode == 0, r.stderr
    assert "unfinished upload" in r.stdout
    assert keys(dst) == old and _pending(dst) == []
    after = ckpt("inspect", dst, "--json")
    assert after.returncode == 0 and json.loads(after.stdout) == json.loads(before.stdout), after.stderr
