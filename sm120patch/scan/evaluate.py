"""What an arch test says on each GPU: its operands read as arch atoms, the expression evaluated
over the capabilities, and the reading (leaves SM120 out, admits it, excludes it by name)."""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

from sm120patch.patchkit import arch

LEAVES_OUT = "leaves-out"  # SM120 answered as an older GPU is
ADMITS = "admits"  # SM120 answered as an arch upstream favours is
EXCLUDES = "excludes"  # the test names SM120 to leave it out (`major >= 10 and major != 12`)
MAX_UNKNOWNS = 8  # operands that are no arch check, each tried both ways (2**8 assignments)

_OPS: dict[type, Callable[[object, object], bool]] = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,  # type: ignore[operator]
    ast.LtE: lambda a, b: a <= b,  # type: ignore[operator]
    ast.Gt: lambda a, b: a > b,  # type: ignore[operator]
    ast.GtE: lambda a, b: a >= b,  # type: ignore[operator]
    ast.In: lambda a, b: a in b,  # type: ignore[operator]
    ast.NotIn: lambda a, b: a not in b,  # type: ignore[operator]
}




def spelled(node: ast.AST) -> str | None:
    """`patchkit.syntax.key` spelling of an ast node, arguments of calls left out:
    `get_platform().is_sm100`, `is_sm100a_supported()` for `is_sm100a_supported(device)`,
    `torch.cuda.get_device_capability()[0]`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = spelled(node.value)
        return None if base is None else f"{base}.{node.attr}"
    if isinstance(node, ast.Call):
        base = spelled(node.func)
        return None if base is None else f"{base}()"
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        base = spelled(node.value)
        index = node.slice.value
        return None if base is None or not isinstance(index, int) else f"{base}[{index}]"
    return None


def _quantity(node: ast.AST) -> str | None:
    """The arch quantity an operand holds (see `patchkit.arch.arch_quantity`), including
    `major * 10 + minor`."""
    if (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Add)
        and isinstance(node.left, ast.BinOp)
        and isinstance(node.left.op, ast.Mult)
        and _quantity(node.left.left) == "major"
        and isinstance(node.left.right, ast.Constant)
        and node.left.right.value == 10
        and _quantity(node.right) == "minor"
    ):
        return "sm"
    if (
        isinstance(node, ast.Tuple)
        and len(node.elts) == 2
        and [_quantity(e) for e in node.elts] == ["major", "minor"]
    ):
        return "capability"  # `(target.major, target.minor)`
    return arch.arch_quantity(spelled(node))


def _constant(node: ast.AST) -> object:
    """An int, a tuple of ints, or a list/tuple/set of those; else None."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_constant(e) for e in node.elts]
        if items and all(i is not None for i in items):
            return tuple(items) if isinstance(node, ast.Tuple) else frozenset(items)
    return None


_FLIP = {
    ast.Lt: ast.Gt,
    ast.Gt: ast.Lt,
    ast.LtE: ast.GtE,
    ast.GtE: ast.LtE,
    ast.Eq: ast.Eq,
    ast.NotEq: ast.NotEq,
}


@dataclass(frozen=True)
class _Atom:
    """One arch comparison or check: its value on a GPU, whether it names SM120."""

    value: Callable[[arch.Capability], bool]
    names_sm120: bool
    minor: bool = False  # a test of the minor version alone says nothing without a major


def _fits(kind: str, const: object) -> str | None:
    """The kind `const` compares as against a quantity of `kind`, or None if it is no arch."""
    if isinstance(const, int):
        if kind == "capability" and const < 70:
            return None  # `capability >= 9`: too loose to trust
        return arch.plausible_arch_number(kind, const)
    if isinstance(const, tuple):  # a capability, (10, 0)
        ok = len(const) == 2 and all(isinstance(c, int) for c in const) and 7 <= const[0] <= 13
        return "capability" if kind == "capability" and ok else None
    if isinstance(const, frozenset) and const:
        kinds = {_fits(kind, c) for c in const}
        return kinds.pop() if len(kinds) == 1 and None not in kinds else None
    return None


def _mentions_12(kind: str, const: object) -> bool:
    if isinstance(const, frozenset):
        return any(_mentions_12(kind, c) for c in const)
    if isinstance(const, tuple):
        return bool(const) and const[0] == 12
    return const in ((12,) if kind == "major" else (12, 120, 121))


def _compare_atom(left: ast.AST, op: ast.cmpop, right: ast.AST) -> _Atom | None:
    """An arch comparison: one side an arch quantity, the other constant(s)."""
    qty, const = _quantity(left), _constant(right)
    if qty is None or const is None:
        qty, const = _quantity(right), _constant(left)
        if qty is None or const is None or type(op) not in _FLIP:
            return None
        op = _FLIP[type(op)]()
    if type(op) not in _OPS:
        return None
    if isinstance(op, (ast.In, ast.NotIn)):
        if not isinstance(const, (tuple, frozenset)):
            return None
        const = frozenset(const)  # `major in (9, 10)`: members, whatever the brackets
    elif isinstance(const, frozenset):
        return None
    as_kind = _fits(qty, const)
    if as_kind is None:
        return None
    compare = _OPS[type(op)]

    def value(cap: arch.Capability) -> bool:
        try:
            return compare(arch.arch_value(as_kind, cap), const)
        except TypeError:
            return False

    return _Atom(value, _mentions_12(as_kind, const), as_kind == "minor")


class _Expr:
    """An expression read as a yes/no test: its arch atoms and the operands that are not.

    Each leaf is read once: an arch atom (a value per GPU) or an unknown operand (one of the
    bits an assignment gives); `table` then evaluates the tree on every GPU and assignment.
    """

    def __init__(self, node: ast.AST, path: str) -> None:
        self.node = node
        self.path = path
        self.leaves: dict[tuple[int, ...], _Atom | int] = {}  # atom, or the unknown's bit
        self._bits: dict[str, int] = {}
        self.atoms = 0
        self.names_sm120 = False
        self.full = 1
        self._collect(node)

    @property
    def unknowns(self) -> int:
        return len(self._bits)

    def _collect(self, node: ast.AST) -> None:
        if isinstance(node, ast.BoolOp):
            for v in node.values:
                self._collect(v)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self._collect(node.operand)
        elif isinstance(node, ast.IfExp):
            for part in (node.test, node.body, node.orelse):
                self._collect(part)
        elif isinstance(node, ast.Compare):
            left = node.left
            for op, right in zip(node.ops, node.comparators, strict=True):
                atom = _compare_atom(left, op, right)
                self._leaf((id(left), id(op), id(right)), atom, ast.Compare(left, [op], [right]))
                left = right
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            pass
        else:
            caps = arch.arch_predicate(spelled(node), self.path)
            if caps is None and isinstance(node, ast.Call) and node.args:
                # vLLM's `current_platform.is_device_capability_family(100)`: the arch is
                # the argument
                caps = arch.capability_check(spelled(node.func), _constant(node.args[0]))
            atom = None
            if caps is not None:
                names = arch.SM120 in caps and not caps >= {arch.SM100, arch.SM120}
                atom = _Atom(caps.__contains__, names)
            self._leaf((id(node),), atom, node)

    def _leaf(self, ident: tuple[int, ...], atom: _Atom | None, node: ast.AST) -> None:
        if atom is not None:
            self.atoms += not atom.minor
            self.names_sm120 |= atom.names_sm120
            self.leaves[ident] = atom
            return
        text = ast.unparse(node)
        self.leaves[ident] = self._bits.setdefault(text, len(self._bits))

    def table(self) -> dict[arch.Capability, int]:
        """The answers on each GPU, one bit per assignment of the unknown operands (bit a is
        the answer when unknown i takes bit i of a): every assignment in one pass per GPU."""
        n = min(self.unknowns, MAX_UNKNOWNS)
        size = 1 << n
        self.full = (1 << size) - 1
        self._masks = [sum(1 << a for a in range(size) if a >> i & 1) for i in range(n)]
        return {cap: self._ev(self.node, cap) for cap in arch.ARCH_POINTS}

    def _leaf_mask(self, ident: tuple[int, ...], cap: arch.Capability) -> int:
        leaf = self.leaves[ident]
        if isinstance(leaf, _Atom):
            return self.full if leaf.value(cap) else 0
        return self._masks[min(leaf, len(self._masks) - 1)] if self._masks else 0

    def _ev(self, node: ast.AST, cap: arch.Capability) -> int:
        if isinstance(node, ast.BoolOp):
            values = [self._ev(v, cap) for v in node.values]
            out = values[0]
            for v in values[1:]:
                out = out & v if isinstance(node.op, ast.And) else out | v
            return out
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return self.full ^ self._ev(node.operand, cap)
        if isinstance(node, ast.IfExp):
            test = self._ev(node.test, cap)
            return (test & self._ev(node.body, cap)) | (
                (self.full ^ test) & self._ev(node.orelse, cap)
            )
        if isinstance(node, ast.Compare):
            out, left = self.full, node.left
            for op, right in zip(node.ops, node.comparators, strict=True):
                out &= self._leaf_mask((id(left), id(op), id(right)), cap)
                left = right
            return out
        if isinstance(node, ast.Constant) and isinstance(node.value, bool):
            return self.full if node.value else 0
        return self._leaf_mask((id(node),), cap)


@dataclass(frozen=True)
class Reading:
    verdict: str | None  # LEAVES_OUT, ADMITS, EXCLUDES, or None: not a gate
    favoured: tuple[str, ...]
    routes_sm120: bool  # SM120 can get a yes here that older GPUs do not


def judge(table: dict[arch.Capability, int], names_sm120: bool) -> Reading:
    """What a test's answers (see `_Expr.table`) say.

    Not a gate unless some favoured arch gets another answer than SM120. Then: a test that
    names SM120 is SM120-aware code, or leaves it out on purpose (`major != 12`) where SM120
    gets an older GPU's answer. SM120 answered unlike SM100/SM103 leaves it out where it gets
    an older GPU's answer (`is_sm100`, `major in (9, 10)`, `not is_sm100()`), and otherwise has
    a path of its own (`major >= 11`). SM120 answered like SM100/SM103 admits it where the
    archs that differ (SM90, SM110) answer as older GPUs do (`major >= 10`, `is_blackwell`,
    `(10, 0) > capability`), and otherwise is a test for SM90 or SM110 alone (`major == 9`),
    which leaves SM120 out as it leaves SM100 out.
    """
    sm120, older = table[arch.SM120], table[arch.OLDER]
    routes = sm120 != 0 and sm120 != older
    favoured = tuple(c for c in arch.FAVOURED if table[c] != sm120)
    names = tuple(arch.arch_name(c) for c in favoured)
    if not favoured:
        return Reading(None, (), routes)
    like_older = sm120 == older
    if names_sm120:
        return Reading(EXCLUDES if like_older else None, names if like_older else (), routes)
    if table[arch.SM100] != sm120 or table[arch.SM103] != sm120:
        return Reading(LEAVES_OUT if like_older else ADMITS, names, routes)
    if all(table[c] == older for c in favoured):
        return Reading(ADMITS, names, routes)
    return Reading(LEAVES_OUT, names, routes)


def _members_atom(members: frozenset[arch.Capability]) -> dict[arch.Capability, int]:
    return {cap: int(cap in members) for cap in arch.ARCH_POINTS}
