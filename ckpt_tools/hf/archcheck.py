"""Will ``from_pretrained`` load these names? Asked of ``from_pretrained`` itself.

The architecture named by ``config.json`` is built on the meta device and handed a state dict of
meta tensors with the names, shapes and dtypes about to be written; ``from_pretrained``'s own
loading report (``output_loading_info``) then says what would be missing, unexpected or
misshapen. Everything it ignores (``_keys_to_ignore_on_load_*``, tied weights, old rotary
``inv_freq`` and ``position_ids`` buffers, its own key renames and base-model prefixes) is
ignored here for the same reason, with no copy of those rules to drift. No data is read and no
memory is used beyond the meta model's bookkeeping.

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
from collections.abc import Iterable
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
    import torch

    cfg = _config_object(config, cls)
    state = {name: torch.empty(shape, dtype=as_torch(dtype), device="meta") for name, (shape, dtype) in tensors.items()}
    try:
        with _quiet():
            _, info = cls.from_pretrained(None, config=cfg, state_dict=state, device_map="meta",
                                          output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as e:  # noqa: BLE001 - transformers' own failure: the names cannot be vouched for
        raise Unchecked(f"transformers could not build {cls.__name__} on the meta device "
                        f"({type(e).__name__}: {str(e)[:160]})") from e
    mismatched = tuple(sorted((n, tuple(given), tuple(wanted)) for n, given, wanted in info.get("mismatched_keys", ())))
    report = LoadReport(cls.__name__, tuple(sorted(info.get("missing_keys", ()))),
                        tuple(sorted(info.get("unexpected_keys", ()))), mismatched)
    if report.ok and cls.__name__ == (config.get("architectures") or [None])[0]:
        _remember(config, tensors)
    return report


def _config_object(config: dict, cls):
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("transformers_version",)}
    try:
        return AutoConfig.for_model(**fields) if "model_type" in fields else cls.config_class(**fields)
    except Exception as e:  # noqa: BLE001 - any failure to read the config means: not checked
        raise Unchecked(f"transformers cannot read this config.json ({type(e).__name__}: {str(e)[:120]})") from e


def tied_sources(config_file: Path, names: Iterable[str]) -> dict[str, str]:
    """``{name: the name it is tied to}`` for the weights the model of ``config_file`` ties
    (``lm_head.weight`` to the input embedding, BERT's decoder to its word embeddings), which
    ``save_pretrained`` writes once and ``from_pretrained`` does not miss; asked of the model
    class (``get_expanded_tied_weights_keys``), built on the meta device. Empty when the
    architecture cannot be built here."""
    try:
        config = json.loads(config_file.read_text())
        cls = model_class(config, list(names))
        cfg = _config_object(config, cls)
        import torch

        with _quiet(), torch.device("meta"):
            model = cls._from_config(cfg)
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
