"""Will ``from_pretrained`` load these names? Asked of the model class itself.

The architecture named by ``config.json`` is built on the meta device (``torch.device("meta")``
and the class's ``_from_config``: no memory, no weights, no accelerate, the same on every
supported transformers) and the names, shapes and dtypes about to be written are set against
its state dict, with the rules ``from_pretrained`` reads off the class (:func:`compare`): its
base-model prefix, tied parameters, non-persistent buffers, ``_keys_to_ignore_on_load_*``. No
copy of those rules is kept here to drift.

The check fails closed: when it cannot run (:class:`Unchecked`: transformers missing, a class
it lacks, remote code, a config it cannot read) the caller refuses, naming ``--no-arch-check``.

Asking costs ``import torch`` and ``transformers`` and the architecture's module (seconds), far
more than exporting a small model. The answer depends only on what is asked (config, names,
shapes, dtypes) and on the code that answers (ckpt, transformers and torch versions), so a
clean answer is remembered under a hash of all of them (:func:`known_good`): exporting the next
checkpoint of the same run asks nothing and imports neither. Refusals and unchecked
architectures are never remembered; ``CKPT_CACHE_DIR=""`` turns remembering off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .._version import __version__
from ..core.dtypes import DType, as_torch
from . import models

SHOWN = 3  # names quoted per kind in a message


@dataclass(frozen=True)
class LoadReport:
    """What ``from_pretrained`` of ``architecture`` would say about a set of names."""

    architecture: str
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]  # name, given, wanted

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self) -> str:
        """The first few problems of each kind, for one error line."""
        parts = []
        for what, names in (("missing", self.missing), ("unexpected", self.unexpected)):
            if names:
                more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
                parts.append(f"{len(names)} {what} ({', '.join(names[:SHOWN])}{more})")
        if self.mismatched:
            shown = ", ".join(f"{n} is {list(g)}, wants {list(w)}" for n, g, w in self.mismatched[:SHOWN])
            parts.append(f"{len(self.mismatched)} misshapen ({shown})")
        return "; ".join(parts)


class Unchecked(Exception):
    """The architecture cannot be built here (transformers missing, unknown class, remote code)."""


HEAD = "lm_head.weight"  # an output head: the weights are a *ForCausalLM's


def model_class(config: dict, names: Iterable[str] = ()):
    """The transformers class ``config["architectures"][0]`` names, or raise :class:`Unchecked`.

    A config with no ``architectures`` (what ``LlamaConfig(...).save_pretrained`` writes) is
    loaded through an Auto class, so the class follows from ``model_type`` and the names:
    ``lm_head.weight`` among ``names`` → ``AutoModelForCausalLM``'s class, else ``AutoModel``'s."""
    try:
        import transformers
    except ImportError as e:
        raise Unchecked("transformers is not installed (pip install 'ckpt-tools[hf]')") from e
    archs = config.get("architectures") or []
    if config.get("auto_map"):
        raise Unchecked(f"{archs[0] if archs else config.get('model_type')} is remote code (auto_map), "
                        "which ckpt does not run")
    if not archs:
        cls = models.class_for_type(config.get("model_type"), causal_lm=HEAD in set(names))
        if cls is None:
            raise Unchecked(f"config.json names no architectures, and transformers {transformers.__version__} "
                            f"has no model for its model_type {config.get('model_type')!r}")
        return cls
    if not isinstance(archs[0], str):
        raise Unchecked("config.json names no architectures")
    if config.get("auto_map"):
        raise Unchecked(f"{archs[0]} is remote code (auto_map), which ckpt does not run")
    # the first name only: the class from_pretrained would be called on, as the export records it
    cls = models.architecture_class(archs[:1])
    if cls is None:
        raise Unchecked(f"transformers {transformers.__version__} has no class {archs[0]}")
    return cls


def load_report(config: dict, tensors: dict[str, tuple[tuple[int, ...], DType]]) -> LoadReport:
    """What ``from_pretrained`` would report for a checkpoint holding ``tensors``
    (name → (shape, dtype)) under ``config``. Raises :class:`Unchecked` when the architecture
    cannot be built offline.

    Example: ``load_report(cfg, {"model.norm.weight": ((32,), DType("float32"))}).missing``
    """
    if known_good(config, tensors):
        return LoadReport(str(config["architectures"][0]), (), (), ())
    cls = model_class(config, tensors)
    report = compare(meta_model(config, cls), {n: tuple(shape) for n, (shape, _) in tensors.items()})
    if report.ok and cls.__name__ == (config.get("architectures") or [None])[0]:
        _remember(config, tensors)
    return report


def meta_model(config: dict, cls):
    """``cls`` built from ``config`` on the meta device (``torch.device("meta")`` and the class's
    ``_from_config``, as ``AutoModel*.from_config`` does): every parameter and buffer with its
    shape, no memory, no weights read, no accelerate. Raises :class:`Unchecked` when
    transformers cannot build it."""
    import torch
    import transformers

    cfg = _config_object(config, cls)
    try:
        with _quiet(), torch.device("meta"):
            return cls._from_config(cfg)
    except Exception as e:  # noqa: BLE001 - transformers' own failure: the names cannot be vouched for
        raise Unchecked(f"transformers {transformers.__version__} could not build {cls.__name__} on the meta "
                        f"device ({type(e).__name__}: {_clip(str(e))})") from e


def compare(model, given: dict[str, tuple[int, ...]]) -> LoadReport:
    """``from_pretrained``'s loading report for a checkpoint of ``given`` names and shapes, asked
    of the built ``model`` and its class: its state dict (what it loads), its base-model prefix
    (added or dropped, so a bare model's weights load into a model with a head and back), its
    tied parameters (one name of each tied group is enough), its non-persistent buffers and
    ``_keys_to_ignore_on_load_unexpected`` (present but not loaded: not unexpected) and
    ``_keys_to_ignore_on_load_missing`` (absent but not needed: not missing)."""
    state = model.state_dict(keep_vars=True)
    wanted = {n: tuple(t.shape) for n, t in state.items()}
    place = _placer(model, wanted)
    placed = {place(n): (n, shape) for n, shape in given.items()}
    unloaded = {n for n, _ in model.named_buffers()} - set(state)  # non-persistent buffers
    skip_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    skip_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    unexpected = sorted(n for p, (n, _) in placed.items()
                        if p not in wanted and p not in unloaded and not skip_unexpected(p) and not skip_unexpected(n))
    groups: dict[int, set[str]] = {}  # tied parameters are one tensor under several names
    for n, t in state.items():
        groups.setdefault(id(t), set()).add(n)
    missing = sorted(n for n in wanted if n not in placed and not skip_missing(n)
                     and not any(other in placed for other in groups[id(state[n])]))
    mismatched = sorted((n, shape, wanted[p]) for p, (n, shape) in placed.items() if p in wanted and shape != wanted[p])
    return LoadReport(type(model).__name__, tuple(missing), tuple(unexpected), tuple(mismatched))


def _placer(model, wanted):
    """The name ``from_pretrained`` loads a checkpoint's name into: the model's base-model prefix
    added or dropped where that finds it in ``wanted`` (the model's state dict names)."""
    prefix = getattr(model, "base_model_prefix", "") or ""

    def place(name: str) -> str:
        if name in wanted or not prefix:
            return name
        if name.startswith(prefix + ".") and name[len(prefix) + 1:] in wanted:
            return name[len(prefix) + 1:]
        return f"{prefix}.{name}" if f"{prefix}.{name}" in wanted else name

    return place


def parameters_only(shapes: dict[str, tuple[int, ...]], config: dict) -> dict[str, tuple[int, ...]]:
    """``shapes`` (a model's tensor names and shapes) less those its class holds as buffers
    (DeepSeek's ``e_score_correction_bias``), asked of the class named by ``config``
    (:func:`buffers`). Asking costs importing transformers: where every name ends in ``weight``
    or ``bias`` (parameters' names in every model ckpt maps), or without a config, nothing is
    asked and every tensor kept, as where the class cannot be built."""
    if not config or all(n.rsplit(".", 1)[-1] in ("weight", "bias") for n in shapes):
        return shapes
    try:
        held = buffers(config, shapes)
    except Exception:  # noqa: BLE001 - an architecture not buildable here: no buffer is known
        return shapes
    return {n: s for n, s in shapes.items() if n not in held}


def buffers(config: dict, names: Iterable[str]) -> set[str]:
    """Of a checkpoint's model ``names``, those the model class holds as (persistent) buffers,
    not parameters: DeepSeek's ``mlp.gate.e_score_correction_bias``, which its state dict and
    ``save_pretrained`` carry beside the weights. Asked of the class built on the meta device
    (:func:`meta_model`), as :func:`load_report` asks, and remembered the same way. Raises
    :class:`Unchecked` when the class cannot be built.

    Example: ``buffers(cfg, ["model.layers.1.mlp.gate.e_score_correction_bias", ...])``."""
    def ask(names: list[str]) -> list[str]:
        model = meta_model(config, model_class(config, names))
        state = model.state_dict(keep_vars=True)
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        place = _placer(model, state)
        return [n for n in names if place(n) in state and place(n) not in params]

    return _remembered("buffers", "buffer?", config, names, ask)


def kept_in_float32(config: dict, names: Iterable[str], dtype: str) -> set[str]:
    """Of ``names``, those ``from_pretrained(..., dtype=dtype)`` of the config's class holds in
    float32 whatever ``dtype`` says, so ``save_pretrained`` writes them in float32: the class's
    own dtype plan (``_get_dtype_plan``: ``_keep_in_fp32_modules_strict`` for float16 and
    bfloat16, ``_keep_in_fp32_modules`` for float16; DeepSeek-V3's router ``gate.weight`` and
    ``e_score_correction_bias``), matched as transformers matches it (``build_glob_alternation``).
    Asked of the class built on the meta device and remembered like a clean load report. Raises
    :class:`Unchecked` when the class cannot be built."""
    def ask(names: list[str]) -> list[str]:
        model = meta_model(config, model_class(config, names))
        import torch

        try:
            from transformers.core_model_loading import build_glob_alternation

            plan = model._get_dtype_plan(getattr(torch, dtype))
        except (ImportError, AttributeError) as e:  # a transformers without dtype plans (4.x)
            raise Unchecked(f"this transformers has no dtype plan to ask ({e})") from e
        if not plan:
            return []
        # as from_pretrained matches it: the first pattern that matches a name gives its dtype
        alternation, by_group, _ = build_glob_alternation(list(plan))
        return [n for n in names if (m := alternation.search(n)) is not None
                and plan[by_group[m.lastgroup]] == torch.float32]

    return _remembered("float32", f"float32 under {dtype}?", config, names, ask)


def _remembered(kind: str, question: str, config: dict, names: Iterable[str],
                ask: Callable[[list[str]], list[str]]) -> set[str]:
    """``ask(names)`` (sorted, once each), remembered in the cache folder under ``kind`` as a
    clean load report is: only the next command's cost is at stake if it cannot be written."""
    names = sorted(set(names))
    folder, key = cache_dir(), _key(config, {n: ((), question) for n in names})
    kept = folder / kind / key if folder is not None and key is not None else None
    if kept is not None and kept.is_file():
        try:
            return set(json.loads(kept.read_text()))
        except (OSError, ValueError):
            pass
    found = sorted(ask(names))
    if kept is not None:
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            tmp = kept.parent / f".{key}.{os.getpid()}"
            tmp.write_text(json.dumps(found))
            os.replace(tmp, kept)
        except OSError:
            pass
    return set(found)


def _patterns(model, attribute: str):
    """A test for names matching the regular expressions of the model's (and, on transformers
    5, its submodels') ``attribute``, as ``from_pretrained`` matches them (``re.search``)."""
    import re

    found = set(getattr(type(model), attribute, None) or ()) | set(getattr(model, attribute, None) or ())
    if not found:
        return lambda name: False
    regex = re.compile("|".join(f"(?:{p})" for p in sorted(found)))
    return lambda name: regex.search(name) is not None


def _clip(text: str, limit: int = 160) -> str:
    """``text`` on one line, cut at a word boundary with an ellipsis when longer than ``limit``."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0]
    return (cut or text[:limit]).rstrip(",;:") + " …"


def _config_object(config: dict, cls):
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("transformers_version",)}
    try:
        return AutoConfig.for_model(**fields) if "model_type" in fields else cls.config_class(**fields)
    except Exception as e:  # noqa: BLE001 - any failure to read the config means: not checked
        raise Unchecked(f"transformers cannot read this config.json ({type(e).__name__}: {_clip(str(e), 120)})") from e


def tied_sources(config_file: Path, names: Iterable[str]) -> dict[str, str]:
    """``{name: the name it is tied to}`` for the weights the model of ``config_file`` ties
    (``lm_head.weight`` to the input embedding, BERT's decoder to its word embeddings), which
    ``save_pretrained`` writes once and ``from_pretrained`` does not miss; asked of the model
    class (``get_expanded_tied_weights_keys``), built on the meta device. Empty when the
    architecture cannot be built here."""
    try:
        config = json.loads(config_file.read_text())
        model = meta_model(config, model_class(config, list(names)))
        return dict(model.get_expanded_tied_weights_keys(all_submodels=True))
    except Exception:  # noqa: BLE001 - a model transformers cannot build: nothing is known tied
        return {}


# -- clean answers remembered ----------------------------------------------------------------

def cache_dir() -> Path | None:
    """Where clean answers are kept: ``$CKPT_CACHE_DIR`` (empty: nowhere), else
    ``$XDG_CACHE_HOME/ckpt-tools/archcheck`` (``~/.cache/...``)."""
    chosen = os.environ.get("CKPT_CACHE_DIR")
    if chosen is not None:
        return Path(chosen) if chosen else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ckpt-tools" / "archcheck"


def _key(config: dict, tensors: dict[str, tuple[tuple[int, ...], DType]]) -> str | None:
    """A hash of the question and of the code that answers it (versions read from the package
    metadata, without importing either package); None when they cannot be named."""
    from importlib import metadata

    try:
        # the answering code's own text too (this module and the class lookup it asks):
        # a development copy changes without a new version
        code = [hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in (__file__, models.__file__)]
        versions = [__version__, *code, metadata.version("transformers"), metadata.version("torch")]
        archs = config.get("architectures") or []
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            return None
        asked = json.dumps([versions, config, sorted((n, [int(x) for x in shape], str(dtype))
                                                     for n, (shape, dtype) in tensors.items())],
                           sort_keys=True, allow_nan=True)
    except (metadata.PackageNotFoundError, OSError, TypeError, ValueError):
        return None
    return hashlib.sha256(asked.encode()).hexdigest()


def known_good(config: dict, tensors: dict[str, tuple[tuple[int, ...], DType]]) -> bool:
    """Whether ``from_pretrained`` already said, under these versions, that it loads exactly
    these names, shapes and dtypes under this config (so asking again is work with a known
    answer)."""
    folder, key = cache_dir(), _key(config, tensors)
    return folder is not None and key is not None and (folder / key).is_file()


def _remember(config: dict, tensors: dict[str, tuple[tuple[int, ...], DType]]) -> None:
    folder, key = cache_dir(), _key(config, tensors)
    if folder is None or key is None:
        return
    try:  # a cache that cannot be written only costs the next export the question again
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}"
        tmp.write_text(str(config["architectures"][0]) + "\n")
        os.replace(tmp, folder / key)
    except OSError:
        pass


def ignored(config_file: Path, tensors: dict[str, tuple[tuple[int, ...], str]], unused: set[str]) -> list[str]:
    """Of ``unused`` (names a model has no place for), those ``from_pretrained`` skips without
    calling them unexpected; none when the architecture cannot be checked."""
    if not unused:
        return []
    try:
        config = json.loads(config_file.read_text())
        report = load_report(config, {k: (shape, DType(dtype)) for k, (shape, dtype) in tensors.items()})
    except (Unchecked, ValueError, OSError):
        return []
    return sorted(unused - set(report.unexpected))


def ignored_of(config_file: Path, tensors: dict[str, tuple[tuple[int, ...], str]], names: set[str]) -> list[str]:
    """Of ``names`` (some of ``tensors``), those ``from_pretrained`` neither needs nor calls
    unexpected: :func:`ignored`, once the names the model has a place for are set aside (those
    it reports missing when they are taken away). For ``verify``, which has no model to ask."""
    if not names:
        return []
    try:
        config = json.loads(config_file.read_text())
        rest = {k: (shape, DType(dtype)) for k, (shape, dtype) in tensors.items() if k not in names}
        needed = set(load_report(config, rest).missing)
    except (Unchecked, ValueError, OSError):
        return []
    return ignored(config_file, tensors, set(names) - needed)


@contextlib.contextmanager
def _quiet():
    """transformers logs its loading report as a warning and shows a progress bar while it
    "loads" the meta tensors; here the report is ours to word, and nothing is loaded."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def likely_fix(report: LoadReport) -> str:
    """A guess at the next step, from the shape of the mismatch."""
    names = report.unexpected + report.missing
    if any(".lora_" in n or ".base_layer." in n for n in names):
        return "the checkpoint holds PEFT LoRA weights: export with --lora merge or --lora adapter"
    if any(n.startswith(("tok_embeddings.", "layers.")) and ".attention.w" in n or n.startswith("tok_embeddings.")
           for n in report.unexpected):
        return "these are torchtitan names; pass --base with the Hugging Face config of the model"
    if report.mismatched or (report.missing and report.unexpected):
        return "config.json does not describe these weights: pass --base MODEL with the model's own config"
    if report.missing:
        return "the checkpoint lacks weights this architecture needs: is it complete, and is config.json the right one?"
    return "config.json names another architecture: pass --base MODEL with the model's own config"
