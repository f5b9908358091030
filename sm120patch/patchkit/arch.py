"""SGLang's GPU-arch words: how a check for an architecture is spelled, read and written.

The one place the spellings live (`is_sm100_supported()`, `get_platform().is_sm100`,
`_is_sm100_supported`) and the SM100 -> SM120 twin of each; patches and `scan` read them here.
"""

from __future__ import annotations

import libcst as cst

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


def sglang_arch_twin(spelled: str | None, arch: str = "sm120") -> str | None:
    """An SGLang SM100 check in `key` spelling -> the same check for `arch`, in the same form:
    `is_sm100_supported()` -> `is_sm120_supported()`, `get_platform().is_sm100` ->
    `get_platform().is_sm120`, `_is_sm100_supported` -> `_is_sm120_supported`; None for
    anything else. The one place the SM100 -> SM120 spelling lives."""
    for _form, prefix, suffix in _ARCH_FORMS:
        if spelled == f"{prefix}sm100{suffix}":
            return f"{prefix}{arch}{suffix}"
    return None


def mentions_sglang_arch(node: cst.CSTNode) -> bool:
    """Whether any part of `node` is an SGLang GPU-arch check (see `sglang_arch`)."""
    candidates = find(node, (cst.Call, cst.Attribute, cst.Name))
    return any(sglang_arch(c) is not None for c in candidates)  # type: ignore[arg-type]
