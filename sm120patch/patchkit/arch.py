"""SGLang's GPU-arch words: how a check for an architecture is spelled, read and written.

The one place the spellings live (`is_sm100_supported()`, `get_platform().is_sm100`,
`_is_sm100_supported`) and the SM100 -> SM120 twin of each; patches and `scan` read them here.
Below them, the same words in every spelling a release uses (FlashInfer's, capability
comparisons, compile targets), which `scan` reads whole releases with.
"""

from __future__ import annotations

import re

import libcst as cst

from sm120patch.patchkit.model import Import
from sm120patch.patchkit.syntax import key, matching_nodes

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
    return sglang_arch_spelled(key(node))


def sglang_arch_spelled(spelled: str | None) -> tuple[str, str] | None:
    """`sglang_arch` of a check already in `key` spelling (the scan spells its own trees)."""
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
    candidates = matching_nodes(node, (cst.Call, cst.Attribute, cst.Name))
    found = [sglang_arch(c) for c in candidates]  # type: ignore[arg-type]
    return any(f is not None and arch in (None, f[0]) for f in found)


# ------------------------------------------------------------------ the arch words, any spelling
# The patches match SGLang's own three spellings exactly (above). `sm120patch scan` reads whole
# releases, which spell GPU archs many more ways: FlashInfer's `is_sm100a_supported(device)`,
# `self._is_sm100`, `get_platform().is_sm100_or_sm110`, `major == 10`, `sm_major not in (9, 10)`,
# `(10, 0) > get_device_capability()`, `get_device_sm() >= 100`,
# `supported_major_versions=[9, 10]`, `"-gencode=arch=compute_100a,code=sm_100a"`. The words
# below say which GPUs each spelling stands for, as compute capabilities; the scan judges an
# expression by what it says on SM120 against the archs upstream favours and older GPUs. They
# work on spellings (`key` strings), so a reader of any syntax tree can use them.

Capability = tuple[int, int]
SM80, SM90, SM100, SM103, SM110, SM120, SM121 = (
    (8, 0),
    (9, 0),
    (10, 0),
    (10, 3),
    (11, 0),
    (12, 0),
    (12, 1),
)
# The GPUs an expression is evaluated on.
ARCH_POINTS: tuple[Capability, ...] = (SM80, SM90, SM100, SM103, SM110, SM120, SM121)
# What upstream code favours where it leaves SM120 out: Hopper and datacenter Blackwell.
FAVOURED: tuple[Capability, ...] = (SM90, SM100, SM103, SM110)
# The arch that stands for "an older GPU": SM120 judged the same as SM80 is left out.
OLDER: Capability = SM80


def arch_name(cap: Capability) -> str:
    """(10, 0) -> "sm100", (10, 3) -> "sm103", (9, 0) -> "sm90"."""
    return f"sm{cap[0]}{cap[1]}"


def _majors(*majors: int) -> frozenset[Capability]:
    return frozenset(c for c in ARCH_POINTS if c[0] in majors)


# Words that are names, not numbers. SGLang's is_blackwell_supported() is majors [10, 12] in
# 0.5.8 and [10, 11, 12] from 0.5.13: SM120 included.
_NAMED_ARCHS: dict[str, frozenset[Capability]] = {
    "ampere": _majors(8),
    "hopper": frozenset({SM90}),
    "blackwell": _majors(10, 11, 12),
}
# Path prefixes (relative to the package's parent) where a word means something else: the
# diffusion runtime's platform says is_blackwell() for capability major 10 alone.
_SCOPED_ARCHS: dict[str, dict[str, frozenset[Capability]]] = {
    "sglang/multimodal_gen/": {"blackwell": _majors(10)},
    # vLLM's `_is_blackwell()` (mamba's replayssm_config) is `is_device_capability_family(100)`.
    "vllm/": {"blackwell": _majors(10)},
}
_SM_WORD = re.compile(r"sm_?(\d{2,3})([afx]?)")


def arch_word(word: str, path: str = "", *, exact_a: bool = False) -> frozenset[Capability] | None:
    """The GPUs (of ARCH_POINTS) an arch word names, else None.

    `sm100`, `sm100a`, `sm100f` -> capability major 10 (FlashInfer's is_sm100a_supported()
    tests the major); `sm103a` -> 10.3 alone; `sm120a` -> 12.0; `sm12x` -> major 12;
    `sm100_or_sm110` -> majors 10 and 11; `sm100_or_newer` -> major 10 and later; `hopper`,
    `blackwell`, `ampere` (as used under `path`). With `exact_a`, an `a` suffix names one
    capability (`sm_100a` code runs on 10.0 only): for compile targets rather than predicates.
    """
    newer = word.endswith(("_or_newer", "_or_later", "_or_above", "_plus"))
    if newer:  # `is_sm100_or_newer`: that arch and every later one
        base = arch_word(word.rsplit("_or_", 1)[0].removesuffix("_plus"), path, exact_a=exact_a)
        if base is None or not base:
            return None
        first = min(base)
        return frozenset(c for c in ARCH_POINTS if c >= first)
    out: set[Capability] = set()
    for part in word.split("_or_"):
        named = _SCOPED_ARCHS.get(_scope(path), {}).get(part, _NAMED_ARCHS.get(part))
        if named is not None:
            out |= named
            continue
        m = _SM_WORD.fullmatch(part)
        if m is None:
            return None
        digits, suffix = m.groups()
        if suffix == "x":
            major, minor = int(digits), None
        else:
            major, minor = divmod(int(digits), 10)
            if minor == 0 and not (exact_a and suffix == "a"):
                minor = None
        if not 7 <= major <= 13:
            return None
        out |= {c for c in ARCH_POINTS if c[0] == major and (minor is None or c[1] == minor)}
    return frozenset(out)


def _scope(path: str) -> str:
    return next((p for p in _SCOPED_ARCHS if path.startswith(p)), "")


# `is_<word>`, `_is_<word>`, `is_<word>_supported`, `is_<word>_device`, and SGLang's
# `is_hopper_with_cuda_12_3`, as the last part of a name, attribute or call.
_PREDICATE = re.compile(
    r"_?is_(?P<word>[a-z0-9_]+?)(?:_supported|_device|_system)?(?:_with_cuda_\d+(?:_\d+)?)?"
)


def arch_predicate(spelled: str | None, path: str = "") -> frozenset[Capability] | None:
    """The GPUs a yes/no arch check in `key` spelling is true on, else None, whatever its
    spelling: `is_sm100_supported()`, `get_platform().is_sm100`, `_is_sm100_supported`,
    `self._is_sm100`, `is_sm100a_supported()` (arguments are not part of the spelling),
    `current_platform.is_hopper()`, `is_blackwell()`. `is_cuda()` is no arch check."""
    if not spelled:
        return None
    last = spelled.rsplit(".", 1)[-1].removesuffix("()")
    m = _PREDICATE.fullmatch(last)
    return arch_word(m["word"], path) if m else None


# Quantities that hold the GPU's arch, by the last part of their spelling.
_MAJOR = re.compile(r"(?:.*_)?major")
_MINOR = re.compile(r"(?:.*_)?minor")
_CAPABILITY = re.compile(
    r"(?:.*_)?capability|_?(?:device_|cuda_|compute_|gpu_)?(?:cap|cc)"
    r"|get_(?:device|compute)_capability"
)
_SM = re.compile(r"_?(?:device_sm|sm_version|sm_arch|cuda_arch|sm)|get_(?:device_sm|sm_version)")


def arch_quantity(spelled: str | None) -> str | None:
    """What a spelling holds: "major" (`sm_major`, `cc_major`, `cap.major`,
    `get_device_capability()[0]`), "minor", "capability" (a (major, minor) tuple:
    `device_capability`, `torch.cuda.get_device_capability()`, FlashInfer's
    `get_compute_capability()`), "sm" (major * 10 + minor: `get_device_sm()`, `_device_sm`,
    `sm_version`, vLLM's `capability.to_int()`), else None. Versions of anything else
    (`torch_version.major`) are none."""
    if not spelled or ("version" in spelled and "sm_version" not in spelled):
        return None
    base, _, index = spelled.partition("[")
    if index:
        if arch_quantity(base) != "capability" or index not in ("0]", "1]"):
            return None
        return "major" if index == "0]" else "minor"
    base, dot, last = spelled.rpartition(".")
    if dot and last == "to_int()" and (arch_quantity(base) == "capability" or "capabilit" in base):
        return "sm"  # vLLM's `DeviceCapability.to_int()`: major * 10 + minor
    last = last.removesuffix("()")
    for kind, pattern in (
        ("major", _MAJOR),
        ("minor", _MINOR),
        ("capability", _CAPABILITY),
        ("sm", _SM),
    ):
        if pattern.fullmatch(last):
            return kind
    return None


def arch_value(kind: str, cap: Capability) -> int | Capability:
    """The value a quantity of `kind` (see `arch_quantity`) has on a GPU of capability `cap`."""
    if kind == "major":
        return cap[0]
    if kind == "minor":
        return cap[1]
    if kind == "sm":
        return cap[0] * 10 + cap[1]
    return cap


def plausible_arch_number(kind: str, value: int) -> str | None:
    """The kind an integer compared with an arch quantity really is, judged by its size (a
    `capability` compared with 90 is an sm number, an `sm` compared with 9 a major), else
    None: 0, 2 or 1000 are no arch."""
    if 7 <= value <= 13 and kind in ("major", "sm", "capability"):
        return "major"
    if 70 <= value <= 130 and kind in ("major", "sm", "capability"):
        return "sm"
    if 0 <= value <= 9 and kind == "minor":
        return "minor"
    return None


# vLLM's capability checks take the arch as an argument (vllm/platforms/interface.py):
# `is_device_capability(c)` is `capability == c`, `has_device_capability(c)` is `capability >= c`,
# each with `c` a (major, minor) tuple or an int `major * 10 + minor` (`DeviceCapability.to_int`);
# `is_device_capability_family(c)` is `capability.to_int() // 10 == c // 10`, the major alone
# (CUDA 13's family: 100 covers 10.x, 120 covers 12.x).
VLLM_CAPABILITY_CHECKS = frozenset(
    {"is_device_capability", "has_device_capability", "is_device_capability_family"}
)


def capability_check(spelled: str | None, argument: object) -> frozenset[Capability] | None:
    """The GPUs (of ARCH_POINTS) a vLLM capability check in `key` spelling, called with the
    constant `argument`, is true on, else None: `current_platform.is_device_capability()` with
    100 -> {10.0}, with (10, 3) -> {10.3}; `has_device_capability()` with 100 -> 10.0 and every
    later GPU; `is_device_capability_family()` with 100 -> {10.0, 10.3}. An argument no arch can
    be (`has_device_capability(60)`, a name) is None."""
    method = (spelled or "").rsplit(".", 1)[-1].removesuffix("()")
    if method not in VLLM_CAPABILITY_CHECKS:
        return None
    wanted: Capability
    if type(argument) is int and plausible_arch_number("sm", argument) == "sm":
        if method == "is_device_capability_family":
            return frozenset(c for c in ARCH_POINTS if c[0] == argument // 10)
        wanted = (argument // 10, argument % 10)  # to_int()'s order is the tuple's
    elif (
        isinstance(argument, tuple)
        and len(argument) == 2
        and all(type(a) is int for a in argument)
        and 7 <= argument[0] <= 13
        and method != "is_device_capability_family"
    ):
        wanted = (argument[0], argument[1])
    else:
        return None
    if method == "is_device_capability":
        return frozenset(c for c in ARCH_POINTS if c == wanted)
    return frozenset(c for c in ARCH_POINTS if c >= wanted)


# Compile targets as upstream writes them: `sm_100a`, `sm100a`, `compute_90a`, `10.0a`,
# `-gencode=arch=compute_100a,code=sm_100a`. A suffix `a` is the arch-specific feature set
# (wgmma on 9.0a, tcgen05 on 10.0a): code built for it runs on that GPU alone.
_ARCH_STRING = re.compile(r"(?:sm_?|compute_)(\d{2,3})([af]?)|(\d{1,2})\.(\d)([af])")
_GENCODE = re.compile(r"arch=compute_(\d{2,3})([af]?)")
_DOTTED = re.compile(r"(1[0-3]|[7-9])\.(\d)")


def arch_string(text: str, *, dotted: bool = False) -> tuple[frozenset[Capability], bool] | None:
    """(the GPUs a compile-target string builds for, whether it is arch-specific `a` code),
    else None. Only whole targets count: `"sm_100a"`, `"10.0a"`, a `-gencode` flag; a kernel
    name that mentions sm100 is not a target. With `dotted`, a bare capability too: `"12.0"`,
    as the keys of vLLM's per-arch tables (`SYMM_MEM_ALL_REDUCE_MAX_SIZES`); elsewhere a bare
    `"12.0"` is as often a CUDA version."""
    bare = _DOTTED.fullmatch(text) if dotted else None
    if bare is not None:
        # a GPU the scan does not evaluate ("10.7", Rubin) is still a key of the table
        return frozenset(c for c in ARCH_POINTS if c == (int(bare[1]), int(bare[2]))), False
    m = _ARCH_STRING.fullmatch(text) or _GENCODE.search(text)
    if m is None:
        return None
    groups = [g for g in m.groups() if g is not None]
    digits = groups[0] + groups[1] if len(groups) == 3 else groups[0]
    suffix = groups[-1] if groups[-1] in ("a", "f") else ""
    caps = arch_word(f"sm{digits}{suffix}", exact_a=True)
    return (caps, suffix == "a") if caps else None


def arch_twin_names(name: str) -> list[str]:
    """Names an SM120 twin of a function named for SM100 or SM90 would have:
    `gen_fmha_sm100a_module` -> `gen_fmha_sm120a_module`, `..._sm12x_...`."""
    out = []
    for m in re.finditer(r"sm_?(?:100|103|110|90)([af]?)", name):
        sep = "_" if m[0].startswith("sm_") else ""
        for twin in (f"sm{sep}120{m[1]}", f"sm{sep}12x", f"sm{sep}120"):
            out.append(name[: m.start()] + twin + name[m.end() :])
    return list(dict.fromkeys(out))


# Bytes that every spelling above contains: a file without them holds no arch check, and a
# file with them is parsed only around the lines that have them. Each pattern starts with a
# literal that is looked for first (one alternation of them all reads a release 3x slower).
# The quantities (`major`, `capability`, ...) count only near a number an arch can be
# (`sm_major == 10`, `(10, 0) > cap`, `supported_major_versions=[9, 10]`): `major` alone is
# mostly a version's.
ARCH_TEXT: tuple[tuple[bytes, re.Pattern[bytes], bool | None], ...] = tuple(
    (literal, re.compile(pattern), quantity)
    for literal, pattern, quantity in (
        (b"is_", rb"is_(?:sm_?\d|blackwell|hopper|ampere)", False),
        (b"major", rb"major", True),
        (b"capabilit", rb"capabilit", True),
        (b"device_sm", rb"device_sm", True),
        (b"sm_version", rb"sm_version", True),
        (b"compute_", rb"compute_\d{2,3}", False),
        # `sm_100a`, `sm100` (a target) or `sm == 100` (a quantity): one pass over the text.
        (b"sm", rb"sm(?:_?\d{2,3}[af]?\b|(\s*(?:==|!=|>=|<=|[<>]|in\b|not\b)))", None),
        (b"arch", rb"archs\b|arch_list", True),
        # vLLM's per-arch tables keyed `"10.0": {...}`: one key ending .0 marks the file
        (b'.0"', rb'"(?:1[0-3]|[7-9])\.\d"', False),
        # and `100: {`, a table keyed by sm numbers (FI_ALLREDUCE_FUSION_MAX_SIZE_MB)
        (b"0: {", rb"(?m)^[ \t]+(?:[7-9]\d|1[0-2]\d):[ \t]*\{", False),
    )
)
_ARCH_NUMBER = re.compile(rb"(?<![\w.])(?:[7-9]|1[0-3]|[7-9]\d|1[0-2]\d|130)(?![\w.])")


def arch_text_hits(data: bytes) -> list[int]:
    """Offsets in `data` where an arch word may be (see ARCH_TEXT), in no particular order."""
    out = []
    for literal, pattern, quantity in ARCH_TEXT:
        if literal not in data:
            continue
        for m in pattern.finditer(data):
            if quantity or (quantity is None and m.group(1) is not None):
                # the number on this line or the next two (`== (\n 10,\n 3,\n)`)
                start = data.rfind(b"\n", 0, m.start()) + 1
                end = m.end()
                for _ in range(3):
                    end = data.find(b"\n", end + 1)
                    if end < 0:
                        end = len(data)
                        break
                if not _ARCH_NUMBER.search(data, start, end):
                    continue
            out.append(m.start())
    return out
