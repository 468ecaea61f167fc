"""The tensors an HF export writes, under the names its architecture loads.

Order of work (pure planning, no tensor data except the tied-embedding comparison):
  1. names as the model's state dict spells them (wrapper prefixes removed, no two alike);
  2. a naming scheme maps them (:mod:`.lora`: merge the update, or split out a PEFT
     adapter; :mod:`.torchtitan`: torchtitan's names and rotary row order; :mod:`.megatron`:
     Megatron-Core's stacked layers, fused QKV and [gate; up] split into HF's weights;
     :mod:`.experts`: a Mixture-of-Experts model's experts as ``save_pretrained`` writes them);
  3. tied embeddings written once;
  4. :mod:`ckpt_tools.hf.archcheck`: ``from_pretrained`` of the config's architecture must find every name
     and shape it needs and nothing it does not. A mismatch is exit 3, before a byte is written.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..core.describe import Checkpoint, TensorInfo
from ..core.dtypes import DType
from ..core.plan import LowRank, Piece, Target, whole
from ..engine.reader import Reader
from ..engine.stream import materialize
from ..errors import BadInput
from ..formats import describe
from ..hf import archcheck, assets as hfassets
from ..hf.hub import resolve_model_dir
from ..runtime import env
from . import experts, lora as peft_lora, megatron, quant, torchtitan
from .wrappers import normalize_name



@dataclass
class ExportPlan:
    """What to write: whole pieces under their HF names; ``adapter_config`` for a PEFT adapter.

    ``check`` asks the architecture (it raises BadInput, or returns notes); it costs an import
    of transformers, so the caller may run it while the files are written, as long as it waits
    for it before the commit (:func:`checked_in_background`)."""

    ckpt: Checkpoint  # the source, plus --base's weights when an adapter-only save is merged
    pieces: list[Piece]
    adapter_config: dict[str, Any] | None = None
    check: Callable[[], list[str]] = lambda: []
    asks_transformers: bool = False  # whether ``check`` builds the architecture (imports torch)


def target(t: TensorInfo, name: str, cast: DType | None, q: quant.Quantized | None = None) -> Target:
    if q is not None and cast is not None:
        return quant.target(t, name, cast, q)
    dtype = cast if cast is not None and t.dtype.is_floating_point and t.state != "step" else t.dtype
    return Target(t, t.group, name, dtype, t.param, t.state)


def plan_export(ckpt: Checkpoint, src: Path, keep: list[TensorInfo], *, cast: DType | None, config: dict,
                lora: str | None = None, lora_alpha: float | None = None, base: str | None = None,
                quantized: quant.Quantized | None = None, arch_check: bool = True) -> ExportPlan:
    """Plan an HF export of ``keep`` (the model tensors of ``ckpt``); see the module docstring.

    ``lora``: ``"merge"`` (default) or ``"adapter"``. ``quantized``: the source's quantization,
    whose weights are dequantized to ``cast``. Raises BadInput (exit 3) for names the
    architecture would not load, LoRA without a known alpha, adapter-only weights without ``base``.
    ``arch_check=False`` (``--no-arch-check``): the names are written unchecked, with a warning.
    """
    asks = bool(config) and arch_check  # whether the check builds the architecture

    names: dict[str, TensorInfo] = {}
    for t in keep:
        n = normalize_name(t.name)
        if n in names:
            raise BadInput(f"{src}: two tensors become {n!r} once wrapper prefixes are removed")
        names[n] = t
    if megatron.detect(names):  # Megatron-Core's stacked, fused names: no LoRA, a map of their own
        if lora == "adapter":
            raise BadInput(f"{src}: a Megatron-Core save holds no PEFT LoRA weights to write as an adapter; "
                           "drop --lora adapter")
        pieces = megatron.to_hf_pieces(ckpt, names, config, src, cast)
        notes = megatron.check_args(ckpt, config, src)
        pieces = untie(ckpt, kept_in_float32(pieces, config, cast), config, src)
        return ExportPlan(ckpt, pieces, None, lambda: check(pieces, config, src, arch_check) + notes,
                          asks and not archcheck.known_good(config, _asked(pieces)))
    found = peft_lora.find(ckpt, alpha=lora_alpha) if any(".lora_" in n for n in names) else None
    if found is None and lora == "adapter":
        raise BadInput(f"{src}: holds no LoRA weights (lora_A/lora_B) to write as an adapter; drop --lora adapter")
    if found is not None and lora == "adapter":
        peft_lora.check_alpha(found, src)
        pieces = [whole(target(t, n, cast)) for n, t in peft_lora.adapter_names(found, names)]
        return ExportPlan(ckpt, pieces, peft_lora.adapter_config(found, base_model=base, config=config),
                          lambda: check_adapter(found, config, src, arch_check),
                          asks and not archcheck.known_good(config, _adapter_targets(found)))
    if found is not None:
        base_tensors = None
        if found.adapter_only and base:
            ckpt, base_tensors = _with_base_weights(ckpt, base)
        pieces = []
        for n, t, tgt in peft_lora.merge_plan(found, names, src, base_tensors):
            p = whole(target(t, n, cast, quantized))
            pieces.append(replace(p, add=LowRank(tgt.a, tgt.b, found.scale(tgt), tgt.embedding)) if tgt else p)
        merged = {p.target.name: p.target.source for p in pieces}
        if experts.hub_tensors(ckpt, merged, config, src) is not merged:
            raise BadInput(f"{src}: LoRA merged into a Mixture-of-Experts model whose experts save_pretrained "
                           "writes in another layout: not planned yet; export with --lora adapter")
    else:
        names = experts.hub_tensors(ckpt, names, config, src)  # MoE: the layout save_pretrained writes
        if torchtitan.detect(names):
            names = torchtitan.split_experts(ckpt, names, config, src)
        pieces = [whole(target(t, n, cast, quantized)) for n, t in names.items()]
    notes: list[str] = []
    if torchtitan.detect(p.target.name for p in pieces):
        notes = torchtitan.dropped_bias(ckpt, pieces, config, src, refuse=arch_check)
        pieces = torchtitan.to_hf_pieces(pieces, config, src)
    pieces = untie(ckpt, kept_in_float32(pieces, config, cast), config, src)
    return ExportPlan(ckpt, pieces, None, lambda: check(pieces, config, src, arch_check) + notes,
                      asks and not archcheck.known_good(config, _asked(pieces)))


def kept_in_float32(pieces: list[Piece], config: dict, cast: DType | None) -> list[Piece]:
    """``--dtype bf16|fp16``: the weights the architecture keeps in float32 at that dtype (its
    dtype plan, :func:`archcheck.kept_in_float32`: DeepSeek-V3's router weight and
    ``e_score_correction_bias``) are written in float32, as ``save_pretrained`` of the model
    loaded at that dtype writes them, instead of rounded to ``cast``. Unchanged when no class
    can be asked (the architecture check then says why)."""
    if cast is None or cast not in ("bfloat16", "float16") or not config:
        return pieces
    try:
        keep = archcheck.kept_in_float32(config, [p.target.name for p in pieces], str(cast))
    except archcheck.Unchecked:
        return pieces
    f32 = DType("float32")
    return [replace(p, target=replace(p.target, dtype=f32)) if p.target.name in keep and p.target.dtype == cast
            and p.target.computed is None else p for p in pieces]


def _with_base_weights(ckpt: Checkpoint, base: str) -> tuple[Checkpoint, dict[str, TensorInfo]]:
    """``ckpt`` extended with the safetensors weights of ``base`` (located by absolute file
    names, so one reader reads both), and those weights by name."""

    folder = resolve_model_dir(base, allow_patterns=["*.safetensors", "*.json"])
    try:
        other = describe(folder)
    except BadInput as e:
        raise BadInput(f"--base {base}: has no weights to merge the adapter into ({e})") from e
    if other.format != "hf":
        raise BadInput(f"--base {base}: is {other.format!r}; merging an adapter-only save needs HF safetensors weights")
    root = other.base_dir().resolve()
    moved = tuple(replace(t, chunks=tuple(c.replaced(location=replace(c.location, file=str(root / c.location.file)))
                                          for c in t.chunks)) for t in other.tensors)

    return replace(ckpt, tensors=ckpt.tensors + moved), {normalize_name(t.name): t for t in moved}


def untie(ckpt: Checkpoint, pieces: list[Piece], config: dict, src: Path) -> list[Piece]:
    """Tied embeddings: write the input embedding once (after checking the output copy
    equals it); untied: both must be there."""
    by_name = {p.target.name: p for p in pieces}
    head = by_name.get("lm_head.weight")
    embed = next((by_name[n] for n in by_name if n.endswith(("embed_tokens.weight", "wte.weight", "word_embeddings.weight"))), None)
    if not config or head is None and embed is None:
        return pieces
    if hfassets.tied(config):
        if embed is not None and embed.add is not None:
            raise BadInput(f"{src}: LoRA on {embed.target.name}, whose config ties lm_head.weight to it: one merged "
                           "weight cannot be both the trained embedding and the untouched head; export with --lora adapter")
        if head is not None and embed is not None:
            import torch

            with Reader(ckpt) as r:
                if not torch.equal(materialize(r, head), materialize(r, embed)):
                    raise BadInput(f"{src}: the config ties lm_head.weight to {embed.target.name}, but they differ; "
                                   "fix tie_word_embeddings in config.json (or pass --base) and re-run")
            return [p for p in pieces if p is not head]
        return pieces
    if head is None and (config.get("architectures") or [""])[0].endswith("ForCausalLM"):
        raise BadInput(f"{src}: the config does not tie embeddings, but there is no lm_head.weight; "
                       "the checkpoint is incomplete, or config.json should say tie_word_embeddings: true")
    return pieces


NO_CHECK = "--no-arch-check"


def unchecked(src: Path, what: str, why: archcheck.Unchecked) -> BadInput:
    """The check fails closed: it could not run, so nothing is written unless asked."""
    return BadInput(f"{src}: {what} cannot be checked against the architecture of config.json: {why}; "
                    f"nothing was written. Pass {NO_CHECK} to write them unchecked (from_pretrained may then "
                    "refuse them, or load them wrong)")


def skipped(what: str) -> str:
    return (f"warning: {what} were not checked against the architecture of config.json ({NO_CHECK}); "
            "from_pretrained may refuse them")


def check(pieces: list[Piece], config: dict, src: Path, arch_check: bool = True) -> list[str]:
    """Refuse names ``from_pretrained`` of the config's architecture would not load, or that
    cannot be checked; with ``arch_check=False``, a warning instead of the check. Without a
    config (``convert --to hf`` of weights alone) there is nothing to check against: a note."""
    if not config:
        return ["the names were not checked against an architecture (no config.json; pass --base MODEL)"]
    if not arch_check:
        return [skipped("the names")]
    try:
        report = archcheck.load_report(config, _as_loaded(_asked(pieces), config, src))
    except archcheck.Unchecked as e:
        raise unchecked(src, "the names", e) from e
    if not report.ok:
        what = ("config.json" if config.get("architectures") else
                f"config.json names no architectures; its model_type {config.get('model_type')!r} and these names")
        raise BadInput(f"{src}: {report.architecture} ({what}) would not load these weights: {report.describe()}; "
                       f"{archcheck.likely_fix(report)}")
    return []


def architecture(plan: ExportPlan, config: dict, arch_check: bool) -> str | None:
    """The class the checked names were checked against, for a config that names none (what
    ``save_pretrained`` of that class writes in ``architectures``); None otherwise, or unchecked.
    Called after the check, whose import of transformers it reuses."""
    if not config or config.get("architectures") or not arch_check or plan.adapter_config is not None:
        return None
    try:
        return archcheck.model_class(config, _asked(plan.pieces)).__name__
    except archcheck.Unchecked:
        return None


def _asked(pieces: list[Piece]) -> dict[str, tuple[tuple[int, ...], DType]]:
    return {p.target.name: (p.target.shape, p.target.dtype) for p in pieces}


def _as_loaded(asked: dict[str, tuple[tuple[int, ...], DType]], config: dict,
               src: Path) -> dict[str, tuple[tuple[int, ...], DType]]:
    """The names and shapes ``from_pretrained`` holds once its conversion registry has read the
    written ones (Mixture-of-Experts: per-expert hub tensors fused), which the model's own state
    dict is compared with."""
    loaded = experts.to_model(config, asked, src) if experts.is_moe(config, asked) else None
    if not loaded:
        return asked
    return {p.name: (p.shape, asked[p.same if p.same is not None else p.runs[0].source][1]) for p in loaded.values()}


def _adapter_targets(found: peft_lora.Lora) -> dict[str, tuple[tuple[int, ...], DType]]:
    return {f"{t.module}.weight": (t.weight_shape, t.a.dtype) for t in found.targets}


def check_adapter(found: peft_lora.Lora, config: dict, src: Path, arch_check: bool = True) -> list[str]:
    """Every LoRA target must be a weight of the base architecture with the shape ``B @ A`` has
    (the base weights themselves need not be in the checkpoint)."""
    if not config:
        return ["the adapter's targets were not checked against a base architecture (no config.json; pass --base)"]
    if not arch_check:
        return [skipped("the adapter's targets")]
    try:
        report = archcheck.load_report(config, _adapter_targets(found))
    except archcheck.Unchecked as e:
        raise unchecked(src, "the adapter's targets", e) from e
    if report.unexpected or report.mismatched:
        bad = archcheck.LoadReport(report.architecture, (), report.unexpected, report.mismatched)
        raise BadInput(f"{src}: the LoRA targets are not weights of {report.architecture} (config.json): "
                       f"{bad.describe()}; pass --base with the model the adapter was trained on")
    return []


@contextlib.contextmanager
def checked_in_background(plan: ExportPlan):
    """Run ``plan.check`` in a thread while the caller writes; the yielded ``wait()`` returns its
    notes or raises its BadInput, and must be called before the commit (so a refusal leaves
    nothing at DST). Importing transformers mostly holds the GIL, copying files mostly not."""
    if plan.asks_transformers:
        # torch first, here: the writer may import it too, and two threads importing the same
        # package tree at once can deadlock on the import locks
        import torch  # noqa: F401

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-archcheck") as pool:
        future = pool.submit(plan.check)
        yield future.result


def say(notes: list[str], progress: bool = True) -> None:
    """The export's notes (and ``warning:`` lines), printed even with ``--quiet`` (which hides progress only); once per
    torchrun launch. ``progress`` is not consulted."""
    if env.rank() != 0:
        return
    for n in notes:
        print(n if n.startswith("warning: ") else f"note: {n}", file=sys.stderr)
