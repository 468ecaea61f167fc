"""``ckpt``: each command parses its flags, calls one library function, prints the result."""

from __future__ import annotations

from . import entry  # first: from here a Ctrl-C while the program loads is one error line

import functools
import gc
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import click

import ckpt_tools
from ckpt_tools.errors import CkptError, UsageError, count, one_line
from ckpt_tools.security import bounded


def _fail(message: str, code: int) -> None:
    # one line, whatever the file names or foreign exception texts in it hold
    click.echo(f"error: {one_line(message)}", err=True)
    sys.exit(code)


def _interrupted() -> None:
    from ckpt_tools.storage.atomic import interrupted_message

    # cleanup already ran on the way out (staging removed); an import the interrupt cut in half
    # can make the interpreter's own shutdown end by SIGINT instead of exit 130
    click.echo(f"error: {one_line(interrupted_message())}", err=True)
    entry.exit_now(130)


def _wraps_interrupt(e: BaseException | None) -> bool:
    """Whether ``e`` was raised from a KeyboardInterrupt: Python 3.11 raises one that a Ctrl-C
    caused while a class was being made (in a descriptor's ``__set_name__``, as a module the
    command imports loads) as a RuntimeError from it."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__
    return False


def command(fn: Callable) -> Callable:
    """Common flags (--quiet, --debug) and the mapping of errors to CONTRACT.md's exit codes."""

    @click.option("--quiet", is_flag=True, help="No progress bars.")
    @click.option("--debug", is_flag=True, help="Show a traceback on error.")
    @functools.wraps(fn)
    def wrapper(*args: Any, quiet: bool, debug: bool, **kwargs: Any) -> Any:
        entry.ready()  # from here a Ctrl-C is a KeyboardInterrupt: staging is removed, then reported
        # A command keeps its description and plan (acyclic, millions of objects at scale) to the
        # end; the collector's full passes would walk them all again and again (a third of a
        # 256-rank plan's time). Young cycles are still collected, in passes 70x rarer.
        gc.set_threshold(50_000, 20, 100)
        try:
            return fn(*args, progress=not quiet, **kwargs)
        except CkptError as e:
            if debug:
                traceback.print_exc()
            _fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            _interrupted()
        except click.exceptions.Exit:
            raise
        except Exception as e:  # a bug: say so, point at --debug
            if _wraps_interrupt(e):
                _interrupted()
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


@main.command("inspect", short_help="Say what a checkpoint is and what it holds (headers only).")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@click.option("--tensors", is_flag=True, help="List every tensor (name, group, shape, dtype).")
@command
def inspect_cmd(path: str, as_json: bool, tensors: bool, progress: bool) -> None:
    """Say what the checkpoint at PATH is and what it holds (reads headers only)."""
    from ckpt_tools.commands.inspect import format_run, format_summary

    bounded.promote_after_pauses()  # a description, then nothing built but a summary

    info = ckpt_tools.inspect(path, tensors=tensors)
    emit_json(info) if as_json else click.echo(format_run(info) if "checkpoints" in info else format_summary(info))


@main.command("latest", short_help="Print the newest complete checkpoint of a run directory.")
@click.argument("run_dir", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Every checkpoint of the run, complete or not, as one JSON object.")
@click.option("--verify", is_flag=True, help="Also compare a ckpt manifest's checksums (sizes are always compared).")
@command
def latest_cmd(run_dir: str, as_json: bool, verify: bool, progress: bool) -> None:
    """Print the path of the newest complete checkpoint under RUN_DIR (exit 3, naming what each
    lacks, when none is), for --resume_from_checkpoint "$(ckpt latest RUN_DIR)". Reads headers
    and listings only."""
    from ckpt_tools.commands.latest import none_complete, run_listing

    info = run_listing(run_dir, verify=verify, until_complete=not as_json)
    if as_json:
        emit_json(info)
    for note in info["notes"]:
        click.echo(f"note: {note}", err=True)
    if info["latest"] is None:
        _fail(none_complete(info), 3)
    if not as_json:
        click.echo(info["latest"])

def _report(report: dict, progress: bool) -> None:
    from ckpt_tools.runtime import env

    if progress and env.rank() == 0:
        from ckpt_tools.commands.inspect import human_bytes

        n, size = report.get("num_tensors"), report.get("total_bytes")
        click.echo(f"wrote {report['dst']} ({report['format']}"
                   + (f", {count(report['world_size'], 'rank')}" if report.get("world_size") else "")
                   + (f", {n} tensors, {human_bytes(size)}" if n is not None else "") + ")", err=True)


def _plan_lines(report: dict) -> None:
    """A dry run's plan on stdout: where, what, and each file the plan names."""
    from ckpt_tools.commands.inspect import human_bytes

    n, size = report.get("num_tensors"), report.get("total_bytes")
    click.echo(f"would write {report['dst']} ({report['format']}"
               + (f", {report['world_size']} ranks" if report.get("world_size") else "")
               + (f", {n} tensors, {human_bytes(size)}" if n is not None else "")
               + (f", {report['dtype']}" if report.get("dtype") else "") + "); nothing written")
    for f in report.get("files", []):
        what = (f"  {f['tensors']} tensors" if f.get("tensors") is not None else "")
        what += f", {human_bytes(f['tensor_bytes'])}" if f.get("tensor_bytes") is not None else ""
        click.echo(f"  {f['path']}{what}")


def writes(fn: Callable) -> Callable:
    """``--json`` and ``--dry-run`` for a command that writes DST: the command returns its report
    (the dict the Python API returns), printed here as JSON, a plan, or one ``wrote`` line."""

    @click.option("--dry-run", is_flag=True, help="Plan only: say what would be written (files, tensors, bytes); "
                  "nothing is written, DST is not created.")
    @click.option("--json", "as_json", is_flag=True, help="Print what was written (with --dry-run: would be) as "
                  "one JSON object, for scripts.")
    @functools.wraps(fn)
    def wrapper(*args: Any, as_json: bool, dry_run: bool, progress: bool, **kwargs: Any) -> None:
        report = fn(*args, dry_run=dry_run, progress=progress and not dry_run, **kwargs)
        if as_json:
            from ckpt_tools.runtime import env

            if env.rank() == 0:
                emit_json(report)
        elif dry_run:
            _plan_lines(report)
        else:
            _report(report, progress)

    return wrapper


_SIZE = click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors shard (e.g. 2GB, 500MB).")
_DTYPE = click.option("--dtype", metavar="{bf16,fp16,fp32}",
                      help="Cast floating-point tensors (others keep theirs); bfloat16, float16, float32 too.")
_OVERWRITE = click.option("--overwrite", is_flag=True, help="Replace DST (the old one stays until the new one is complete).")
_NO_ARCH_CHECK = click.option("--no-arch-check", is_flag=True,
                              help="Write the HF names without checking them against the architecture of "
                                   "config.json (when transformers cannot build it); a warning says so.")
_RANK_LOCAL = click.option("--rank-local", type=click.Choice(["drop", "keep-first"]), default="drop", show_default=True,
                           help="Rank-local extra state (RNG, data-loader) when the world size changes: drop it, "
                                "or keep source rank r's value on new rank r.")


@main.command("convert", short_help="Convert a checkpoint to another format (--to).")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--to", "to", required=True, metavar="{hf,torch,dcp,sharded,deepspeed}",
              help="Output format (deepspeed: a DeepSpeed ZeRO save, from one, at --world-size; checked by the library).")
@click.option("--world-size", type=click.IntRange(min=1), help="Ranks of sharded/dcp output (default: the source's, else 1).")
@_DTYPE
@_SIZE
@click.option("--model-only", is_flag=True, help="Leave out optimizer and extra state.")
@click.option("--base", help="HF model dir or hub id to take config and tokenizer from (hf output).")
@click.option("--layout", help="Framework layout of the output: torchtitan (with --to dcp, from an HF source); "
              "verl (with --to sharded: the device mesh named ('fsdp',), as verl's loader and merger need).")
@click.option("--keys", metavar="OLD=NEW,...", help="With --to dcp: the top-level keys the loader expects, e.g. "
              "model=model,optimizer=optim (default: model, optimizer, as get_state_dict's dcp.save writes them).")
@_RANK_LOCAL
@_NO_ARCH_CHECK
@_OVERWRITE
@command
@writes
def convert_cmd(src, dst, to, world_size, dtype, max_shard_size, model_only, base, layout, keys, rank_local,
                no_arch_check, overwrite, progress, dry_run):
    """Convert SRC (any format) to DST in format --to."""
    return ckpt_tools.convert(src, dst, to=to, world_size=world_size, dtype=dtype, max_shard_size=max_shard_size,
                              model_only=model_only, base=base, overwrite=overwrite, progress=progress,
                              rank_local=rank_local, layout=layout, keys=_key_map(keys), arch_check=not no_arch_check,
                              dry_run=dry_run)


def _key_map(text: str | None) -> dict[str, str] | None:
    """``--keys model=model,optimizer=optim`` as a dict; a malformed one is a usage error."""
    if not text:
        return None
    pairs = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.count("=") == 1 for p in pairs):
        raise UsageError(f"--keys expects OLD=NEW pairs separated by commas (model=model,optimizer=optim), not {text!r}")
    return dict(tuple(s.strip() for s in p.split("=")) for p in pairs)


@main.command("export", short_help="Write a Hugging Face directory that from_pretrained loads.")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--base", help="HF model dir or hub id to take config and tokenizer from (and, for an "
              "adapter-only LoRA save with --lora merge, the base weights).")
@_DTYPE
@_SIZE
@click.option("--lora", type=click.Choice(["merge", "adapter"]), default="merge", show_default=True,
              help="PEFT LoRA: fold it into the base weights, or write a PEFT adapter directory.")
@click.option("--lora-alpha", type=float, help="LoRA alpha, when the checkpoint has no adapter_config.json / "
              "lora_train_meta.json.")
@click.option("--quantize", type=click.Choice(["fp8-block", "fp8-dynamic"]),
              help="Write the linear weights as FP8 for serving: fp8-block (DeepSeek/Qwen 128x128 blocks, "
              "*_scale_inv) or fp8-dynamic (compressed-tensors FP8_DYNAMIC, per-channel weight_scale).")
@_NO_ARCH_CHECK
@_OVERWRITE
@command
@writes
def export_cmd(src, dst, base, dtype, max_shard_size, lora, lora_alpha, quantize, no_arch_check, overwrite, progress,
               dry_run):
    """Export SRC as a Hugging Face directory (safetensors, config, tokenizer) at DST."""
    return ckpt_tools.export(src, dst, base=base, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite,
                             progress=progress, lora=lora, lora_alpha=lora_alpha, quantize=quantize,
                             arch_check=not no_arch_check, dry_run=dry_run)


@main.command("reshard", short_help="Reshard a training checkpoint to another number of ranks.")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--to", "to", required=True, type=click.IntRange(min=1), help="New world size M.")
@click.option("--from", "from_", type=click.IntRange(min=1), help="Expected source world size N (checked).")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes writing output files in parallel (same bytes as one).")
@_RANK_LOCAL
@_OVERWRITE
@command
@writes
def reshard_cmd(src, dst, to, from_, workers, rank_local, overwrite, progress, dry_run):
    """Reshard a sharded, DCP or DeepSpeed ZeRO checkpoint (model, optimizer, extra state) to --to ranks."""
    return ckpt_tools.reshard(src, dst, to=to, from_=from_, overwrite=overwrite, progress=progress,
                              rank_local=rank_local, workers=workers, dry_run=dry_run)


@main.command("shard", short_help="Lay a Hugging Face model out as an N-rank FSDP2 checkpoint.")
@click.argument("model")
@click.argument("dst", type=click.Path())
@click.option("--ranks", required=True, type=click.IntRange(min=1), help="Number of FSDP ranks N.")
@click.option("--format", "fmt", type=click.Choice(["dcp", "sharded"]), default="sharded", show_default=True,
              help="sharded: verl's per-rank model_/optim_world_size_N_rank_r.pt files, fsdp_config.json and "
                   "huggingface/; dcp: one torch.distributed.checkpoint directory of the job's state dict.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cpu: gloo; cuda: NCCL, one GPU per rank.")
@click.option("--mixed-precision", type=click.Choice(["bf16", "fp16"]), help="FSDP2 MixedPrecisionPolicy.")
@click.option("--cpu-offload", is_flag=True, help="FSDP2 CPUOffloadPolicy.")
@click.option("--with-optimizer", type=click.Choice(["adamw"]), help="Also write a fresh optimizer state.")
@click.option("--check", is_flag=True, help="Compare a forward pass with the unsharded model; report the largest difference.")
@_OVERWRITE
@command
@writes
def shard_cmd(model, dst, ranks, fmt, device, mixed_precision, cpu_offload, with_optimizer, check, overwrite,
              progress, dry_run):
    """Load Hugging Face MODEL, shard it with FSDP2 over --ranks ranks, save a checkpoint at DST."""
    from ckpt_tools.commands.shard import shard

    report = shard(model, dst, ranks=ranks, format=fmt, device=device, mixed_precision=mixed_precision,
                   cpu_offload=cpu_offload, with_optimizer=with_optimizer, overwrite=overwrite, check=check,
                   progress=progress, dry_run=dry_run)
    if check and report.get("max_abs_diff") is not None:
        click.echo(f"check: largest difference from the unsharded model {report['max_abs_diff']:.3g}", err=True)
    return report


@main.command("verify", short_help="Check a checkpoint, or compare two bit for bit.")
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path(), required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@click.option("--atol", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Absolute tolerance: values compared in float64, dtypes may then differ.")
@click.option("--rtol", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Relative tolerance (|a - b| <= atol + rtol * |b|).")
@click.option("--nan-check", is_flag=True, help="Also flag tensors holding NaN or Inf.")
@command
def verify_cmd(a, b, as_json, atol, rtol, nan_check, progress):
    """Check checkpoint A (manifest checksums, shard coverage, every tensor readable), or
    compare A with B (any formats and world sizes) bit for bit, or within --atol/--rtol.
    Exits 1 when anything differs or a file is damaged (truncated, corrupt, missing); 3 when
    A or B is no checkpoint, holds unsafe content or was written by a newer torch."""
    from ckpt_tools.commands.verify import format_report, verify

    report = verify(a, b, atol=atol, rtol=rtol, nan_check=nan_check, progress=progress)
    emit_json(report) if as_json else click.echo(format_report(report))
    if not report["ok"]:
        sys.exit(1)


@main.command("clean", short_help="Remove what interrupted runs left beside DST.")
@click.argument("dst", type=click.Path())
@command
def clean_cmd(dst, progress):
    """Remove what interrupted runs writing DST left beside it (hidden .DST.ckpt-tmp-* staging);
    staging a live run is writing is kept."""
    from ckpt_tools.storage.atomic import clean_staging

    result = clean_staging(dst)
    for p in result["removed"]:
        click.echo(f"removed {p}")
    for p in result["in_use"]:
        click.echo(f"kept {p} (a running ckpt is writing it)")
    if not result["removed"] and not result["in_use"]:
        click.echo(f"nothing to clean beside {dst}")


@main.command("estimate", short_help="Memory per GPU to train a model with DDP and with FSDP.")
@click.argument("model")
@click.option("--ranks", required=True, type=click.IntRange(min=1), help="Number of GPUs.")
@click.option("--mixed-precision", type=click.Choice(["bf16", "fp16"]),
              help="FSDP2 MixedPrecisionPolicy param dtype: DDP adds a 2 B/param copy; FSDP gathers its unit in it.")
@click.option("--cpu-offload", is_flag=True, help="FSDP2 CPUOffloadPolicy: FSDP's sharded state in CPU memory; "
              "the GPU holds the gathered unit.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@command
def estimate_cmd(model, ranks, mixed_precision, cpu_offload, as_json, progress):
    """Memory per GPU for training MODEL on --ranks GPUs with DDP and with FSDP: parameters,
    gradients and AdamW state (fp32 master copy; activations not counted). One rule for FSDP,
    with or without --mixed-precision and --cpu-offload: its GPU figure includes the largest
    FSDP unit gathered unsharded, in fp32 or in the --mixed-precision dtype."""
    est = ckpt_tools.estimate(model, ranks=ranks, mixed_precision=mixed_precision, cpu_offload=cpu_offload)
    emit_json(est.to_json()) if as_json else click.echo(est.table())


def run() -> None:
    """The console script ``ckpt`` and ``python -m ckpt_tools``."""
    from ckpt_tools.runtime.lifeline import tie_to_launcher

    tie_to_launcher()  # under torchrun: end with the launcher, even if it dies while we start up
    try:
        main(prog_name="ckpt")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            click.echo(str(e.code), err=True)
    # Everything is written and committed: end now, without the interpreter's teardown of
    # torch and transformers (seconds after the last line, for nothing).
    entry.exit_now(code)


if __name__ == "__main__":
    run()
