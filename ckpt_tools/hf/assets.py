"""The files around the weights that make an HF directory usable: config (with its dtype
field set to what was written), generation config and tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..core.describe import dtype_name
from ..errors import BadInput
from ..security import safefs
from .hub import resolve_model_dir

ASSET_PATTERNS = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt",
    "merges.txt", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json",
)


def find_assets(src: Path, base: str | None) -> Path | None:
    """Where config and tokenizer come from: ``--base`` when given, else the source's own
    ``huggingface/`` folder, else the source directory itself (an HF directory)."""
    if base:
        return resolve_model_dir(base, allow_patterns=list(ASSET_PATTERNS))
    root = src if src.is_dir() else src.parent
    for candidate in (root / "huggingface", root):
        if (candidate / "config.json").is_file():
            _inside(root, candidate)
            return candidate
    return None


def _inside(root: Path, assets: Path) -> None:
    """The source's own asset files are part of the checkpoint: each must be a regular file
    that resolves inside it (a symlinked ``huggingface/`` or ``tokenizer.json`` leading out
    would copy an outside file into the output). ``--base`` folders are the user's choice."""

    rel = assets.relative_to(root)
    for name in ASSET_PATTERNS:
        f = assets / name
        if f.exists() or f.is_symlink():
            safefs.require_regular(safefs.resolve_inside(root, str(rel / name), what=str(root)))


def read_config(assets: Path | None) -> dict:
    if assets is None or not (assets / "config.json").is_file():
        return {}
    try:
        return json.loads((assets / "config.json").read_text())
    except ValueError as e:
        raise BadInput(f"{assets / 'config.json'}: not valid JSON ({e})") from e


def asset_names(assets: Path | None) -> list[str]:
    """The asset files :func:`copy_assets` would copy from ``assets``."""
    return [] if assets is None else [n for n in ASSET_PATTERNS if (assets / n).is_file()]


def copy_assets(assets: Path | None, out: Path, *, dtype: str | None, architecture: str | None = None) -> list[str]:
    """Copy the asset files into ``out``; set config's dtype field, and its ``architectures`` to
    ``[architecture]`` when it names none (as ``save_pretrained`` writes the class it saved).
    Returns the names copied."""
    copied = []
    if assets is None:
        return copied
    for name in ASSET_PATTERNS:
        f = assets / name
        if f.is_file():
            shutil.copyfile(f, out / name)
            copied.append(name)
    if "config.json" in copied and (dtype is not None or architecture is not None):
        config = json.loads((out / "config.json").read_text())
        if dtype is not None:
            config["dtype"] = dtype_name(dtype)
            if "torch_dtype" in config:
                config["torch_dtype"] = dtype_name(dtype)
        if architecture is not None and not config.get("architectures"):
            config["architectures"] = [architecture]
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return copied


def rewrite_config(path: Path, config: dict) -> None:
    """Write ``config`` at ``path`` (copied there by :func:`copy_assets`), keeping the dtype
    fields (and an ``architectures`` it filled in) that copy set."""
    written = json.loads(path.read_text())
    new = dict(config)
    for key in ("dtype", "torch_dtype", "architectures"):
        if key in written and (key != "architectures" or not new.get(key)):
            new[key] = written[key]
    path.write_text(json.dumps(new, indent=2, sort_keys=True) + "\n")


def tied(config: dict) -> bool:
    """Whether the config ties the output projection to the input embedding."""
    value = config.get("tie_word_embeddings")
    if value is None:
        value = config.get("text_config", {}).get("tie_word_embeddings", True) if config else False
    return bool(value)
