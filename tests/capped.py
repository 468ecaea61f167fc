"""Run ``ckpt`` command lines under an address-space cap and a timeout, in one subprocess.

``run_batch(cases)`` starts ``python tests/capped.py``, which caps its own address space
(``RLIMIT_AS``), then runs each case's command line in-process (click's ``CliRunner``) under a
per-case alarm, and reports per case: exit code, stderr, wall time and how much its peak RSS
grew. One interpreter for many cases keeps the cost of importing torch to once; the cap and the
timeout still hold for every case, and a case that hangs where no alarm reaches it (inside C
code) fails the whole batch by the outer timeout, naming the case it was in.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

AS_CAP = 4 << 30  # 4 GiB of address space, as the issue asks
ROOT = Path(__file__).resolve().parents[1]


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout()


def _main(spec_path: str, out_path: str) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_CAP, AS_CAP))
    from click.testing import CliRunner

    from ckpt_tools.cli.main import main

    spec = json.loads(Path(spec_path).read_text())
    results = {}
    signal.signal(signal.SIGALRM, _on_alarm)
    progress = Path(out_path + ".running")
    for case_id, argv in spec["cases"]:
        progress.write_text(case_id)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.monotonic()
        signal.alarm(spec["timeout"])
        try:
            r = CliRunner().invoke(main, argv, catch_exceptions=True)
            code, out, err = r.exit_code, r.stdout, r.stderr
            if r.exception is not None and not isinstance(r.exception, SystemExit):
                err += f"\nescaped: {type(r.exception).__name__}: {r.exception}"
        except _Timeout:
            code, out, err = "timeout", "", ""
        finally:
            signal.alarm(0)
        results[case_id] = {"exit": code, "stdout": out[-2000:], "stderr": err, "seconds": round(time.monotonic() - start, 3),
                            "rss_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) // 1024}
    Path(out_path).write_text(json.dumps(results))
    progress.unlink()


def run_batch(cases: list[tuple[str, list[str]]], work: Path, *, per_case: int = 60,
              total: int = 600) -> dict[str, dict]:
    """Run ``cases`` ((id, argv) pairs) in one capped subprocess; ``{id: result}``."""
    spec, out = work / "capped-spec.json", work / "capped-out.json"
    spec.write_text(json.dumps({"cases": cases, "timeout": per_case}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    running = Path(str(out) + ".running")
    try:
        proc = subprocess.run([sys.executable, __file__, str(spec), str(out)], capture_output=True, text=True,
                              timeout=total, env=env, cwd=work)
    except subprocess.TimeoutExpired:
        case = running.read_text() if running.exists() else "?"
        raise AssertionError(f"case {case!r} hung where no alarm reaches (the runner passed {total} s)") from None
    if proc.returncode != 0 or not out.exists():
        case = running.read_text() if running.exists() else "?"
        raise AssertionError(f"the capped runner died in case {case!r} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
