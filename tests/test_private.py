"""The pickled hand-over between ckpt's own processes is loaded only from this user's private
directory: a spec or result someone else could have written is refused before it is unpickled;
and only with the globals its writer named: one naming any other is refused before it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tools.runtime import private, procs

MARK = "the payload ran"


def _payload_path(work: Path) -> Path:
    return work / "ran"


class _Runs:
    """Unpickling this object writes a file: proof that a pickle was loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path(self.path).write_text, (MARK,))


def _work(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    return work


def _plant(spec: Path, work: Path) -> None:
    """A spec whose work, once unpickled, writes the payload file."""
    import pickle

    with open(spec, "wb") as f:
        f.write(json.dumps({"sys_path": list(sys.path), "parent": os.getpid()}).encode() + b"\n")
        pickle.dump(_Runs(str(_payload_path(work))), f)


def _child(spec: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpt_tools.runtime.child", str(spec)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_own_work_round_trips(tmp_path):
    work = _work(tmp_path)
    child = procs.start(os.path.join, ("a", "b"), work=work, name="w")
    child.proc.wait(timeout=60)
    assert child.outcome() == ("ok", os.path.join("a", "b"))


def test_child_refuses_a_spec_in_a_directory_open_to_others(tmp_path):
    work = _work(tmp_path)
    spec = work / "w.in"
    _plant(spec, work)
    work.chmod(0o755)  # open to others: not the private directory ckpt made
    r = _child(spec)
    assert r.returncode != 0
    assert "open to others" in r.stderr
    assert not _payload_path(work).exists()


def test_child_refuses_a_spec_that_is_a_link(tmp_path):
    work = _work(tmp_path)
    elsewhere = tmp_path / "planted.in"
    _plant(elsewhere, work)
    (work / "w.in").symlink_to(elsewhere)
    r = _child(work / "w.in")
    assert r.returncode != 0
    assert not _payload_path(work).exists()


def test_parent_refuses_a_result_writable_by_others(tmp_path):
    import pickle

    work = _work(tmp_path)
    child = procs.start(os.path.join, ("a", "b"), work=work, name="w")
    child.proc.wait(timeout=60)
    child.out.write_bytes(pickle.dumps(_Runs(str(_payload_path(work)))))
    child.out.chmod(0o666)
    with pytest.raises(private.NotPrivate, match="writable by others"):
        child.outcome()
    assert not _payload_path(work).exists()


def test_writer_never_follows_a_planted_link(tmp_path):
    work = _work(tmp_path)
    target = tmp_path / "victim"
    (work / "w.in").symlink_to(target)
    with pytest.raises(FileExistsError):
        procs.start(os.path.join, ("a", "b"), work=work, name="w")
    assert not target.exists()


def test_child_refuses_work_naming_a_global_its_parent_did_not(tmp_path):
    """In the private directory itself, a spec whose pickle names another global (here
    ``builtins.getattr`` of a path's ``write_text``) is refused before any of it runs."""
    import pickle

    work = _work(tmp_path)
    spec = work / "w.in"
    with private.open_write(spec) as f:
        f.write(json.dumps({"sys_path": list(sys.path), "parent": os.getpid(), "admit": []}).encode() + b"\n")
        pickle.dump((os.path.join, (_Runs(str(_payload_path(work))),)), f)
    r = _child(spec)
    assert r.returncode == 1
    with private.open_read(work / "w.out") as f:
        status, error, _ = private.load(f)
    assert status == "error" and "which its writer did not name" in str(error), error
    assert not _payload_path(work).exists()


def test_parent_refuses_a_result_naming_another_global(tmp_path):
    import pickle

    work = _work(tmp_path)
    child = procs.start(os.path.join, ("a", "b"), work=work, name="w")
    child.proc.wait(timeout=60)
    child.out.unlink()
    with private.open_write(child.out) as f:
        f.write(pickle.dumps(("ok", _Runs(str(_payload_path(work))))))
    with pytest.raises(pickle.UnpicklingError, match="did not name"):
        child.outcome()
    assert not _payload_path(work).exists()
