"""The protocol-2 pickle ``torch.save`` writes, emitted for a tree of inert nodes (what
:mod:`ckpt_tools.security.torchfile` reads) without importing torch, and patched for the next
file of the same shape: where its :class:`Slot` ints were written, and those ints replaced
(:func:`patch`). :mod:`.torchwriter` puts it in the zip.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import re
import struct
import sys
import threading
import types
from array import array
from collections import OrderedDict
from itertools import accumulate
from typing import Any

from ..errors import BadInput
from ..security.skeleton import int_opcode
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
    filled with ``(name, offset, value)`` of each :class:`Slot` written, for :func:`patch`.
    Written by the C pickler (:func:`_c_dumps`) where it can vouch for the bytes, else by
    :class:`_Emitter`."""
    slots = slots if slots is not None else []
    data = _c_dumps(tree, slots)  # (notes its slots only once it vouches for the bytes)
    if data is None:
        buf = io.BytesIO()
        emitter = _Emitter(buf, protocol=2)
        emitter.file, emitter.slots = buf, slots
        try:
            emitter.dump(tree)
        except RecursionError:
            raise BadInput("the pickle tree is nested too deeply to write") from None
        data = buf.getvalue()
    return data


# -- the C pickler ---------------------------------------------------------------------------
#
# torch.save's pickler is the C one, and :class:`_Emitter` writes what it writes; the C one
# writes it ~7x faster (a 25k-tensor file's tree: 2.2 s in Python). Three things it cannot do
# are done around it, and the result is checked, else the tree goes to _Emitter:
# - a Global node is a name only: the C pickler finds a global by importing its module, so each
#   module named has a stand-in module in sys.modules under a name of the same length no import
#   can mean (``^0^^^``), holding the node; the GLOBAL opcodes are renamed after, nothing shifting;
# - a Slot (an int subclass) and a one-character string kept apart (_Str, a str subclass) are
#   written through ``persistent_id`` as a sentinel (an int, a string with a random token), then
#   spliced: the int's own opcode in place of ``sentinel BINPERSID``, the character in place of the
#   sentinel's text (its memo put kept: it is where _Emitter puts the string);
# - REDUCE and NEWOBJ nodes reduce to their function or class and arguments (``reducer_override``).
# Every stand-in and sentinel must be found exactly where and as often as it was written.

_SENTINEL = 0x5EED << 48  # | i: a Slot's sentinel, an 8-byte LONG1 whose top bytes are these
_TOKEN = "\ue000" + "".join(f"{b:02x}" for b in os.urandom(8)) + "#"  # + i + "#": a _Str's sentinel
_SLOT_SPLICE = re.compile(rb"\x8a\x08(.{4})\x00\x00\xed\x5eQ", re.DOTALL)  # a Slot's sentinel, BINPERSID
_STR_SPLICE = re.compile(rb"X.{4}" + re.escape(_TOKEN.encode()) + rb"([0-9]+)#(q.|r.{4})Q",  # a _Str's, its memo put, BINPERSID
                         re.DOTALL)
_STANDS: dict[str, bytes] = {}  # a module's name -> its stand-in's, as written in a GLOBAL opcode
_STANDS_LOCK = threading.Lock()


class _Fallback(Exception):
    """The C pickler cannot write this tree as torch's does: _Emitter writes it."""


def _stand_in(node: Global) -> None:
    """Make ``node`` (a Global) what the C pickler finds at its name in its module's stand-in."""
    with _STANDS_LOCK:
        stand = _STANDS.get(node.module)
        if stand is None:
            name = f"^{len(_STANDS)}^".ljust(len(node.module), "^")
            if len(name) != len(node.module) or name in sys.modules:
                raise _Fallback(f"no stand-in name for module {node.module!r}")
            sys.modules[name] = types.ModuleType(name)
            stand = _STANDS[node.module] = name.encode("ascii")
        module = sys.modules[stand.decode("ascii")]
        if getattr(module, node.name, None) is not node:
            setattr(module, node.name, node)
            type.__setattr__(node, "__module__", module.__name__)
            type.__setattr__(node, "__qualname__", node.name)


class _CPickler(pickle.Pickler):
    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=2)
        self.globals: dict[str, int] = {}  # module -> Global nodes of it written (each once: memoized)
        self.slotted: list[Slot] = []
        self.strs: list[_Str] = []
        self.seen_strs: set[int] = set()

    def persistent_id(self, obj: Any) -> Any:
        t = type(obj)
        if t is StorageRef:
            return (_STORAGE, obj.type, obj.key, obj.location, obj.numel)
        if t is Slot:
            self.slotted.append(obj)
            return _SENTINEL | (len(self.slotted) - 1)
        if t is _Str:
            if id(obj) in self.seen_strs:  # a memo reference to it: _Emitter's to write
                raise _Fallback("a one-character string referenced twice")
            self.seen_strs.add(id(obj))
            self.strs.append(obj)
            return f"{_TOKEN}{len(self.strs) - 1}#"
        return None

    def reducer_override(self, obj: Any) -> Any:
        t = type(obj)
        if t is Reduce:
            return (obj.func, obj.args) if obj.state is None else (obj.func, obj.args, obj.state)
        if t is NewObj:
            return (copyreg.__newobj__, (obj.func, *obj.args)) + (() if obj.state is None else (obj.state,))
        if t is Global:
            if "\n" in obj.name or not obj.name.isascii():
                raise _Fallback("a global name the GLOBAL opcode cannot hold")
            _stand_in(obj)
            self.globals[obj.module] = self.globals.get(obj.module, 0) + 1
            return NotImplemented
        if t is OrderedDict:  # its class, as _Emitter writes it: the interned node
            if not obj.__dict__:  # (what its reduce gives without attributes, without the call)
                return (_ODICT, (), None, None, iter(obj.items()))
            return (_ODICT, *obj.__reduce_ex__(2)[1:])
        return NotImplemented  # a container, a number, bytes: the C pickler's own way


def _c_dumps(tree: Any, slots: list[tuple[Any, int, int]]) -> bytes | None:
    """``tree``'s pickle by the C pickler, its slots noted in ``slots``; None where it cannot
    vouch for it (then :class:`_Emitter` writes it)."""
    buf = io.BytesIO()
    pickler = _CPickler(buf)
    try:
        pickler.dump(tree)
    except Exception:  # noqa: BLE001 - anything it cannot write, _Emitter writes or refuses
        return None
    data = buf.getvalue()
    # let go of its memo (a table of every object written and the tuples reducer_override made
    # for them: ~37 MB for a 25k-tensor file) before the splices copy the pickle
    named, strs, slotted = pickler.globals, pickler.strs, pickler.slotted
    del pickler, buf
    for module, n in named.items():
        stand, real = b"c" + _STANDS[module] + b"\n", b"c" + module.encode("ascii") + b"\n"
        if data.count(stand) != n:
            return None
        data = data.replace(stand, real)
    if strs:
        data = _splice_strs(data, strs)
        if data is None:
            return None
    if slotted:
        data = _splice_slots(data, slotted, slots)
    return data


def _splice_strs(data: bytes, strs: list[_Str]) -> bytes | None:
    """``data`` with each kept-apart string's sentinel (and BINPERSID) made that string, its
    memo put kept; None unless each is found once, in the order written."""
    found = _STR_SPLICE.findall(data)
    if [int(i) for i, _ in found] != list(range(len(strs))):
        return None
    pieces = _STR_SPLICE.split(data)[::3]  # (split gives the text, then the two groups, ...)
    parts: list[bytes] = [pieces[0]]
    for s, (_, put), rest in zip(strs, found, pieces[1:]):
        text = str.encode(s, "utf-8", "surrogatepass")
        parts += (pickle.BINUNICODE + _U(len(text)) + text + put, rest)
    return b"".join(parts)


def _splice_slots(data: bytes, slotted: list[Slot], slots: list[tuple[Any, int, int]]) -> bytes | None:
    """``data`` with each slot's sentinel (and BINPERSID) made its int's own opcode, its place
    noted in ``slots``; None unless each is found once, in the order written (a slot's sentinel
    numbers it: the numbers found must be 0, 1, 2, ... as pickling met them)."""
    n = len(slotted)
    if b"".join(_SLOT_SPLICE.findall(data)) != array("I", range(n)).tobytes():
        return None
    values = [int(s) for s in slotted]
    codes = {v: _int_code(v) or int_opcode(v) for v in set(values)}
    parts: list[bytes] = [b""] * (2 * n + 1)
    parts[0::2] = _SLOT_SPLICE.split(data)[::2]  # (split gives the text, then the group, ...)
    parts[1::2] = [codes[v] for v in values]
    ends = list(accumulate(map(len, parts)))  # a slot's opcode starts where the text before it ends
    slots.extend(zip([s.name for s in slotted], ends[0::2], values))
    return b"".join(parts)


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
