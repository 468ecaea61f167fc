"""PEFT LoRA names: recognise them, fold them into the base weights, or write a PEFT adapter.

A PEFT model's state dict (what FSDP saves of it under verl, accelerate or plain ``fully_shard``)
spells its names ``base_model.model.<hf name>``; a LoRA-wrapped linear ``<m>`` holds
``<m>.base_layer.weight`` (the frozen base), ``<m>.lora_A.<adapter>.weight`` (r × in) and
``<m>.lora_B.<adapter>.weight`` (out × r). ``merge_and_unload`` gives ``<m>.weight`` =
``W + (B @ A) * alpha / r`` (``alpha / sqrt(r)`` with rsLoRA). A LoRA-wrapped embedding holds
``<m>.lora_embedding_A.<adapter>`` (r × num_embeddings) and ``<m>.lora_embedding_B.<adapter>``
(dim × r), and merges as ``W + (B @ A).T * scale`` (PEFT's ``Embedding.get_delta_weight``).
``modules_to_save`` copies (``<m>.modules_to_save.<adapter>.*``) replace their
``original_module`` when merged.

alpha is not in the tensors: it comes from ``adapter_config.json`` (PEFT) or
``lora_train_meta.json`` (verl) beside the checkpoint, or from ``--lora-alpha``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.describe import Checkpoint, TensorInfo
from ..errors import BadInput
from .wrappers import normalize_name

MODES = ("merge", "adapter")  # export --lora: fold into the base weights, or a PEFT adapter

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
VERL_META = "lora_train_meta.json"

# in memory (and so in FSDP saves) ``lora_A.<adapter>.weight``; in PEFT's saved form
# (``adapter_model.safetensors``, and what the Trainer saves of a PEFT model under FSDP) the
# adapter name is removed: ``lora_A.weight``
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_EMBEDDING = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?$")
SAVED_ADAPTER = "default"  # what PeftModel.from_pretrained names an adapter saved without its name
_BASE = re.compile(r"^(?P<module>.+)\.base_layer\.(?P<leaf>weight|bias)$")
_SAVED = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<rest>.+)$")
_ORIGINAL = re.compile(r"^(?P<module>.+)\.original_module\.(?P<rest>.+)$")
# what this module cannot fold in, and would otherwise write under names nothing loads
_UNSUPPORTED = (
    (re.compile(r"\.lora_magnitude_vector(\.|$)"), "DoRA (use_dora=True)"),
    (re.compile(r"\.lora_B(\.[^.]+)?\.bias$"), "LoRA bias (lora_bias=True)"),
)


@dataclass(frozen=True)
class Target:
    """One LoRA-wrapped module: ``module`` is its name under the base model."""

    module: str
    a: TensorInfo
    b: TensorInfo
    embedding: bool = False  # an nn.Embedding: the update is (B @ A).T

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def weight_shape(self) -> tuple[int, int]:
        """The shape of the base weight the update is added to."""
        out, inp = self.b.shape[0], self.a.shape[1]
        return (inp, out) if self.embedding else (out, inp)


@dataclass(frozen=True)
class Lora:
    """The LoRA found in a checkpoint."""

    adapter: str
    targets: tuple[Target, ...]
    adapter_only: bool
    alpha: float | None = None
    alpha_from: str | None = None
    config: dict[str, Any] = field(default_factory=dict, compare=False)  # adapter_config.json, if any

    @property
    def rank(self) -> int:
        return max(t.rank for t in self.targets)

    @property
    def target_modules(self) -> list[str]:
        return sorted({t.module.rsplit(".", 1)[-1] for t in self.targets})

    def scale(self, t: Target) -> float:
        if self.alpha is None:
            raise ValueError("alpha unknown")
        return self.alpha / (math.sqrt(t.rank) if self.config.get("use_rslora") else t.rank)

    def summary(self) -> dict[str, Any]:
        """``inspect --json``'s ``"lora"`` object."""
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": self.target_modules,
                "adapter_only": self.adapter_only, "adapter": self.adapter, "num_targets": len(self.targets),
                "alpha_from": self.alpha_from}


def base_name(name: str) -> str:
    """``name`` as the base model spells it (PEFT's wrapper prefix removed)."""
    return name.removeprefix(PEFT_PREFIX)


def find(ckpt: Checkpoint, *, alpha: float | None = None) -> Lora | None:
    """The LoRA in ``ckpt``'s model tensors, or None. ``alpha`` (``--lora-alpha``) wins over
    the side files. Raises BadInput for LoRA variants whose merge is not plain ``W + BA``."""
    model = [t for t in ckpt.tensors if t.group == "model"]
    names = {normalize_name(t.name): t for t in model}
    parts: dict[tuple[str, str], dict[str, TensorInfo]] = {}
    embeddings: set[str] = set()
    for name, t in names.items():
        m = _LORA.match(name) or _EMBEDDING.match(name)
        if m:
            key = (base_name(m["module"]), m["adapter"] or SAVED_ADAPTER)
            ab = parts.setdefault(key, {})
            if m["ab"] in ab:  # both spellings of one tensor, or a linear's and an embedding's
                raise BadInput(f"{ckpt.root}: {ab[m['ab']].name!r} and {t.name!r} are both {key[0]}'s "
                               f"lora_{m['ab']}; the checkpoint is not one PEFT model's")
            ab[m["ab"]] = t
            if m.re is _EMBEDDING:
                embeddings.add(key[0])
        elif ".lora_" in name:
            # every LoRA tensor must be one this module folds in: any other (DoRA's magnitude,
            # an embedding's A/B, lora_B's bias) would be dropped or written under a name
            # nothing loads
            kind = next((k for pattern, k in _UNSUPPORTED if pattern.search(name)), "a LoRA tensor ckpt does not know")
            raise BadInput(f"{ckpt.root}: {name!r} is {kind}, which ckpt cannot merge or export yet; "
                           "merge it with PEFT's merge_and_unload on the loaded model")
    if not parts:
        return None
    adapters = sorted({a for _, a in parts})
    if len(adapters) > 1:
        raise BadInput(f"{ckpt.root}: holds {len(adapters)} LoRA adapters ({', '.join(adapters)}); "
                       "ckpt merges or exports one adapter only")
    targets = []
    for (module, _), ab in sorted(parts.items()):
        if module in embeddings and not all(_EMBEDDING.match(normalize_name(t.name)) for t in ab.values()):
            raise BadInput(f"{ckpt.root}: {module} holds both linear and embedding LoRA weights")
        if set(ab) != {"A", "B"}:
            lacking = "lora_B" if "A" in ab else "lora_A"
            raise BadInput(f"{ckpt.root}: {module} has no {lacking} weight; the LoRA is incomplete")
        a, b = ab["A"], ab["B"]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise BadInput(f"{ckpt.root}: {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not make a "
                           "rank-r update")
        targets.append(Target(module, a, b, module in embeddings))
    lora_names = {t.name for tgt in targets for t in (tgt.a, tgt.b)}
    # PEFT saves a LoRA-wrapped embedding's base weight with the adapter (save_embedding_layers)
    saved_with = {f"{t.module}.base_layer.weight" for t in targets if t.embedding}
    adapter_only = all(t.name in lora_names or base_name(normalize_name(t.name)) in saved_with for t in model)
    config, found_alpha, source = _side_alpha(ckpt)
    if config.get("alpha_pattern"):
        raise BadInput(f"{source}: alpha_pattern gives modules their own alpha, which ckpt does not apply yet")
    if alpha is not None:
        found_alpha, source = float(alpha), "--lora-alpha"
    return Lora(adapters[0], tuple(targets), adapter_only, found_alpha, source, config)


def _side_alpha(ckpt: Checkpoint) -> tuple[dict, float | None, str | None]:
    """adapter_config.json (PEFT) or lora_train_meta.json (verl) in the checkpoint directory or
    its ``huggingface/`` folder: (adapter config, alpha, which file)."""
    root = ckpt.base_dir()
    # not the parent folder: an adapter_config.json there may belong to another run, and a
    # wrong alpha would merge silently wrong weights
    for folder in (root, root / "huggingface"):
        for name in (ADAPTER_CONFIG, VERL_META):
            f = folder / name
            if not f.is_file():
                continue
            try:
                data = json.loads(f.read_text())
                value = data.get("lora_alpha")
            except (OSError, ValueError, AttributeError) as e:
                raise BadInput(f"{f}: not a valid JSON object ({e})") from e
            if value is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise BadInput(f"{f}: lora_alpha is {value!r}, not a number")
            return (data if name == ADAPTER_CONFIG else {"task_type": data.get("task_type")}), float(value), str(f)
    return {}, None, None


def check_alpha(lora: Lora, src: Path) -> None:
    if lora.alpha is None:
        raise BadInput(f"{src}: LoRA alpha is unknown (no {ADAPTER_CONFIG} or {VERL_META} in the checkpoint); "
                       "pass --lora-alpha A (the lora_alpha the job trained with)")


# -- merge: the base model's names, the update folded in ------------------------------------

def merge_plan(lora: Lora, names: dict[str, TensorInfo], src: Path, base: dict[str, TensorInfo] | None = None
               ) -> list[tuple[str, TensorInfo, Target | None]]:
    """``(hf name, source tensor, LoRA target to fold in or None)`` for every tensor of the
    merged model. ``names`` are the checkpoint's (wrapper prefixes removed); ``base`` holds the
    full base weights under HF names, for an adapter-only checkpoint."""
    if lora.adapter_only and base is None:  # said first: the alpha alone would not make a model
        raise BadInput(f"{src}: holds LoRA adapter weights only; export them with --lora adapter, "
                       "or merge them into full weights with --base MODEL")
    check_alpha(lora, src)
    by_module = {t.module: t for t in lora.targets}
    lora_names = {t.name for tgt in lora.targets for t in (tgt.a, tgt.b)}
    out: dict[str, tuple[TensorInfo, Target | None]] = {}
    saved: dict[str, TensorInfo] = {}
    if lora.adapter_only:
        out = {n: (t, None) for n, t in base.items()}
    for name, t in names.items():
        if t.name in lora_names:
            continue
        plain = base_name(name)
        if m := _BASE.match(plain):
            plain = f"{m['module']}.{m['leaf']}"
        elif m := _SAVED.match(plain):
            saved[f"{m['module']}.{m['rest']}"] = t
            continue
        elif _ORIGINAL.match(plain):
            continue  # replaced by its modules_to_save copy
        out[plain] = (t, None)
    for plain, t in saved.items():
        out[plain] = (t, None)
    for module, tgt in by_module.items():
        weight = f"{module}.weight"
        if weight not in out:
            raise BadInput(f"{src}: LoRA target {module} has no base weight {weight!r}"
                           + (" in --base" if lora.adapter_only else ""))
        w = out[weight][0]
        if w.shape != tgt.weight_shape:
            fan = " (fan_in_fan_out layers are not supported)" if lora.config.get("fan_in_fan_out") else ""
            raise BadInput(f"{src}: {module}: the LoRA update is {list(tgt.weight_shape)}, "
                           f"its base weight is {list(w.shape)}{fan}; is --base the model the adapter was trained on?")
        out[weight] = (w, tgt)
    return [(n, t, tgt) for n, (t, tgt) in out.items()]


# -- adapter: what PeftModel.from_pretrained loads -------------------------------------------

def adapter_names(lora: Lora, names: dict[str, TensorInfo]) -> list[tuple[str, TensorInfo]]:
    """``(name in adapter_model.safetensors, source)``: PEFT's saved names, the adapter name
    removed (``base_model.model.<m>.lora_A.weight``), as ``save_pretrained`` writes them."""
    if any(_SAVED.match(base_name(n)) for n in names):
        raise BadInput("modules_to_save copies cannot be written as an adapter yet; export with --lora merge")
    out = []
    for tgt in lora.targets:
        a, b = ("lora_embedding_A", "lora_embedding_B") if tgt.embedding else ("lora_A.weight", "lora_B.weight")
        out.append((f"{PEFT_PREFIX}{tgt.module}.{a}", tgt.a))
        out.append((f"{PEFT_PREFIX}{tgt.module}.{b}", tgt.b))
    return out


def adapter_config(lora: Lora, *, base_model: str | None, config: dict) -> dict[str, Any]:
    """adapter_config.json: the checkpoint's own when it has one, else built from what the
    tensors and side files say."""
    ranks = {t.rank for t in lora.targets}
    if len(ranks) > 1 and not lora.config:
        raise BadInput(f"LoRA targets have different ranks ({sorted(ranks)}) and no {ADAPTER_CONFIG} says which; "
                       "ckpt cannot write a rank_pattern it does not know")
    arch = (config.get("architectures") or [""])[0]
    task = lora.config.get("task_type") or ("CAUSAL_LM" if arch.endswith("ForCausalLM") else None)
    out = {
        "peft_type": "LORA", "r": lora.rank, "lora_alpha": lora.alpha, "target_modules": lora.target_modules,
        "task_type": task, "bias": "none", "fan_in_fan_out": False, "lora_dropout": 0.0, "inference_mode": True,
        "use_rslora": False, "modules_to_save": None, "init_lora_weights": True,
        "base_model_name_or_path": base_model or config.get("_name_or_path") or None,
    }
    if lora.config.get("peft_type") == "LORA":
        out.update({k: v for k, v in lora.config.items() if k not in ("base_model_name_or_path",) or v})
        out["lora_alpha"] = lora.alpha
    out["inference_mode"] = True
    return out


def summary(ckpt: Checkpoint) -> dict[str, Any] | None:
    """PEFT LoRA in the model tensors, as ``inspect`` and ``verify`` report it: rank, alpha (None
    when no side file says), targets; a variant ckpt cannot fold in is named under ``unsupported``."""
    if not any(".lora_" in t.name for t in ckpt.tensors if t.group == "model"):
        return None
    try:
        found = find(ckpt)
    except BadInput as e:
        return {"rank": None, "alpha": None, "target_modules": [], "adapter_only": None, "unsupported": str(e)}
    return found.summary() if found else None
