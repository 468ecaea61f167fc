"""Loading untrusted files without running their code.

``torch.load`` is only ever called with ``weights_only=True``. DCP's ``.metadata`` is a plain
pickle: it goes through :class:`ckpt_tools.security.dcpmeta.MetadataUnpickler`, which admits DCP's own
metadata classes (as plain stand-ins) and the few builtin types they are made of, nothing else.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import re
import struct
import tarfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import bounded, safefs
from ..errors import BadInput, Damaged, UnsafeInput, first_line
from .torchfile import check_structure

# verl's extra-state files hold `np.random.get_state()`: arrays need numpy's reconstructor,
# which builds an empty array and fills it from bytes; it runs no code of the file's choosing.
_NUMPY_SAFE = [
    np.ndarray,
    np.dtype,
    np._core.multiarray._reconstruct,
    np._core.multiarray.scalar,
    *[getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")],
]


@contextlib.contextmanager
def _quiet_device_mesh():
    # Unpickling a DeviceMesh outside its job logs a warning per mesh; it is expected here.
    logger = logging.getLogger("torch.distributed.device_mesh")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def load_torch(path: Path | str, *, mmap: bool = True) -> Any:
    """``torch.load`` a file safely; tensors are memory-mapped (read lazily) when ``mmap``."""
    path = Path(path)
    safefs.require_regular(path)  # torch.load opens by name: a FIFO would block it forever
    if is_torchscript(path):
        raise UnsafeInput(
            f"{path} is a TorchScript archive, which carries code; "
            "save the state dict with torch.save(model.state_dict()) instead"
        )
    with safefs.open_file(path) as f:
        if _is_zip(path):
            stored_only(f, where=str(path))
            _gate(f, where=str(path))
        elif tarfile.is_tarfile(path):
            raise BadInput(f"{path}: a tar-format torch checkpoint (PyTorch before 1.0), which ckpt does not read; "
                           "re-save it with a current torch.save")
        else:  # legacy torch.save: magic number, protocol, sys info, the object, storage keys
            check_structure(f, where=str(path), pickles=5)
    import torch.distributed.tensor  # noqa: F401  (registers DTensor for weights_only loading)

    from .fsdp1 import safe_globals as fsdp1_globals

    try:
        with _quiet_device_mesh(), torch.serialization.safe_globals(_NUMPY_SAFE + fsdp1_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and _is_zip(path))
    except pickle.UnpicklingError as e:
        raise _refusal(str(path), e) from e
    except _DAMAGED + (OSError,) as e:
        raise damaged(path, e) from e
    bounded.check_tree(obj, where=str(path))
    return obj


def damaged(path: Path, e: BaseException) -> BadInput:
    """What is wrong with a ``torch.save`` file torch's loader failed on, in ckpt's words: a zip
    cut short (torch.save writes the zip's directory last, so a truncated copy has none) says
    so with its size; otherwise the first sentence of torch's reason (its miniz text runs on
    over several sentences of advice)."""
    size = None
    with contextlib.suppress(OSError):
        size = path.stat().st_size
    if _is_zip(path) and not _has_zip_end(path):
        return Damaged(f"{path}: truncated: {size:,} bytes on disk and no zip directory at its end, which "
                        "torch.save writes last; copy the file again")
    return Damaged(f"{path}: not a readable torch.save file, corrupt or truncated ({first_sentence(e)}); "
                    "copy it again from a good copy")


def first_sentence(e: BaseException) -> str:
    """The first sentence of an exception's first line, never cut mid-word."""
    text = first_line(e)
    cut = text.find(". ")
    text = text[:cut] if cut > 0 else text.rstrip(".")
    if len(text) > 200:
        text = text[:200].rsplit(" ", 1)[0] + " ..."
    return text


def _has_zip_end(path: Path) -> bool:
    """Whether the file ends with a whole zip end-of-central-directory record (its last 64 KiB
    + 22 bytes hold it, a zip comment included)."""
    try:
        with safefs.open_file(path) as f:
            size = f.seek(0, io.SEEK_END)
            f.seek(max(0, size - (1 << 16) - 22))
            tail = f.read()
    except (OSError, BadInput):
        return True  # not ours to judge
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + 22 > len(tail):
        return False
    (comment,) = struct.unpack("<H", tail[at + 20:at + 22])
    return at + 22 + comment == len(tail)


def load_torch_bytes(data: bytes | memoryview, *, where: str) -> Any:
    """``torch.load`` an in-memory ``torch.save`` blob (a DCP item) safely."""
    stored_only(io.BytesIO(data), where=where)
    _gate(io.BytesIO(data), where=where)
    try:
        with _quiet_device_mesh(), torch.serialization.safe_globals(_NUMPY_SAFE):
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refusal(where, e) from e
    except _DAMAGED as e:
        raise Damaged(f"{where}: corrupt or truncated item ({first_sentence(e)}); copy the file again") from e
    bounded.check_tree(obj, where=where)
    return obj


# what torch.load raises for a damaged or hostile file (its unpickler is plain Python)
_DAMAGED = (RuntimeError, EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError, OverflowError,
            RecursionError, MemoryError, zipfile.BadZipFile, struct.error)


def _gate(f: Any, *, where: str) -> None:
    """Check the zip's ``data.pkl`` with ckpt's own unpickler (:func:`torchfile.check_structure`)
    before torch's reads it: torch's hashes a shared or 200,000-deep tuple key (a hang or a
    segfault) before any check could run. Only a hostile structure is refused here; a zip or
    pickle that is merely damaged is left for torch's loader to explain."""
    try:
        with zipfile.ZipFile(f) as z:
            names = [i for i in z.infolist() if i.filename.endswith("/data.pkl")]
            data = z.read(names[0]) if len(names) == 1 and names[0].file_size <= safefs.MAX_METADATA_BYTES else None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError):
        data = None
    finally:
        f.seek(0)
    if data is not None:
        check_structure(data, where=where)


def stored_only(f: Any, *, where: str) -> None:
    """Refuse a torch.save zip (a path or file-like object) with a compressed record, or one
    whose record claims more bytes than the zip holds: torch.save only stores, and a deflated
    record is a decompression bomb waiting for torch's reader. Not a zip: nothing to check."""
    try:
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
            size = z.fp.seek(0, io.SEEK_END)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return  # torch's reader says what is wrong with it
    finally:
        if hasattr(f, "seek"):
            f.seek(0)
    for i in infos:
        if i.compress_type != zipfile.ZIP_STORED or i.file_size > size:
            raise BadInput(f"{where}: record {i.filename!r} is compressed or claims {i.file_size} bytes of a "
                           f"{size}-byte file; torch.save writes neither (corrupt or hostile file)")


def _refusal(where: str, e: pickle.UnpicklingError) -> BadInput:
    """UnsafeInput naming what the pickle asked for; a pickle that names no global is corrupt."""
    text = str(e)
    m = re.search(r"GLOBAL (\S+)", text) or re.search(r"Unsupported (?:global|class):? (\S+)", text)
    if m is None:
        detail = text.split("WeightsUnpickler error:", 1)
        if len(detail) == 2:
            # a pickle the safe loader cannot follow (e.g. a raw pickle.dump): refuse, never run it
            why = next((ln.strip() for ln in detail[1].splitlines() if ln.strip()), "unknown")
            return UnsafeInput(f"{where}: refused: not a torch.save file that can be loaded without running "
                               f"code ({why}); re-save it with torch.save")
        return Damaged(f"{where}: not a readable torch.save file, corrupt or truncated ({first_line(e)})")
    name = m.group(1).rstrip(".,")
    return UnsafeInput(f"{where}: refused: it asks to run {name}, which a checkpoint never needs; "
                       "the file may be malicious (nothing from it was run)")


def load_torch_meta(f: Any, *, where: str) -> Any:
    """``torch.load`` a file-like ``torch.save`` blob onto the meta device: the structure,
    shapes, strides and offsets, without reading the data."""
    stored_only(f, where=where)
    _gate(f, where=where)
    try:
        with _quiet_device_mesh():
            obj = torch.load(f, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refusal(where, e) from e
    except _DAMAGED as e:
        raise Damaged(f"{where}: corrupt or truncated item ({first_sentence(e)}); copy the file again") from e
    bounded.check_tree(obj, where=where)
    return obj


def _is_zip(path: Path) -> bool:
    with safefs.open_file(path) as f:
        return f.read(4) == b"PK\x03\x04"


def is_torchscript(path: Path) -> bool:
    """TorchScript archives are zips holding a ``code/`` folder or ``constants.pkl``."""
    if not _is_zip(path):
        return False
    try:
        with zipfile.ZipFile(path) as z:
            return any("/code/" in n or n.endswith("/constants.pkl") for n in z.namelist())
    except zipfile.BadZipFile:
        return False
