"""SGLang's GPU-arch words: how a check for an architecture is spelled, read and written.

The one place the spellings live (`is_sm100_supported()`, `get_platform().is_sm100`,
`_is_sm100_supported`) and the SM100 -> SM120 twin of each; patches and `scan` read them here.
"""

from __future__ import annotations

import libcst as cst

from sm120patch.patchkit.model import Import
from sm120patch.patchkit.syntax import find, key

# GPU-arch checks as SGLang spells them: `is_sm100_supported()` (sglang.srt.utils),
# `get_platform().is_sm100` (0.5.19 on) and module flags `_is_sm100_supported`.
_ARCH_FORMS: tuple[tuple[str, str, str], ...] = (
    # (form, prefix, suffix) around the arch name in `key()` spelling
    ("call", "is_", "_supported()"),
    ("platform", "get_platform().is_", ""),
    ("flag", "_is_", "_supported"),
)


def sglang_arch(node: cst.BaseExpression) -> tuple[str, str] | None:
    """(arch, form) of one SGLang GPU-arch check, else None.

    `is_sm100_supported()` -> ("sm100", "call"), `get_platform().is_sm120` -> ("sm120",
    "platform"), `_is_sm90_supported` -> ("sm90", "flag"), `is_blackwell_supported()` ->
    ("blackwell", "call"). `is_cuda()` and the like are not arch checks.
    """
    spelled = key(node)
    if spelled is None:
        return None
    for form, prefix, suffix in _ARCH_FORMS:
        if spelled.startswith(prefix) and spelled.endswith(suffix):
            arch = spelled[len(prefix) : len(spelled) - len(suffix)]
            if arch == "blackwell" or (
                arch.startswith("sm") and arch[2:].isdigit() and arch[2:3] != "0"
            ):
                return arch, form
    return None


def sglang_arch_check(arch: str, form: str) -> cst.BaseExpression:
    """The check for `arch` in `form` (see `sglang_arch`), as a new expression node."""
    prefix, suffix = next((p, s) for f, p, s in _ARCH_FORMS if f == form)
    return cst.parse_expression(f"{prefix}{arch}{suffix}")


def sglang_arch_import(arch: str, form: str) -> Import | None:
    """What the check for `arch` in `form` needs imported: the `call` form's function, next to
    the SM100 one (`is_sm120_supported` beside `is_sm100_supported`, both from sglang.srt.utils);
    `get_platform()` and the module flags need nothing new."""
    if form != "call" or arch == "sm100":
        return None
    return Import(f"is_{arch}_supported", next_to="is_sm100_supported")


def sglang_arch_twin(spelled: str | None, arch: str = "sm120") -> str | None:
    """An SGLang SM100 check in `key` spelling -> the same check for `arch`, in the same form:
    `is_sm100_supported()` -> `is_sm120_supported()`, `get_platform().is_sm100` ->
    `get_platform().is_sm120`, `_is_sm100_supported` -> `_is_sm120_supported`; None for
    anything else. The one place the SM100 -> SM120 spelling lives."""
    for _form, prefix, suffix in _ARCH_FORMS:
        if spelled == f"{prefix}sm100{suffix}":
            return f"{prefix}{arch}{suffix}"
    return None


def sglang_arch_twin_node(node: cst.BaseExpression, arch: str = "sm120") -> cst.BaseExpression:
    """`node`, an SGLang check for one arch (`sglang_arch`), checking `arch` instead, in the
    same form and with the same whitespace: `is_sm100_supported()` -> `is_sm120_supported()`,
    `get_platform().is_sm100` -> `get_platform().is_sm120`, `_is_sm100_supported` ->
    `_is_sm120_supported`."""
    found = sglang_arch(node)
    if found is None:
        raise ValueError(f"not an SGLang arch check: {key(node)}")
    prefix, suffix = next((p, s) for f, p, s in _ARCH_FORMS if f == found[1])
    name = f"{prefix}{arch}{suffix}".removesuffix("()").rpartition(".")[2]
    if isinstance(node, cst.Call):
        return node.with_changes(func=node.func.with_changes(value=name))
    if isinstance(node, cst.Attribute):
        return node.with_changes(attr=node.attr.with_changes(value=name))
    return node.with_changes(value=name)


def mentions_sglang_arch(node: cst.CSTNode, arch: str | None = None) -> bool:
    """Whether any part of `node` is an SGLang GPU-arch check (see `sglang_arch`), of `arch`
    when given."""
    candidates = find(node, (cst.Call, cst.Attribute, cst.Name))
    found = [sglang_arch(c) for c in candidates]  # type: ignore[arg-type]
    return any(f is not None and arch in (None, f[0]) for f in found)
