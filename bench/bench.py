"""Side-by-side timings of ckpt against `cp -r` and the peers, reported as ratios.

    python bench/bench.py export  [--gb 1.5] [--out DIR]   # DCP bf16 -> HF: cp, ckpt export, accelerate, dcp_to_torch_save
    python bench/bench.py reshard [--gb 2.0] [--out DIR]   # 8-rank fp32 model+AdamW -> 4 ranks: cp, ckpt reshard
    python bench/bench.py paths [--gb 1.4] [--repeat 3]    # every path against cp -r of its source, and the peers
    python bench/bench.py verl [--gb 1.2] [--repeat 5]     # verl FSDP2 actor -> HF: cp, ckpt export, verl.model_merger

Each tool runs in its own process, once per round (5 rounds, medians reported); peak RSS (total and anonymous) is sampled from /proc every 20 ms.
In `paths`, each path runs right after its baseline (`cp -r` of its source, or `cat` of it for
`verify`), and its ratio is the median of those pairs. ckpt_tools is compiled to bytecode first, as
`pip install` does.
Page cache is not dropped between runs (no root assumed): every tool reads warm files, cp included.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def llama_shapes(gb: float, dtype_bytes: int, hidden: int = 4096) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-shaped tensors (7B: hidden 4096, intermediate 11008, vocab 32000), with as many
    layers as fit in ``gb`` (at least 1)."""
    h, i, v = hidden, hidden * 11008 // 4096, 32000
    layer = [("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (h, h)),
             ("self_attn.v_proj.weight", (h, h)), ("self_attn.o_proj.weight", (h, h)),
             ("mlp.gate_proj.weight", (i, h)), ("mlp.up_proj.weight", (i, h)), ("mlp.down_proj.weight", (h, i)),
             ("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]
    per_layer = sum(torch.Size(s).numel() for _, s in layer) * dtype_bytes
    fixed = 2 * v * h * dtype_bytes
    n = max(1, int((gb * 2**30 - fixed) // per_layer))
    out = [("model.embed_tokens.weight", (v, h))]
    for k in range(n):
        out += [(f"model.layers.{k}.{name}", s) for name, s in layer]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def make_hf(dst: Path, gb: float, dtype: torch.dtype, hidden: int = 4096) -> None:
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    shapes = llama_shapes(gb, torch.empty((), dtype=dtype).element_size(), hidden)
    weight_map, part, size, idx = {}, {}, 0, 0

    def flush():
        nonlocal part, size, idx
        if part:
            name = f"model-{idx:05d}.safetensors"
            save_file(part, dst / name, metadata={"format": "pt"})
            weight_map.update({k: name for k in part})
            part, size, idx = {}, 0, idx + 1

    for name, shape in shapes:
        part[name] = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
        size += part[name].nbytes
        if size > 500 * 2**20:
            flush()
    flush()
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _llama_config(dst, hidden, sum(1 for n, _ in shapes if n.endswith("input_layernorm.weight")), dtype)


def _llama_config(dst: Path, hidden: int, layers: int, dtype: torch.dtype) -> None:
    """The config (and a tokenizer) of llama_shapes' model: what an export needs to load with
    from_pretrained (without one, ``ckpt export`` stops and asks for ``--base``)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11008 // 4096,
                num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128,
                tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                dtype=str(dtype).removeprefix("torch.")).save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(HERE.parent / "fixtures" / "llama_hf" / name, dst / name)


def make_sharded_with_adam(dst: Path, gb: float, world: int) -> None:
    """A verl-style fp32 checkpoint (model + AdamW exp_avg/exp_avg_sq + step) at ``world`` ranks,
    built from a synthetic HF model through ckpt's own sharded writer (one third model)."""
    import ckpt_tools
    from ckpt_tools.core.describe import TensorInfo
    from ckpt_tools.formats import describe

    tmp = dst.parent / "hf_src"
    make_hf(tmp, gb / 3, torch.float32, hidden=2048)  # 1B-shaped, so 2 GiB holds several layers
    ckpt = describe(tmp)
    tensors = list(ckpt.tensors)
    # the optimizer moments reuse the weights' bytes: same shapes and sizes as real ones
    for t in ckpt.tensors:
        for state in ("exp_avg", "exp_avg_sq"):
            tensors.append(TensorInfo("optimizer", f"state.{t.name}.{state}", t.shape, t.dtype, t.chunks, t.name, state))
    from dataclasses import replace

    ckpt = replace(ckpt, tensors=tuple(tensors), param_order=tuple(t.name for t in ckpt.tensors))
    ckpt_tools.convert(tmp, dst, to="sharded", world_size=world, progress=False, _ckpt=ckpt)
    shutil.rmtree(tmp)


class Peak:
    """Samples a process's RSS and anonymous RSS from /proc until it ends."""

    def __init__(self, pid: int):
        self.pid, self.rss, self.anon = pid, 0, 0
        self._t = threading.Thread(target=self._run, daemon=True)
        self._stop = False
        self._t.start()

    def _run(self):
        while not self._stop:
            try:
                text = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return
            for line in text.splitlines():
                if line.startswith("VmRSS:"):
                    self.rss = max(self.rss, int(line.split()[1]) * 1024)
                elif line.startswith("RssAnon:"):
                    self.anon = max(self.anon, int(line.split()[1]) * 1024)
            time.sleep(0.02)

    def stop(self):
        self._stop = True
        self._t.join()


REPEAT = 5


def timed_rounds(tools: list[tuple[str, list[str], Path]], clean_after: bool = False,
                 bases: dict[str, str] | None = None) -> list[dict]:
    """Run every tool once per round, REPEAT rounds (removing its output before each run); report
    each tool's median run. Rounds, not one tool's runs back to back: a virtual disk's speed
    drifts over a minute, and every tool should meet the same drift.

    With ``bases`` (tool → the name of its baseline, another of ``tools``), each such tool runs
    right after a fresh run of its baseline, and its row also gets ``ratio``: the median over
    rounds of its time over that baseline's just before. A baseline then runs only paired, and
    its row is the median of all its runs. Pairs, because this disk's speed for the same copy
    drifts by 2x within a minute: a ratio of two runs seconds apart is what one can trust."""
    bases = bases or {}
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in tools}
    by_name = {name: (argv, out) for name, argv, out in tools}

    def once(name: str) -> dict:
        argv, out = by_name[name]
        r = _timed_once(name, argv, out)
        runs[name].append(r)
        if clean_after and out.exists():  # many outputs at once would push the sources out of the cache
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        return r

    paired = set(bases.values())
    for _ in range(REPEAT):
        for name, _, _ in tools:
            if name in bases:
                base = once(bases[name])
                run = once(name)
                run["ratio"] = run["seconds"] / max(base["seconds"], 1e-9)
            elif name not in paired:
                once(name)
    rows = []
    for name, _, _ in tools:
        ordered = sorted(runs[name], key=lambda r: r["seconds"])
        row = dict(ordered[len(ordered) // 2])
        row["all_seconds"] = [r["seconds"] for r in runs[name]]
        if name in bases:
            ratios = sorted(r["ratio"] for r in runs[name])
            row["ratio"], row["all_ratios"] = ratios[len(ratios) // 2], [round(x, 2) for x in ratios]
        rows.append(row)
    return rows


def _timed_once(name: str, argv: list[str], out: Path) -> dict:
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    subprocess.run(["sync"], check=False)
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = Peak(p.pid)
    _, err = p.communicate()
    subprocess.run(["sync"], check=False)
    dt = time.perf_counter() - t0
    peak.stop()
    if p.returncode:
        print(f"{name} failed: {err.decode()[-2000:]}", file=sys.stderr)
    return {"tool": name, "seconds": round(dt, 2), "peak_rss": peak.rss, "peak_anon": peak.anon, "ok": p.returncode == 0}


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def table(rows: list[dict], base: float) -> str:
    lines = ["| tool | time (s) | × cp | peak RSS (MiB) | peak anon (MiB) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tool']} | {r['seconds']:.2f} | {r['seconds'] / base:.2f} | "
                     f"{r['peak_rss'] / 2**20:.0f} | {r['peak_anon'] / 2**20:.0f} |" + ("" if r["ok"] else " FAILED"))
    return "\n".join(lines)


def bench_export(work: Path, gb: float) -> list[dict]:
    hf, src = work / "hf", work / "dcp"
    make_hf(hf, gb, torch.bfloat16)
    import ckpt_tools

    ckpt_tools.convert(hf, src, to="dcp", world_size=4, progress=False)
    for f in hf.glob("*.safetensors"):  # its config and tokenizer stay: the export's --base
        f.unlink()
    print(f"source: {src} ({du(src) / 2**30:.2f} GiB DCP, 4 ranks, bf16)", file=sys.stderr)
    return timed_rounds([
        ("cp -r + sync", ["cp", "-r", str(src), str(work / "cp")], work / "cp"),
        ("ckpt export", [sys.executable, "-m", "ckpt_tools", "export", str(src), str(work / "ckpt"), "--base", str(hf),
                         "--quiet"], work / "ckpt"),
        ("accelerate merge_fsdp_weights", py(
            "from accelerate.utils import merge_fsdp_weights; import sys; "
            f"merge_fsdp_weights({str(src)!r}, {str(work / 'acc')!r}, safe_serialization=True)"), work / "acc"),
        ("torch dcp_to_torch_save", py(
            "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
            f"dcp_to_torch_save({str(src)!r}, {str(work / 'dcp.pt')!r})"), work / "dcp.pt"),
    ], clean_after=True)  # one output on disk at a time: a 12.5 GiB run fits a 64 GiB disk


def bench_reshard(work: Path, gb: float) -> list[dict]:
    src = work / "ws8"
    make_sharded_with_adam(src, gb, 8)
    print(f"source: {src} ({du(src) / 2**30:.2f} GiB, 8 ranks, fp32 model + AdamW)", file=sys.stderr)
    rows = timed_rounds([
        ("cp -r + sync", ["cp", "-r", str(src), str(work / "cp")], work / "cp"),
        ("ckpt reshard 8→4", [sys.executable, "-m", "ckpt_tools", "reshard", str(src), str(work / "ws4"),
                              "--to", "4", "--from", "8", "--quiet"], work / "ws4"),
        ("ckpt reshard 8→4 --workers 2", [sys.executable, "-m", "ckpt_tools", "reshard", str(src),
                                          str(work / "ws4w"), "--to", "4", "--workers", "2", "--quiet"], work / "ws4w"),
    ])
    same = sorted(p.name for p in (work / "ws4").iterdir()) == sorted(p.name for p in (work / "ws4w").iterdir()) and all(
        p.is_dir() or p.read_bytes() == (work / "ws4w" / p.name).read_bytes() for p in (work / "ws4").iterdir())
    print(f"--workers 2 output byte-identical to one process's: {same}", file=sys.stderr)
    return rows


def bench_paths(work: Path, gb: float) -> tuple[list[dict], dict[str, str]]:
    """Every path of issue 13's table in one run: each tool against ``cp -r`` (+ sync) of its own
    source, rounds interleaved; ``verify`` also against ``cat`` of the files to /dev/null."""
    import ckpt_tools

    hf, dcp, ws8 = work / "hf", work / "dcp", work / "ws8"
    make_hf(hf, gb, torch.bfloat16)
    ckpt_tools.convert(hf, dcp, to="dcp", world_size=4, progress=False)
    make_sharded_with_adam(ws8, gb * 1.36, 8)  # the 1.9 GiB beside its 1.4 GiB DCP
    for name, src in (("hf", hf), ("dcp", dcp), ("ws8", ws8)):
        print(f"source {name}: {src} ({du(src) / 2**30:.2f} GiB)", file=sys.stderr)
    ck = [sys.executable, "-m", "ckpt_tools"]
    naive = ("import glob, torch.distributed.checkpoint as dcp; from safetensors.torch import load_file; sd = {}; "
             f"[sd.update(load_file(f)) for f in sorted(glob.glob({str(hf)!r} + '/*.safetensors'))]; "
             f"dcp.save({{'model': sd}}, checkpoint_id={str(work / 'naive')!r}, no_dist=True)")
    files = sorted(str(f) for f in ws8.rglob("*") if f.is_file())
    tools = [
        ("cp -r hf", ["cp", "-r", str(hf), str(work / "cp_hf")], work / "cp_hf", None),
        ("cp -r dcp", ["cp", "-r", str(dcp), str(work / "cp_dcp")], work / "cp_dcp", None),
        ("cp -r ws8", ["cp", "-r", str(ws8), str(work / "cp_ws8")], work / "cp_ws8", None),
        ("cat ws8 > /dev/null", ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files], work / "none", None),
        ("`export` dcp → hf", [*ck, "export", str(dcp), str(work / "o1"), "--base", str(hf), "--quiet"], work / "o1",
         "cp -r dcp"),
        ("`export` dcp → hf `--dtype fp16`", [*ck, "export", str(dcp), str(work / "o2"), "--base", str(hf), "--dtype",
                                              "fp16", "--quiet"], work / "o2", "cp -r dcp"),
        ("`convert` dcp → torch", [*ck, "convert", str(dcp), str(work / "o3.pt"), "--to", "torch", "--quiet"],
         work / "o3.pt", "cp -r dcp"),
        ("torch `dcp_to_torch_save` (peer)", py(
            "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
            f"dcp_to_torch_save({str(dcp)!r}, {str(work / 'o4.pt')!r})"), work / "o4.pt", "cp -r dcp"),
        ("`convert` hf → dcp, 4 ranks", [*ck, "convert", str(hf), str(work / "o5"), "--to", "dcp", "--world-size", "4",
                                         "--quiet"], work / "o5", "cp -r hf"),
        ("`load_file` + `dcp.save`, the naive script (peer)", py(naive), work / "naive", "cp -r hf"),
        ("`convert` dcp → sharded, 4 ranks", [*ck, "convert", str(dcp), str(work / "o6"), "--to", "sharded",
                                              "--world-size", "4", "--quiet"], work / "o6", "cp -r dcp"),
        ("`reshard` sharded 8 → 4", [*ck, "reshard", str(ws8), str(work / "o7"), "--to", "4", "--quiet"],
         work / "o7", "cp -r ws8"),
        ("`convert` sharded 8 → dcp, 2 ranks", [*ck, "convert", str(ws8), str(work / "o8"), "--to", "dcp",
                                                "--world-size", "2", "--quiet"], work / "o8", "cp -r ws8"),
        ("`verify` of the 8-rank checkpoint alone", [*ck, "verify", str(ws8), "--quiet"], work / "none",
         "cat ws8 > /dev/null"),
    ]
    bases = {name: base for name, _, _, base in tools if base}
    rows = timed_rounds([(name, argv, out) for name, argv, out, _ in tools], clean_after=True, bases=bases)
    return rows, bases


def make_verl_actor(dst: Path, gb: float, world: int) -> None:
    """A verl FSDP2 actor directory as ``FSDPCheckpointManager`` saves it (model files only:
    what the merger reads): fp32 ``model_world_size_{W}_rank_{r}.pt`` (DTensor ``Shard(0)``),
    ``fsdp_config.json`` and ``huggingface/`` (config of the Llama shape, a tokenizer)."""
    import ckpt_tools
    from transformers import LlamaConfig

    tmp = dst.parent / "hf_verl_src"
    make_hf(tmp, gb, torch.float32, hidden=2048)
    ckpt_tools.convert(tmp, dst, to="sharded", world_size=world, progress=False)
    _name_mesh(dst, world)
    layers = 1 + max(int(n.split(".")[2]) for n in json.loads((tmp / "model.safetensors.index.json").read_text())["weight_map"]
                     if n.startswith("model.layers."))
    shutil.rmtree(tmp)
    hf = dst / "huggingface"
    LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=2048 * 11008 // 4096, num_hidden_layers=layers,
                num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False,
                architectures=["LlamaForCausalLM"], dtype="float32").save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer: the merger saves one
        shutil.copy(HERE.parent / "fixtures" / "llama_hf" / name, hf / name)


def _name_mesh(dst: Path, world: int) -> None:
    """Name the rank files' device mesh ``("fsdp",)``, as verl's FSDP2 workers build it
    (``init_device_mesh(..., mesh_dim_names=["fsdp"])``): verl's merger asserts that name, and
    ckpt's sharded writer, building files from an HF source, leaves the mesh unnamed (as a
    plain ``fully_shard`` job's default mesh is)."""
    from ckpt_tools.security.safeload import load_torch

    for r in range(world):
        f = dst / f"model_world_size_{world}_rank_{r}.pt"
        sd = load_torch(f, mmap=False)  # weights_only, DTensor globals allowed; read whole: f is rewritten
        for t in sd.values():
            t.device_mesh._mesh_dim_names = ("fsdp",)
        torch.save(sd, f)


def same_tensors(a: Path, b: Path) -> tuple[bool, str]:
    """Whether two HF directories hold the same names with bit-equal tensors (read as safetensors)."""
    from safetensors import safe_open

    def tensors(d: Path) -> dict[str, Path]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                out.update({k: f for k in h.keys()})
        return out

    ta, tb = tensors(a), tensors(b)
    if set(ta) != set(tb):
        return False, f"names differ: {sorted(set(ta) ^ set(tb))[:5]}"
    for name in ta:
        with safe_open(ta[name], "pt") as ha, safe_open(tb[name], "pt") as hb:
            x, y = ha.get_tensor(name), hb.get_tensor(name)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            return False, f"{name} differs ({x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)})"
    return True, f"{len(ta)} tensors bit-equal"


def bench_verl(work: Path, gb: float) -> tuple[list[dict], dict[str, str]]:
    """ckpt export of a verl FSDP2 actor against verl's own merger (``python -m verl.model_merger
    merge --backend fsdp``, verl 0.9.1), on the same files, rounds interleaved. The merger writes
    bf16 (it casts every shard with ``.bfloat16()``), so ``ckpt export --dtype bf16`` is the
    like-for-like run; plain ``ckpt export`` keeps fp32 (bytes copied)."""
    src = work / "actor"
    make_verl_actor(src, gb, 8)
    print(f"source: {src} ({du(src) / 2**30:.2f} GiB, 8 ranks, fp32 FSDP2)", file=sys.stderr)
    # the architecture check asked every time (no remembered answer), and remembered (warmed once)
    asks = ["env", "CKPT_CACHE_DIR=", sys.executable, "-m", "ckpt_tools", "export", str(src)]
    kept = ["env", f"CKPT_CACHE_DIR={work / 'cache'}", sys.executable, "-m", "ckpt_tools", "export", str(src)]
    for extra in ([], ["--dtype", "bf16"]):
        subprocess.run([*kept, str(work / "warm"), "--quiet", "--overwrite", *extra], check=True)
    tools = [
        ("cp -r + sync", ["cp", "-r", str(src), str(work / "cp")], work / "cp"),
        ("ckpt export (fp32, as saved), check asked", [*asks, str(work / "ckpt32"), "--quiet"], work / "ckpt32"),
        ("ckpt export (fp32, as saved), check remembered", [*kept, str(work / "k32"), "--quiet"], work / "k32"),
        ("ckpt export --dtype bf16, check asked", [*asks, str(work / "ckpt16"), "--dtype", "bf16", "--quiet"],
         work / "ckpt16"),
        ("ckpt export --dtype bf16, check remembered", [*kept, str(work / "k16"), "--dtype", "bf16", "--quiet"],
         work / "k16"),
        ("verl.model_merger merge (bf16)", [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                                            "--local_dir", str(src), "--target_dir", str(work / "verl")], work / "verl"),
    ]
    rows = timed_rounds(tools)
    checks = {"ckpt --dtype bf16 vs verl merger": same_tensors(work / "ckpt16", work / "verl"),
              "ckpt bf16 remembered vs asked": same_tensors(work / "k16", work / "ckpt16"),
              "ckpt fp32 vs ckpt bf16, cast by torch": _cast_equal(work / "ckpt32", work / "ckpt16")}
    return rows, {k: f"{'equal' if ok else 'DIFFERENT'}: {why}" for k, (ok, why) in checks.items()}


def _cast_equal(fp32: Path, bf16: Path) -> tuple[bool, str]:
    """The fp32 export cast by torch equals the bf16 export (the cast is the only difference)."""
    from safetensors.torch import load_file

    a = {k: v for f in sorted(fp32.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted(bf16.glob("*.safetensors")) for k, v in load_file(f).items()}
    bad = [k for k in a if k not in b or not torch.equal(a[k].bfloat16(), b[k])]
    return (not bad and set(a) == set(b)), (f"{len(a)} tensors" if not bad else f"{bad[:3]} differ")


def paths_table(rows: list[dict], bases: dict[str, str]) -> str:
    lines = ["| path | time (s) | × its baseline (median of pairs; range) | peak anon MiB |", "|---|---|---|---|"]
    for r in rows:
        base = bases.get(r["tool"])
        ratio = (f"{r['ratio']:.2f} × {base.split()[0]} ({min(r['all_ratios']):.2f}-{max(r['all_ratios']):.2f})"
                 if base else "baseline")
        lines.append(f"| {r['tool']} | {r['seconds']:.2f} | {ratio} | {r['peak_anon'] / 2**20:.0f} |"
                     + ("" if r["ok"] else " FAILED"))
    return "\n".join(lines)


def compile_package() -> None:
    """Compile ckpt_tools' modules to bytecode first, as ``pip install`` does: from a source
    checkout run with PYTHONDONTWRITEBYTECODE, every run would otherwise compile the package
    again (about 80 ms of each ckpt run, which no installed copy pays)."""
    import compileall

    import ckpt_tools

    compileall.compile_dir(str(Path(ckpt_tools.__file__).parent), quiet=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["export", "reshard", "paths", "verl"])
    ap.add_argument("--gb", type=float, default=None, help="source size in GiB (export 1.5, reshard 2.0)")
    ap.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir, removed)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds (each tool once per round); medians are reported")
    args = ap.parse_args()
    global REPEAT
    REPEAT = max(1, args.repeat)
    work = Path(args.out or tempfile.mkdtemp(prefix="ckpt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    compile_package()
    try:
        gb = args.gb or {"export": 1.5, "reshard": 2.0, "paths": 1.4, "verl": 1.2}[args.which]
        if args.which == "verl":
            load = os.getloadavg()
            rows, checks = bench_verl(work, gb)
            print(f"\nverl, {gb} GiB fp32 8 ranks, {os.cpu_count()} cores, torch {torch.__version__}, median of "
                  f"{REPEAT} interleaved rounds; load average before {load[0]:.1f}, after {os.getloadavg()[0]:.1f}\n")
            print(table(rows, rows[0]["seconds"]))
            for k, v in checks.items():
                print(f"{k}: {v}")
            print(json.dumps(rows))
            return
        if args.which == "paths":
            rows, bases = bench_paths(work, gb)
            print(f"\npaths, {gb} GiB bf16 DCP / {gb * 1.36:.2f} GiB fp32+AdamW 8 ranks, {os.cpu_count()} cores, "
                  f"torch {torch.__version__}, {REPEAT} rounds; each path right after its baseline\n")
            print(paths_table(rows, bases))
            print(json.dumps(rows))
            return
        rows = bench_export(work, gb) if args.which == "export" else bench_reshard(work, gb)
        print(f"\n{args.which}, {gb} GiB, {os.cpu_count()} cores, torch {torch.__version__}, "
              f"median of {REPEAT} runs\n")
        print(table(rows, rows[0]["seconds"]))
        print(json.dumps(rows))
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
