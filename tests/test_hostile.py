"""Hostile inputs: every file is built here, under tmp_path, then fed to ``ckpt inspect`` and
``ckpt convert --to hf``. Each must end with exit 3 and one ``error:`` line on stderr, no
traceback, nothing at DST, and code in a pickle never runs (its canary file never appears)."""

from __future__ import annotations

import builtins
import json
import os
import pickle
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpt_tools.cli.main import main


# -- code in pickles ------------------------------------------------------------------------

class _System:
    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


class _Exec:
    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return (builtins.exec, (f"open({str(self.canary)!r}, 'w').close()",))


class _Open:
    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return (builtins.open, (str(self.canary), "w"))


def _weights() -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": torch.ones(4, 3), "lm_head.weight": torch.ones(4, 3)}


def _verl(d: Path, *, model=None, optim=None, extra=None) -> Path:
    """A one-rank verl checkpoint; any of its files may be replaced by a hostile object."""
    d.mkdir()
    torch.save(model if model is not None else _weights(), d / "model_world_size_1_rank_0.pt")
    if optim is not None:
        torch.save(optim, d / "optim_world_size_1_rank_0.pt")
    if extra is not None:
        torch.save(extra, d / "extra_state_world_size_1_rank_0.pt")
    (d / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    return d


def _dcp(d: Path, state: dict | None = None) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state or {"model": _weights()}, checkpoint_id=str(d))
    return d


def _edit_metadata(d: Path, edit: Callable) -> Path:
    # our own file, just written: plain pickle is fine here
    meta = pickle.loads((d / ".metadata").read_bytes())
    edit(meta)
    (d / ".metadata").write_bytes(pickle.dumps(meta))
    return d


def _relocate(meta, new_path: str) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    for k, v in list(meta.storage_data.items()):
        meta.storage_data[k] = _StorageInfo(new_path, v.offset, v.length)


def _scripted(path: Path) -> Path:
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 4)

        def forward(self, x):
            return self.lin(x)

    torch.jit.save(torch.jit.script(Tiny()), str(path))
    return path


# -- safetensors ----------------------------------------------------------------------------

def _st(header: dict | bytes, data: bytes = b"", *, claimed: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if claimed is None else claimed) + raw + data


_W = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
_DATA16 = bytes(range(16))
_DATA32 = bytes(range(32))


def _valid_st() -> bytes:
    return _st({"w": _W}, _DATA16)


def _st_dir(d: Path, content: bytes, name: str = "model.safetensors") -> Path:
    d.mkdir()
    (d / name).write_bytes(content)
    return d


def _sparse(d: Path, size: int) -> Path:
    """Grow the file (sparse: no disk used) so that only the 100 MB cap refuses its header."""
    os.truncate(d / "model.safetensors", size)
    return d


def _hf_index(d: Path, weight_map: dict[str, str], shards: dict[str, bytes] | None = None) -> Path:
    d.mkdir()
    for name, content in (shards or {}).items():
        (d / name).write_bytes(content)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


# -- the corpus: name -> builder(tmp_path, canary) -> SRC ----------------------------------

def _pickle_cases():
    return {
        "pt-os-system": lambda t, c: _save(t / "model.pt", {"w": torch.ones(2), "x": _System(c)}),
        "pt-builtins-exec": lambda t, c: _save(t / "model.pt", {"w": torch.ones(2), "x": _Exec(c)}),
        "bin-builtins-open": lambda t, c: _save_dir(t / "src", "pytorch_model.bin", {"w": _Open(c)}),
        "pt-legacy-pickle": lambda t, c: _raw_pickle(t / "model.pt", {"w": _System(c)}),
        "pt-top-level-object": lambda t, c: _save(t / "model.bin", _System(c)),
        "bin-index-shard": lambda t, c: _bin_index(t / "src", {"w": _Exec(c)}),
        "verl-model-file": lambda t, c: _verl(t / "src", model={"w": torch.ones(2), "x": _System(c)}),
        "verl-optim-file": lambda t, c: _verl(t / "src", optim={"state": {}, "param_groups": [{"params": [0]}], "x": _Exec(c)}),
        "verl-extra-state-file": lambda t, c: _verl(t / "src", extra={"lr_scheduler": _Open(c)}),
        "dcp-metadata-is-code": lambda t, c: _dcp_metadata_raw(t / "src", _System(c)),
        "dcp-metadata-nested-code": lambda t, c: _edit_metadata(
            _dcp(t / "src"), lambda m: m.planner_data.__setitem__("model.x", _Exec(c))),
        "torchscript-pt": lambda t, c: _scripted(t / "model.pt"),
        "torchscript-pytorch-model-bin": lambda t, c: _scripted(_mkdir(t / "src") / "pytorch_model.bin").parent,
        "torchscript-verl-rank-file": lambda t, c: _torchscript_verl(t / "src"),
    }


# BYTE_IO items are only unpickled when an output needs them (not by `inspect` or `--to hf`)


def _byte_io_case(t: Path, c: Path) -> Path:
    return _dcp(t / "src", {"model": _weights(), "extra": {"lr_scheduler": _System(c)}})


def _safetensors_cases():
    big = 2 ** 40
    return {
        "st-header-past-eof": lambda t, c: _st_dir(t / "src", _st({"w": _W}, _DATA16, claimed=10_000)),
        "st-header-over-100MB": lambda t, c: _sparse(_st_dir(t / "src", _st({"w": _W}, _DATA16, claimed=150 * 2 ** 20)),
                                                     200 * 2 ** 20),
        "st-overlapping-offsets": lambda t, c: _st_dir(t / "src", _st(
            {"a": {**_W, "data_offsets": [0, 16]}, "b": {**_W, "data_offsets": [8, 24]}}, _DATA32[:24])),
        "st-offsets-out-of-range": lambda t, c: _st_dir(t / "src", _st({"w": {**_W, "data_offsets": [16, 32]}}, _DATA16)),
        "st-negative-offsets": lambda t, c: _st_dir(t / "src", _st({"w": {**_W, "data_offsets": [-16, 0]}}, _DATA16)),
        "st-shape-dtype-vs-bytes": lambda t, c: _st_dir(t / "src", _st({"w": {**_W, "shape": [2, 3]}}, _DATA16)),
        "st-truncated-data": lambda t, c: _st_dir(t / "src", _valid_st()[:-5]),
        "st-truncated-header": lambda t, c: _st_dir(t / "src", _valid_st()[:12]),
        "st-shorter-than-length-field": lambda t, c: _st_dir(t / "src", b"\x10\x00\x00"),
        "st-trailing-bytes": lambda t, c: _st_dir(t / "src", _valid_st() + b"\x00" * 8),
        "st-duplicate-keys": lambda t, c: _st_dir(t / "src", _st(
            b'{"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, '
            b'"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 32]}}', _DATA32)),
        "st-non-utf8-header": lambda t, c: _st_dir(t / "src", _st(b'{"w\xff\xfe": {"dtype": "F32"}}', _DATA16)),
        "st-header-not-json": lambda t, c: _st_dir(t / "src", _st(b"\x00" * 24, _DATA16)),
        "st-header-not-object": lambda t, c: _st_dir(t / "src", _st([1, 2, 3], _DATA16)),  # type: ignore[arg-type]
        "st-unknown-dtype": lambda t, c: _st_dir(t / "src", _st({"w": {**_W, "dtype": "F128"}}, _DATA16)),
        "st-declared-1TiB": lambda t, c: _st_dir(t / "src", _st(
            {"w": {"dtype": "F32", "shape": [big], "data_offsets": [0, 4 * big]}}, _DATA16)),
        "st-single-file-declared-1TiB": lambda t, c: _write(t / "model.safetensors", _st(
            {"w": {"dtype": "F32", "shape": [big, 4], "data_offsets": [0, 16 * big]}}, _DATA16)),
    }


def _path_cases():
    return {
        "hf-index-missing-shard": lambda t, c: _hf_index(t / "src", {"w": "model-00001-of-00002.safetensors",
                                                                    "v": "model-00002-of-00002.safetensors"},
                                                         {"model-00001-of-00002.safetensors": _valid_st()}),
        "hf-index-dotdot": lambda t, c: _hf_index(_outside(t, "x.safetensors") / "src", {"w": "../x.safetensors"}),
        "hf-index-absolute": lambda t, c: _hf_index(t / "src", {"w": str(_outside(t, "x.safetensors") / "x.safetensors")}),
        "hf-index-symlink-out": lambda t, c: _symlinked(_hf_index(_outside(t, "x.safetensors") / "src",
                                                                  {"w": "model-00001-of-00001.safetensors"}),
                                                        "model-00001-of-00001.safetensors", t / "x.safetensors"),
        "hf-single-symlink-out": lambda t, c: _symlinked(_mkdir(_outside(t, "x.safetensors") / "src"),
                                                         "model.safetensors", t / "x.safetensors"),
        "bin-index-dotdot": lambda t, c: _bin_index(t / "src", None, weight_file="../outside.bin", outside=t / "outside.bin"),
        "dcp-relative-path-dotdot": lambda t, c: _dcp_moved(t, "../evil.distcp", t / "evil.distcp"),
        "dcp-relative-path-absolute": lambda t, c: _dcp_moved(t, str(t / "evil.distcp"), t / "evil.distcp"),
        "dcp-symlink-out": lambda t, c: _dcp_symlinked(t),
        "dcp-item-past-eof": lambda t, c: _edit_metadata(_dcp(t / "src"), _items_past_eof),
        "dcp-declared-1TiB": lambda t, c: _edit_metadata(_dcp(t / "src"), _huge_tensor),
        "dcp-declared-1TiB-items-in-file": lambda t, c: _edit_metadata(_dcp(t / "src"), lambda m: _huge_tensor(m, fit=True)),
        "dcp-data-file-missing": lambda t, c: _dcp_missing_file(t / "src"),
    }


# -- builders -------------------------------------------------------------------------------

def _mkdir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    return d


def _write(p: Path, content: bytes) -> Path:
    p.write_bytes(content)
    return p


def _save(p: Path, obj) -> Path:
    torch.save(obj, p)
    return p


def _save_dir(d: Path, name: str, obj) -> Path:
    _save(_mkdir(d) / name, obj)
    return d


def _raw_pickle(p: Path, obj) -> Path:
    p.write_bytes(pickle.dumps(obj))
    return p


def _bin_index(d: Path, evil, *, weight_file: str = "pytorch_model-00001-of-00001.bin", outside: Path | None = None) -> Path:
    _mkdir(d)
    if outside is not None:
        torch.save({"w": torch.ones(2)}, outside)
    else:
        torch.save(evil, d / weight_file)
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"w": weight_file}}))
    return d


def _outside(t: Path, name: str) -> Path:
    """A valid safetensors file beside SRC (outside it): refusing it must not depend on it being broken."""
    (t / name).write_bytes(_valid_st())
    return t


def _symlinked(d: Path, name: str, target: Path) -> Path:
    (d / name).symlink_to(target)
    return d


def _torchscript_verl(d: Path) -> Path:
    _verl(d)
    _scripted(d / "model_world_size_1_rank_0.pt")
    return d


def _dcp_metadata_raw(d: Path, obj) -> Path:
    _dcp(d)
    (d / ".metadata").write_bytes(pickle.dumps(obj))
    return d


def _dcp_moved(t: Path, rel: str, outside: Path) -> Path:
    d = _dcp(t / "src")
    (d / "__0_0.distcp").rename(outside)
    return _edit_metadata(d, lambda m: _relocate(m, rel))


def _dcp_symlinked(t: Path) -> Path:
    d = _dcp(t / "src")
    (d / "__0_0.distcp").rename(t / "evil.distcp")
    (d / "__0_0.distcp").symlink_to(t / "evil.distcp")
    return d


def _dcp_missing_file(d: Path) -> Path:
    _dcp(d)
    (d / "__0_0.distcp").unlink()
    return d


def _items_past_eof(meta) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    for k, v in list(meta.storage_data.items()):
        meta.storage_data[k] = _StorageInfo(v.relative_path, v.offset, v.length + 10 ** 6)


def _huge_tensor(meta, *, fit: bool = False) -> None:
    """One tensor claims 2**38 x 3 float32 in two chunks; its items claim the bytes that
    needs (past the end of the file), or keep their real lengths (``fit``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    big = 2 ** 38
    fqn = next(k for k in meta.state_dict_metadata if k.startswith("model."))
    md = meta.state_dict_metadata[fqn]
    md.size = torch.Size([big, 3])
    md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([big // 2, 3])),
                 ChunkStorageMetadata(offsets=torch.Size([big // 2, 0]), sizes=torch.Size([big // 2, 3]))]
    old = next(v for k, v in meta.storage_data.items() if k.fqn == fqn)
    for k in [k for k in meta.storage_data if k.fqn == fqn]:
        del meta.storage_data[k]
    for i, c in enumerate(md.chunks):
        length = old.length if fit else 12 * big
        meta.storage_data[MetadataIndex(fqn, c.offsets, i)] = _StorageInfo(old.relative_path, old.offset, length)


CASES: dict[str, Callable] = {**_pickle_cases(), **_safetensors_cases(), **_path_cases(),
                               "dcp-byte-io-item-code": _byte_io_case}


COMMANDS = {
    "inspect": lambda src, dst: ["inspect", str(src)],
    "convert-hf": lambda src, dst: ["convert", str(src), str(dst), "--to", "hf"],
}


def _params():
    for name in CASES:
        for cmd in COMMANDS:
            yield pytest.param(name, cmd, id=f"{name}-{cmd}")


def _run(args: list[str]):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _assert_refused(result, tmp_path: Path, dst: Path, canary: Path) -> None:
    err = result.stderr
    assert result.exit_code == 3, f"exit {result.exit_code}\nstdout: {result.stdout}\nstderr: {err}"
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert "Traceback" not in err, err
    assert str(tmp_path) in errors[0], f"the error should name the file: {errors[0]}"
    assert not canary.exists(), "code in a pickle ran"
    assert not dst.exists()
    assert not [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}")]


@pytest.mark.parametrize("case, command", _params())
def test_hostile_input_is_refused(case: str, command: str, tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    src = CASES[case](tmp_path, canary)
    assert not canary.exists()  # building the corpus must not trip it
    dst = tmp_path / "out"
    _assert_refused(_run(COMMANDS[command](src, dst)), tmp_path, dst, canary)


@pytest.mark.parametrize("to", ["torch", "dcp", "sharded"])
def test_byte_io_item_with_code_is_refused_when_read(to: str, tmp_path: Path) -> None:
    """Outputs that carry objects unpickle the BYTE_IO item, weights_only, and refuse it."""
    canary = tmp_path / "CANARY"
    src = _byte_io_case(tmp_path, canary)
    dst = tmp_path / ("out.pt" if to == "torch" else "out")
    _assert_refused(_run(["convert", str(src), str(dst), "--to", to]), tmp_path, dst, canary)


def test_corpus_builders_make_loadable_baselines(tmp_path: Path) -> None:
    """The clean versions the corpus is mutated from are accepted, so each refusal above is
    down to the one thing broken."""
    ok = {
        "safetensors": _st_dir(tmp_path / "st", _valid_st()),
        "verl": _verl(tmp_path / "verl"),
        "dcp": _dcp(tmp_path / "dcp"),
        "hf-index": _hf_index(tmp_path / "idx", {"w": "model-00001-of-00001.safetensors"},
                              {"model-00001-of-00001.safetensors": _valid_st()}),
    }
    for name, src in ok.items():
        result = _run(["inspect", str(src)])
        assert result.exit_code == 0, f"{name}: {result.stderr}"
