"""A faster careful unpickler for the few opcodes DCP's ``.metadata`` is made of.

The careful reader (``pickle._Unpickler`` with :func:`~ckpt_tools.security.bounded.guard_dispatch`)
costs about 0.5 µs an opcode: a method call, a ``read`` through the unframer and a dispatch per
opcode. A 256-rank ``.metadata`` with optimizer state holds 14.7 million opcodes (39 MB).
:func:`load` runs the same steps over the file's bytes in one loop with the stack in local
variables, and takes each MEMOIZE that follows an opcode with it: that file in 4.9 s instead of
7.6 s. A DCP record's common runs are taken in one turn too (its start with its state dict's,
a ``torch.Size((...))`` call, SETITEMS with its BUILD): a 256-rank file's 4.9 million opcodes
in 2.4 million turns. What is left is building the records (``__new__`` and ``__setstate__``,
the same calls in either reader) and the if-chain itself.

It is an accelerator, never a second judge: it does only what the careful reader would do
(globals through the same ``find_class``; every dict key through
:func:`~ckpt_tools.security.bounded.check_key` before it is hashed; REDUCE, NEWOBJ and BUILD the
same calls on the same objects, which only ``find_class`` can have put on the stack; BUILD never
into a class or function, which the careful reader refuses), and it
knows only the opcodes protocol 4 and 5 picklers write for plain data. On anything else (another
opcode, a frame that does not end where an opcode does, a missing memo entry or a BINPUT past
the memo's end, any exception raised by what it builds) it raises :class:`Decline` and the
caller reads the file the careful way from the start, so a refusal and its message are always
the careful reader's. Nothing it builds is deeper than the careful reader's: the caller still
passes the result through :func:`~ckpt_tools.security.bounded.check_tree`.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable
from typing import Any

from .bounded import check_key

_I4 = struct.Struct("<i").unpack_from
_U4 = struct.Struct("<I").unpack_from
_U8 = struct.Struct("<Q").unpack_from
_F8 = struct.Struct(">d").unpack_from


WINDOW = 1 << 20  # bytes read at a time when the pickle is read frame by frame (``more``)
_FRAME_MAX = 64 << 20  # a frame's size read for at most (picklers frame ~64 KiB at a time)


class Decline(Exception):
    """The fast reader does not vouch for this pickle; read it the careful way."""


class _Unread:
    """The memo entry of a part of a record that was not built (its state dict, a call's
    arguments, the record itself): met again, it is refused by the tree check."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<unread>"


UNREAD = _Unread()


class Widened(Exception):
    """The memo's codes widened from two bytes to four while a record reader worked out its
    codes (:meth:`Memo.shared`): nothing of the record was added; it is read again."""


class Memo:
    """The memo of one :func:`load`: entry ``i`` is ``objs[codes[i]]``, two bytes an entry while
    it names at most 65,536 objects, then four (widened once, in place).

    A 256-rank ``.metadata`` memoizes 1.2 million objects, nearly all of them parts of its
    records: their unbuilt parts and the records themselves (never referred to again by torch:
    :data:`UNREAD`, code 0) and a few hundred distinct ``torch.Size`` tuples and names, each
    kept once (:meth:`shared`): 5,700 objects in all. As a list of references it was 9.4 MB, the
    read's largest single allocation; as codes 2.3 MB. A file of many tensors names objects of
    each tensor's own (6-9: its metadata, names, path, Size, chunk list; its properties are
    shared, its state dict is UNREAD once spent) and widens past 7,000-11,000 tensors."""

    __slots__ = ("codes", "objs", "_shared", "_room", "strings")

    def __init__(self) -> None:
        self.codes = array("H")
        self.objs: list[Any] = [UNREAD]
        self._shared: dict[int, int] = {}  # id of an object kept once -> its code
        self._room = 0xFFFF  # the largest code ``codes`` holds
        # each distinct short string read, once: a DCP pickles a tensor's name anew in its
        # metadata's key and in each rank's storage entry (25k tensors over 16 ranks: the read's
        # peak 4.4 MB lower). Equal strings, one object: the tree is equal to the careful
        # reader's, never re-pickled
        self.strings: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, i: int) -> Any:
        return self.objs[self.codes[i]]

    def append(self, x: Any) -> None:
        code = len(self.objs)
        if code > self._room:
            self._widen()
        self.codes.append(code)
        self.objs.append(x)

    def __setitem__(self, i: int, x: Any) -> None:  # (a BINPUT over an entry: :func:`_put`)
        code = len(self.objs)
        if code > self._room:
            self._widen()
        self.codes[i] = code
        self.objs.append(x)

    def shared(self, x: Any) -> int:
        """The code of ``x``, an object entered many times (a Size's tuple, a name): one a value.
        :class:`Widened` where the codes widened first (a record reader's runs of codes, worked
        out before, would be two bytes an entry)."""
        code = self._shared.get(id(x))
        if code is None:
            code = len(self.objs)
            if code > self._room:
                self._widen()
                raise Widened
            self._shared[id(x)] = code
            self.objs.append(x)  # (kept: its id stays its own)
        return code

    def _widen(self) -> None:
        old, self.codes, self._room = self.codes, array("I", self.codes), 0xFFFF_FFFF
        del old[:]  # (let go at once: a reader's runs were bound to it, and find it gone)


def load(buf: bytes, find_class: Callable[[str, str], Any], records: dict[type, Callable] | None = None,
         more: Callable[[int], bytes] | None = None, pairs: Callable[[dict, list], list] | None = None) -> Any:
    """The object pickled in ``buf`` (the whole pickle, STOP its last opcode read), exactly as
    the careful reader with ``find_class`` builds it; :class:`Decline` where it cannot say.

    ``records``: for a class ``find_class`` gives, a reader of one record of it (called as
    ``reader(buf, pos, frame_end, memo)`` at its EMPTY_TUPLE NEWOBJ, after the class) that
    returns ``(value, end)`` with the record's entries added to the :class:`Memo`, or None to
    read it opcode by opcode; the value stands for the object built (:mod:`.dcprows`).

    ``more``: where ``buf`` is the pickle's start only, ``more(n)`` gives up to ``n`` of its
    next bytes (a file's ``read``): the pickle is read frame by frame, the bytes before the
    current frame let go (a 256-rank ``.metadata`` with its optimizer is 39 MB, held whole
    while its rows were built). An opcode outside every frame that reaches past what was
    read declines, as one past the pickle's end does.

    ``pairs``: called with each dict a SETITEMS fills and its keys and values (flat, as on the
    stack), it returns those the dict is to take (the rest it kept elsewhere: :mod:`.dcprows`
    joins a DCP's storage entries to their chunks). The tree is then not the careful reader's."""
    try:
        return _load(buf, find_class, records or {}, more, pairs)
    except Decline:
        raise
    except Exception as e:  # what the careful reader would make of it is its own to say
        raise Decline(f"{type(e).__name__}: {e}") from None


def _load(buf: bytes, find_class: Callable[[str, str], Any], records: dict[type, Callable],  # noqa: C901 (one loop on purpose)
          more: Callable[[int], bytes] | None, pairs: Callable[[dict, list], list] | None = None) -> Any:
    if more is not None and len(buf) < 11:  # the protocol and the first FRAME opcode with its size
        buf += more(11 - len(buf))
    n = len(buf)
    # the memo as codes: MEMOIZE numbers objects 0, 1, 2, ... (a dict of 1.2 million int keys,
    # as a 256-rank .metadata needs, is ~70 MB and slower); a BINPUT past its end declines
    memo = Memo()
    objs = memo.objs  # (its codes read as memo.codes: they widen once, where the memo names 65,536 objects)
    strings = memo.strings
    memoize = memo.append
    stack: list[Any] = []
    metastack: list[list[Any]] = []
    append = stack.append
    # protocol 4 or 5 only, named once at the start: ``find_class`` then behaves as in the
    # careful reader (which maps Python 2 names for protocols under 3)
    if n < 2 or buf[0] != 0x80 or buf[1] not in (4, 5):
        raise Decline("not a protocol 4 or 5 pickle")
    pos = 2
    framed = False
    fend = n  # where the current frame ends
    while True:
        op = buf[pos]
        # most frequent first (in a many-rank .metadata, runs of opcodes taken together): a chain
        # of compares is cheaper than a call through a table
        if op == 0x6a:  # LONG_BINGET
            x = objs[memo.codes[_U4(buf, pos + 1)[0]]]
            pos += 5
            # a record's class, then EMPTY_TUPLE NEWOBJ: the record read in the same turn (as below)
            if type(x) is type and buf[pos] == 0x29 and buf[pos + 1] == 0x81 and x in records:
                try:
                    got = records[x](buf, pos, fend, memo)
                except Widened:
                    got = records[x](buf, pos, fend, memo)
                if got is not None:
                    x, pos = got
            append(x)
            continue
        if op == 0x68:  # BINGET
            append(objs[memo.codes[buf[pos + 1]]])
            pos += 2
            continue
        if op == 0x4b:  # BININT1
            append(buf[pos + 1])
            pos += 2
            continue
        if op == 0x29:  # EMPTY_TUPLE
            if buf[pos + 1] == 0x81:  # EMPTY_TUPLE NEWOBJ: cls() without arguments
                cls = stack[-1]
                if type(cls) is type and cls in records:  # a record read in one step
                    try:
                        got = records[cls](buf, pos, fend, memo)
                    except Widened:  # (nothing of it added: read again, its codes four bytes each)
                        got = records[cls](buf, pos, fend, memo)
                    if got is not None:
                        stack[-1], pos = got
                        continue
                stack[-1] = obj = cls.__new__(cls)
                pos += 2
                if buf[pos] == 0x94:
                    memoize(obj)
                    pos += 1
                    if buf.startswith(_STATE_OPENS, pos):  # its state dict begun: EMPTY_DICT MEMOIZE MARK
                        x = {}
                        append(x)
                        # its memo entry UNREAD: the dict is spent by the BUILD that ends the
                        # record (a pickler never refers back to it; one that does is refused
                        # by the tree check), not held to the end (a 25k-tensor file's, 6 MB)
                        memo.codes.append(0)
                        metastack.append(stack)
                        stack = []
                        append = stack.append
                        pos += 3
                continue
            append(())
            pos += 1
            continue
        if op == 0x86 or op == 0x85:  # TUPLE2, TUPLE1
            if op == 0x86:
                x = (stack[-2], stack[-1])
                del stack[-2:]
            else:
                x = (stack.pop(),)
            append(x)
            pos += 1
            if buf[pos] == 0x94:
                memoize(x)
                pos += 1
                if buf.startswith(_CALLED_WITH_IT, pos):  # TUPLE1 MEMOIZE REDUCE MEMOIZE: f(x), as torch.Size((...)) pickles
                    memo.codes.append(0)  # (the call's argument tuple, spent by it: UNREAD, as above)
                    stack.pop()
                    stack[-1] = x = stack[-1](x)
                    memoize(x)
                    pos += 4
            continue
        if op == 0x75:  # SETITEMS
            items = stack
            stack = metastack.pop()
            append = stack.append
            target = stack[-1]
            if pairs is not None:
                items = pairs(target, items)
            for i in range(0, len(items) - 1, 2):
                check_key(items[i])
                target[items[i]] = items[i + 1]
            pos += 1
            if buf[pos] == 0x62:  # BUILD with the state dict just filled
                _build(stack)
                pos += 1
            continue
        if op == 0x4d:  # BININT2
            append(buf[pos + 1] | buf[pos + 2] << 8)
            pos += 3
            continue
        if op == 0x8c:  # SHORT_BINUNICODE
            end = pos + 2 + buf[pos + 1]
            if end > n:
                raise Decline("truncated")
            x = str(buf[pos + 2:end], "utf-8", "surrogatepass")
            x = strings.setdefault(x, x)
            append(x)
            pos = end
            if buf[pos] == 0x94:
                memoize(x)
                pos += 1
            continue
        if op == 0x4a:  # BININT
            append(_I4(buf, pos + 1)[0])
            pos += 5
            continue
        if op == 0x94:  # MEMOIZE (one not taken with the opcode before it)
            memoize(stack[-1])
            pos += 1
            continue
        if op == 0x28:  # MARK
            metastack.append(stack)
            stack = []
            append = stack.append
            pos += 1
            continue
        if op == 0x62:  # BUILD
            _build(stack)
            pos += 1
            continue
        if op == 0x7d:  # EMPTY_DICT
            x = {}
            append(x)
            pos += 1
            if buf[pos] == 0x94:
                memoize(x)
                pos += 1
            continue
        if op == 0x52:  # REDUCE
            args = stack.pop()
            stack[-1] = x = stack[-1](*args)
            pos += 1
            if buf[pos] == 0x94:
                memoize(x)
                pos += 1
            continue
        if op == 0x89:  # NEWFALSE
            append(False)
            pos += 1
            continue
        if op == 0x88:  # NEWTRUE
            append(True)
            pos += 1
            continue
        if op == 0x4e:  # NONE
            append(None)
            pos += 1
            continue
        if op == 0x74 or op == 0x87:  # TUPLE, TUPLE3
            if op == 0x74:
                x = tuple(stack)
                stack = metastack.pop()
                append = stack.append
            else:
                x = (stack[-3], stack[-2], stack[-1])
                del stack[-3:]
            append(x)
            pos += 1
            if buf[pos] == 0x94:
                memoize(x)
                pos += 1
            continue
        if op == 0x5d:  # EMPTY_LIST
            x = []
            append(x)
            pos += 1
            if buf[pos] == 0x94:
                memoize(x)
                pos += 1
            continue
        if op == 0x65 or op == 0x61:  # APPENDS, APPEND
            if op == 0x65:
                items = stack
                stack = metastack.pop()
                append = stack.append
            else:
                items = [stack.pop()]
            if type(stack[-1]) is not list:  # extend() or append() of another object: careful reader's
                raise Decline("APPENDS to a non-list")
            stack[-1].extend(items)
            pos += 1
            continue
        if op == 0x81:  # NEWOBJ
            args = stack.pop()
            cls = stack[-1]
            stack[-1] = x = cls.__new__(cls, *args)
            pos += 1
            continue
        if op == 0x93:  # STACK_GLOBAL
            name = stack.pop()
            module = stack[-1]
            if type(name) is not str or type(module) is not str:
                raise Decline("STACK_GLOBAL requires str")
            stack[-1] = find_class(module, name)
            pos += 1
            continue
        if op == 0x58 or op == 0x8d:  # BINUNICODE, BINUNICODE8
            if op == 0x58:
                size, start = _U4(buf, pos + 1)[0], pos + 5
            else:
                size, start = _U8(buf, pos + 1)[0], pos + 9
            end = start + size
            if end > n:
                raise Decline("truncated")
            append(str(buf[start:end], "utf-8", "surrogatepass"))
            pos = end
            continue
        if op == 0x43 or op == 0x42:  # SHORT_BINBYTES, BINBYTES
            if op == 0x43:
                size, start = buf[pos + 1], pos + 2
            else:
                size, start = _U4(buf, pos + 1)[0], pos + 5
            end = start + size
            if end > n:
                raise Decline("truncated")
            append(bytes(buf[start:end]))
            pos = end
            continue
        if op == 0x8a:  # LONG1
            size = buf[pos + 1]
            end = pos + 2 + size
            if end > n:
                raise Decline("truncated")
            append(int.from_bytes(buf[pos + 2:end], "little", signed=True))
            pos = end
            continue
        if op == 0x47:  # BINFLOAT
            append(_F8(buf, pos + 1)[0])
            pos += 9
            continue
        if op == 0x71:  # BINPUT
            _put(memo, buf[pos + 1], stack[-1], records)
            pos += 2
            continue
        if op == 0x72:  # LONG_BINPUT
            _put(memo, _U4(buf, pos + 1)[0], stack[-1], records)
            pos += 5
            continue
        if op == 0x73:  # SETITEM
            value = stack.pop()
            key = stack.pop()
            check_key(key)
            stack[-1][key] = value
            pos += 1
            continue
        if op == 0x64:  # DICT
            items = stack
            stack = metastack.pop()
            append = stack.append
            for k in items[::2]:
                check_key(k)
            append({items[i]: items[i + 1] for i in range(0, len(items) - 1, 2)})
            pos += 1
            continue
        if op == 0x6c:  # LIST
            items = stack
            stack = metastack.pop()
            append = stack.append
            append(items)
            pos += 1
            continue
        if op == 0x95:  # FRAME: the careful reader's framing, or decline
            if framed and pos != fend:  # a frame begun before the last one was read to its end
                raise Decline("frame not at the end of the previous one")
            if more is not None and (n - pos < 9 or n - pos < 18 + _U8(buf, pos + 1)[0]):
                buf = _refill(buf[pos:], more)  # the frame is not all read: the bytes before it let go
                n, pos = len(buf), 0
            size = _U8(buf, pos + 1)[0]
            pos += 9
            fend = pos + size
            if fend > n:
                raise Decline("frame past the end of the file")
            framed = True
            continue
        if op == 0x2e:  # STOP
            pos += 1
            # an opcode read across a frame's end shows here: past the end of the last frame
            if framed and pos > fend or pos > n:
                raise Decline("opcode across a frame's end")
            return stack.pop()
        raise Decline(f"opcode {op:#04x}")


def _refill(rest: bytes, more: Callable[[int], bytes]) -> bytes:
    """``rest`` (from a FRAME opcode on) and the next window of the pickle, at least to that
    frame's end and the next frame's opcode and size where the pickle goes that far: the loop
    looks a few bytes past an opcode (a MEMOIZE after it, a run it starts) and sees there what
    it sees when it reads the whole pickle."""
    buf = rest + more(WINDOW)
    # (a frame past any a pickler writes, ~64 KiB, is not read for: the loop then declines it)
    if len(buf) >= 9 and len(buf) < (need := 18 + _U8(buf, 1)[0]) <= _FRAME_MAX:
        buf += more(need - len(buf))
    return buf


# runs of opcodes a DCP record pickles as, taken in one turn of the loop (the same steps)
_STATE_OPENS = b"}\x94("  # EMPTY_DICT MEMOIZE MARK, after EMPTY_TUPLE NEWOBJ MEMOIZE
_CALLED_WITH_IT = b"\x85\x94R\x94"  # TUPLE1 MEMOIZE REDUCE MEMOIZE, after a tuple memoized


def _build(stack: list[Any]) -> None:
    """BUILD: the state on top into the object below it, by its ``__setstate__``."""
    state = stack.pop()
    inst = stack[-1]
    if callable(inst):  # a class or function find_class gave: the careful reader refuses it
        raise Decline("BUILD on a class or function")
    setstate = getattr(inst, "__setstate__", None)
    if setstate is None:  # plain __dict__/slots update: rare, the careful reader's
        raise Decline("BUILD without __setstate__")
    setstate(state)


def _put(memo: list[Any] | Memo, i: int, x: Any, records: dict | None = None) -> None:
    """BINPUT: at ``i`` of the memo, as the careful reader's dict takes it, where a list can.
    Not over an entry while records are read in one step: their readers may keep what they
    looked up in the memo (protocols 4 and 5 never put twice; only a hand-made pickle does)."""
    if i < len(memo):
        if records:
            raise Decline("BINPUT over a memo entry")
        memo[i] = x
    elif i == len(memo):
        memo.append(x)
    else:
        raise Decline("BINPUT past the memo's end")


def pickled_int(b: bytes) -> int:
    """An int as pickled: BININT1, BININT2, BININT or LONG1 (its opcode first)."""
    op = b[0]
    if op == 0x4b:
        return b[1]
    if op == 0x4d:
        return b[1] | b[2] << 8
    if op == 0x4a:
        return _I4(b, 1)[0]
    return int.from_bytes(b[2:], "little", signed=True)


def pickled_ints(b: bytes) -> tuple[int, ...] | None:
    """The non-negative ints of a run of BININT1, BININT2 and BININT opcodes; None if one is negative."""
    out, i = [], 0
    while i < len(b):
        n = 2 if b[i] == 0x4b else 3 if b[i] == 0x4d else 5
        v = pickled_int(b[i:i + n])
        if v < 0:
            return None
        out.append(v)
        i += n
    return tuple(out)
