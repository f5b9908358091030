"""Small libcst helpers shared by the patches under patches/.

Everything works on syntax trees, never on text: operands are compared by their shape
(`key`), nodes are replaced by identity (`Module.deep_replace`), and new code is made of
libcst nodes whose whitespace is copied from the neighbours so diffs stay minimal. A module's
imports, read and added to, are in `imports.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeGuard, TypeVar

import libcst as cst


def code(node: cst.CSTNode, limit: int = 100) -> str:
    """The source of `node` on one line, shortened: for 'found ...' in refusal messages."""
    text = " ".join(cst.Module(body=[]).code_for_node(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def matching_nodes(
    root: cst.CSTNode,
    kinds: type[cst.CSTNode] | tuple[type[cst.CSTNode], ...],
    want: Callable[[cst.CSTNode], bool] | None = None,
) -> list[cst.CSTNode]:
    """Every node of `kinds` under `root` (itself included), in pre-order, for which `want`
    holds. A plain visitor: for the small nodes it is meant for (a test, a branch), it costs
    a fraction of `libcst.matchers.findall`, and importing the matchers costs more still."""
    found: list[cst.CSTNode] = []

    class _Visitor(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if isinstance(node, kinds) and (want is None or want(node)):
                found.append(node)
            return True

    root.visit(_Visitor())
    return found


Node = TypeVar("Node", bound=cst.CSTNode)


def nodes(root: cst.CSTNode, kind: type[Node]) -> list[Node]:
    """`matching_nodes` for one kind of node, typed as that kind."""
    return [n for n in matching_nodes(root, kind) if isinstance(n, kind)]


def keyword_args(scope: cst.CSTNode, keyword: str) -> list[cst.Arg]:
    """Every `keyword=...` argument of a call in the simple statements and the compound
    statements' headers under `scope`, without walking nested blocks twice."""
    out: list[cst.Arg] = []
    for stmt in statements(scope):
        for part in _headers_and_lines(stmt):
            out += [a for a in nodes(part, cst.Arg) if _is_keyword(a, keyword)]
    return out


def _is_keyword(arg: cst.CSTNode, keyword: str) -> bool:
    return isinstance(arg, cst.Arg) and arg.keyword is not None and arg.keyword.value == keyword


def conditions(scope: cst.CSTNode) -> list[cst.BaseExpression]:
    """The test of every `if` and `elif` and the value of every `return` under `scope`, found
    by walking statements only (a condition is always an if's test or a returned value)."""
    out: list[cst.BaseExpression] = []
    for stmt in statements(scope):
        if isinstance(stmt, cst.If):
            out.append(stmt.test)
        for line in _headers_and_lines(stmt):
            if isinstance(line, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
                out += [s.value for s in line.body if isinstance(s, cst.Return) and s.value]
    return out


def _headers_and_lines(stmt: cst.CSTNode) -> list[cst.CSTNode]:
    """The expressions a statement-level node holds outside its blocks: an `if`'s test, a
    def's decorators and parameters, the simple statement lines of a suite."""
    if isinstance(stmt, (cst.Module, cst.IndentedBlock)):
        return [s for s in stmt.body if isinstance(s, cst.SimpleStatementLine)]
    if isinstance(stmt, cst.SimpleStatementSuite):
        return [stmt]
    if isinstance(stmt, (cst.If, cst.While)):
        return [stmt.test]
    if isinstance(stmt, cst.FunctionDef):
        return [*stmt.decorators, stmt.params]
    if isinstance(stmt, cst.For):
        return [stmt.target, stmt.iter]
    if isinstance(stmt, cst.With):
        return list(stmt.items)
    return []


def functions(module: cst.CSTNode, name: str) -> list[cst.FunctionDef]:
    """Every function or method called `name`, at any depth of statement nesting."""
    return [
        n for n in statements(module) if isinstance(n, cst.FunctionDef) and n.name.value == name
    ]


def classes(module: cst.CSTNode, name: str) -> list[cst.ClassDef]:
    """Every class called `name`, at any depth of statement nesting."""
    return [n for n in statements(module) if isinstance(n, cst.ClassDef) and n.name.value == name]


# Nodes that can hold statements. A def or class can only appear as a statement, so walking
# these alone finds every one of them without visiting a single expression: on a 5,000-line
# server_args.py that is the difference between milliseconds and most of a second.
# (`Module.deep_replace` likewise rebuilds every node of the file; `replace` below does not.)
_BLOCKS = (
    cst.Module,
    cst.BaseSuite,
    cst.BaseCompoundStatement,
    cst.Else,
    cst.Finally,
    cst.ExceptHandler,
    cst.ExceptStarHandler,
    cst.MatchCase,
)


_BLOCK_FIELDS = ("body", "orelse", "handlers", "finalbody", "cases")


# Whether a node type is one of `_BLOCKS`, by type: most of those are abstract classes, whose
# `isinstance` goes through `ABCMeta.__instancecheck__`, and a walk asks it of every line of
# every block (most of a walk's time, before this table). A type's answer never changes.
_IS_BLOCK: dict[type, bool] = {}


def _is_block(value: object) -> TypeGuard[cst.CSTNode]:
    hit = _IS_BLOCK.get(type(value))
    if hit is None:
        hit = _IS_BLOCK[type(value)] = isinstance(value, _BLOCKS)
    return hit


# The names of `_BLOCK_FIELDS` a node type has (every libcst node is a dataclass; anything
# else is asked for all of them).
_FIELDS_OF: dict[type, tuple[str, ...]] = {}


def _fields_of(kind: type) -> tuple[str, ...]:
    hit = _FIELDS_OF.get(kind)
    if hit is None:
        fields = getattr(kind, "__dataclass_fields__", None)
        hit = _FIELDS_OF[kind] = (
            _BLOCK_FIELDS if fields is None else tuple(n for n in _BLOCK_FIELDS if n in fields)
        )
    return hit


def _blocks_under(node: cst.CSTNode) -> list[cst.CSTNode]:
    # Read the block fields directly: `CSTNode.children` runs a visitor over every
    # expression of the node, which is what we are avoiding.
    out: list[cst.CSTNode] = []
    for name in _fields_of(type(node)):
        value = getattr(node, name, None)
        if isinstance(value, (tuple, list)):
            out.extend(v for v in value if _is_block(v))
        elif _is_block(value):
            out.append(value)
    return out


def statements(node: cst.CSTNode) -> list[cst.CSTNode]:
    """Every statement-level node under `node` (compound statements and their blocks), in order."""
    return [n for n, _ in _walk(node)]


# The last few walks, by node identity. Nodes are immutable and the cache holds a reference
# to each, so an id cannot be reused while its entry lives: patches of one file share walks.
_WALKS: dict[int, tuple[cst.CSTNode, list[tuple[cst.CSTNode, cst.CSTNode | None]]]] = {}


def forget_walks() -> None:
    """Drop the walks kept, and the trees they hold (`runner.forget_parses`)."""
    _WALKS.clear()


def _walk(node: cst.CSTNode) -> list[tuple[cst.CSTNode, cst.CSTNode | None]]:
    hit = _WALKS.get(id(node))
    if hit is not None and hit[0] is node:
        return hit[1]
    out = _walk_uncached(node)
    if len(_WALKS) >= 8:
        _WALKS.pop(next(iter(_WALKS)))
    _WALKS[id(node)] = (node, out)
    return out


def _walk_uncached(node: cst.CSTNode) -> list[tuple[cst.CSTNode, cst.CSTNode | None]]:
    out: list[tuple[cst.CSTNode, cst.CSTNode | None]] = []
    stack: list[tuple[cst.CSTNode, cst.CSTNode | None]] = [(node, None)]
    while stack:
        current, parent = stack.pop()
        out.append((current, parent))
        stack.extend((child, current) for child in reversed(_blocks_under(current)))
    return out


def parent_of(module: cst.Module, node: cst.CSTNode) -> cst.CSTNode | None:
    """The statement-level node holding `node` (a block, for a statement), by the walk."""
    for n, parent in _walk(module):
        if n is node:
            return parent
    return None


def qualified_name(module: cst.Module, node: cst.CSTNode) -> str:
    """The qualified name of the function or class around `node` (`CustomAllreduce.__init__`),
    `<module>` at module level."""
    names = []
    current = parent_of(module, node)
    while current is not None:
        if isinstance(current, (cst.FunctionDef, cst.ClassDef)):
            names.append(current.name.value)
        current = parent_of(module, current)
    return ".".join(reversed(names)) or "<module>"


def replace(
    module: cst.Module, old: cst.CSTNode, new: cst.CSTNode, scope: cst.CSTNode
) -> cst.Module:
    """`module.deep_replace(old, new)` where `old` lies inside `scope`, a statement-level node
    (a def, a class, an if...): only `scope` is rebuilt, then the chain of blocks above it, so
    the cost is that of `scope`, not of the whole file."""
    parents = {id(n): p for n, p in _walk(module)}
    if id(scope) not in parents:
        raise ValueError("scope is not a statement of this module")
    current: cst.CSTNode = scope
    replacement = new if scope is old else scope.deep_replace(old, new)
    while True:
        parent = parents[id(current)]
        if parent is None:
            return replacement  # type: ignore[return-value]
        replacement = _with_child(parent, current, replacement)
        current = parent


def _with_child(parent: cst.CSTNode, old: cst.CSTNode, new: cst.CSTNode) -> cst.CSTNode:
    for name in _BLOCK_FIELDS:
        value = getattr(parent, name, None)
        if value is old:
            return parent.with_changes(**{name: new})
        if isinstance(value, (tuple, list)) and any(v is old for v in value):
            return parent.with_changes(**{name: type(value)(new if v is old else v for v in value)})
    raise ValueError(f"{type(old).__name__} is not a block of {type(parent).__name__}")


def key(node: cst.BaseExpression) -> str | None:
    """A canonical spelling of a simple operand, ignoring whitespace, comments and parentheses.

    `x`, `f()`, `a.b`, `get_platform().is_sm90`; None for anything else (an operand we do not
    recognise is never silently treated as one we do).
    """
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = key(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    if isinstance(node, cst.Call) and not node.args:
        base = key(node.func)
        return None if base is None else f"{base}()"
    return None


def string(node: cst.CSTNode) -> str | None:
    """The value of a plain string literal (`"x"`, `'x'`), else None."""
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def target_key(node: cst.BaseExpression) -> str | None:
    """`key`, and a subscript by a string of a simple name: `overrides["x"]` (spelled with
    double quotes whatever the source uses); None for anything else."""
    if isinstance(node, cst.Subscript) and isinstance(node.value, cst.Name):
        if len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
            name = string(node.slice[0].slice.value)
            return None if name is None else f'{node.value.value}["{name}"]'
        return None
    return key(node)


def single_assign(stmt: cst.CSTNode) -> cst.Assign | None:
    """The assignment of a line holding one assignment to one target (`a = b`), else None."""
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, cst.Assign) and len(small.targets) == 1:
            return small
    return None


def or_operands(node: cst.BaseExpression) -> list[cst.BaseExpression] | None:
    """The operands of a flat `a or b or c` chain (any parenthesisation inside), else None."""
    if not (isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.Or)):
        return None
    out: list[cst.BaseExpression] = []
    for side in (node.left, node.right):
        inner = or_operands(side)
        out.extend(inner if inner is not None else [side])
    return out


def and_operands(node: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The operands of an `a and b and c` chain, left to right (a single operand otherwise)."""
    if isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.And):
        left = and_operands(node.left) if not node.left.lpar else [node.left]
        return [*left, node.right]
    return [node]


def and_codes(node: cst.BaseExpression) -> list[str]:
    """Each operand of an `a and b and c` chain in one canonical spelling (`ast.unparse`:
    redundant parentheses, whitespace and quotes folded), so that a test compares operand by
    operand with `and_form` of the spelling a release uses: `world_size > 2 and (not
    full_nvlink)` is the same gate as `world_size > 2 and not full_nvlink`."""
    import ast

    empty = cst.Module(body=[])
    return [ast.unparse(ast.parse(empty.code_for_node(o).strip(), mode="eval"))
            for o in and_operands(node)]


def and_form(text: str) -> list[str]:
    """The operands of the `and` chain written in `text`, spelt as `and_codes` spells them."""
    import ast

    tree = ast.parse(text, mode="eval").body
    chain = tree.values if isinstance(tree, ast.BoolOp) and isinstance(tree.op, ast.And) else [tree]
    return [ast.unparse(o) for o in chain]



def widen_or(node: cst.BooleanOperation, extra: cst.BaseExpression) -> cst.BooleanOperation:
    """`(a or b)` -> `(a or b or extra)`, keeping the outer parentheses and their whitespace.

    The new `or` copies the whitespace of the chain's last `or`, so a one-line chain stays
    on one line and a chain broken over lines gets the new operand on a line of its own.
    """
    last_or = node.operator
    # Copy the layout of the last `or`, not its comments: a comment belongs to its own line.
    new_or = last_or.with_changes(
        whitespace_before=_no_comments(last_or.whitespace_before),
        whitespace_after=_no_comments(last_or.whitespace_after),
    )
    inner = node.with_changes(lpar=(), rpar=())
    return cst.BooleanOperation(
        left=inner,
        operator=new_or,
        right=extra,
        lpar=node.lpar,
        rpar=node.rpar,
    )


def _no_comments(ws: cst.BaseParenthesizableWhitespace) -> cst.BaseParenthesizableWhitespace:
    if isinstance(ws, cst.ParenthesizedWhitespace):
        return ws.with_changes(
            first_line=cst.TrailingWhitespace(newline=ws.first_line.newline),
            empty_lines=[line for line in ws.empty_lines if line.comment is None],
        )
    return ws


def module_assignments(module: cst.Module, target: str) -> list[cst.SimpleStatementLine]:
    """Module-level statements `target = ...` (exactly one target)."""
    out = []
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
            small = stmt.body[0]
            if (
                isinstance(small, cst.Assign)
                and len(small.targets) == 1
                and isinstance(small.targets[0].target, cst.Name)
                and small.targets[0].target.value == target
            ):
                out.append(stmt)
    return out


def insert_after(
    module: cst.Module, anchor: cst.BaseStatement, new: Sequence[cst.BaseStatement]
) -> cst.Module:
    """Insert statements right after a module-level statement."""
    body: list[cst.BaseStatement] = list(module.body)
    index = next(i for i, s in enumerate(body) if s is anchor)
    body[index + 1 : index + 1] = list(new)
    return module.with_changes(body=body)


def parse_statement(source: str, like: cst.Module) -> cst.BaseStatement:
    """Parse one statement with the module's own newline and indentation conventions."""
    return cst.parse_statement(source, config=like.config_for_parsing)


def guarded_nodes(
    root: cst.CSTNode, want: Callable[[cst.CSTNode], bool]
) -> list[tuple[cst.CSTNode, list[cst.If]]]:
    """Each statement under `root` for which `want` holds, with the `if`s whose body holds it.

    The `if`s come outermost first. Only an `if`'s body counts: a node in its `elif` or
    `else` branch does not run when that `if`'s test is true, so that `if` does not guard it.
    Walks statements only (never into expressions): `want` looks for statements, and a
    whole-function visit of SGLang's 1,000-line argument handlers was most of a plan's time.
    """
    found: list[tuple[cst.CSTNode, list[cst.If]]] = []
    blocks = (
        cst.IndentedBlock,
        cst.SimpleStatementSuite,
        cst.Else,
        cst.Finally,
        cst.ExceptHandler,
        cst.ExceptStarHandler,
        cst.MatchCase,
        cst.BaseCompoundStatement,
    )

    def walk(node: cst.CSTNode, stack: list[cst.If]) -> None:
        if want(node):
            found.append((node, list(stack)))
        if isinstance(node, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
            for small in node.body:
                if want(small):
                    found.append((small, list(stack)))
            return
        if isinstance(node, cst.If):
            walk(node.body, [*stack, node])
            if node.orelse is not None:
                walk(node.orelse, stack)
            return
        # The block fields only (`children` would visit every expression too).
        for name in _BLOCK_FIELDS:
            value = getattr(node, name, None)
            for child in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(child, (*blocks, cst.SimpleStatementLine)):
                    walk(child, stack)

    walk(root, [])
    return found
