"""Several processes writing one plan: ``--workers K`` and a ``torchrun`` launch give the same
bytes as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt_tools

ROOT = Path(__file__).resolve().parents[1]


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def single(fixtures_dir: Path, tmp_path_factory) -> dict[str, dict[str, bytes]]:
    out = {}
    for name in ("llama_sharded_ws8", "llama_dcp"):
        dst = tmp_path_factory.mktemp("single") / name
        ckpt_tools.reshard(fixtures_dir / name, dst, to=3, progress=False)
        out[name] = _files(dst)
    return out


@pytest.mark.parametrize("name", ["llama_sharded_ws8", "llama_dcp"])
def test_workers_write_the_same_bytes(name: str, fixtures_dir: Path, tmp_path: Path, single) -> None:
    dst = tmp_path / "out"
    ckpt_tools.reshard(fixtures_dir / name, dst, to=3, workers=2, progress=False)
    got = _files(dst)
    assert got.keys() == single[name].keys()
    assert [k for k in got if got[k] != single[name][k]] == []


@pytest.mark.parametrize("name", ["llama_sharded_ws8", "llama_dcp"])
def test_forked_workers_write_the_same_bytes(name: str, fixtures_dir: Path, tmp_path: Path, single) -> None:
    """A command's own process (torch not loaded, no other thread) forks its workers: the plan
    and description as they stand in memory, none of it handed over in a file."""
    dst = tmp_path / "out"
    script = f"""
import ckpt_tools
from ckpt_tools.runtime import procs
forked, fork = [], procs.fork
procs.fork = lambda *a, **k: forked.append(1) or fork(*a, **k)
ckpt_tools.reshard({str(fixtures_dir / name)!r}, {str(dst)!r}, to=3, workers=2, progress=False)
assert len(forked) == 2, forked
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _files(dst)
    assert got.keys() == single[name].keys()
    assert [k for k in got if got[k] != single[name][k]] == []


# logs each file hashed for the manifest (its process's rank under torchrun, its pid, its path)
_HASHED = """
import os
from ckpt_tools.storage import manifest
_digest = manifest.file_digest
def _logged(path):
    with open({log!r}, "a") as f:
        f.write(f"{{os.environ.get('RANK', '-')}} {{os.getpid()}} {{path}}\\n")
    return _digest(path)
manifest.file_digest = _logged
"""


def _hashed(log: Path, by: int) -> dict[str, list[str]]:
    """The files each process hashed (field ``by`` of a log line: 0 its rank, 1 its pid), by
    their name under the staging directory they were written in."""
    out: dict[str, list[str]] = {}
    for line in log.read_text().splitlines():
        fields = line.split(" ", 2)
        parts = Path(fields[2]).parts
        staging = next(i for i, part in enumerate(parts) if ".ckpt-tmp-" in part)
        out.setdefault(fields[by], []).append("/".join(parts[staging + 1:]))
    return out


@pytest.mark.parametrize("name", ["llama_sharded_ws8", "llama_dcp"])
def test_workers_seal_the_files_they_write(name: str, fixtures_dir: Path, tmp_path: Path, single) -> None:
    """Each --workers process hashes (and fsyncs) its files as it writes them, as one process
    does, and reports their digests: the parent reads none of them back for the manifest (a
    many-rank job's whole output, one file after the other), only the files it writes itself
    (a DCP's .metadata). Every file is hashed once, and the manifest is one process's."""
    dst, log = tmp_path / "out", tmp_path / "hashed"
    script = _HASHED.format(log=str(log)) + f"""
import ckpt_tools
ckpt_tools.reshard({str(fixtures_dir / name)!r}, {str(dst)!r}, to=3, workers=2, progress=False)
print(os.getpid())
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    hashed = _hashed(log, by=1)
    parent = hashed.pop(proc.stdout.split()[-1], [])
    workers = [f for files in hashed.values() for f in files]
    assert len(hashed) == 2 and all(hashed.values()), hashed
    listed = json.loads((dst / ".ckpt-manifest.json").read_text())["files"]
    assert sorted(parent + workers) == sorted(listed)  # each file once
    if name == "llama_dcp":
        assert parent == [".metadata"]
    got = _files(dst)
    assert [k for k in got if got[k] != single[name][k]] == []


def _twice(x: int) -> int:
    return 2 * x


def _fails() -> None:
    raise ValueError("boom")


def _dies() -> None:
    os.kill(os.getpid(), 9)


def test_a_forked_child_reports_and_never_runs_its_parents_code(tmp_path: Path) -> None:
    """A forked worker's value, its error and its death come back as a started one's do; and
    it ends where its work ends: never back in the caller's frames (whose ``finally`` would
    remove the parent's staging), whatever its work did."""
    from ckpt_tools.runtime import procs

    ran = tmp_path / "finally-ran"
    outcomes = {}
    try:
        children = [procs.fork(fn, args, work=tmp_path, name=name)
                    for name, fn, args in (("ok", _twice, (21,)), ("error", _fails, ()), ("died", _dies, ()))]
        while (done := procs.wait_any(children)) is not None:
            outcomes[done.name] = done.outcome()
    finally:
        with ran.open("a") as f:
            f.write(f"{os.getpid()}\n")
    assert outcomes["ok"] == ("ok", 42)
    assert outcomes["error"][0] == "error" and isinstance(outcomes["error"][1], ValueError)
    assert "boom" in outcomes["error"][2]
    assert outcomes["died"] == ("died", -9)
    assert ran.read_text().split() == [str(os.getpid())]


def test_torchrun_processes_write_their_share(fixtures_dir: Path, tmp_path: Path, single) -> None:
    dst = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ckpt_tools", "reshard", str(fixtures_dir / "llama_sharded_ws8"), str(dst), "--to", "3", "--quiet"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _files(dst)
    assert got.keys() == single["llama_sharded_ws8"].keys()
    assert [k for k in got if got[k] != single["llama_sharded_ws8"][k]] == []
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name], "staging left behind"


def test_torchrun_processes_seal_the_files_they_write(fixtures_dir: Path, tmp_path: Path, single) -> None:
    """Under torchrun each process hashes the files it writes and reports their digests: rank
    0 does not read the other processes' files back for the manifest (on a shared filesystem,
    other nodes' bytes, all of them, one after the other). Every file is hashed once."""
    dst, log = tmp_path / "out", tmp_path / "hashed"
    script = tmp_path / "run.py"
    script.write_text(_HASHED.format(log=str(log)) + f"""
import sys
from ckpt_tools.cli.main import run
sys.argv = ["ckpt", "reshard", {str(fixtures_dir / "llama_sharded_ws8")!r}, {str(dst)!r}, "--to", "3", "--quiet"]
run()
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hashed = _hashed(log, by=0)
    assert sorted(hashed) == ["0", "1"] and hashed["1"], hashed
    listed = json.loads((dst / ".ckpt-manifest.json").read_text())["files"]
    assert sorted(hashed["0"] + hashed["1"]) == sorted(listed)  # each file once
    got = _files(dst)
    assert [k for k in got if got[k] != single["llama_sharded_ws8"][k]] == []


def test_torchrun_refuses_existing_destination_on_every_process(fixtures_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ckpt_tools", "reshard", str(fixtures_dir / "llama_sharded_ws8"), str(dst), "--to", "3", "--quiet"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode != 0
    # torchrun stops the other process once one fails, so it may or may not get to print its own
    # refusal; either way no process got past the check: nothing written, no staging left
    assert proc.stderr.count("error: ") >= 1 and "exists" in proc.stderr
    assert list(dst.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


# -- many ranks: each process plans only its own files --------------------------------------

def _torchrun(nproc: int, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         "-m", "ckpt_tools", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def many_ranks(tmp_path_factory) -> dict[str, Path]:
    """256-rank verl rank files (model, optimizer, extra state) and a 256-rank DCP (model and
    optimizer), made by torch's own writers (tests/fw_scale.py); some tensors have fewer rows
    than ranks, so trailing ranks hold none."""
    from fw_scale import make_dcp, make_verl
    from test_scale import SHAPES

    root = tmp_path_factory.mktemp("many")
    make_verl(root / "verl", 256, optim=True, shapes=SHAPES)
    make_dcp(root / "dcp", 256, optim=True, shapes=SHAPES)
    return {"verl": root / "verl", "dcp": root / "dcp"}


@pytest.mark.parametrize("kind", ["verl", "dcp"])
def test_torchrun_four_processes_256_ranks_same_bytes(kind: str, many_ranks, tmp_path: Path) -> None:
    """A 256 -> 192 reshard by 4 processes of a torchrun launch (each planning and writing only
    its quarter of the output ranks; rank 0 writes .metadata from what the others report) is
    byte for byte, every file, the single process's output."""
    src = many_ranks[kind]
    one = tmp_path / "one"
    ckpt_tools.reshard(src, one, to=192, progress=False)
    four = tmp_path / "four"
    proc = _torchrun(4, "reshard", str(src), str(four), "--to", "192", "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = _files(four), _files(one)
    assert len(want) > 150 and got.keys() == want.keys()
    assert [k for k in got if got[k] != want[k]] == []
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp-" in p.name], "staging left behind"


def test_torchrun_four_processes_dcp_to_rank_files_same_bytes(many_ranks, tmp_path: Path) -> None:
    """A 256-rank DCP converted to 192 verl rank files by 4 processes (each builds its first
    file of a kind whole and patches its next ones from it) is byte for byte, every file, the
    single process's output (which patches every file after rank 0's)."""
    src = many_ranks["dcp"]
    one = tmp_path / "one"
    ckpt_tools.convert(src, one, to="sharded", world_size=192, progress=False)
    four = tmp_path / "four"
    proc = _torchrun(4, "convert", str(src), str(four), "--to", "sharded", "--world-size", "192", "--quiet",
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = _files(four), _files(one)
    assert len([k for k in want if k.endswith(".pt")]) == 2 * 192 and got.keys() == want.keys()
    assert [k for k in got if got[k] != want[k]] == []


@pytest.mark.parametrize("kind", ["verl", "dcp"])
def test_a_process_plans_only_its_own_files(kind: str, many_ranks) -> None:
    """The plan of process 1 of 4 (output ranks 48-95 of 192) holds those ranks' files and no
    other, each the same job (pieces, copies, objects) as in the whole plan, and the same writer."""
    from ckpt_tools.core.plan import share_of, targets_from
    from ckpt_tools.engine.reader import Reader
    from ckpt_tools.formats import writers
    from ckpt_tools.layouts import describe

    ckpt = describe(many_ranks[kind])
    targets = targets_from(ckpt.tensors)
    mine = share_of(192, 4, 1)
    assert mine == range(48, 96)
    common = dict(rank_local="drop", open_reader=lambda: Reader(ckpt))
    if kind == "verl":
        def plan(ranks):
            return writers.rank_files(ckpt, targets, ckpt.objects, 192, keep=True, ranks=ranks, **common)
    else:
        def plan(ranks):
            return writers.dcp_dir(ckpt, targets, ckpt.objects, 192, keep_parts=True, ranks=ranks, **common)
    w_part, part = plan(mine)
    w_all, whole = plan(None)
    assert {j.rank for j in part} == set(mine)
    assert {j.path for j in part} == {j.path for j in whole if j.rank in mine}
    assert all(j.pieces for j in part if j.kind != "extra")
    by_path = {j.path: j for j in whole}
    for j in part:
        assert j == by_path[j.path] and j.meta == by_path[j.path].meta, j.path
    assert type(w_part) is type(w_all) and w_part.accepts_spans == w_all.accepts_spans
    # the whole plan's other files (rank 0's .metadata entries included) are nowhere in it
    assert not any(j.rank == 0 for j in part)


@pytest.mark.parametrize("name", ["llama_dcp", "llama_accelerate"])
def test_torchrun_dcp_metadata_from_the_processes_reports(name: str, fixtures_dir: Path, tmp_path: Path) -> None:
    """A DCP (and accelerate's two DCP part directories, each with its own .metadata) resharded
    by 3 processes, each planning one output rank: rank 0's .metadata, built from what the
    others report, is the single process's, byte for byte, as is every other file."""
    one = tmp_path / "one"
    ckpt_tools.reshard(fixtures_dir / name, one, to=3, progress=False)
    three = tmp_path / "three"
    proc = _torchrun(3, "reshard", str(fixtures_dir / name), str(three), "--to", "3", "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = _files(three), _files(one)
    assert got.keys() == want.keys() and sum(k.endswith(".metadata") for k in got) == (2 if "accelerate" in name else 1)
    assert [k for k in got if got[k] != want[k]] == []


def test_workers_share_files_by_bytes_and_by_count():
    """``--workers`` (and a torchrun launch) split whole files largest first onto the least
    loaded process; files of no tensor bytes (a many-rank job's extra state) are spread over
    the processes too, not all given to one, and every file is in exactly one share."""
    from ckpt_tools.core.plan import FileJob
    from ckpt_tools.engine.parallel import FILE_COST, balance

    class Job(FileJob):
        @property
        def nbytes(self) -> int:  # (the bytes a job would write, without its pieces)
            return self.meta["bytes"]

    jobs = [Job(f"extra_{r}.pt", meta={"bytes": 0}) for r in range(6)]
    jobs += [Job(f"model_{r}.pt", meta={"bytes": (10 + r) * FILE_COST}) for r in range(6)]
    shares = balance(jobs, 3)
    assert sorted(j.path for share in shares for j in share) == sorted(j.path for j in jobs)
    assert [[j.path for j in share] for share in shares] == [  # largest first onto the least loaded
        ["model_5.pt", "model_0.pt", "extra_0.pt", "extra_3.pt"],
        ["model_4.pt", "model_1.pt", "extra_1.pt", "extra_4.pt"],
        ["model_3.pt", "model_2.pt", "extra_2.pt", "extra_5.pt"]]
