"""The Hugging Face half of ``export`` (and ``convert --to hf``): names checked against the
architecture, tied weights once, LoRA merged or written as a PEFT adapter, config and tokenizer
beside the weights. :func:`ckpt_tools.commands.convert.export` is the command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.describe import Checkpoint, TensorInfo
from dataclasses import replace

from ..core.dtypes import DType
from ..core.plan import FileJob, Piece, whole
from ..engine.execute import execute
from ..errors import BadInput, UsageError
from ..formats import hf
from ..hf import assets as hfassets
from ..naming import hfnames, quant
from .options import Options, note
from .report import summary


def write_hf(ckpt: Checkpoint, src: Path, dst: Path, keep: list[TensorInfo], opts: Options,
             left_out: list[str]) -> dict[str, Any]:
    """Write ``keep`` (the model tensors of ``ckpt``) as an HF directory (or one ``.safetensors``
    file) at ``dst``; the report says what was written."""
    report: dict[str, Any] = {"src": str(src), "dst": str(dst), "format": "hf", "world_size": None}
    cast = opts.cast
    assets = hfassets.find_assets(src, opts.base)
    config = hfassets.read_config(assets)
    single = dst.suffix == ".safetensors"
    quantized, config_out = lowp_plan(keep, config, src, opts)
    if quantized is not None and cast is not None:
        keep = [t for t in keep if t.name not in quantized.dropped]
    plan = hfnames.plan_export(ckpt, src, keep, cast=cast, config=config_out or config, lora=opts.lora,
                               lora_alpha=opts.lora_alpha, base=opts.base, arch_check=opts.arch_check,
                               quantized=quantized if cast is not None else None)
    pieces, adapter = plan.pieces, plan.adapter_config is not None
    if quantized is not None and cast is None and not adapter:
        # kept quantized: the architecture is asked about the weights the codes stand for
        view = [whole(quant.target(p.target.source, p.target.name, DType("bfloat16"), quantized))
                for p in pieces if p.target.source.name not in quantized.dropped]
        plan.check = lambda: hfnames.check(view, quant.without_quantization(config), src, opts.arch_check)
    if opts.quantize:
        pieces, config_out = quantize_pieces(pieces, config_out or config, opts.quantize, src)
    if opts.loadable and not single and not adapter:
        # after planning, whose refusals (an adapter-only LoRA save...) say more than this one
        require_config(config, assets, src, opts.base)
    if adapter and single:
        raise UsageError(f"{dst}: a PEFT adapter is a directory (adapter_model.safetensors + adapter_config.json)")
    writer = hf.Writer(single_file=single, max_shard_size=opts.max_shard_size)
    if adapter:
        jobs = [FileJob(hfnames.peft_lora.ADAPTER_WEIGHTS, tuple(pieces))]
    else:
        jobs = writer.plan(pieces) if not single else [FileJob(dst.name, tuple(pieces))]
    targets = [p.target for p in pieces]
    # a quantized export's dtype is its unquantized tensors' (float8 codes are not what it computes in)
    dtypes = {t.dtype for t in targets if t.dtype.is_floating_point and not t.dtype.startswith("float8")}
    written = cast or (max(dtypes, key=lambda d: sum(t.numel for t in targets if t.dtype == d)) if dtypes else None)

    notes: list[str] = []

    def after(tmp: Path) -> None:
        notes.extend(wait_for_check())  # a refusal here leaves nothing at DST
        if adapter:
            (tmp / hfnames.peft_lora.ADAPTER_CONFIG).write_text(json.dumps(plan.adapter_config, indent=2) + "\n")
            report["assets"] = [hfnames.peft_lora.ADAPTER_CONFIG]
        elif not single:
            report["assets"] = hfassets.copy_assets(assets, tmp, dtype=written,
                                                    architecture=hfnames.architecture(plan, config, opts.arch_check))
            if config_out is not None and (tmp / "config.json").is_file():
                hfassets.rewrite_config(tmp / "config.json", config_out)

    with hfnames.checked_in_background(plan) as wait_for_check:
        if opts.dry_run:  # the plan and the names' check, nothing written
            notes.extend(wait_for_check())
        else:
            execute(plan.ckpt, writer, jobs, dst, overwrite=opts.overwrite, progress=opts.progress,
                    desc=f"{plan.ckpt.format} → hf", fmt="hf", after=after)
    hfnames.say(notes, opts.progress)
    if left_out:
        note(f"note: the export holds the model only; left out {', '.join(left_out)} state")
    if assets is None and not single and not adapter:
        note("note: no config.json or tokenizer found (no huggingface/ folder); pass --base MODEL to add them")
    report.update(num_tensors=len(targets), total_bytes=sum(t.nbytes for t in targets), left_out=left_out,
                  dtype=str(written) if written else None,
                  lora="adapter" if adapter else ("merge" if any(p.add for p in pieces) else None))
    extra = ([hfnames.peft_lora.ADAPTER_CONFIG] if adapter else [] if single else hfassets.asset_names(assets))
    report.update(summary(dst, jobs, targets, dry_run=opts.dry_run, cast=written, extra_files=extra))
    if quantized is not None:
        report["quantization"] = "dequantized" if cast is not None else quantized.summary()
    if opts.quantize:
        report["quantization"] = opts.quantize
    return report


def lowp_plan(keep: list[TensorInfo], config: dict, src: Path,
              opts: Options) -> tuple[quant.Quantized | None, dict | None]:
    """The source's quantization (exit 3 when it cannot be dequantized exactly and ``--dtype``
    asks for it) and the config to write (None: the source's, unchanged): a dequantized
    export's has no ``quantization_config``."""
    if opts.cast is None and not opts.quantize:
        return (quant.find(keep, config, src) if quant.config_of(config) else None), None
    found = quant.find(keep, config, src)
    if opts.quantize and found is not None:
        raise UsageError(f"--quantize {opts.quantize}: {src} is already quantized ({found.method}); dequantize it "
                         "first (ckpt export SRC TMP --dtype bf16), then quantize that")
    return found, (quant.without_quantization(config) if found is not None else None)


def quantize_pieces(pieces: list[Piece], config: dict, scheme: str, src: Path) -> tuple[list[Piece], dict]:
    """``export --quantize``: each linear weight becomes FP8 codes + scale (embeddings, head,
    norms and routers stay as they are); the config gains the scheme's ``quantization_config``."""
    out = []
    names = [p.target.name for p in pieces]
    for p in pieces:
        t = p.target
        if p.add is None and t.computed is None and quant.quantizable(replace(t.source, name=t.name)):
            out.extend(whole(q) for q in quant.quantize_targets(t, scheme))
        else:
            out.append(p)
    if len(out) == len(pieces):
        raise BadInput(f"{src}: holds no linear weight to quantize (2-D *.weight other than embeddings, "
                       "lm_head, norms and routers)")
    kept = quant.unquantized_linears(names, {p.target.name: p.target.shape for p in pieces})
    return out, {**config, "quantization_config": quant.quantization_config(scheme, kept)}


def require_config(config: dict, assets: Path | None, src: Path, base: str | None) -> None:
    """``export`` promises a directory ``from_pretrained`` loads: weights without a config.json
    are not one, so they are refused (exit 3, before anything is written), naming ``--base``."""
    if config:
        return
    if base:
        raise BadInput(f"--base {base}: has no config.json, so the export would not load with from_pretrained; "
                       "pass --base with the model's Hugging Face directory or hub id (config.json, tokenizer). "
                       "Nothing was written")
    where = "neither beside them nor in a huggingface/ folder" if assets is None else f"{assets} has none"
    raise BadInput(f"{src}: no config.json to go with the weights ({where}), so the export would not load "
                   "with from_pretrained; pass --base MODEL (the model's Hugging Face directory or hub id) "
                   "to take config and tokenizer from, or write the weights alone with `ckpt convert "
                   "--to hf`. Nothing was written")
