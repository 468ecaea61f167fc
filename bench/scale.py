"""How ckpt's cost grows with ranks and tensors (the same bytes): time and peak RSS of inspect,
reshard (to 3/4 of the ranks), export and convert, beside ``cp -r`` and torch's
``dcp_to_torch_save``. Sources are made by torch's own writers (tests/fw_scale.py), never ckpt.

    python bench/scale.py --ranks 8 64 256 1024 --tensors 300 3000 30000 --out docs/scale-run.md

Two sweeps of the same 80 MB: ranks at the fewest tensors, tensors at the fewest ranks, and
one point more (``--tile 32``, 0 for none) of the same bytes as an MoE's per-expert layout
holds them: 19,521 matrices of 32 x 32, in the table and not the plot; and one of the training
state (``--moments 256``: the model and its AdamW moments at 256 ranks, resharded by one
process and by two), also in the table only. Writes
a markdown table to ``--out``, its rows as JSON beside it, and, when matplotlib is importable
(``pip install .[bench]``), a PNG; ``--plot RUN.json`` draws the PNG of an earlier run.
Each run is a fresh process (``ckpt ...``); peak RSS is the child's (GNU time's %M). A case
under 2 s, and every case of the training state, is run three times and its median run reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

SPLIT = {300: 1, 3000: 11, 30000: 112}  # matrices cut into row blocks: ~291, ~2.2k, ~25k tensors


def timed(cmd: list[str], *, cwd: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one child process. The RSS comes from GNU time where
    installed: a forked child's ``ru_maxrss`` starts at this process's size (the fixtures')."""
    gnu = shutil.which("time") or ("/usr/bin/time" if os.path.exists("/usr/bin/time") else None)
    report = cwd / ".rss"
    full = [gnu, "-f", "%M", "-o", str(report), *cmd] if gnu else cmd
    t = time.perf_counter()
    p = subprocess.Popen(full, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    secs = time.perf_counter() - t
    err = p.stderr.read().decode() if p.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {err[-800:]}")
    kb = int(report.read_text().split()[-1]) if gnu else usage.ru_maxrss
    return secs, kb / 1024


QUICK = 2.0  # a case under this many seconds is run three times: its median run is reported


def measured(cmd: list[str], cwd: Path, runs: int = 0) -> tuple[float, float]:
    """:func:`timed`, or where that was quick (or ``runs`` asks it), the median of three runs
    (``runs``: of so many; time and peak RSS of that run): a run of a fraction of a second is
    the one most disturbed by what ran before it (the first point's cases, right after its
    fixtures were written, ran up to 2x slower). What a run wrote is removed before the next."""
    before = set(cwd.iterdir())
    done = [timed(cmd, cwd=cwd)]
    for _ in range((runs or (3 if done[0][0] < QUICK else 1)) - 1):
        for made in set(cwd.iterdir()) - before:
            if made.is_dir():
                shutil.rmtree(made)
            else:
                made.unlink()
        done.append(timed(cmd, cwd=cwd))
    return sorted(done)[len(done) // 2]


PEERS = {"cp -r rank files": ":", "dcp_to_torch_save": "--"}  # the yardsticks, as plotted
TORCH_SAVE = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save;"
              "dcp_to_torch_save(sys.argv[1], sys.argv[2])")


def cases(ranks: int, tensors: int, work: Path) -> list[tuple[str, list[str]]]:
    ckpt = [sys.executable, "-m", "ckpt_tools"]
    v, d = work / "verl", work / "dcp"
    m = max(1, ranks * 3 // 4)
    return [
        ("cp -r rank files", ["cp", "-r", str(v), str(work / "cp")]),
        ("inspect rank files", [*ckpt, "inspect", str(v)]),
        ("inspect dcp", [*ckpt, "inspect", str(d)]),
        ("reshard rank files", [*ckpt, "reshard", str(v), str(work / "o1"), "--to", str(m), "--quiet"]),
        ("reshard dcp", [*ckpt, "reshard", str(d), str(work / "o2"), "--to", str(m), "--quiet"]),
        # (row blocks of a matrix are no Llama's names: --no-arch-check where the model is split)
        ("export rank files", [*ckpt, "export", str(v), str(work / "o3"), "--quiet",
                               *(["--no-arch-check"] if tensors > 300 else [])]),
        ("convert dcp -> hf", [*ckpt, "convert", str(d), str(work / "o6"), "--to", "hf", "--quiet"]),
        ("convert hf -> dcp", [*ckpt, "convert", str(work / "o3"), str(work / "o7"), "--to", "dcp",
                               "--quiet"]),  # (the export above is its source)
        ("convert dcp -> rank files", [*ckpt, "convert", str(d), str(work / "o8"), "--to", "sharded", "--quiet"]),
        ("convert dcp -> torch", [*ckpt, "convert", str(d), str(work / "o4.pt"), "--to", "torch", "--quiet"]),
        ("dcp_to_torch_save", [sys.executable, "-c", TORCH_SAVE, str(d), str(work / "o5.pt")]),
    ]


def moment_cases(ranks: int, work: Path) -> list[tuple[str, list[str]]]:
    """The training state (model and AdamW moments) resharded to 3/4 of the ranks, by one
    process and by two (``--workers 2``: this machine's two cores)."""
    ckpt = [sys.executable, "-m", "ckpt_tools"]
    v, d = work / "verl", work / "dcp"
    m = str(max(1, ranks * 3 // 4))
    return [
        ("cp -r rank files", ["cp", "-r", str(v), str(work / "cp")]),
        ("reshard rank files", [*ckpt, "reshard", str(v), str(work / "o1"), "--to", m, "--quiet"]),
        ("reshard rank files --workers 2", [*ckpt, "reshard", str(v), str(work / "o2"), "--to", m, "--workers", "2",
                                            "--quiet"]),
        ("reshard dcp", [*ckpt, "reshard", str(d), str(work / "o3"), "--to", m, "--quiet"]),
        ("reshard dcp --workers 2", [*ckpt, "reshard", str(d), str(work / "o4"), "--to", m, "--workers", "2",
                                     "--quiet"]),
    ]


def run_moments(ranks: int, root: Path) -> list[dict]:
    """One more point: ``ranks`` ranks of the model with its AdamW moments (rows ``layout:
    moments``), as issue 30 asks of a reshard (256 -> 192 in 5 s)."""
    import fw_scale

    work = root / f"w{ranks}_moments"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    fw_scale.make_verl(work / "verl", ranks, optim=True)
    fw_scale.make_dcp(work / "dcp", ranks, optim=True)
    os.sync()  # (the sources' writeback done before anything is timed: ckpt's own fsyncs wait on a busy disk)
    n = len(fw_scale.llama_shapes())
    rows = []
    for name, cmd in moment_cases(ranks, work):
        secs, mb = measured(cmd, work, runs=3)  # (the median of three: the first ran right after 2 GB of sources were written)
        rows.append({"case": name, "ranks": ranks, "tensors": n, "s": secs, "mb": mb, "layout": "moments"})
        print(f"{name:30s} ranks {ranks:5d} with moments: {secs:7.2f} s {mb:7.0f} MB", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return rows


def run(ranks: list[int], tensors: list[int], root: Path, tile: int = 0) -> list[dict]:
    """Two sweeps of the same bytes: ranks (at the first tensor count) and tensors (at the first
    rank count); each point's sources are made, measured and removed before the next. With
    ``tile``, one more point at the first rank count: every matrix in ``tile`` x ``tile`` blocks
    (an MoE's per-expert layout; rows ``layout: tiles``). The tensors sweep's row blocks do not
    divide evenly over the ranks (2 rows over 8): no rank file repeats another's shape."""
    import fw_scale  # torch's own writers (not needed to --plot)

    points = [(w, tensors[0], 0) for w in ranks] + [(ranks[0], t, 0) for t in tensors[1:]]
    points += [(ranks[0], 0, tile)] if tile else []
    rows = []
    for w, t, tiles in points:
        work = root / f"w{w}_t{t}_{tiles}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        shape = {"split": SPLIT.get(t, 1), "tile": tiles}
        fw_scale.make_verl(work / "verl", w, **shape)
        fw_scale.make_dcp(work / "dcp", w, **shape)
        os.sync()
        n = len(fw_scale.llama_shapes(**shape))
        if not rows:  # the architecture check's answer, cached per model (~/.cache/ckpt-tools) as after any first export
            timed([sys.executable, "-m", "ckpt_tools", "export", str(work / "verl"), str(work / "warm"), "--quiet"], cwd=work)
            shutil.rmtree(work / "warm")
        for name, cmd in cases(w, n, work):
            secs, mb = measured(cmd, work)
            rows.append({"case": name, "ranks": w, "tensors": n, "s": secs, "mb": mb, **({"layout": "tiles"} if tiles else {})})
            print(f"{name:24s} ranks {w:5d} tensors {n:6d}{' tiles' if tiles else ''}: {secs:7.2f} s {mb:7.0f} MB",
                  flush=True)
        shutil.rmtree(work, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| case | ranks | tensors | seconds | peak RSS MB |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        kind = f" ({r['layout']})" if r.get("layout") else ""
        out.append(f"| {r['case']} | {r['ranks']} | {r['tensors']}{kind} | {r['s']:.2f} | {r['mb']:.0f} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], png: Path) -> bool:
    """Seconds against ranks (one line per case, at the fewest tensors) and against tensors (at
    the fewest ranks), log-log, side by side. False without matplotlib (``pip install .[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in rows if not r.get("layout")]  # (the tiles and moments points: in the table only)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    few_t, few_w = min(r["tensors"] for r in rows), min(r["ranks"] for r in rows)
    for ax, (x, fixed, value) in zip(axes, (("ranks", "tensors", few_t), ("tensors", "ranks", few_w))):
        ours = [c for c in dict.fromkeys(r["case"] for r in rows) if c not in PEERS]
        for case in [*ours, *PEERS]:
            pts = sorted((r[x], r["s"]) for r in rows if r["case"] == case and r[fixed] == value)
            if len(pts) > 1:  # ckpt's cases in colours of their own, the yardsticks black, dashed
                style = {"color": "black", "linestyle": PEERS[case]} if case in PEERS else \
                    {"color": plt.cm.tab10(ours.index(case) % 10)}
                ax.plot(*zip(*pts), marker="o", label=case, **style)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"{x} ({fixed}: {value})")
        ax.set_ylabel("seconds")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("ckpt at scale: the same 80 MB in more ranks, or in more tensors")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    ap.add_argument("--tensors", type=int, nargs="+", default=[300, 3000, 30000])
    ap.add_argument("--tile", type=int, default=32, help="one more point: matrices in TILE x TILE blocks (0: none)")
    ap.add_argument("--out", type=Path, default=Path("docs/scale-run.md"))
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="only draw the PNG of an earlier run's JSON")
    ap.add_argument("--moments", type=int, default=256,
                    help="one more point: this many ranks with AdamW moments, resharded (0: none)")
    a = ap.parse_args()
    if a.plot is not None:
        rows = json.loads(a.plot.read_text())
        png = a.plot.with_suffix(".png")
        print(f"wrote {png}" if plot(rows, png) else "no matplotlib: pip install .[bench]")
        return
    sys.path.insert(0, str(HERE))
    from bench import compile_package

    compile_package()  # as pip install does: else a checkout under PYTHONDONTWRITEBYTECODE compiles every run
    load = os.getloadavg()[0]
    if a.work is not None:
        Path(a.work).mkdir(parents=True, exist_ok=True)  # (a fresh scratch place, named, not there yet)
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        rows = run(a.ranks, a.tensors, Path(tmp), a.tile)
        rows += run_moments(a.moments, Path(tmp)) if a.moments else []
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    a.out.write_text(f"# ckpt at scale (bench/scale.py)\n\nload average {load:.1f} at the start, "
                     f"{os.getloadavg()[0]:.1f} at the end\n\n" + table(rows))
    if plot(rows, a.out.with_suffix(".png")):
        print(f"wrote {a.out} and {a.out.with_suffix('.png')}")
    else:
        print(f"wrote {a.out} (no matplotlib: no plot)")


if __name__ == "__main__":
    main()
