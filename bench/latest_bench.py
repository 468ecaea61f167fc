"""How long ``ckpt latest`` takes over a real run of 20 checkpoints.

    python bench/latest_bench.py [--out DIR] [--ranks 2] [--saves 20]

Two real runs on CPU ranks (gloo), each saving after every one of ``--saves`` steps: a plain FSDP2
job (``fully_shard`` + ``dcp.save``: ``step_N/`` DCPs) and verl's ``FSDPCheckpointManager``
(``global_step_N/actor/`` rank files, ``latest_checkpointed_iteration.txt``), the jobs of
``tests/test_latest.py`` and ``tests/fw_verl.py`` (the tiny Llama of the tests). Then, for each run,
the median of 5 of: ``latest`` (checks from the newest down to the first complete one) and the
listing ``inspect RUN_DIR`` gives (every checkpoint checked), both in this process, and
``python -m ckpt_tools latest RUN`` as a user runs it (interpreter start and imports included).
Files are warm in the page cache.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "fixtures"), str(HERE.parent)]


def _median(fn, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--saves", type=int, default=20)
    a = ap.parse_args()
    import fw_verl
    from dist import run_ranks
    from test_latest import _fsdp2_job

    from ckpt_tools.commands.latest import run_listing

    base = a.out or Path(tempfile.mkdtemp(prefix="ckpt-latest-bench-"))
    saves = tuple(range(1, a.saves + 1))
    runs = {
        "fsdp2 dcp": base / "fsdp2",
        "verl rank files": base / "verl",
    }
    run_ranks(functools.partial(_fsdp2_job, saves=saves, load=None, steps=a.saves), a.ranks, base,
              str(runs["fsdp2 dcp"]))
    run_ranks(functools.partial(fw_verl.job, save_at=saves, load=None, steps=a.saves), a.ranks, base,
              str(runs["verl rank files"] / "global_step_{step}" / "actor"))
    for name, run in runs.items():
        info = run_listing(run)
        assert len(info["checkpoints"]) == a.saves and info["latest"], info
        newest = _median(lambda: run_listing(run, until_complete=True))
        listing = _median(lambda: run_listing(run))
        cli = _median(lambda: subprocess.run([sys.executable, "-m", "ckpt_tools", "latest", str(run)],
                                             check=True, capture_output=True))
        print(f"{name}: {a.saves} checkpoints x {a.ranks} ranks: latest {newest * 1000:.0f} ms, every checkpoint "
              f"checked (inspect RUN_DIR) {listing * 1000:.0f} ms, `ckpt latest` command {cli * 1000:.0f} ms "
              "(medians of 5)")

if __name__ == "__main__":
    main()
