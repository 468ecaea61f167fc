"""Hostile input, round 2: escapes through symlinked directories, files that block, pickles that
blow up when walked, headers that lie about sizes and offsets, names that forge error lines.

Every case is built here under tmp_path, then each of its commands runs under a 4 GiB
address-space cap and a timeout (``tests/capped.py``: one capped interpreter for the batch, an
alarm per command). Each must end with exit 3 (1 for a damaged manifest under ``verify``), one
``error:`` line and no traceback, in seconds, with bounded memory, writing nothing.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from capped import run_batch

DEEP = 200_000
SECONDS = 30  # the slowest refusal allowed, on a loaded 2-core machine (most take well under 1 s)
RSS_MIB = 512  # what one refusal may add to the runner's peak RSS


# -- pickles built by hand --------------------------------------------------------------------

def _deep_pickle(n: int = DEEP) -> bytes:
    """A list nested ``n`` deep: ``n`` EMPTY_LISTs, then ``n - 1`` APPENDs (the unpickler is a
    stack machine: no recursion needed to build it, only to walk it)."""
    return b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b"."


# dicts keyed by tuples whose hash never ends: Python hashes a tuple recursively, in C, every
# time; 200,000 deep overflows the C stack (a segfault), shared 60 levels deep takes 2**60 steps
_DEEP_KEY = b"}K\x01" + b"\x85" * DEEP + b"K\x02s"
_SHARED_KEY = (b"})r\xf0\xff\xff\x7f0" + b"(j\xf0\xff\xff\x7fj\xf0\xff\xff\x7ftr\xf0\xff\xff\x7f0" * 60
               + b"j\xf0\xff\xff\x7fK\x02s")


def _laughs(levels: int = 60) -> list:
    """A "billion laughs": each level a list holding the previous one twice. Pickled with a memo
    it is ~1 KB; walked as a tree, 2**levels nodes."""
    x: list = []
    for _ in range(levels):
        x = [x, x]
    return x


def _blob(data_pkl: bytes, *, compress: bool = False) -> bytes:
    """A torch.save-shaped zip around a given pickle."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


# -- checkpoints ------------------------------------------------------------------------------

def _weights() -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": torch.ones(4, 3), "lm_head.weight": torch.ones(4, 3)}


def _mkdir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    return d


def _dcp(d: Path, state: dict | None = None) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state or {"model": _weights()}, checkpoint_id=str(d))
    return d


def _edit_metadata(d: Path, edit: Callable, *, raw: Callable[[bytes], bytes] | None = None) -> Path:
    meta = pickle.loads((d / ".metadata").read_bytes())  # our own file, just written
    edit(meta)
    data = pickle.dumps(meta, protocol=2)  # no framing: ``raw`` may splice opcodes in
    (d / ".metadata").write_bytes(raw(data) if raw else data)
    return d


def _storage(meta, fn: Callable) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    for k, v in list(meta.storage_data.items()):
        meta.storage_data[k] = _StorageInfo(*fn(k, v))


def _dcp_item(d: Path, blob: bytes) -> Path:
    """A DCP whose BYTE_IO item ``extra.state`` is ``blob``."""
    _dcp(d, {"model": _weights(), "extra": {"state": 0}})
    data = d / "__0_0.distcp"
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(blob)
    return _edit_metadata(d, lambda m: _storage(m, lambda k, v: (v.relative_path, offset, len(blob))
                                                if k.fqn == "extra.state" else (v.relative_path, v.offset, v.length)))


def _dcp_planner(d: Path, value) -> Path:
    return _edit_metadata(_dcp(d), lambda m: m.planner_data.__setitem__("model.lm_head.weight", value))


def _dcp_planner_deep(d: Path, ops: bytes | None = None) -> Path:
    """planner_data of one item replaced by the pickle opcodes ``ops`` (default: a list nested
    200,000 deep), spliced into the file dcp.save wrote."""
    mark = "ZZ-PLACEHOLDER-ZZ"
    op = b"X" + len(mark).to_bytes(4, "little") + mark.encode()  # BINUNICODE, as protocol 2 writes it

    def splice(data: bytes) -> bytes:
        assert data.count(op) == 1
        return data.replace(op, ops if ops is not None else _deep_pickle()[2:-1])

    return _edit_metadata(_dcp(d), lambda m: m.planner_data.__setitem__("model.lm_head.weight", mark), raw=splice)


def _dcp_moved_into(t: Path, rel: str) -> Path:
    """A DCP whose data file sits at ``rel`` (relative to it) instead of beside .metadata."""
    d = _dcp(t / "src")
    target = d / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    (d / "__0_0.distcp").rename(target)
    return _edit_metadata(d, lambda m: _storage(m, lambda k, v: (rel, v.offset, v.length)))


def _dcp_dir_symlink(t: Path) -> Path:
    outside = _mkdir(t / "outside")
    d = _dcp(t / "src")
    (d / "__0_0.distcp").rename(outside / "__0_0.distcp")
    (d / "sub").symlink_to(outside, target_is_directory=True)
    return _edit_metadata(d, lambda m: _storage(m, lambda k, v: ("sub/__0_0.distcp", v.offset, v.length)))


def _dcp_symlink_loop(t: Path) -> Path:
    d = _dcp(t / "src")
    (d / "loop").symlink_to(d / "loop")
    return _edit_metadata(d, lambda m: _storage(m, lambda k, v: ("loop/__0_0.distcp", v.offset, v.length)))


def _dcp_fifo(d: Path, name: str) -> Path:
    _dcp(d)
    (d / name).unlink()
    os.mkfifo(d / name)
    return d


def _dcp_sparse_metadata(d: Path) -> Path:
    _dcp(d)
    os.truncate(d / ".metadata", 3 << 29)  # 1.5 GiB, sparse: no disk used
    return d


def _past_eof(m) -> None:
    _storage(m, lambda k, v: (v.relative_path, v.offset, v.length + 10 ** 6))


def _negative_chunk(m) -> None:
    """lm_head's one chunk rewritten as offsets (4, 3), sizes (-4, -3): 12 "elements", the
    tensor's count, so a coverage check that adds sizes sees no hole."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    fqn = "model.lm_head.weight"
    md = m.state_dict_metadata[fqn]
    old = next(v for k, v in m.storage_data.items() if k.fqn == fqn)
    for k in [k for k in m.storage_data if k.fqn == fqn]:
        del m.storage_data[k]
    md.chunks = [ChunkStorageMetadata(offsets=torch.Size([4, 3]), sizes=torch.Size([-4, -3]))]
    m.storage_data[MetadataIndex(fqn, torch.Size([4, 3]), 0)] = old


def _st_valid() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}).encode()
    return len(header).to_bytes(8, "little") + header + bytes(16)


def _hf_index(t: Path, shard: str, *, link: bool = True) -> Path:
    """An HF index whose one shard is reached through ``sub/``, a symlink to a directory outside."""
    outside = _mkdir(t / "outside")
    (outside / "model-00001-of-00001.safetensors").write_bytes(_st_valid())
    d = _mkdir(t / "src")
    if link:
        (d / "sub").symlink_to(outside, target_is_directory=True)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"w": shard}}))
    return d


def _bin_index_dir_symlink(t: Path) -> Path:
    outside = _mkdir(t / "outside")
    torch.save({"w": torch.ones(2)}, outside / "pytorch_model-00001-of-00001.bin")
    d = _mkdir(t / "src")
    (d / "sub").symlink_to(outside, target_is_directory=True)
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": "sub/pytorch_model-00001-of-00001.bin"}}))
    return d


def _verl(d: Path, model: bytes | Callable[[Path], None] | None = None) -> Path:
    _mkdir(d)
    f = d / "model_world_size_1_rank_0.pt"
    if model is None:
        torch.save(_weights(), f)
    elif callable(model):
        model(f)
    else:
        f.write_bytes(model)
    (d / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    return d


def _verl_pickled(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _legacy(ops: bytes) -> bytes:
    """A legacy (pre-zip) torch.save file whose object pickle is ``ops``: magic number, protocol,
    sys info, the object, storage keys, five pickles in a row."""
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

    return (pickle.dumps(MAGIC_NUMBER, 2) + pickle.dumps(PROTOCOL_VERSION, 2) + pickle.dumps({}, 2)
            + b"\x80\x02" + ops + b"." + pickle.dumps([], 2))


def _write(p: Path, content: bytes) -> Path:
    p.write_bytes(content)
    return p


def _verl_assets(t: Path, *, link_dir: bool) -> Path:
    """A verl checkpoint whose huggingface/ folder (or its tokenizer.json) is a symlink out:
    exporting it would copy an outside file into the output."""
    secret = _mkdir(t / "outside")
    (secret / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (secret / "tokenizer.json").write_text("{}")
    d = _verl(t / "src")
    if link_dir:
        (d / "huggingface").symlink_to(secret, target_is_directory=True)
    else:
        _mkdir(d / "huggingface")
        (d / "huggingface" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        (d / "huggingface" / "tokenizer.json").symlink_to(secret / "tokenizer.json")
    return d


def _hf_fifo(d: Path) -> Path:
    os.mkfifo(_mkdir(d) / "model.safetensors")
    return d


def _path_fifo(t: Path) -> Path:
    os.mkfifo(t / "model.pt")
    return t / "model.pt"


def _newline_dir(t: Path) -> Path:
    return _edit_metadata(_dcp(t / "src\nerror: forged by the directory name"), _past_eof)


def _newline_file(t: Path) -> Path:
    d = _dcp_moved_into(t, "x\nerror: forged by a data file name\x1b[2K.distcp")
    return _edit_metadata(d, _past_eof)


def _zip_bomb_item(d: Path) -> Path:
    # 256 MiB of pickle in a few hundred KB: a string of 'a's, deflated
    big = b"\x80\x02X" + (256 << 20).to_bytes(4, "little") + b"a" * (256 << 20) + b"."
    return _dcp_item(d, _blob(big, compress=True))


CASES: dict[str, tuple[Callable[[Path], Path], tuple[str, ...]]] = {
    # reading outside the checkpoint
    "dcp-relative-path-through-dir-symlink": (_dcp_dir_symlink, ("inspect", "export", "reshard", "verify")),
    "dcp-relative-path-symlink-loop": (_dcp_symlink_loop, ("inspect", "export")),
    "hf-index-shard-through-dir-symlink": (lambda t: _hf_index(t, "sub/model-00001-of-00001.safetensors"),
                                           ("inspect", "export")),
    "bin-index-shard-through-dir-symlink": (_bin_index_dir_symlink, ("inspect", "export")),
    "verl-rank-file-symlink-out": (lambda t: _verl(t / "src", lambda f: f.symlink_to(
        _verl(t / "outside").joinpath("model_world_size_1_rank_0.pt"))), ("inspect", "export")),
    "verl-huggingface-tokenizer-symlink-out": (lambda t: _verl_assets(t, link_dir=False), ("export",)),
    "verl-huggingface-dir-symlink-out": (lambda t: _verl_assets(t, link_dir=True), ("export",)),
    # files that block
    "verl-rank-file-is-fifo": (lambda t: _verl(t / "src", os.mkfifo), ("inspect", "export", "reshard", "verify")),
    "dcp-data-file-is-fifo": (lambda t: _dcp_fifo(t / "src", "__0_0.distcp"), ("inspect", "export")),
    "hf-single-file-is-fifo": (lambda t: _hf_fifo(t / "src"), ("inspect", "export")),
    "path-is-fifo": (_path_fifo, ("inspect", "export")),
    # pickles that blow up when walked
    "dcp-bytes-item-billion-laughs": (lambda t: _dcp_item(t / "src", _blob(pickle.dumps(_laughs(), 2))),
                                      ("inspect", "export", "reshard", "verify")),
    "dcp-bytes-item-nested-200k": (lambda t: _dcp_item(t / "src", _blob(_deep_pickle())), ("inspect", "export")),
    "dcp-bytes-item-cycle": (lambda t: _dcp_item(t / "src", _blob(b"\x80\x02]q\x00h\x00a.")), ("inspect", "export")),
    "dcp-metadata-planner-billion-laughs": (lambda t: _dcp_planner(t / "src", _laughs()), ("inspect", "export")),
    "dcp-metadata-planner-nested-200k": (lambda t: _dcp_planner_deep(t / "src"), ("inspect", "export")),
    "dcp-metadata-planner-not-a-path": (lambda t: _dcp_planner(t / "src", [["a", ["b"]], {"c": 1}]), ("inspect",)),
    "verl-rank-file-billion-laughs": (lambda t: _verl(t / "src", _verl_pickled({"w": torch.ones(2), "x": _laughs()})),
                                      ("inspect", "export", "reshard", "verify")),
    "verl-rank-file-nested-200k": (lambda t: _verl(t / "src", _blob(_deep_pickle())), ("inspect", "export")),
    "dcp-metadata-dict-keyed-by-200k-deep-tuple": (lambda t: _dcp_planner_deep(t / "src", _DEEP_KEY), ("inspect",)),
    "dcp-metadata-dict-keyed-by-shared-tuple": (lambda t: _dcp_planner_deep(t / "src", _SHARED_KEY), ("inspect",)),
    "dcp-bytes-item-dict-keyed-by-200k-deep-tuple": (
        lambda t: _dcp_item(t / "src", _blob(b"\x80\x02" + _DEEP_KEY + b".")), ("inspect", "export")),
    "pt-file-dict-keyed-by-shared-tuple": (
        lambda t: _write(t / "model.pt", _blob(b"\x80\x02" + _SHARED_KEY + b".")), ("inspect", "export")),
    "legacy-pt-file-dict-keyed-by-200k-deep-tuple": (lambda t: _write(t / "model.pt", _legacy(_DEEP_KEY)),
                                                     ("inspect", "export")),
    "verl-rank-file-dict-keyed-by-200k-deep-tuple": (
        lambda t: _verl(t / "src", _blob(b"\x80\x02" + _DEEP_KEY + b".")), ("inspect", "export")),
    # sizes, offsets and lengths that lie
    "dcp-metadata-sparse-1.5GiB": (lambda t: _dcp_sparse_metadata(t / "src"), ("inspect", "export")),
    "dcp-negative-storage-offset": (lambda t: _edit_metadata(_dcp(t / "src"), lambda m: _storage(
        m, lambda k, v: (v.relative_path, -8, v.length))), ("inspect", "export", "reshard", "verify")),
    "dcp-negative-length": (lambda t: _edit_metadata(_dcp(t / "src"), lambda m: _storage(
        m, lambda k, v: (v.relative_path, v.offset, -v.length))), ("inspect", "export")),
    "dcp-negative-chunk-sizes-over-a-hole": (lambda t: _edit_metadata(_dcp(t / "src"), _negative_chunk),
                                             ("inspect", "export")),
    "dcp-bytes-item-deflate-bomb": (lambda t: _zip_bomb_item(t / "src"), ("inspect", "export")),
    # names that would forge a second error line
    "src-dir-name-with-newline": (_newline_dir, ("inspect", "export")),
    "data-file-name-with-newline-and-escape": (_newline_file, ("inspect", "export")),
}

COMMANDS = {
    "inspect": lambda src, dst: ["inspect", str(src)],
    "export": lambda src, dst: ["export", str(src), str(dst)],
    "reshard": lambda src, dst: ["reshard", str(src), str(dst), "--to", "2"],
    "verify": lambda src, dst: ["verify", str(src)],  # not damage a manifest explains: exit 3 too
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[dict, Path, Path]]:
    """Build every case, run every (case, command) in one capped batch; ``{id: (result, tmp, dst)}``."""
    work = tmp_path_factory.mktemp("hostile2")
    batch, where = [], {}
    for name, (build, commands) in CASES.items():
        t = _mkdir(work / name)
        src = build(t)
        for cmd in commands:
            dst = t / f"out-{cmd}"
            case_id = f"{name}-{cmd}"
            batch.append((case_id, COMMANDS[cmd](src, dst)))
            where[case_id] = (t, dst)
    results = run_batch(batch, work)
    return {k: (results[k], *where[k]) for k in where}


def _ids():
    return [f"{name}-{cmd}" for name, (_, commands) in CASES.items() for cmd in commands]


def assert_refused(result: dict, dst: Path, *, code: int = 3) -> None:
    err = result["stderr"]
    assert result["exit"] == code, f"exit {result['exit']}\n{err}"
    errors = [line for line in err.splitlines() if line.lstrip().startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: "), err
    assert "Traceback" not in err and "escaped:" not in err and "internal error" not in err, err
    assert result["seconds"] < SECONDS, result
    assert result["rss_growth_mib"] < RSS_MIB, result
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}")]


@pytest.mark.parametrize("case_id", _ids())
def test_refused_in_seconds_under_a_4gib_cap(case_id: str, outcomes) -> None:
    result, tmp, dst = outcomes[case_id]
    assert_refused(result, dst)


@pytest.mark.parametrize("case_id", [i for i in _ids() if "newline" in i])
def test_names_cannot_forge_a_second_error_line(case_id: str, outcomes) -> None:
    result, _, _ = outcomes[case_id]
    (line,) = [x for x in result["stderr"].splitlines() if x.startswith("error: ")]
    assert "\\n" in line and "forged" in line and "\x1b" not in line


def test_baselines_are_accepted(tmp_path: Path) -> None:
    """The clean versions the cases are mutated from pass, so each refusal is down to its one lie."""
    from click.testing import CliRunner

    from ckpt_tools.cli.main import main

    ok = {
        "dcp": _dcp(tmp_path / "dcp"),
        "dcp-with-item": _dcp_item(tmp_path / "item", _blob(pickle.dumps({"a": [1, 2, [3]]}, 2))),
        "dcp-data-in-subdir": _dcp_moved_into(_mkdir(tmp_path / "sub"), "data/__0_0.distcp"),
        "hf-index-in-subdir": _hf_index(_mkdir(tmp_path / "hfi"), "sub/model-00001-of-00001.safetensors",
                                        link=False),
        "verl": _verl(tmp_path / "verl"),
    }
    inner = ok["hf-index-in-subdir"] / "sub"
    inner.mkdir()
    shutil.copy(tmp_path / "hfi" / "outside" / "model-00001-of-00001.safetensors", inner)
    for name, src in ok.items():
        result = CliRunner().invoke(main, ["inspect", str(src)], catch_exceptions=False)
        assert result.exit_code == 0, f"{name}: {result.stderr}"


def test_deep_manifest_is_a_verify_finding(tmp_path: Path, fixtures_dir: Path) -> None:
    """A manifest nested 200,000 deep: verify reports the damage (exit 1), no RecursionError."""
    import ckpt_tools

    dst = tmp_path / "hf"
    ckpt_tools.convert(fixtures_dir / "llama_hf", dst, to="hf", progress=False)
    (dst / ".ckpt-manifest.json").write_text("[" * DEEP + "]" * DEEP)
    result = run_batch([("verify", ["verify", str(dst)])], tmp_path)["verify"]
    assert result["exit"] == 1, result
    assert "unreadable manifest" in result["stdout"] and "nests too deeply" in result["stdout"], result
    assert "Traceback" not in result["stderr"] and "internal error" not in result["stderr"], result
    assert result["seconds"] < SECONDS


def test_gc_pause_promotes_only_when_asked(monkeypatch):
    """A pause's objects go to the collector's oldest generation only for a command that asked
    (inspect) and a pause that asks (a description); they stay collectable (nothing frozen)."""
    import gc

    from ckpt_tools.security import bounded

    def young_after(promote: bool) -> int:
        gc.collect()
        with bounded.gc_paused(promote=promote):
            kept = [[i] for i in range(20_000)]
        young = gc.get_count()[0]
        del kept
        return young

    thresholds = gc.get_threshold()
    gc.set_threshold(1_000_000)  # no pass while the test counts
    try:
        monkeypatch.setattr(bounded, "_PROMOTE", False)  # (an inspect run in this process asked)
        assert young_after(True) >= 20_000  # not asked by the command: left young
        monkeypatch.setattr(bounded, "_PROMOTE", True)
        assert young_after(False) >= 20_000  # not asked by the pause
        assert young_after(True) < 1_000 and gc.get_freeze_count() == 0 and gc.isenabled()
    finally:
        gc.set_threshold(*thresholds)
    gc.disable()
    try:
        with bounded.gc_paused(promote=True):  # nested in a pause the caller holds: left to the caller
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_gc_frozen_sets_live_objects_aside_and_gives_them_back(tmp_path):
    """While the engine moves bytes, what was alive before (the description, the plan) is out of
    the collector's passes; after, it is back and collectable, also when the work fails. A
    process that froze objects of its own keeps them frozen, and they stay so after."""
    import gc

    from ckpt_tools.security import bounded

    gc.collect()
    live = [[i] for i in range(10_000)]
    seen = []
    with bounded.gc_frozen():
        seen.append(gc.get_freeze_count())
    assert seen[0] >= 10_000 and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError):
        with bounded.gc_frozen():
            raise RuntimeError("a failed write")
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the process's own
    try:
        frozen = gc.get_freeze_count()
        # Frozen objects still die by reference count (another thread's, a test server's), so the
        # count may fall a little; it neither grows by what the block builds (no second freeze)
        # nor drops to nothing (no unfreeze of the process's own).
        with bounded.gc_frozen():
            extra = [[i] for i in range(1_000)]
            assert frozen // 2 < gc.get_freeze_count() <= frozen
        assert frozen // 2 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
    del live, extra


def test_gc_frozen_nests_and_sets_aside_what_pauses_build():
    """Within a frozen block, what a paused block builds (a description, a plan) is set aside as
    the pause ends, a nested block adds to what is set aside, and all is given back after the
    outermost block only."""
    import gc

    from ckpt_tools.security import bounded

    gc.collect()
    with bounded.gc_frozen():
        start = gc.get_freeze_count()
        with bounded.gc_paused():
            built = [[i] for i in range(10_000)]
        after_pause = gc.get_freeze_count()
        more = [[i] for i in range(5_000)]
        with bounded.gc_frozen():
            after_nested = gc.get_freeze_count()
        assert gc.get_freeze_count() > after_pause  # the inner block gives nothing back
    assert after_pause >= start + 10_000 and after_nested >= after_pause + 5_000
    assert gc.get_freeze_count() == 0
    del built, more


def test_check_tree_leaves_nothing_for_the_collector():
    """check_tree's walk (a closure that recurses through itself) leaves no cycle behind: its
    table of every container is freed as it returns, also with the collector paused, as it is
    while a description is read (else a 25k-tensor file's table stayed until the pause ended)."""
    import gc

    from ckpt_tools.security import bounded

    gc.collect()
    with bounded.gc_paused():
        bounded.check_tree({"a": [(1, [2, 3]), {"b": [4, (5, [6])]}] * 1000}, where="t")
        assert gc.collect() == 0


def test_check_tree_counts_short_flat_tuples_where_they_stand():
    """Short tuples of leaves (shapes, offsets) are walked without a call each time they are
    met: sharing one many times is not a bomb, a bomb made of tuples above them still is, and
    one past the depth limit is still refused."""
    from ckpt_tools.security import bounded

    shape = (4096, 4096)
    bounded.check_tree({"chunks": [[shape, shape]] * 200_000}, where="t")  # what it shares, it walks
    bomb = (1, 2, 3)
    for _ in range(60):
        bomb = (bomb, bomb)
    with pytest.raises(bounded.HostileTree, match="stand for about 2\\^"):
        bounded.check_tree(bomb, where="t")
    deep: object = (1, 2)
    for _ in range(bounded.MAX_DEPTH - 1):
        deep = [deep]
    bounded.check_tree(deep, where="t")  # MAX_DEPTH levels, the tuple the last
    with pytest.raises(bounded.HostileTree, match="deeper than"):
        bounded.check_tree([deep], where="t")


def test_check_tree_counts_nodes_of_leaves_where_they_stand():
    """A node holding only leaves and short tuples of leaves (a DCP chunk record) is counted
    where it is met, like a short tuple: shared 200,000 times it is walked, a bomb made of
    lists above it is still refused, and so are a cycle and a tree too deep through nodes
    that hold more."""
    from ckpt_tools.security import bounded

    class Rec:
        def __init__(self, *fields):
            self.fields = list(fields)

    bounded.register(Rec, lambda r: r.fields)
    try:
        chunk = Rec((0, 0), (4096, 4096), "__0_0.distcp", 7)
        bounded.check_tree({"chunks": [chunk] * 200_000}, where="t")
        bomb: object = [chunk, chunk]
        for _ in range(60):
            bomb = [bomb, bomb]
        with pytest.raises(bounded.HostileTree, match="stand for about 2\\^"):
            bounded.check_tree(bomb, where="t")
        loop = Rec((1,), 2)
        loop.fields.append(loop)
        with pytest.raises(bounded.HostileTree, match="contains itself"):
            bounded.check_tree([chunk, loop], where="t")
        deep: object = chunk
        for _ in range(bounded.MAX_DEPTH - 2):
            deep = Rec(deep, 1)
        bounded.check_tree(deep, where="t")  # MAX_DEPTH levels, the chunk's tuples the last
        with pytest.raises(bounded.HostileTree, match="deeper than"):
            bounded.check_tree(Rec(deep), where="t")
    finally:
        del bounded._NODES[Rec]
        bounded._OPAQUE.clear()


def test_check_tree_knows_leaf_types_by_type_and_never_a_container():
    """A type found to hold no children is then known as a leaf at once (a torch pickle's Global
    nodes and one-character strings are met ~10^5 times); registering a node type forgets that,
    so a type registered later is walked, its cycles refused; dict subclasses are always walked."""
    from ckpt_tools.security import bounded

    class Box:
        pass

    class Keyed(dict):
        pass

    box = Box()
    box.kids = [box]
    bounded.check_tree([box, box], where="t")  # unregistered: a leaf, whatever it holds
    assert Box in bounded._OPAQUE
    bomb: object = 1
    for _ in range(60):
        bomb = Keyed(a=bomb, b=bomb)
    with pytest.raises(bounded.HostileTree, match="stand for about 2\\^"):
        bounded.check_tree([box, bomb], where="t")
    assert Keyed not in bounded._OPAQUE
    bounded.register(Box, lambda b: b.kids)
    try:
        assert Box not in bounded._OPAQUE
        with pytest.raises(bounded.HostileTree, match="contains itself"):
            bounded.check_tree([box], where="t")
    finally:
        del bounded._NODES[Box]
        bounded._OPAQUE.clear()


def test_check_tree_notes_only_what_is_held_twice():
    """check_tree notes the size of a container held by two holders or more, never of one held
    once (most of a torch pickle's): a bomb shared through any kind of container or node is
    refused at once, whatever its children are (the container itself, a tuple made for the
    walk, a view of the node's fields, a list the node keeps), and a tree of 200,000 nodes held
    once is walked without a table of them."""
    import tracemalloc
    from collections import OrderedDict

    from ckpt_tools.security import bounded
    from ckpt_tools.security.torchfile import Global, NewObj, Reduce

    class Fields:  # children a view of its fields, as dcpmeta's records
        def __init__(self, *kids):
            self.a, self.b = kids

    class Kept:  # children a list it keeps
        def __init__(self, *kids):
            self.kids = list(kids)

    bounded.register(Fields, lambda r: vars(r).values())
    bounded.register(Kept, lambda r: r.kids)
    g = Global("m", "f")
    kinds = {"tuple": lambda a: (a, a), "list": lambda a: [a, a], "dict": lambda a: {"x": a, "y": a},
             "OrderedDict": lambda a: OrderedDict(x=a, y=a), "Reduce": lambda a: Reduce(g, (a, a)),
             "Reduce args": lambda a: Reduce(g, a) if type(a) is tuple else Reduce(g, (a,)),
             "NewObj state": lambda a: NewObj(g, (a,), {"s": a}), "fields": lambda a: Fields(a, a),
             "kept": lambda a: Kept(a, a), "one holder, then two": lambda a: ([a], [a])}
    try:
        for kind, make in kinds.items():
            bomb: object = [[1, 2, 3]]
            for _ in range(45):  # (2**45 paths; two levels each through a node and its args)
                bomb = make(bomb)
            if kind == "Reduce args":  # (held once at every level: a chain, not a bomb)
                bounded.check_tree(bomb, where="t")
                continue
            with pytest.raises(bounded.HostileTree, match="stand for about 2\\^"):
                bounded.check_tree(bomb, where=kind)
        many = [Reduce(g, ([i, i + 1], {"k": (i, [i])})) for i in range(200_000)]
        tracemalloc.start()
        try:
            bounded.check_tree(many, where="t")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20  # (a table of its ~1,000,000 containers is ~60 MB)
    finally:
        del bounded._NODES[Fields], bounded._NODES[Kept]
        bounded._OPAQUE.clear()
