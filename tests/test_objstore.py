"""Checkpoints in object storage, against a real S3 server (SeaweedFS, on 127.0.0.1 under
tmp_path; see s3server.py): every command on a bucket gives what it gives on a local copy, the
outputs are read by their real consumers (``dcp.load`` through torch's ``FsspecReader`` on the
URL, ``from_pretrained`` of a download), ``inspect`` moves headers only, a remote DST is
published marker-last, and the store's failures are one ``error:`` line with the contract's code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from s3server import CountingProxy, ThrottlingProxy, make_bucket, start_server

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
MARKER_NAMES = {".metadata", "model.safetensors.index.json", ".ckpt-manifest.json"}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A running server with bucket ``ckpt``; the standard AWS environment set for this process."""
    server = start_server(tmp_path_factory.mktemp("s3server"))  # fails (never skips) when it cannot start
    saved = {k: os.environ.get(k) for k in server.env()}
    try:
        make_bucket(server, "ckpt")
        os.environ.update(server.env())
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=os.environ["AWS_ENDPOINT_URL"])


def upload(local: Path, url: str) -> str:
    """Put a local checkpoint at ``url`` with the plain client (not ckpt's code)."""
    fs = _fs()
    key = url.removeprefix("s3://")
    if local.is_dir():
        for p in sorted(local.rglob("*")):
            if p.is_file():
                fs.put_file(str(p), f"{key}/{p.relative_to(local)}")
    else:
        fs.put_file(str(local), key)
    return url


def download(url: str, local: Path) -> Path:
    fs = _fs()
    key = url.removeprefix("s3://")
    for path in fs.find(key):
        rel = path[len(key):].lstrip("/")
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(local / rel))
    return local


def keys(url: str) -> set[str]:
    key = url.removeprefix("s3://")
    return {p[len(key):].lstrip("/") for p, info in _fs().find(key, detail=True).items() if info["type"] == "file"}


def ckpt(*args, env=None, timeout=300):
    """The CLI in a process of its own, with the standard AWS environment."""
    return subprocess.run([sys.executable, "-m", "ckpt_tools", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def without_paths(info):
    if isinstance(info, dict):
        return {k: without_paths(v) for k, v in info.items() if k not in ("path", "src", "dst")}
    if isinstance(info, list):
        return [without_paths(v) for v in info]
    return info


# -- the storage layer ---------------------------------------------------------------------------

def test_urls_and_markers():
    from ckpt_tools.storage.objstore import is_remote, local_path
    from ckpt_tools.storage.remote import marker_rank

    assert is_remote("s3://b/p") and is_remote("gs://b/p") and is_remote("memory://x")
    assert not is_remote("/tmp/x") and not is_remote("ckpt") and not is_remote("file:///tmp/x")
    assert not is_remote(Path("s3:/b/p"))
    assert local_path("file:///tmp/x") == "/tmp/x"
    assert [marker_rank(n) for n in ("__0_0.distcp", "a/.metadata", "model.safetensors.index.json",
                                     ".ckpt-manifest.json", "model-00001-of-00002.safetensors")] == [0, 1, 1, 2, 0]


def test_file_urls_are_local_paths(tmp_path):
    import ckpt_tools

    src = FIXTURES / "llama_hf"
    assert ckpt_tools.inspect(f"file://{src}") == ckpt_tools.inspect(src)
    ckpt_tools.convert(f"file://{src}", f"file://{tmp_path / 'out.pt'}", to="torch", progress=False)
    assert (tmp_path / "out.pt").is_file()


def test_store_range_reads_multipart_listing(s3, tmp_path):
    from ckpt_tools.storage.objstore import PART_BYTES, Store

    data = os.urandom(2 * PART_BYTES + 12345)  # a multipart upload of three parts
    (tmp_path / "big.bin").write_bytes(data)
    (tmp_path / "small.txt").write_bytes(b"hello")
    st = Store("s3://ckpt/store-test", role="destination")
    assert not st.exists()
    st.upload([(tmp_path / "big.bin", "d/big.bin"), (tmp_path / "small.txt", "small.txt")])
    assert [(x.rel, x.size) for x in st.list()] == [("d/big.bin", len(data)), ("small.txt", 5)]
    assert st.exists() and not st.is_file() and Store("s3://ckpt/store-test/small.txt").is_file()
    assert st.read("d/big.bin", 100, 200) == data[100:200]
    got = st.read_ranges([("d/big.bin", 0, 8), ("d/big.bin", PART_BYTES - 4, PART_BYTES + 4), ("small.txt", 1, 3)])
    assert got == [data[:8], data[PART_BYTES - 4: PART_BYTES + 4], b"el"]
    assert st.pending_uploads() == []


def test_publish_uploads_markers_last(tmp_path):
    """The order publish puts objects in, on a real (in-memory) fsspec store."""
    from ckpt_tools.storage import remote
    from ckpt_tools.storage.objstore import Store

    out = tmp_path / "out"
    for name in ("__0_0.distcp", ".metadata", "sub/.metadata", "sub/__0_0.distcp", ".ckpt-manifest.json",
                 "model.safetensors.index.json", "model-00001-of-00001.safetensors"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(name.encode())
    order: list[str] = []

    class Recording(Store):
        def upload(self, pairs):
            pairs = list(pairs)
            order.extend(rel for _, rel in pairs if rel != remote.LEASE)
            super().upload(pairs)

    st = Recording("memory://bucket/pub", role="destination")
    remote.publish(out, st, overwrite=False)
    ranks = [remote.marker_rank(r) for r in order]
    assert ranks == sorted(ranks) and order[-1] == ".ckpt-manifest.json", order
    assert {x.rel for x in st.list()} == {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}


# -- SRC as a URL ---------------------------------------------------------------------------------

SOURCES = ["llama_dcp", "llama_hf", "llama_hf_sharded", "llama_sharded_ws2", "llama_accelerate", "llama_torch",
           "llama_torch_training.pt", "llama_tied_sharded_ws2"]


@pytest.mark.parametrize("name", SOURCES)
def test_inspect_remote_equals_local(s3, name):
    import ckpt_tools

    url = upload(FIXTURES / name, f"s3://ckpt/src/{name}")
    remote = ckpt_tools.inspect(url, tensors=True)
    local = ckpt_tools.inspect(FIXTURES / name, tensors=True)
    assert remote["path"] == url
    assert without_paths(remote) == without_paths(local)


@pytest.fixture(scope="module")
def big_dcp(s3, tmp_path_factory):
    """A 300 MB DCP (dcp.save of real tensors plus an optimizer-like step and a pickled object)."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("big") / "dcp"
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.rand(1536, 4096, generator=g) for i in range(12)}  # 12 x 24 MiB
    sd["step"] = torch.tensor(7.0)
    sd["meta"] = {"note": "kept as bytes"}
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path, upload(path, "s3://ckpt/src/big_dcp")


def test_inspect_moves_headers_only(s3, big_dcp):
    """inspect of a 300 MB remote DCP moves its .metadata and a few small items, not its tensors."""
    path, url = big_dcp
    size = sum(p.stat().st_size for p in path.iterdir())
    assert size > 300e6
    proxy = CountingProxy(int(s3.endpoint.rsplit(":", 1)[1]))
    try:
        r = ckpt("inspect", url, "--json", env={"AWS_ENDPOINT_URL": proxy.endpoint})
        assert r.returncode == 0, r.stderr
        moved = proxy.to_client
    finally:
        proxy.close()
    print(f"inspect of a {size / 1e6:.0f} MB remote DCP moved {moved / 1e3:.0f} kB to the client")
    assert moved < 5e6
    local = ckpt("inspect", path, "--json")
    assert without_paths(json.loads(r.stdout)) == without_paths(json.loads(local.stdout))


def _tensors(sd):
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def test_export_bucket_to_bucket_equals_local(s3, tmp_path):
    """export from a bucket to a bucket: the same bytes as a local export; from_pretrained loads it."""
    from transformers import AutoModelForCausalLM

    src = upload(FIXTURES / "llama_sharded_ws2", "s3://ckpt/src/export_ws2")
    r = ckpt("export", src, "s3://ckpt/out/export_hf", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    assert "wrote s3://ckpt/out/export_hf" in r.stdout + r.stderr
    r = ckpt("export", FIXTURES / "llama_sharded_ws2", tmp_path / "local", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    got = download("s3://ckpt/out/export_hf", tmp_path / "got")
    names = sorted(str(p.relative_to(got)) for p in got.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(tmp_path / "local")) for p in (tmp_path / "local").rglob("*") if p.is_file())
    for n in names:
        if n != ".ckpt-manifest.json":  # it records the source's path
            assert (got / n).read_bytes() == (tmp_path / "local" / n).read_bytes(), n
    got_manifest = json.loads((got / ".ckpt-manifest.json").read_text())
    assert got_manifest["source"]["path"] == src
    assert got_manifest["files"] == json.loads((tmp_path / "local" / ".ckpt-manifest.json").read_text())["files"]
    a = AutoModelForCausalLM.from_pretrained(got)
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "local")
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_convert_to_dcp_url_loads_through_fsspec_reader(s3, tmp_path):
    """convert a bucket's rank files to a DCP in the bucket; torch's own FsspecReader loads it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    src = upload(FIXTURES / "llama_sharded_ws2", "s3://ckpt/src/convert_ws2")
    r = ckpt("convert", src, "s3://ckpt/out/convert_dcp", "--to", "dcp", "--world-size", "3")
    assert r.returncode == 0, r.stderr
    r = ckpt("convert", FIXTURES / "llama_sharded_ws2", tmp_path / "local_dcp", "--to", "dcp", "--world-size", "3")
    assert r.returncode == 0, r.stderr
    assert keys("s3://ckpt/out/convert_dcp") == {p.name for p in (tmp_path / "local_dcp").iterdir()}
    meta = FileSystemReader(str(tmp_path / "local_dcp")).read_metadata()
    want = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
            if hasattr(m, "size")}
    got = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else torch.zeros_like(v) for k, v in want.items()}
    dcp.load(want, storage_reader=FileSystemReader(str(tmp_path / "local_dcp")), no_dist=True)
    dcp.load(got, storage_reader=FsspecReader("s3://ckpt/out/convert_dcp", endpoint_url=s3.endpoint), no_dist=True)
    assert want.keys() == got.keys() and want
    for k in want:
        assert torch.equal(want[k], got[k]), k


@pytest.mark.parametrize("to", ["torch", "sharded"])
def test_convert_from_bucket_same_tensors(s3, tmp_path, to):
    import torch.distributed.tensor  # noqa: F401 - torch.load(weights_only=True) of DTensors needs it

    src = upload(FIXTURES / "llama_dcp", f"s3://ckpt/src/convert_{to}")
    out = "train.pt" if to == "torch" else "ws2"
    r = ckpt("convert", src, f"s3://ckpt/out/convert_{to}/{out}", "--to", to)
    assert r.returncode == 0, r.stderr
    r = ckpt("convert", FIXTURES / "llama_dcp", tmp_path / "local" / out, "--to", to)
    assert r.returncode == 0, r.stderr
    got = download(f"s3://ckpt/out/convert_{to}", tmp_path / "got")
    files = sorted(p.relative_to(tmp_path / "local") for p in (tmp_path / "local").rglob("*.pt"))
    assert files and files == sorted(p.relative_to(got) for p in got.rglob("*.pt"))
    for f in files:
        a = torch.load(got / f, weights_only=True)
        b = torch.load(tmp_path / "local" / f, weights_only=True)
        flat_a, flat_b = _flatten(a), _flatten(b)
        assert flat_a.keys() == flat_b.keys()
        for k in flat_a:
            va, vb = flat_a[k], flat_b[k]
            if hasattr(va, "to_local"):
                va, vb = va.to_local(), vb.to_local()
            assert (torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb), (f, k)


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix: obj}


def test_reshard_remote_and_verify_across(s3, tmp_path):
    """reshard bucket -> bucket equals a local reshard; verify compares local with remote."""
    src = upload(FIXTURES / "llama_sharded_ws2", "s3://ckpt/src/reshard_ws2")
    r = ckpt("reshard", src, "s3://ckpt/out/reshard_ws3", "--to", "3")
    assert r.returncode == 0, r.stderr
    r = ckpt("reshard", FIXTURES / "llama_sharded_ws2", tmp_path / "ws3", "--to", "3")
    assert r.returncode == 0, r.stderr
    assert keys("s3://ckpt/out/reshard_ws3") == {str(p.relative_to(tmp_path / "ws3"))
                                                 for p in (tmp_path / "ws3").rglob("*") if p.is_file()}
    r = ckpt("verify", tmp_path / "ws3", "s3://ckpt/out/reshard_ws3", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and report["checked"] > 0 and report["b"]["path"] == "s3://ckpt/out/reshard_ws3"
    r = ckpt("verify", "s3://ckpt/out/reshard_ws3", FIXTURES / "llama_tied_sharded_ws2")  # another model
    assert r.returncode == 1, r.stdout + r.stderr


def test_existing_destination_refused_then_overwritten(s3, tmp_path):
    dst = "s3://ckpt/out/exists"
    upload(FIXTURES / "llama_dcp", dst)
    r = ckpt("convert", FIXTURES / "llama_hf", dst, "--to", "dcp")
    assert r.returncode == 4 and r.stderr.startswith("error: ") and "--overwrite" in r.stderr
    assert keys(dst) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    r = ckpt("export", FIXTURES / "llama_hf", dst, "--overwrite")
    assert r.returncode == 0, r.stderr
    left = keys(dst)
    assert "model.safetensors" in left and ".metadata" not in left and "__1_0.distcp" not in left
    assert ".ckpt-manifest.json" in left and ".ckpt-writing" not in left
    for other in (dst, f"{dst}/inner", "s3://ckpt/out"):  # never into its own source
        r = ckpt("convert", dst, other, "--to", "dcp", "--overwrite")
        _one_error(r, 4)
        assert "must not be the source" in r.stderr
    assert keys(dst) == left


# -- a run killed midway, and ckpt clean ----------------------------------------------------------

def test_killed_upload_leaves_no_marker_and_clean_removes_it(s3, big_dcp, tmp_path):
    from ckpt_tools.storage.objstore import Store

    _, src = big_dcp
    dst = "s3://ckpt/out/killed"
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", "convert", src, dst, "--to", "dcp", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TMPDIR": str(tmp_path)})  # its local staging, killed with it
    st = Store(dst, role="destination")
    deadline = time.monotonic() + 240
    try:
        while not st.pending_uploads():  # a multipart upload of a .distcp under way
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no upload seen"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = keys(dst)
    assert not left & MARKER_NAMES and not any(k.endswith("/.metadata") for k in left), left
    assert st.pending_uploads()
    r = ckpt("inspect", dst)
    assert r.returncode == 3 and r.stderr.startswith("error: "), r.stderr
    r = ckpt("clean", dst)
    assert r.returncode == 0, r.stderr
    assert "unfinished upload" in r.stdout
    assert st.pending_uploads() == [] and keys(dst) == set()


# -- the store's failures -------------------------------------------------------------------------

def _one_error(r, code):
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr


def test_missing_bucket(s3, tmp_path):
    _one_error(ckpt("inspect", "s3://no-such-bucket/ckpt"), 3)
    r = ckpt("export", FIXTURES / "llama_hf", "s3://no-such-bucket/out")
    _one_error(r, 4)
    assert "no-such-bucket" in r.stderr


def test_refused_credentials(s3, tmp_path):
    bad = {"AWS_SECRET_ACCESS_KEY": "wrong", "AWS_ACCESS_KEY_ID": "nobody"}
    upload(FIXTURES / "llama_hf", "s3://ckpt/src/creds")
    r = ckpt("inspect", "s3://ckpt/src/creds", env=bad)
    _one_error(r, 3)
    assert "refused" in r.stderr
    _one_error(ckpt("export", FIXTURES / "llama_hf", "s3://ckpt/out/creds", env=bad), 4)


def test_unreachable_endpoint_fails_within_seconds(s3, tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    t = time.monotonic()
    r = ckpt("inspect", "s3://ckpt/src/anything", env={"AWS_ENDPOINT_URL": dead})
    _one_error(r, 3)
    assert "endpoint" in r.stderr
    _one_error(ckpt("export", FIXTURES / "llama_hf", "s3://ckpt/out/dead", env={"AWS_ENDPOINT_URL": dead}), 4)
    assert time.monotonic() - t < 30


def test_latest_of_a_remote_run(s3, tmp_path):
    """latest RUN_DIR on a bucket: the newest complete checkpoint, printed as its URL."""
    run = "s3://ckpt/src/run1"
    upload(FIXTURES / "llama_dcp", f"{run}/ckpt_1")
    cut = tmp_path / "ckpt_2"
    cut.mkdir()
    for p in (FIXTURES / "llama_dcp").iterdir():
        if p.name != ".metadata":  # a save cut off before its coordinator wrote the marker
            (cut / p.name).write_bytes(p.read_bytes())
    upload(cut, f"{run}/ckpt_2")
    r = ckpt("latest", run)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{run}/ckpt_1"
    r = ckpt("inspect", f"{run}/ckpt_2")
    _one_error(r, 3)
    assert "s3://ckpt/src/run1/ckpt_2" in r.stderr


def test_shard_into_a_bucket(s3, tmp_path):
    """shard MODEL s3://...: the ranks' DCP published into the bucket, read back by FsspecReader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from safetensors.torch import load_file

    r = ckpt("shard", FIXTURES / "llama_hf", "s3://ckpt/out/shard_dcp", "--ranks", "2", "--format", "dcp")
    assert r.returncode == 0, r.stderr
    assert {".metadata", ".ckpt-manifest.json"} <= keys("s3://ckpt/out/shard_dcp")
    want = load_file(FIXTURES / "llama_hf" / "model.safetensors")
    reader = FsspecReader("s3://ckpt/out/shard_dcp", endpoint_url=s3.endpoint)
    meta = reader.read_metadata()
    got = {k: torch.zeros(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
           if hasattr(m, "size")}
    dcp.load(got, storage_reader=reader, no_dist=True)
    # the job's state dict is {"model": model.state_dict()}: DCP keys are "model.<HF name>"
    assert {k.removeprefix("model.") for k in got} == set(want)
    for k, v in got.items():
        assert torch.equal(v, want[k.removeprefix("model.")]), k


def test_throttled_requests_are_retried_then_an_error(s3, tmp_path):
    """503 SlowDown: retried with backoff (the command succeeds); throttled for good, one error
    line, exit 3, within seconds."""
    url = upload(FIXTURES / "llama_hf", "s3://ckpt/src/throttled")
    port = int(s3.endpoint.rsplit(":", 1)[1])
    proxy = ThrottlingProxy(port, throttle=2)
    try:
        r = ckpt("inspect", url, "--json", env={"AWS_ENDPOINT_URL": proxy.endpoint})
        assert r.returncode == 0, r.stderr
        assert proxy.throttled == 2
    finally:
        proxy.close()
    assert without_paths(json.loads(r.stdout)) == without_paths(json.loads(ckpt("inspect", FIXTURES / "llama_hf",
                                                                                "--json").stdout))
    proxy = ThrottlingProxy(port, throttle=-1)
    try:
        t = time.monotonic()
        r = ckpt("inspect", url, env={"AWS_ENDPOINT_URL": proxy.endpoint})
        took = time.monotonic() - t
    finally:
        proxy.close()
    _one_error(r, 3)
    assert "SlowDown" in r.stderr or "reduce your request rate" in r.stderr, r.stderr
    assert proxy.throttled >= 2 and took < 60, (proxy.throttled, took)
    print(f"throttled for good: {proxy.throttled} attempts, error after {took:.1f}s")
