"""The protocol-2 pickle ``torch.save`` writes, emitted for a tree of inert nodes (what
:mod:`ckpt_tools.security.torchfile` reads) without importing torch, and patched for the next
file of the same shape: where its :class:`Slot` ints were written, and those ints replaced
(:func:`patch`). :mod:`.torchwriter` puts it in the zip.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections import OrderedDict
from typing import Any

from ..errors import BadInput
from ..security.torchfile import _ODICT, _STORAGE, Global, NewObj, Reduce, StorageRef, _Str


class _Emitter(pickle._Pickler):
    """The pure-Python pickler (at protocol 2 the same bytes as the C one torch uses), taught the
    nodes. Python rather than C because only it lets a name-only stand-in be written as a GLOBAL."""

    dispatch = pickle._Pickler.dispatch.copy()

    def persistent_id(self, obj: Any) -> tuple | None:
        if type(obj) is StorageRef:
            return (_STORAGE, obj.type, obj.key, obj.location, obj.numel)
        return None

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is OrderedDict:  # a real OrderedDict reduces to its class: use the interned node
            self.save(_ODICT)
        elif type(obj) is Global:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))
            self.memoize(obj)
        else:
            super().save_global(obj, name)

    def _save_node(self, obj: Reduce) -> None:
        self.save(obj.func)
        self.save(obj.args)
        self.write(pickle.NEWOBJ if type(obj) is NewObj else pickle.REDUCE)
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    dispatch.update({Global: save_global, Reduce: _save_node, NewObj: _save_node, _Str: pickle._Pickler.save_str})

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        """``pickle._Pickler.save`` with the types a checkpoint's tree is made of done inline (a
        many-rank file's tree has ~100 nodes per tensor: the generic path's persistent-id call,
        frame commit and dispatch cost more than the bytes). The same opcodes, in the same order,
        as the generic path writes at protocol 2; anything else goes to it."""
        t = type(obj)
        write = self.write
        if t is int:
            if 0 <= obj <= 0xFF:
                write(pickle.BININT1 + _B(obj))
            elif 0 <= obj <= 0xFFFF:
                write(pickle.BININT2 + _H(obj))
            elif -0x80000000 <= obj <= 0x7FFFFFFF:
                write(pickle.BININT + _I(obj))
            else:
                self.save_long(obj)
            return
        if t is Slot:
            self.slots.append((obj.name, self.file.tell(), obj))
            self.save(int(obj))
            return
        if obj is None:
            write(pickle.NONE)
            return
        if t is bool:
            write(pickle.NEWTRUE if obj else pickle.NEWFALSE)
            return
        if t is StorageRef:  # a persistent id, before the memo (as the generic path)
            self.save((_STORAGE, obj.type, obj.key, obj.location, obj.numel))
            write(pickle.BINPERSID)
            return
        memo = self.memo
        x = memo.get(id(obj))
        if x is not None:
            i = x[0]
            write(pickle.BINGET + _B(i) if i < 256 else pickle.LONG_BINGET + _U(i))
            return
        if t is str or t is _Str:
            encoded = obj.encode("utf-8", "surrogatepass")
            write(pickle.BINUNICODE + _U(len(encoded)) + encoded)
        elif t is tuple:
            n = len(obj)
            if not n:
                write(pickle.EMPTY_TUPLE)
                return
            if n > 3:
                write(pickle.MARK)
            for element in obj:
                self.save(element)
            x = memo.get(id(obj))
            if x is not None:  # (a tuple that holds itself: the generic path's answer)
                i = x[0]
                get = pickle.BINGET + _B(i) if i < 256 else pickle.LONG_BINGET + _U(i)
                write((pickle.POP * n if n <= 3 else pickle.POP_MARK) + get)
                return
            write(_TUPLE_CODE.get(n, pickle.TUPLE))
        elif t is dict and len(obj) <= 1000:
            write(pickle.EMPTY_DICT)
            self._put(obj)
            if len(obj) > 1:
                write(pickle.MARK)
                for k, v in obj.items():
                    self.save(k)
                    self.save(v)
                write(pickle.SETITEMS)
            elif obj:
                for k, v in obj.items():
                    self.save(k)
                    self.save(v)
                write(pickle.SETITEM)
            return
        elif t is Reduce or t is NewObj:
            self._save_node(obj)
            return
        else:
            super().save(obj, save_persistent_id)
            return
        self._put(obj)

    def _put(self, obj: Any) -> None:  # memoize, inline
        i = len(self.memo)
        self.write(pickle.BINPUT + _B(i) if i < 256 else pickle.LONG_BINPUT + _U(i))
        self.memo[id(obj)] = i, obj


_B, _H, _I, _U = (struct.Struct(f).pack for f in ("<B", "<H", "<i", "<I"))
_TUPLE_CODE = {1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}


class Slot(int):
    """An int of a tree that files of the same shape hold other values of (a rank, a local size).
    :func:`dumps` notes where it writes each, so the next such file's pickle is this one's with
    the values replaced (:func:`patch`) instead of the whole tree written again."""

    def __new__(cls, name: Any, value: int) -> Slot:
        slot = super().__new__(cls, value)
        slot.name = name
        return slot


def dumps(tree: Any, slots: list[tuple[Any, int, int]] | None = None) -> bytes:
    """The protocol-2 pickle torch.save writes for the object ``tree`` stands for. ``slots``:
    filled with ``(name, offset, value)`` of each :class:`Slot` written, for :func:`patch`."""
    buf = io.BytesIO()
    emitter = _Emitter(buf, protocol=2)
    emitter.file, emitter.slots = buf, slots if slots is not None else []
    try:
        emitter.dump(tree)
    except RecursionError:
        raise BadInput("the pickle tree is nested too deeply to write") from None
    return buf.getvalue()


def _int_code(v: int) -> bytes:
    """What :meth:`_Emitter.save` writes for ``v`` (opcode and argument), or b"" for a long."""
    if 0 <= v <= 0xFF:
        return pickle.BININT1 + _B(v)
    if 0 <= v <= 0xFFFF:
        return pickle.BININT2 + _H(v)
    if -0x80000000 <= v <= 0x7FFFFFFF:
        return pickle.BININT + _I(v)
    return b""


def slot_places(slots: list[tuple[Any, int, int]]) -> dict[Any, list[tuple[int, int]]]:
    """The slots :func:`dumps` wrote, by name: where each was written and the value there."""
    places: dict[Any, list[tuple[int, int]]] = {}
    for name, at, old in slots:
        places.setdefault(name, []).append((at, old))
    return places


def patch(data: bytes, places: dict[Any, list[tuple[int, int]]], values: dict[Any, int]) -> bytes | None:
    """``data`` (written by :func:`dumps`, its slots at ``places``: :func:`slot_places`) with
    each slot named in ``values`` given that value: the bytes :func:`dumps` writes for the same
    tree holding those values. A value of another width (BININT1, BININT2, BININT) is spliced in:
    a protocol-2 pickle has no frames, ints are never memoized, and nothing in it counts bytes,
    so the rest reads the same shifted. None where a value needs a LONG1, or names no slot of
    ``data`` (then the tree is written whole)."""
    edits = []
    for name, value in values.items():
        written = places.get(name)
        if written is None:
            return None
        for at, old in written:
            if value == old and type(value) is type(old) is int:
                continue
            was, new = _int_code(old), _int_code(value)
            if not was or not new:
                return None
            edits.append((at, len(was), new))
    edits.sort()
    parts, done = [], 0
    for at, width, new in edits:
        if at < done:  # two slots written at one place: dumps never does
            return None
        parts += (data[done:at], new)
        done = at + width
    parts.append(data[done:])
    return b"".join(parts)


def patched_places(places: dict[Any, list[tuple[int, int]]], values: dict[Any, int]) -> dict[Any, list[tuple[int, int]]]:
    """Where the slots are, and what they hold, in what :func:`patch` made of ``values``: each
    place moved by the widths changed before it (so the next file can be patched from that one)."""
    moved = sorted((at, name, old, values.get(name, old)) for name, written in places.items() for at, old in written)
    out: dict[Any, list[tuple[int, int]]] = {}
    shift = 0
    for at, name, old, new in moved:
        out.setdefault(name, []).append((at + shift, new))
        shift += len(_int_code(new)) - len(_int_code(old))
    return out
