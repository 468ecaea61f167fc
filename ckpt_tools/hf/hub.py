"""Turn a ``MODEL`` argument (local directory or Hugging Face Hub repo id) into a local directory.

``HF_HUB_OFFLINE=1`` and the local cache are honoured: offline, a repo id resolves only to a
snapshot already in the cache.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ckpt_tools.errors import BadInput


def _offline() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once, at import; read it again so that a value set
    # later in the same process (a test, a notebook) is honoured too.
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _looks_like_path(model: str) -> bool:
    # A repo id is "name" or "org/name"; anything else can only have meant a local path.
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or os.sep != "/" and os.sep in model


def resolve_model_dir(model: str, *, allow_patterns: Sequence[str] | None = None) -> Path:
    """Return a local directory holding ``model``'s files.

    Args:
        model: a local directory (returned as is), or a hub repo id such as
            ``meta-llama/Llama-2-7b-hf``, fetched with ``huggingface_hub.snapshot_download``.
        allow_patterns: file patterns to fetch for a repo id (``["config.json"]`` for a
            config-only look-up); ``None`` fetches the whole repo. The returned snapshot may hold
            more files than asked for when the cache already had them.

    Returns:
        The directory (for a repo id, the snapshot folder in the HF cache).

    Raises:
        BadInput: no such directory, no such repo, gated repo, or offline and not cached.

    Example: ``resolve_model_dir("gpt2", allow_patterns=["config.json"]) / "config.json"``
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise BadInput(f"{model}: is a file; pass a Hugging Face model directory or a hub repo id")
    if _looks_like_path(model):
        raise BadInput(f"{model}: no such directory; pass a Hugging Face model directory or a hub repo id")

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    offline = _offline()
    fetch = " ".join([f"hf download {model}", *(f"--include '{p}'" for p in allow_patterns or ())])
    try:
        folder = snapshot_download(model, allow_patterns=list(allow_patterns) if allow_patterns else None,
                                   local_files_only=offline)
    except HFValidationError as e:
        raise BadInput(f"{model}: no such directory, and not a valid hub repo id (org/name)") from e
    except GatedRepoError as e:
        raise BadInput(f"{model}: gated repo on the Hugging Face Hub; accept its terms on the repo page "
                       "and log in with `hf auth login`, or pass a local directory") from e
    except RepositoryNotFoundError as e:
        raise BadInput(f"{model}: no such local directory, and no such repo on the Hugging Face Hub "
                       "(or it is private); check the name, or log in with `hf auth login`") from e
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE=1 is set" if offline else "the hub could not be reached"
        raise BadInput(f"{model}: no such local directory, not in the Hugging Face cache, and {why}; "
                       f"download it while online (`{fetch}`) or pass a local directory") from e
    except HfHubHTTPError as e:
        raise BadInput(f"{model}: Hugging Face Hub request failed ({e}); retry, or pass a local directory") from e
    return Path(folder)
