"""What the commands print: bars only on a terminal (labelled with the real source format),
whole command summaries in ``ckpt --help``, help for every option, and ``shard`` saying what it
does at each stage and ending when its work ends. The CLI runs as ``python -m ckpt_tools``."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from click.testing import CliRunner

from ckpt_tools.cli.main import main

REPO = Path(__file__).resolve().parents[1]


def _ckpt(*args: str, stderr_tty: bool = False) -> tuple[int, str]:
    """Run ``python -m ckpt_tools ARGS``; its stderr on a pipe, or on a pseudo-terminal."""
    cmd = [sys.executable, "-m", "ckpt_tools", *args]
    if not stderr_tty:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=300)
        return proc.returncode, proc.stderr.decode(errors="replace")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's other side closed
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=60), out.decode(errors="replace")


def test_no_bar_in_a_pipe_or_log(tmp_path):
    rc, err = _ckpt("export", "fixtures/llama_sharded_ws8", str(tmp_path / "hf"))
    assert rc == 0, err
    assert "\r" not in err and "\x1b[" not in err, repr(err)
    assert f"wrote {tmp_path / 'hf'}" in err


def test_bar_on_a_terminal_names_the_source_format(tmp_path):
    rc, err = _ckpt("export", "fixtures/llama_sharded_ws8", str(tmp_path / "hf"), stderr_tty=True)
    assert rc == 0, err
    assert "sharded → hf" in err, repr(err)
    assert "hf → hf" not in err


def test_help_gives_whole_command_summaries():
    result = CliRunner().invoke(main, ["--help"], terminal_width=80)
    assert result.exit_code == 0
    commands = result.output.split("Commands:")[1].strip().splitlines()
    assert len(commands) == 9, commands
    for line in commands:
        assert line.rstrip().endswith(".") and "..." not in line, line


def test_every_option_has_help():
    for name, command in main.commands.items():
        for param in command.params:
            if param.param_type_name == "option" and param.name not in ("help",):
                assert param.help, f"ckpt {name} {param.opts[0]} has no help text"


def test_estimate_states_its_one_rule():
    result = CliRunner().invoke(main, ["estimate", "--help"], terminal_width=100)
    text = " ".join(result.output.split())
    assert "with or without --mixed-precision and --cpu-offload" in text
    assert "largest FSDP unit gathered unsharded" in text


def test_shard_says_each_stage_and_ends_with_the_work(tmp_path):
    dst = tmp_path / "out"
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", "shard", "fixtures/llama_hf", str(dst),
                             "--ranks", "2"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[tuple[float, str]] = []
    for raw in proc.stderr:
        lines.append((time.monotonic() - start, raw.decode(errors="replace").rstrip("\n")))
    rc = proc.wait(timeout=300)
    ended = time.monotonic() - start
    text = "\n".join(f"{t:6.2f} {line}" for t, line in lines)
    assert rc == 0, text
    stages = ["loading fixtures/llama_hf", "starting 2 ranks", "sharding: 2 ranks up", "writing the sharded checkpoint",
              f"wrote {dst} (sharded, 2 ranks, 21 tensors, 48.9 KiB)"]
    at = []
    for stage in stages:
        found = [t for t, line in lines if line.startswith(stage)]
        assert len(found) == 1, f"{stage!r} not said once:\n{text}"
        at.append(found[0])
    assert at == sorted(at), text
    assert lines[0][1].startswith("loading") and lines[0][0] < 5, text  # said at once, before torch loads
    # the ranks end with their work (no interpreter teardown of torch first), and so does the command
    assert at[-1] - at[-2] < 2.5, text
    assert ended - at[-1] < 1.0, text
