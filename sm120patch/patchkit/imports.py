"""A module's imports, read and added to, on libcst trees: which names its module-level
`from ... import` statements bring and from where (`import_sources`, `imported_from`,
`binds_at_module_level`), and one name placed right after another in the one import that holds
it (`import_next_to`, `add_import_after`), the way the runner places what a patch's code needs
(`Result.imports`). Split from `syntax.py`, which walks and rewrites the rest of a tree.
"""

from __future__ import annotations

import libcst as cst


def module_imports(module: cst.Module) -> list[cst.Import | cst.ImportFrom]:
    """Every module-level `import` and `from ... import` statement, in order: the one scanner
    the import helpers below share."""
    return [
        small
        for stmt in module.body
        if isinstance(stmt, cst.SimpleStatementLine)
        for small in stmt.body
        if isinstance(small, (cst.Import, cst.ImportFrom))
    ]


def _absolute_froms(module: cst.Module) -> list[cst.ImportFrom]:
    """Module-level absolute `from x import a, b` (not `*`)."""
    return [
        imp
        for imp in module_imports(module)
        if isinstance(imp, cst.ImportFrom)
        and not imp.relative
        and not isinstance(imp.names, cst.ImportStar)
    ]


def _import_froms(module: cst.Module, from_module: str) -> list[cst.ImportFrom]:
    return [
        imp
        for imp in module_imports(module)
        if isinstance(imp, cst.ImportFrom)
        and not imp.relative
        and _dotted(imp.module) == from_module
    ]


def _dotted(node: cst.BaseExpression | None) -> str:
    if node is None:
        return ""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    return ""


def imported_from(module: cst.Module) -> set[tuple[str, str]]:
    """(module, name) for each name of each module-level absolute `from module import name`."""
    return {
        (_dotted(imp.module), a.evaluated_name)
        for imp in _absolute_froms(module)
        if imp.module
        for a in imp.names  # type: ignore[union-attr]
    }


def imports_module(module: cst.Module, name: str) -> bool:
    """Whether a module-level `import name` (not aliased) binds `name`."""
    return any(
        isinstance(imp, cst.Import)
        and any(a.evaluated_name == name and a.asname is None for a in imp.names)
        for imp in module_imports(module)
    )


def import_sources(module: cst.Module, name: str) -> list[str]:
    """The modules `name` is imported from by module-level `from ... import` statements.

    Only plain imports count (`from m import name`, not `import other as name`); relative
    imports are not looked at.
    """
    return [
        _dotted(imp.module)
        for imp in _absolute_froms(module)
        if any(a.evaluated_name == name and a.asname is None for a in imp.names)  # type: ignore[union-attr]
    ]


def binds_at_module_level(module: cst.Module, name: str) -> bool:
    """Whether a module-level `from ... import` binds `name` (as itself or as an alias),
    whichever module it comes from."""
    return any(
        isinstance(imp, cst.ImportFrom)
        and not isinstance(imp.names, cst.ImportStar)
        and any((a.evaluated_alias or a.evaluated_name) == name for a in imp.names)
        for imp in module_imports(module)
    )


def import_next_to(module: cst.Module, name: str, like: str) -> cst.Module | None:
    """`module` importing `name`: as it is when it does, else with `name` added right after
    `like` in the one module-level `from ... import` that brings `like` (see
    `add_import_after`). None when there is no single such import: the caller refuses.
    """
    if import_sources(module, name):
        return module
    sources = import_sources(module, like)
    if len(sources) != 1:
        return None
    return add_import_after(module, sources[0], name, like)


def add_import_after(
    module: cst.Module, from_module: str, name: str, after: str
) -> cst.Module | None:
    """Insert `name` right after `after` in the one `from <from_module> import (...)` holding it.

    The new alias takes `after`'s comma (and so its line break and indent), and `after` gets
    a plain comma followed by the same whitespace; in a one-name-per-line import the diff is
    one added line. Returns None when no single such import exists: the caller refuses.
    """
    holders = [
        imp
        for imp in _import_froms(module, from_module)
        if not isinstance(imp.names, cst.ImportStar)
        and any(a.evaluated_name == after and a.asname is None for a in imp.names)
    ]
    if len(holders) != 1:
        return None
    imp = holders[0]
    if isinstance(imp.names, cst.ImportStar):
        return None  # `from m import *` names nothing to place an import after
    aliases = list(imp.names)
    index = next(i for i, a in enumerate(aliases) if a.evaluated_name == after)
    anchor = aliases[index]
    new_alias = cst.ImportAlias(name=cst.Name(name), comma=anchor.comma)
    if isinstance(anchor.comma, cst.Comma):
        anchor_comma = anchor.comma
        if index == len(aliases) - 1 and imp.lpar is not None:
            # `after` is the last name, with a trailing comma: that comma leads to the
            # closing parenthesis, so the new name keeps it and `after` gets a line break
            # (its own comment kept) indented like the separator that comes before it.
            prev_comma = aliases[index - 1].comma if index > 0 else None
            before = (
                prev_comma.whitespace_after
                if isinstance(prev_comma, cst.Comma)
                else imp.lpar.whitespace_after
            )
            own = anchor.comma.whitespace_after
            if isinstance(own, cst.ParenthesizedWhitespace) and isinstance(
                before, cst.ParenthesizedWhitespace
            ):
                own = own.with_changes(indent=before.indent, last_line=before.last_line)
            elif isinstance(own, cst.SimpleWhitespace) and isinstance(before, cst.SimpleWhitespace):
                own = before
            anchor_comma = anchor.comma.with_changes(whitespace_after=own)
    else:
        # `after` was the last name without a trailing comma: give it one, single space.
        anchor_comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        if imp.lpar is not None and _is_multiline(imp):
            # Keep one name per line when the import is laid out that way.
            prev_comma = aliases[index - 1].comma if index > 0 else None
            if isinstance(prev_comma, cst.Comma):
                anchor_comma = prev_comma
    aliases[index] = anchor.with_changes(comma=anchor_comma)
    aliases.insert(index + 1, new_alias)
    new_imp = imp.with_changes(names=aliases)
    # The import is a module-level statement: rebuild that line only, not the whole file.
    body = [
        stmt.with_changes(body=[new_imp if small is imp else small for small in stmt.body])
        if isinstance(stmt, cst.SimpleStatementLine) and any(small is imp for small in stmt.body)
        else stmt
        for stmt in module.body
    ]
    return module.with_changes(body=body)


def _is_multiline(imp: cst.ImportFrom) -> bool:
    return "\n" in cst.Module(body=[]).code_for_node(imp)
