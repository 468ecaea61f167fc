"""``--json`` and ``--dry-run`` on the commands that write (convert, export, reshard, shard).

``--json``: one object saying what was written; every value is checked against what is on disk
(each file and its size, the total) and against ``inspect --json`` of the output (format, world
size, tensors, bytes, dtypes). ``--dry-run``: exit 0, nothing created (DST, its staging sibling,
a remote prefix), an existing DST and a leftover staging sibling untouched, and the plan's
figures equal to what the real run then writes. The Python API returns the same dict.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckpt_tools
from ckpt_tools.cli.main import main

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"

CASES = {  # name: (source fixture, DST name, args)
    "convert-dcp": ("llama_sharded_ws8", "dcp", ["convert", "--to", "dcp", "--world-size", "2"]),
    "convert-sharded": ("llama_dcp", "ranks", ["convert", "--to", "sharded", "--world-size", "3"]),
    "convert-torch": ("llama_sharded_ws8", "train.pt", ["convert", "--to", "torch"]),
    "convert-hf-bf16": ("llama_dcp", "hf", ["convert", "--to", "hf", "--dtype", "bf16"]),
    "export": ("llama_sharded_ws8", "hf", ["export", "--dtype", "fp16", "--max-shard-size", "40KB"]),
    "reshard": ("llama_sharded_ws8", "ws3", ["reshard", "--to", "3", "--from", "8"]),
}


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _cmd(case: str, dst: Path, *extra: str) -> list[str]:
    fixture, _, args = CASES[case]
    return [args[0], FIXTURES / fixture, dst, *args[1:], *extra]


def _stdout_json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` (hidden ones included) with its content's digest."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def _inspect(path: Path) -> dict:
    return _stdout_json(_run("inspect", path, "--json"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_json_says_what_is_on_disk(case: str, tmp_path: Path) -> None:
    dst = tmp_path / CASES[case][1]
    report = _stdout_json(_run(*_cmd(case, dst, "--json", "--quiet")))
    assert report["dry_run"] is False and report["dst"] == str(dst)
    on_disk = ({dst.name: dst.stat().st_size} if dst.is_file() else
               {p.relative_to(dst).as_posix(): p.stat().st_size for p in dst.rglob("*") if p.is_file()})
    assert {f["path"]: f["bytes"] for f in report["files"]} == on_disk
    assert report["written_bytes"] == sum(on_disk.values())
    info = _inspect(dst)
    assert report["format"] == info["format"]
    assert report["world_size"] == info["world_size"]
    assert report["num_tensors"] == info["num_tensors"]
    assert report["total_bytes"] == info["total_bytes"]
    assert report["dtypes"] == info["dtypes"]
    # the tensor files: every tensor written, in the files the plan named
    planned = [f for f in report["files"] if f["tensors"] is not None]
    assert planned and all(f["bytes"] >= f["tensor_bytes"] for f in planned)
    if "--dtype" in CASES[case][2]:
        asked = {"bf16": "bfloat16", "fp16": "float16"}[CASES[case][2][CASES[case][2].index("--dtype") + 1]]
        assert report["dtype"] == asked and set(info["dtypes"]) == {asked}
    else:
        assert report["dtype"] == max(info["dtypes"], key=info["dtypes"].get)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dry_run_writes_nothing_and_plans_what_the_run_writes(case: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    dst = out / CASES[case][1]
    plan = _stdout_json(_run(*_cmd(case, dst, "--json", "--dry-run")))
    assert list(out.iterdir()) == []  # no DST, no staging sibling
    assert plan["dry_run"] is True and plan["written_bytes"] is None
    assert all(f["bytes"] is None for f in plan["files"])
    report = _stdout_json(_run(*_cmd(case, dst, "--json", "--quiet")))
    for key in ("format", "world_size", "num_tensors", "total_bytes", "dtypes", "dtype", "left_out"):
        assert plan[key] == report[key], key
    # every file the plan names is written, holding what the plan said
    written = {f["path"]: f for f in report["files"]}
    for f in plan["files"]:
        assert f["path"] in written, f["path"]
        assert (f["tensors"], f["tensor_bytes"]) == (written[f["path"]]["tensors"], written[f["path"]]["tensor_bytes"])
    assert sum(f["tensor_bytes"] or 0 for f in plan["files"]) >= plan["total_bytes"] > 0


def test_dry_run_text_names_the_files_and_exits_0(tmp_path: Path) -> None:
    dst = tmp_path / "ws3"
    result = _run("reshard", FIXTURES / "llama_sharded_ws8", dst, "--to", "3", "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"would write {dst} (sharded, 3 ranks" in result.stdout and "nothing written" in result.stdout
    for r in range(3):
        assert f"model_world_size_3_rank_{r}.pt" in result.stdout
    assert not dst.exists() and list(tmp_path.iterdir()) == []


def test_dry_run_leaves_an_existing_dst_and_leftover_staging_alone(tmp_path: Path) -> None:
    dst = tmp_path / "hf"
    assert _run("export", FIXTURES / "llama_sharded_ws8", dst, "--quiet").exit_code == 0
    leftover = tmp_path / ".hf.ckpt-tmp-leftover"  # what a killed run leaves beside DST
    leftover.mkdir()
    (leftover / "part").write_bytes(b"x" * 10)
    before = _tree(tmp_path)
    refused = _run("export", FIXTURES / "llama_sharded_ws8", dst, "--dry-run")
    assert refused.exit_code == 4 and "--overwrite" in refused.output  # what the real run would say
    no_config = _run("export", FIXTURES / "llama_dcp", dst, "--dry-run", "--overwrite")
    assert no_config.exit_code == 3 and "--base" in no_config.output  # and this refusal too
    plan = _run("export", FIXTURES / "llama_sharded_ws8", dst, "--dry-run", "--overwrite", "--json", "--dtype", "bf16")
    assert _stdout_json(plan)["dry_run"] is True
    assert _tree(tmp_path) == before  # the old DST and the leftover both as they were


def test_notes_and_left_out_state_are_reported(tmp_path: Path) -> None:
    report = _stdout_json(_run("export", FIXTURES / "llama_sharded_ws8", tmp_path / "hf", "--json", "--quiet"))
    assert report["left_out"] == ["optimizer"]
    assert any("left out optimizer" in n for n in report["notes"])
    assert not any(n.startswith(("note:", "warning:")) for n in report["notes"])  # the prefix word is dropped
    report = _stdout_json(_run("reshard", FIXTURES / "llama_sharded_ws8", tmp_path / "ws2", "--to", "2", "--json"))
    assert any("--rank-local drop" in n for n in report["notes"])  # verl's RNG state, a warning


def test_api_returns_the_json_the_cli_prints(tmp_path: Path) -> None:
    cli = _stdout_json(_run("convert", FIXTURES / "llama_sharded_ws8", tmp_path / "a", "--to", "dcp", "--json",
                            "--quiet"))
    api = ckpt_tools.convert(FIXTURES / "llama_sharded_ws8", tmp_path / "b", to="dcp", progress=False)
    strip = {"src", "dst"}
    assert {k: v for k, v in api.items() if k not in strip} == {k: v for k, v in cli.items() if k not in strip}
    plan = ckpt_tools.reshard(FIXTURES / "llama_sharded_ws8", tmp_path / "c", to=2, dry_run=True)
    assert plan["dry_run"] is True and not (tmp_path / "c").exists()
    plan = ckpt_tools.export(FIXTURES / "llama_sharded_ws8", tmp_path / "d", dry_run=True)
    assert plan["format"] == "hf" and not (tmp_path / "d").exists()


def test_shard_dry_run_plans_what_the_job_saves(tmp_path: Path) -> None:
    dst = tmp_path / "ckpt0"
    args = ["shard", FIXTURES / "llama_hf", dst, "--ranks", "2", "--with-optimizer", "adamw", "--json"]
    plan = _stdout_json(_run(*args, "--dry-run"))
    assert plan["dry_run"] is True and list(tmp_path.iterdir()) == []
    report = _stdout_json(_run(*args, "--quiet"))
    info = _inspect(dst)
    for key in ("num_tensors", "total_bytes", "dtypes"):
        assert plan[key] == report[key] == info[key], key
    assert plan["world_size"] == report["world_size"] == info["world_size"] == 2
    on_disk = {p.relative_to(dst).as_posix(): p.stat().st_size for p in dst.rglob("*") if p.is_file()}
    assert {f["path"]: f["bytes"] for f in report["files"]} == on_disk
    assert {f["path"] for f in plan["files"]} == set(on_disk)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from s3server import make_bucket, start_server

    server = start_server(tmp_path_factory.mktemp("s3server"))
    try:
        make_bucket(server, "ckpt")
        yield server
    finally:
        server.stop()


def test_dry_run_to_a_bucket_uploads_nothing(s3, tmp_path: Path) -> None:
    import s3fs

    env = {**os.environ, **s3.env()}
    proc = subprocess.run([sys.executable, "-m", "ckpt_tools", "export", str(FIXTURES / "llama_sharded_ws8"),
                           "s3://ckpt/out/hf", "--dry-run", "--json"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["dst"] == "s3://ckpt/out/hf" and plan["dry_run"] is True
    assert "model.safetensors" in {f["path"] for f in plan["files"]}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=env["AWS_ENDPOINT_URL"],
                           key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"])
    assert fs.find("ckpt") == [] and fs.list_multipart_uploads("ckpt") == []
