"""No framework recognised: a DCP from ``dcp.save``, per-rank files without a framework's
side files, or an unsharded file. Nothing is rank-local."""

from __future__ import annotations

NAME = "plain"
RANK_LOCAL_FILE = None


def detect(ckpt) -> bool:
    return True


def fsdp_version(ckpt) -> int | None:
    return _from_details(ckpt)


def rank_local_object(obj) -> int | None:
    return None


def _from_details(ckpt) -> int | None:
    fsdp = ckpt.details.get("fsdp") or ""
    return 2 if fsdp.startswith("FSDP2") else 1 if fsdp.startswith("FSDP1") else None
