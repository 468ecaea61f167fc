"""One ``torch.save`` file written without torch: the object :class:`.torchsave.Writer` saves
(a bare state dict, or ``{"model", "optimizer", ...}``), built as the pickle tree torch's
pickler visits for it, its storage records copied file to file by the kernel (or cast block by
block) in the order pickling numbers them.

Every zip record but ``.data/serialization_id`` equals what the torch path writes, at the same
offsets (tested).
Saved objects that are not plain data, and dtypes without a legacy storage class, take the torch
path (:func:`native_writer` says which).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..codecs.torchpickler import dumps
from ..core.describe import Checkpoint
from ..core.plan import Piece, Span, by_piece
from ..storage.castio import CastSpan
from .dcpnative import NotNative, STORAGE_OF, Writer as _ObjectReader, plain
from .hf import tensor_bytes
from .shardsynth import SMALL_RECORDS, _local
from .shardtree import Emitter, NotSimple, write_file
from .torchsave import training_state


class Writer:
    """A single ``torch.save`` file, without torch. Build it with :func:`native_writer`."""

    single_file = True
    accepts_spans = True
    accepts_casts = True

    def __init__(self, *, root: Path, param_order: tuple[str, ...] = ()) -> None:
        self.root = Path(root)
        self.param_order = param_order

    def obj(self, job: Any) -> Any:
        """The saved object with each tensor a :class:`Piece` (torchsave.Writer's layout)."""

        try:
            rest = _ObjectReader(root=self.root).values(tuple(job.objects))
        except NotNative as e:
            raise NotSimple(str(e)) from e
        extra = job.meta.get("extra", {})
        if not all(plain(v) for v in extra.values()):
            raise NotSimple("extra state that is not plain data")
        rest.update(extra)
        return training_state(job.pieces, {p: p for p in job.pieces}, rest, self.param_order)

    def tree_for(self, job: Any) -> tuple[Any, Emitter]:
        """The pickle tree and its storages, numbered in the order pickling visits them."""
        emitter = Emitter()

        def build(x: Any) -> Any:
            if isinstance(x, Piece):
                return _local(emitter, x.target.dtype, x.sizes, x, slots=False)
            if type(x) is dict:
                return {k: build(v) for k, v in x.items()}
            return x  # plain data (the values the source saved)

        return build(self.obj(job)), emitter

    def write(self, path: Path, job: Any, pieces: Any, objects: Any) -> None:
        tree, emitter = self.tree_for(job)
        stream = iter(pieces)
        values = by_piece(stream)

        def fill():
            for key, src in emitter.records:
                v = values(src)
                yield key, (list(v.parts) if isinstance(v, Span) else v if isinstance(v, CastSpan) else tensor_bytes(v))
            for _ in stream:
                pass

        # "archive", as torch.save into an open file names it (the path here is a staging name);
        # laid out as torch lays it out: a lone file has no manifest, only its records' CRCs
        write_file(path, dumps(tree), SMALL_RECORDS, fill(), prefix="archive", page_phase=False)

    def finish(self, out: Path, jobs: Any, written: dict) -> None:
        pass


def native_writer(ckpt: Checkpoint, jobs: Any, *, param_order: tuple[str, ...]) -> Writer | None:
    """The torch-free writer for ``jobs`` (one file), or None where torch's writer is needed."""
    writer = Writer(root=ckpt.base_dir(), param_order=param_order)
    try:
        for job in jobs:
            if any(str(p.target.dtype) not in STORAGE_OF for p in job.pieces):
                return None
            writer.tree_for(job)
    except (NotSimple, NotNative):
        return None
    return writer
