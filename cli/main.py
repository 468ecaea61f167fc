"""``ckpt``: each command parses its flags, calls one library function, prints the result."""

from __future__ import annotations

import functools
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import click

import ckpt_tools
from ckpt_tools.errors import CkptError


def _fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def command(fn: Callable) -> Callable:
    """Common flags (--quiet, --debug) and the mapping of errors to CONTRACT.md's exit codes."""

    @click.option("--quiet", is_flag=True, help="No progress bars.")
    @click.option("--debug", is_flag=True, help="Show a traceback on error.")
    @functools.wraps(fn)
    def wrapper(*args: Any, quiet: bool, debug: bool, **kwargs: Any) -> Any:
        try:
            return fn(*args, progress=not quiet, **kwargs)
        except CkptError as e:
            if debug:
                traceback.print_exc()
            _fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted; the destination was left as it was", 130)
        except click.exceptions.Exit:
            raise
        except Exception as e:  # a bug: say so, point at --debug
            if debug:
                traceback.print_exc()
            _fail(f"internal error: {type(e).__name__}: {e} (re-run with --debug for the traceback, and report it)", 5)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(ckpt_tools.__version__, prog_name="ckpt")
def main() -> None:
    """Inspect, convert, export, reshard, shard and verify PyTorch (FSDP) checkpoints."""


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


@main.command("inspect")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@click.option("--tensors", is_flag=True, help="List every tensor (name, group, shape, dtype).")
@command
def inspect_cmd(path: str, as_json: bool, tensors: bool, progress: bool) -> None:
    """Say what the checkpoint at PATH is and what it holds (reads headers only)."""
    from ckpt_tools.inspect import format_summary

    info = ckpt_tools.inspect(path, tensors=tensors)
    emit_json(info) if as_json else click.echo(format_summary(info))


if __name__ == "__main__":
    main()
