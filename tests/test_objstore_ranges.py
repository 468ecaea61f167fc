"""A remote source is read by the byte ranges its plan reads, and a torchrun launch writes a
bucket with no shared filesystem: against the real S3 server of test_objstore.py (SeaweedFS on
127.0.0.1), with a counting proxy between the client and the server.

- ``convert --model-only`` of a checkpoint whose optimizer is twice its model moves about the
  model's bytes, not the checkpoint's;
- ``reshard`` of a remote DCP to more ranks moves the checkpoint's bytes once; under ``torchrun``
  each process moves only the rows of its own files, so the launch as a whole still moves them
  once (whole objects would be moved once per process);
- under ``torchrun --nproc-per-node 2``, ``reshard s3://... s3://...`` with a private ``TMPDIR``
  per process gives a DCP that torch's ``FsspecReader`` loads equal to a local reshard's; a
  process that fails leaves no marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from s3server import CountingProxy
from test_objstore import ckpt, download, keys, s3, upload  # noqa: F401 - s3 is the server fixture

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained_dcp(s3, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """A DCP of a model and its Adam state (twice the model's bytes) after one step, as
    ``dcp.save`` writes it (tensors as torch.save items), local and in the bucket."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])  # 24 MiB of weights
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    path = tmp_path_factory.mktemp("trained") / "dcp"
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(path), no_dist=True)
    model_bytes = sum(v.numel() * v.element_size() for v in msd.values())
    return path, upload(path, "s3://ckpt/src/trained_dcp"), model_bytes


def _through_proxy(s3, run):  # noqa: F811
    """``run(env)`` with the endpoint at a counting proxy: its result, and the bytes the store sent."""
    proxy = CountingProxy(int(s3.endpoint.rsplit(":", 1)[1]))
    try:
        r = run({"AWS_ENDPOINT_URL": proxy.endpoint})
        return r, proxy.to_client
    finally:
        proxy.close()


def _counted(s3, *args, **kw):  # noqa: F811
    return _through_proxy(s3, lambda env: ckpt(*args, env={**env, **kw.get("env", {})}))


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_model_only_moves_the_models_bytes(s3, trained_dcp, tmp_path):  # noqa: F811
    path, url, model_bytes = trained_dcp
    total = _size(path)
    assert total > 2.9 * model_bytes  # the optimizer holds twice the model
    _model_only_moves_the_model(s3, path, url, model_bytes, tmp_path, f"a {total / 1e6:.0f} MB remote DCP")


def _model_only_moves_the_model(s3, path, url, model_bytes: int, tmp_path, what: str) -> None:
    """``convert --model-only`` from ``url`` moves about the model's bytes and gives the local result."""
    r, moved = _counted(s3, "convert", url, tmp_path / "model.pt", "--to", "torch", "--model-only")
    assert r.returncode == 0, r.stderr
    print(f"convert --model-only of {what} ({model_bytes / 1e6:.0f} MB model) moved {moved / 1e6:.1f} MB")
    assert model_bytes <= moved < 1.15 * model_bytes
    r = ckpt("convert", path, tmp_path / "local.pt", "--to", "torch", "--model-only")
    assert r.returncode == 0, r.stderr
    got, want = torch.load(tmp_path / "model.pt", weights_only=True), torch.load(tmp_path / "local.pt", weights_only=True)
    assert got.keys() == want.keys() and got
    assert all(torch.equal(got[k], want[k]) for k in got)


def test_reshard_to_more_ranks_moves_the_bytes_once(s3, trained_dcp, tmp_path):  # noqa: F811
    path, url, _ = trained_dcp
    total = _size(path)
    r, moved = _counted(s3, "reshard", url, tmp_path / "ws2", "--to", "2")
    assert r.returncode == 0, r.stderr
    print(f"reshard --to 2 of a {total / 1e6:.0f} MB remote DCP moved {moved / 1e6:.1f} MB")
    assert 0.95 * total < moved < 1.05 * total
    r = ckpt("reshard", path, tmp_path / "local", "--to", "2")
    assert r.returncode == 0, r.stderr
    for p in (tmp_path / "local").iterdir():
        if p.name != ".ckpt-manifest.json":
            assert (tmp_path / "ws2" / p.name).read_bytes() == p.read_bytes(), p.name


def _torchrun(tmp_path: Path, *args: str, env: dict | None = None, nproc: int = 2,
             limit_rank1: str = "") -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N`` running ``python -m ckpt_tools ARGS``, each process with a
    TMPDIR of its own (its staging and stand-ins private: no filesystem shared between them)."""
    tmps = tmp_path / "tmp"
    for r in range(nproc):
        (tmps / f"rank{r}").mkdir(parents=True)
    script = (f'if [ "$LOCAL_RANK" = 1 ]; then {limit_rank1}: ; fi; '
              f'TMPDIR="{tmps}/rank$LOCAL_RANK" exec "{sys.executable}" -m ckpt_tools "$@"')
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         "--no-python", "sh", "-c", script, "ckpt", *args, "--quiet"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})})


def _dcp_tensors(storage_reader) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    meta = storage_reader.read_metadata()
    out = {k: torch.full(m.size, float("nan"), dtype=m.properties.dtype) if m.properties.dtype.is_floating_point
           else torch.zeros(m.size, dtype=m.properties.dtype)
           for k, m in meta.state_dict_metadata.items() if hasattr(m, "size")}
    dcp.load(out, storage_reader=storage_reader, no_dist=True)
    return out


def test_torchrun_reshard_bucket_to_bucket(s3, trained_dcp, tmp_path):  # noqa: F811
    """Each process fetches the rows of its share, writes them in its own TMPDIR and uploads
    them; rank 0 uploads .metadata and the manifest after every upload: FsspecReader loads it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    path, url, _ = trained_dcp
    total = _size(path)
    out = "s3://ckpt/out/torchrun_ws2"
    r, moved = _through_proxy(s3, lambda env: _torchrun(tmp_path, "reshard", url, out, "--to", "2", env=env))
    assert r.returncode == 0, r.stderr[-3000:]
    print(f"torchrun (2 processes) reshard --to 2 of a {total / 1e6:.0f} MB remote DCP moved {moved / 1e6:.1f} MB")
    assert moved < 1.1 * total  # each process its rows: once in all, not once per process
    assert not [p for p in (tmp_path / "tmp").rglob("*") if p.is_file()], "staging left behind"
    r = ckpt("reshard", path, tmp_path / "local", "--to", "2")
    assert r.returncode == 0, r.stderr
    assert keys(out) == {p.name for p in (tmp_path / "local").iterdir()}
    got = download(out, tmp_path / "got")
    for p in (tmp_path / "local").iterdir():
        if p.name != ".ckpt-manifest.json":
            assert (got / p.name).read_bytes() == p.read_bytes(), p.name
    manifest = json.loads((got / ".ckpt-manifest.json").read_text())
    assert manifest["source"]["path"] == url
    assert manifest["files"] == json.loads((tmp_path / "local" / ".ckpt-manifest.json").read_text())["files"]
    want = _dcp_tensors(FileSystemReader(str(tmp_path / "local")))
    remote = _dcp_tensors(FsspecReader(out, endpoint_url=s3.endpoint))
    assert want.keys() == remote.keys() and want
    assert all(torch.equal(want[k], remote[k]) for k in want)
    r = ckpt("verify", tmp_path / "local", out)
    assert r.returncode == 0, r.stdout + r.stderr


def test_torchrun_existing_destination_refused(s3, trained_dcp, tmp_path):  # noqa: F811
    _, url, _ = trained_dcp
    out = "s3://ckpt/out/torchrun_exists"
    upload(ROOT / "fixtures" / "llama_hf", out)
    before = keys(out)
    r = _torchrun(tmp_path, "reshard", url, out, "--to", "2")
    # every process refuses it with the contract's code (torchrun itself then exits 1; it may
    # stop the other process before that one exits on its own)
    assert r.returncode != 0 and "already exists" in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("exitcode  : 4") >= 1 and "exitcode  : 1 (" not in r.stderr, r.stderr[-3000:]
    assert keys(out) == before


def test_torchrun_failed_process_publishes_no_marker(s3, trained_dcp, tmp_path):  # noqa: F811
    """Process 1 cannot write its files (a file-size limit of 1 MiB): the launch fails and no
    marker reaches the bucket; ``ckpt clean`` then removes what the launch left."""
    _, url, _ = trained_dcp
    out = "s3://ckpt/out/torchrun_failed"
    r = _torchrun(tmp_path, "reshard", url, out, "--to", "2", limit_rank1="ulimit -f 2048; ")
    assert r.returncode != 0
    assert not {".metadata", ".ckpt-manifest.json"} & keys(out)
    r = ckpt("clean", out)
    assert r.returncode == 0, r.stderr
    assert keys(out) == set()


def test_torchrun_single_file_output_refused_before_any_work(s3, trained_dcp, tmp_path):  # noqa: F811
    """A one-file output (``--to torch``) has no per-process split: under torchrun it is exit 2
    before any tensor is fetched, and nothing reaches the bucket."""
    path, url, _ = trained_dcp
    out = "s3://ckpt/out/torchrun_one_file"
    r, moved = _through_proxy(s3, lambda env: _torchrun(tmp_path, "convert", url, out, "--to", "torch", env=env))
    assert r.returncode != 0 and "run it as one process" in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("exitcode  : 2") >= 1, r.stderr[-3000:]
    assert moved < 0.05 * _size(path), moved  # headers only, no tensor data
    assert keys(out) == set()


@pytest.fixture(scope="module")
def trained_ranks(s3, trained_dcp, tmp_path_factory):  # noqa: F811
    """The same training state as 2-rank files (torch.save pickles: values read through the
    unpickler), local and in the bucket."""
    import ckpt_tools

    path, _, model_bytes = trained_dcp
    out = tmp_path_factory.mktemp("ranks") / "ws2"
    ckpt_tools.convert(path, out, to="sharded", world_size=2, progress=False)
    return out, upload(out, "s3://ckpt/src/trained_ws2"), model_bytes


def test_rank_files_model_only_moves_the_models_records(s3, trained_ranks, tmp_path):  # noqa: F811
    """From per-rank torch.save files, the model's storage records move, not the optimizer files."""
    path, url, model_bytes = trained_ranks
    total = _size(path)
    _model_only_moves_the_model(s3, path, url, model_bytes, tmp_path, f"{total / 1e6:.0f} MB of remote rank files")


def test_rank_files_reshard_moves_the_bytes_once(s3, trained_ranks, tmp_path):  # noqa: F811
    path, url, _ = trained_ranks
    total = _size(path)
    r, moved = _counted(s3, "reshard", url, "s3://ckpt/out/ranks_ws3", "--to", "3")
    assert r.returncode == 0, r.stderr
    print(f"reshard 2 → 3 of {total / 1e6:.0f} MB of remote rank files moved {moved / 1e6:.1f} MB")
    assert moved < 1.05 * total
    r = ckpt("reshard", path, tmp_path / "local", "--to", "3")
    assert r.returncode == 0, r.stderr
    r = ckpt("verify", tmp_path / "local", "s3://ckpt/out/ranks_ws3", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["ok"]


def test_stand_in_fills_by_range_and_gives_disk_back(s3, tmp_path):  # noqa: F811
    """The storage layer's side: present() fetches only what is missing, release() punches the
    stand-in's disk out and a later present() fetches those bytes again, equal."""
    from ckpt_tools.storage import remote
    from ckpt_tools.storage.objstore import Store

    data = os.urandom(24 << 20)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "blob.bin").write_bytes(data)
    url = upload(tmp_path / "src", "s3://ckpt/src/standin")
    (tmp_path / "work").mkdir()
    with remote.Mirror(Store(url), tmp_path / "work") as m:
        path = m.local("blob.bin")
        assert remote.is_standin(path) and not remote.is_standin(tmp_path / "src" / "blob.bin")
        assert os.stat(path).st_size == len(data) and os.stat(path).st_blocks * 512 < 1 << 20  # sparse
        assert remote.present([(path, 1 << 20, 21 << 20)]) == 20 << 20
        assert remote.present([(path, 2 << 20, 3 << 20), (path, 0, 1 << 20)]) == 1 << 20  # only what is missing
        assert path.read_bytes()[:21 << 20] == data[:21 << 20]
        freed = remote.release([(path, 4 << 20, 20 << 20)])
        assert freed == 16 << 20 and os.stat(path).st_blocks * 512 < 8 << 20
        assert m.missing("blob.bin", 0, 21 << 20) == [(4 << 20, 20 << 20)]
        assert remote.present([(path, 0, len(data))]) == len(data) - (5 << 20)
        assert path.read_bytes() == data
    assert not remote.is_standin(path)  # unregistered: reads of it are local reads
    assert remote.present([(path, 0, 10)]) == 0


def test_reshard_with_workers_from_a_bucket(s3, trained_ranks, tmp_path):  # noqa: F811
    """--workers K: the plan's ranges are fetched by the command's process, its helper processes
    read the stand-in; the same bytes as one local process."""
    path, url, _ = trained_ranks
    r = ckpt("reshard", url, tmp_path / "ws3", "--to", "3", "--workers", "2")
    assert r.returncode == 0, r.stderr
    r = ckpt("reshard", path, tmp_path / "local", "--to", "3")
    assert r.returncode == 0, r.stderr
    names = sorted(str(p.relative_to(tmp_path / "local")) for p in (tmp_path / "local").rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(tmp_path / "ws3")) for p in (tmp_path / "ws3").rglob("*") if p.is_file())
    for n in names:
        if n != ".ckpt-manifest.json":
            assert (tmp_path / "ws3" / n).read_bytes() == (tmp_path / "local" / n).read_bytes(), n


@pytest.mark.parametrize("same", [True, False])
def test_export_checks_tied_weights_from_a_bucket(s3, tmp_path, same):  # noqa: F811
    """The tied-embedding check reads lm_head and the embedding outside the plan: fetched as it
    reads them. lm_head lies first in the file, so describing it fetched lm_head's first 64 KiB
    and none of the embedding: without the fetch on demand, equal weights would be found to
    differ. Tied and equal, the export equals the local one; different, refused as locally."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=2000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}  # the embedding: 512 KB, past
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()      # what describing fetches
    if not same:
        sd["lm_head.weight"] += 1
    src = tmp_path / "src"
    src.mkdir()
    save_file(sd, src / "model.safetensors")
    model.config.save_pretrained(src)
    url = upload(src, f"s3://ckpt/src/tied_{same}")
    remote_run = ckpt("export", url, tmp_path / "hf")
    local_run = ckpt("export", src, tmp_path / "local")
    if not same:
        assert remote_run.returncode == local_run.returncode == 3, remote_run.stderr
        assert "differ" in remote_run.stderr, remote_run.stderr
        return
    assert remote_run.returncode == 0 and local_run.returncode == 0, remote_run.stderr + local_run.stderr
    for p in (tmp_path / "local").iterdir():
        if p.name != ".ckpt-manifest.json":
            assert (tmp_path / "hf" / p.name).read_bytes() == p.read_bytes(), p.name


def test_torchrun_from_a_bucket_to_a_shared_directory(s3, trained_dcp, tmp_path):  # noqa: F811
    """A remote source and a local DST under torchrun: each process reads its rows through its
    own stand-in, the shared DST is written as by one local process."""
    path, url, _ = trained_dcp
    r = _torchrun(tmp_path, "reshard", url, str(tmp_path / "ws2"), "--to", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    r = ckpt("reshard", path, tmp_path / "local", "--to", "2")
    assert r.returncode == 0, r.stderr
    for p in (tmp_path / "local").iterdir():
        if p.name != ".ckpt-manifest.json":
            assert (tmp_path / "ws2" / p.name).read_bytes() == p.read_bytes(), p.name


def test_torchrun_shard_into_a_bucket_refused_before_any_work(s3, tmp_path):  # noqa: F811
    """shard writes through its own FSDP job, not the engine's per-process split: under torchrun
    a URL DST is exit 2 on every process, nothing written."""
    out = "s3://ckpt/out/torchrun_shard"
    r = _torchrun(tmp_path, "shard", str(ROOT / "fixtures" / "llama_hf"), out, "--ranks", "2")
    # torchrun stops the other process once one fails: it may or may not get to exit on its own
    assert r.returncode != 0 and r.stderr.count("exitcode  : 2") >= 1, r.stderr[-3000:]
    assert "exitcode  : 1 (" not in r.stderr  # no process crashed
    assert "under torchrun" in r.stderr
    assert keys(out) == set()
