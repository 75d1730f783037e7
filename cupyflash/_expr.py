"""The language of ``score_mod`` and ``mask_mod``: parse, check, evaluate, differentiate.

An expression is a string such as ``"score - gamma[h] * abs(q_idx - kv_idx)"`` or
``"(kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])"``.  :func:`parse` turns it into a
typed tree (:class:`Node`) after checking every name, function, type and index count
against the ``mod_args`` arrays it may read, and raises ``ValueError`` quoting the
expression with a caret under the offending token otherwise.  A tree is then

* evaluated on NumPy arrays (:func:`evaluate`: the CPU path, block by block);
* differentiated with respect to ``score`` (:func:`derivative`: a tree again, used by
  the backward);
* printed in a normalised, fully parenthesised form (:func:`normalised`: cache keys).

The grammar, loosest binding first (``|`` and ``&`` bind looser than comparisons, unlike
Python, so that ``q_idx >= 3 & kv_idx < 5`` means what it says)::

    or      := and ("|" and)*
    and     := not ("&" not)*
    not     := "~" not | compare
    compare := sum (("<" | "<=" | ">" | ">=" | "==" | "!=") sum)?     (no chains)
    sum     := product (("+" | "-") product)*
    product := unary (("*" | "/") unary)*
    unary   := "-" unary | postfix
    postfix := NAME "[" expr ("," expr)* "]" | atom
    atom    := NUMBER | NAME | NAME "(" expr ("," expr)* ")" | "(" expr ")"

Types are ``int``, ``float`` and ``bool``.  Numbers with a ``.`` or an exponent are
float; ``b`` (the flat batch index), ``h`` (the query head), ``q_idx`` and ``kv_idx``
are int; ``score`` (``score_mod`` only) is float; an element of a ``mod_args`` array has
its array's kind (bool, int, float).  ``+ - *`` keep int when both sides are int, ``/``
is always float; comparisons give bool, ``& | ~`` take bool.  Functions: ``tanh exp log
sqrt sigmoid`` (float), ``abs`` and ``floor`` (``floor`` gives int), ``min max`` (two
arguments), ``where(cond, a, b)``.  Indices are int expressions, one per axis of the
array; an index outside ``[0, n)`` raises ``IndexError`` at evaluation (never wraps).
``mod_args`` float arrays are constants: no gradient flows into them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

__all__ = ["Node", "parse", "evaluate", "derivative", "constant", "normalised", "COORDINATES", "FUNCTIONS"]

COORDINATES = ("b", "h", "q_idx", "kv_idx")
FUNCTIONS = {"tanh": 1, "exp": 1, "log": 1, "sqrt": 1, "sigmoid": 1, "abs": 1, "floor": 1, "min": 2, "max": 2,
             "where": 3}
_FLOAT_FUNCTIONS = ("tanh", "exp", "log", "sqrt", "sigmoid")
_COMPARE = ("<", "<=", ">", ">=", "==", "!=")
_TOKEN = re.compile(r"\s*(?:(?P<num>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z_]\w*)"
                    r"|(?P<op><=|>=|==|!=|[-+*/()\[\],<>&|~]))")


@dataclass(frozen=True)
class Node:
    """One node of an expression tree: ``kind`` is ``"num"``, ``"name"``, ``"index"``
    (``value`` the array's name, ``args`` the indices), ``"neg"``, ``"not"``, ``"op"``
    (``value`` the operator), ``"call"`` (``value`` the function); ``type`` is ``"int"``,
    ``"float"`` or ``"bool"``; ``pos`` the offset of its token in the source."""

    kind: str
    type: str
    value: object = None
    args: tuple = ()
    pos: int = 0


class _Error(ValueError):
    pass


def _fail(what: str, text: str, pos: int, message: str):
    raise ValueError(f"`{what}`: {message}\n    {text}\n    {' ' * pos}^")


def _arg_kind(a) -> str:
    kind = np.dtype(a.dtype).kind
    return "bool" if kind == "b" else "int" if kind in "iu" else "float"


class _Parser:
    def __init__(self, text: str, what: str, arrays: dict, allow_score: bool):
        self.text, self.what, self.arrays, self.allow_score = text, what, arrays, allow_score
        self.tokens = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                if text[pos:].strip() == "":
                    break
                bad = pos + len(text[pos:]) - len(text[pos:].lstrip())
                _fail(what, text, bad, f"unexpected character {text[bad]!r}")
            kind = m.lastgroup
            self.tokens.append((kind, m.group(kind), m.start(kind)))
            pos = m.end()
        self.tokens.append(("end", "", len(text)))
        self.i = 0

    # ---- tokens ---------------------------------------------------------------------------------

    def peek(self):
        return self.tokens[self.i]

    def take(self, value=None):
        tok = self.tokens[self.i]
        if value is not None and tok[1] != value:
            self.error(tok, f"expected {value!r}" + (f", got {tok[1]!r}" if tok[0] != "end" else " at the end"))
        self.i += 1
        return tok

    def error(self, tok, message):
        _fail(self.what, self.text, tok[2], message)

    def need(self, node: Node, types, tok, what):
        if node.type not in types:
            self.error(tok, f"{what} needs {' or '.join(types)}, got {node.type}")

    # ---- grammar ----------------------------------------------------------------------------------

    def parse(self) -> Node:
        if self.peek()[0] == "end":
            self.error(self.peek(), "empty expression")
        node = self.or_()
        if self.peek()[0] != "end":
            self.error(self.peek(), f"unexpected {self.peek()[1]!r}")
        return node

    def binary(self, ops, operand, check):
        left_tok = self.peek()
        node = operand()
        while self.peek()[1] in ops and self.peek()[0] == "op":
            tok = self.take()
            right_tok = self.peek()
            right = operand()
            node = check(tok, node, right, left_tok, right_tok)
        return node

    def or_(self):
        return self.binary(("|",), self.and_, self.logical)

    def and_(self):
        return self.binary(("&",), self.not_, self.logical)

    def logical(self, tok, a, b, a_tok, b_tok):
        self.need(a, ("bool",), a_tok, f"{tok[1]!r}")
        self.need(b, ("bool",), b_tok, f"{tok[1]!r}")
        return Node("op", "bool", tok[1], (a, b), tok[2])

    def not_(self):
        if self.peek()[1] == "~" and self.peek()[0] == "op":
            tok = self.take()
            operand_tok = self.peek()
            a = self.not_()
            self.need(a, ("bool",), operand_tok, "'~'")
            return Node("not", "bool", None, (a,), tok[2])
        return self.compare()

    def compare(self):
        a_tok = self.peek()
        a = self.sum()
        if self.peek()[1] in _COMPARE and self.peek()[0] == "op":
            tok = self.take()
            b_tok = self.peek()
            b = self.sum()
            self.need(a, ("int", "float"), a_tok, f"{tok[1]!r}")
            self.need(b, ("int", "float"), b_tok, f"{tok[1]!r}")
            if self.peek()[1] in _COMPARE and self.peek()[0] == "op":
                self.error(self.peek(), "comparisons do not chain: use & between two of them")
            return Node("op", "bool", tok[1], (a, b), tok[2])
        return a

    def arithmetic(self, tok, a, b, a_tok, b_tok):
        self.need(a, ("int", "float"), a_tok, f"{tok[1]!r}")
        self.need(b, ("int", "float"), b_tok, f"{tok[1]!r}")
        kind = "float" if tok[1] == "/" or "float" in (a.type, b.type) else "int"
        return Node("op", kind, tok[1], (a, b), tok[2])

    def sum(self):
        return self.binary(("+", "-"), self.product, self.arithmetic)

    def product(self):
        return self.binary(("*", "/"), self.unary, self.arithmetic)

    def unary(self):
        if self.peek()[1] == "-" and self.peek()[0] == "op":
            tok = self.take()
            operand_tok = self.peek()
            a = self.unary()
            self.need(a, ("int", "float"), operand_tok, "'-'")
            return Node("neg", a.type, None, (a,), tok[2])
        return self.atom()

    def arguments(self, close):
        args, toks = [], []
        while True:
            toks.append(self.peek())
            args.append(self.or_())
            if self.peek()[1] == ",":
                self.take()
                continue
            self.take(close)
            return args, toks

    def atom(self):
        tok = self.take()
        kind, text, pos = tok
        if kind == "num":
            is_float = any(c in text for c in ".eE")
            value = float(text) if is_float else int(text)
            if not is_float and value >= 2**63:
                self.error(tok, "integer too large (int64)")
            return Node("num", "float" if is_float else "int", value, (), pos)
        if kind == "op" and text == "(":
            node = self.or_()
            self.take(")")
            return node
        if kind != "name":
            self.error(tok, "expected a number, a name or '('" if kind != "end" else "unexpected end")
        following = self.peek()[1] if self.peek()[0] == "op" else None
        if following == "(":
            return self.call(tok)
        if following == "[":
            return self.index(tok)
        if text in self.arrays:
            self.error(tok, f"`mod_args` array {text!r} needs {self.arrays[text].ndim} index(es): {text}[...]")
        if text == "score":
            if not self.allow_score:
                self.error(tok, "`score` exists in score_mod only (mask_mod sees the indices)")
            return Node("name", "float", text, (), pos)
        if text in COORDINATES:
            return Node("name", "int", text, (), pos)
        if text in FUNCTIONS:
            self.error(tok, f"{text}() is a function: call it")
        self.error(tok, f"unknown name {text!r} (names: score, b, h, q_idx, kv_idx and the `mod_args` arrays)")

    def call(self, tok):
        name, pos = tok[1], tok[2]
        if name not in FUNCTIONS:
            self.error(tok, f"unknown function {name!r} (functions: {', '.join(FUNCTIONS)})")
        self.take("(")
        args, toks = self.arguments(")")
        if len(args) != FUNCTIONS[name]:
            self.error(tok, f"{name}() takes {FUNCTIONS[name]} argument(s), got {len(args)}")
        if name == "where":
            self.need(args[0], ("bool",), toks[0], "where()'s condition")
            a, b = args[1:]
            if (a.type == "bool") != (b.type == "bool"):
                self.error(toks[2], "where()'s two values must both be bool or both be numbers")
            kind = "bool" if a.type == "bool" else "float" if "float" in (a.type, b.type) else "int"
        else:
            for a, t in zip(args, toks):
                self.need(a, ("int", "float"), t, f"{name}()")
            if name in _FLOAT_FUNCTIONS:
                kind = "float"
            elif name == "floor":
                kind = "int"
            else:
                kind = "float" if any(a.type == "float" for a in args) else "int"
        return Node("call", kind, name, tuple(args), pos)

    def index(self, tok):
        name, pos = tok[1], tok[2]
        if name not in self.arrays:
            known = ", ".join(self.arrays) or "none given"
            self.error(tok, f"unknown array {name!r} (the `mod_args` arrays: {known})")
        array = self.arrays[name]
        self.take("[")
        args, toks = self.arguments("]")
        if len(args) != array.ndim:
            self.error(tok, f"{name!r} has {array.ndim} axis(es) (shape {tuple(array.shape)}), "
                            f"indexed with {len(args)}")
        for a, t in zip(args, toks):
            self.need(a, ("int",), t, f"an index of {name!r}")
        return Node("index", _arg_kind(array), name, tuple(args), pos)


def parse(text, what: str, arrays: dict | None = None, *, boolean: bool = False) -> Node:
    """The checked tree of ``text`` (``what``: ``"score_mod"`` or ``"mask_mod"``, named in
    errors); ``arrays`` the ``mod_args`` arrays by name; ``boolean``: a mask_mod, whose
    value must be bool and which may not read ``score``."""
    if not isinstance(text, str):
        raise TypeError(f"`{what}` must be a string expression, got {type(text).__name__}")
    node = _Parser(text, what, arrays or {}, allow_score=not boolean).parse()
    if boolean and node.type != "bool":
        _fail(what, text, node.pos, f"a mask_mod must be boolean (a comparison, & | ~, a bool array); "
                                    f"this is {node.type}")
    if not boolean and node.type == "bool":
        _fail(what, text, node.pos, "a score_mod must be a number, not bool (a mask goes in mask_mod)")
    return node


# ---- printing -------------------------------------------------------------------------------------


def normalised(node: Node) -> str:
    """A canonical, fully parenthesised text of the tree (equal trees, equal texts)."""
    if node.kind == "num":
        return repr(node.value)
    if node.kind == "name":
        return node.value
    if node.kind == "index":
        return f"{node.value}[{', '.join(normalised(a) for a in node.args)}]"
    if node.kind == "neg":
        return f"(-{normalised(node.args[0])})"
    if node.kind == "not":
        return f"(~{normalised(node.args[0])})"
    if node.kind == "op":
        return f"({normalised(node.args[0])} {node.value} {normalised(node.args[1])})"
    return f"{node.value}({', '.join(normalised(a) for a in node.args)})"


# ---- NumPy evaluation -----------------------------------------------------------------------------


def evaluate(node: Node, env: dict, arrays: dict, acc_t) -> np.ndarray:
    """The tree's value on NumPy arrays: ``env`` maps ``score`` and the coordinates to
    arrays that broadcast together (``score`` of ``acc_t``, the coordinates int64);
    ``arrays`` the ``mod_args`` (NumPy), float ones read in ``acc_t``.  Float results are
    ``acc_t``, int ones int64, bool ones bool.  An index outside its axis raises
    IndexError naming the array."""
    acc_t = np.dtype(acc_t)

    def as_float(x, n):
        return x.astype(acc_t, copy=False) if n.type != "float" else x

    def go(n: Node):
        k = n.kind
        if k == "num":
            return np.asarray(n.value, dtype=acc_t if n.type == "float" else np.int64)
        if k == "name":
            return env[n.value]
        if k == "index":
            array = arrays[n.value]
            idx = [np.asarray(go(a), dtype=np.int64) for a in n.args]
            for axis, (i, size) in enumerate(zip(idx, array.shape)):
                if i.size and (i.min() < 0 or i.max() >= size):
                    bad = int(i.min()) if i.min() < 0 else int(i.max())
                    raise IndexError(f"`mod_args` array {n.value!r}: index {bad} on axis {axis} is outside "
                                     f"[0, {size}) (shape {tuple(array.shape)})")
            value = array[tuple(idx)]
            return value.astype(acc_t, copy=False) if n.type == "float" else value
        if k == "neg":
            return -go(n.args[0])
        if k == "not":
            return ~go(n.args[0])
        if k == "op":
            a, b = (go(x) for x in n.args)
            op = n.value
            if op in ("&", "|"):
                return (a & b) if op == "&" else (a | b)
            if n.type == "float" or op in _COMPARE:
                if "float" in (n.args[0].type, n.args[1].type):
                    a, b = as_float(a, n.args[0]), as_float(b, n.args[1])
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                if op == "/":
                    return np.divide(as_float(a, n.args[0]), as_float(b, n.args[1]))
                return {"+": np.add, "-": np.subtract, "*": np.multiply, "<": np.less, "<=": np.less_equal,
                        ">": np.greater, ">=": np.greater_equal, "==": np.equal, "!=": np.not_equal}[op](a, b)
        name = n.value
        args = [go(a) for a in n.args]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if name == "where":
                a, b = args[1:]
                if n.type == "float":
                    a, b = as_float(a, n.args[1]), as_float(b, n.args[2])
                return np.where(args[0], a, b)
            if name in ("min", "max"):
                a, b = args
                if n.type == "float":
                    a, b = as_float(a, n.args[0]), as_float(b, n.args[1])
                return (np.minimum if name == "min" else np.maximum)(a, b)
            if name == "abs":
                return np.abs(args[0])
            if name == "floor":
                return np.floor(args[0]).astype(np.int64) if n.args[0].type == "float" else args[0]
            x = as_float(args[0], n.args[0])
            if name == "sigmoid":
                return (1 / (1 + np.exp(-x))).astype(acc_t, copy=False)
            return getattr(np, name)(x)

    return np.asarray(go(node))


# ---- the derivative with respect to score ----------------------------------------------------------


def _num(x) -> Node:
    return Node("num", "float", float(x))


def _is(node: Node | None, value: float) -> bool:
    return node is not None and node.kind == "num" and node.value == value


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return Node("op", "float", "+", (a, b))


def _sub(a, b):
    if b is None:
        return a
    if a is None:
        return Node("neg", "float", None, (b,))
    return Node("op", "float", "-", (a, b))


def _mul(a, b):
    if a is None or b is None:
        return None
    if _is(a, 1.0):
        return b
    if _is(b, 1.0):
        return a
    return Node("op", "float", "*", (a, b))


def _call(name, *args):
    return Node("call", "float", name, tuple(args))


def constant(node: Node | None) -> bool:
    """Whether the tree names nothing (no score, coordinate or array): one value everywhere
    (None, derivative()'s identically 0, counts)."""
    if node is None or node.kind == "num":
        return True
    return node.kind not in ("name", "index") and all(constant(a) for a in node.args)


def derivative(node: Node) -> Node | None:
    """d(node)/d(score) as a float tree, or None where it is identically 0 (nothing that
    depends on ``score``).  (The tree's type is float even where an int factor is the
    whole derivative: ``score * q_idx`` gives ``q_idx * 1.0``.)"""
    d = _derivative(node)
    if d is None or d.type == "float":
        return d
    return Node("op", "float", "*", (d, _num(1.0)))


def _derivative(node: Node) -> Node | None:
    """derivative() before the float cast.  ``abs``, ``min``, ``max`` and ``where`` take the derivative of
    the branch they pick (at a kink, abs's +1 side and min's / max's first argument);
    ``floor`` and comparisons have derivative 0 almost everywhere."""
    k = node.kind
    if k == "name":
        return _num(1.0) if node.value == "score" else None
    if k in ("num", "index", "not") or node.type != "float":
        return None
    if k == "neg":
        d = derivative(node.args[0])
        return None if d is None else Node("neg", "float", None, (d,))
    if k == "op":
        a, b = node.args
        da, db = derivative(a), derivative(b)
        if node.value == "+":
            return _add(da, db)
        if node.value == "-":
            return _sub(da, db)
        if node.value == "*":
            return _add(_mul(da, b), _mul(a, db))
        if node.value == "/":    # (da b - a db) / b^2, written da / b - a db / b^2
            first = None if da is None else Node("op", "float", "/", (da, b))
            second = None if db is None else Node("op", "float", "/", (_mul(a, db), _mul(b, b)))
            return _sub(first, second)
        return None
    name = node.value
    if name == "where":
        da, db = derivative(node.args[1]), derivative(node.args[2])
        if da is None and db is None:
            return None
        return Node("call", "float", "where", (node.args[0], da or _num(0.0), db or _num(0.0)))
    if name in ("min", "max"):
        a, b = node.args
        da, db = derivative(a), derivative(b)
        if da is None and db is None:
            return None
        pick = Node("op", "bool", "<=" if name == "min" else ">=", (a, b))
        return Node("call", "float", "where", (pick, da or _num(0.0), db or _num(0.0)))
    if name == "floor":
        return None
    (a,) = node.args
    da = derivative(a)
    if da is None:
        return None
    if name == "abs":
        sign = Node("call", "float", "where", (Node("op", "bool", ">=", (a, _num(0.0))), _num(1.0), _num(-1.0)))
        return _mul(sign, da)
    if name == "tanh":
        t = _call("tanh", a)
        return _mul(_sub(_num(1.0), _mul(t, t)), da)
    if name == "exp":
        return _mul(_call("exp", a), da)
    if name == "log":
        return Node("op", "float", "/", (da, a))
    if name == "sqrt":
        return Node("op", "float", "/", (da, _mul(_num(2.0), _call("sqrt", a))))
    if name == "sigmoid":
        s = _call("sigmoid", a)
        return _mul(_mul(s, _sub(_num(1.0), s)), da)
    raise AssertionError(name)


# ---- CUDA C++ --------------------------------------------------------------------------------------

# C++ element types of the mod_args arrays (read with cf::mod_read, score.cuh).
_CXX_ELEMENT = {"bool": "uint8_t", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
                "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
                "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}


def cxx_element(dtype) -> str:
    """The C++ type a ``mod_args`` array of ``dtype`` is read as."""
    from ._dtypes import dtype_name

    return _CXX_ELEMENT[dtype_name(dtype) if np.dtype(dtype).kind == "f" else np.dtype(dtype).name]


def cuda(node: Node, arrays: dict) -> str:
    """The tree as one C++ expression for score.cuh's score functions: it reads ``Acc``
    (the accumulator type), ``ctx`` (the FwdParams), ``score`` (Acc), ``b``, ``h``,
    ``q_idx``, ``kv_idx`` (int64_t); ``arrays`` the ``mod_args`` in order (their index
    is the slot of FwdParams::mod_args).  int expressions are int64_t, float ones Acc,
    bool ones bool; an index outside its axis traps (cf::mod_read)."""
    slots = {name: t for t, name in enumerate(arrays)}

    def flt(n: Node) -> str:
        code = go(n)
        return code if n.type == "float" else f"static_cast<Acc>({code})"

    def both(n: Node, a: Node, b: Node):
        return (flt(a), flt(b)) if n.type == "float" or "float" in (a.type, b.type) else (go(a), go(b))

    def go(n: Node) -> str:
        k = n.kind
        if k == "num":
            return f"static_cast<Acc>({n.value!r})" if n.type == "float" else f"int64_t({n.value})"
        if k == "name":
            return n.value
        if k == "index":
            a = arrays[n.value]
            idx = ", ".join(go(x) for x in n.args)
            read = f"cf::mod_read<{cxx_element(a.dtype)}, {a.ndim}>(ctx, {slots[n.value]}, {idx})"
            if n.type == "bool":
                return f"({read} != 0)"
            if n.type == "int":
                return f"static_cast<int64_t>({read})"
            return f"static_cast<Acc>(cf::to_acc({read}))"
        if k == "neg":
            return f"(-{go(n.args[0])})"
        if k == "not":
            return f"(!{go(n.args[0])})"
        if k == "op":
            a, b = n.args
            if n.value in ("&", "|"):
                return f"({go(a)} {'&&' if n.value == '&' else '||'} {go(b)})"
            if n.value == "/":
                return f"({flt(a)} / {flt(b)})"
            x, y = both(n, a, b)
            return f"({x} {n.value} {y})"
        name = n.value
        if name == "where":
            c, a, b = n.args
            x, y = both(n, a, b) if n.type != "bool" else (go(a), go(b))
            return f"({go(c)} ? {x} : {y})"
        if name in ("min", "max"):
            a, b = n.args
            x, y = both(n, a, b)
            return f"cf::mod_{name}({x}, {y})"
        if name == "abs":
            return f"cf::mod_abs({go(n.args[0])})"
        if name == "floor":
            a = n.args[0]
            return f"static_cast<int64_t>(floor({go(a)}))" if a.type == "float" else go(a)
        x = flt(n.args[0])
        if name == "sigmoid":
            return f"(static_cast<Acc>(1) / (static_cast<Acc>(1) + exp(-{x})))"
        return f"{name}({x})"

    return go(node)
