"""SGLang's per-model MoE runner choice, and its SM120 twin, from one template per model family.

For some MoE models SGLang picks a MoE runner backend by GPU arch, in the model's override
(`_<model>_overrides` in arg_groups/overrides.py or arg_groups/model_overrides/, from 0.5.15)
or in its `elif model_arch in [...]:` branch of `ServerArgs._handle_model_specific_adjustments`
(before): only on SM100, a TRT-LLM-gen backend (`flashinfer_trtllm`, `flashinfer_trtllm_routed`)
whose kernels do not run on SM120. `add_sm120_choice` puts an SM120 branch right after that
SM100 branch: literal source the patch declares (`Branch`), one per form upstream's SM100 branch
takes across releases. Each SM120 branch, in the release's own spelling:

- keeps the SM100 branch's quantization derivation, but into a local (it writes no
  quantization field: upstream sets it later from the model config);
- keeps the choice for `modelopt_fp4` alone (bf16 and FP8 on SM120 keep upstream's choice),
  chooses `flashinfer_cutlass`, and logs it in upstream's words with the backend and the arch
  changed;
- leaves out a FlashInfer version gate around the TRT-LLM choice (it guards TRT-LLM-gen
  kernels) and the branches before the choice in its `if`/`elif` chain (other quantizations'
  SM100 choices).

A branch is put only beside the SM100 branch it was written for: each `Branch` lists the
fingerprints of those (`fingerprint`: the sha256 of the branch's code), and an SM100 branch of
any other form is refused, its fingerprint in the refusal for the maintainer who writes its twin.

The branches of one model family differ across releases only in how the release spells the
server args around the choice (`Spelling`: the arch check, who holds the settings, where the
choice is written), so a patch declares each of its branches as its family's template
(`derived_branch`, `config_branch`) filled with a release's `Spelling`; the literal text is
what the template makes of it.
"""

from __future__ import annotations

import hashlib
import re
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sm120patch.patchkit.model import NotApplicable, Refuse, Result, already_applied

if TYPE_CHECKING:
    import libcst as cst

SERVER_ARGS_FUNC = "_handle_model_specific_adjustments"
# What the MoE patches tell a user from SGLang 0.5.13 (their facts' `user_note` there).
FLAG_NOTE = (
    "upstream already picks flashinfer_cutlass on SM120 when --quantization modelopt_fp4 is "
    "given; this patch adds the choice when the quantization comes from the checkpoint's config"
)
NEW_BACKEND = "flashinfer_cutlass"


@dataclass(frozen=True)
class Branch:
    """One SM120 branch of a patch: `code`, literal source starting `elif <SM120 check>:`, goes
    right after an SM100 branch whose `fingerprint` is in `sm100`; `name` (the releases whose
    form it twins) ends the outcome's shape. `code` may be indented as a whole."""

    name: str
    sm100: tuple[str, ...]
    code: str

    def __post_init__(self) -> None:
        code = textwrap.dedent(self.code).strip("\n") + "\n"
        if not code.startswith("elif "):
            raise ValueError(f"the SM120 branch {self.name!r} does not start with `elif `")
        object.__setattr__(self, "code", code)


@dataclass(frozen=True)
class Spelling:
    """How one form of SGLang's per-model MoE choice spells what its SM120 twin reads and
    writes: the SM120 `arch` check, the server args holding the settings (`args`) and the
    `_quantization_explicitly_unset` flag (`unset`, None before that flag), where the choice
    is `write`n, the expression naming the model's architecture there (`model_arch`), and the
    model config (`model_config`, None where no MoE choice of ours reads it)."""

    arch: str
    args: str
    unset: str | None
    write: str
    model_arch: str
    model_config: str | None

    @property
    def in_method(self) -> bool:
        """In `ServerArgs`'s own method (to 0.5.14): the quantization setting is read first,
        as upstream's SM100 branch reads it there; an override reads it after the config."""
        return self.args == "self"


# ServerArgs._handle_model_specific_adjustments, SGLang to 0.5.10.
IN_METHOD = Spelling("is_sm120_supported()", "self", None, "self.moe_runner_backend",
                     "model_arch", None)
# The same, 0.5.11 to 0.5.14: an explicitly unset quantization is not derived.
IN_METHOD_UNSET = Spelling("is_sm120_supported()", "self", "self", "self.moe_runner_backend",
                           "model_arch", None)
# `_<model>_overrides` in arg_groups/overrides.py, 0.5.15 to 0.5.18.
IN_OVERRIDES = Spelling("is_sm120_supported()", "server_args", "server_args",
                        'overrides["moe_runner_backend"]', "hf_config.architectures[0]",
                        "server_args.get_model_config()")
# `_<model>_overrides` in arg_groups/model_overrides/, 0.5.19 on: the platform's arch flags and
# the group's `cfg`.
IN_MODEL_OVERRIDES = Spelling("get_platform().is_sm120", "cfg", "server_args",
                              'overrides["moe_runner_backend"]', "hf_config.architectures[0]",
                              "model_config_of(server_args)")

_QUANT_METHOD_OF_CONFIG = """\
quantization_config = getattr(hf_config, "quantization_config", None)
quant_method = (
    quantization_config.get("quant_method")
    if quantization_config is not None
    else None
)"""


def derived_branch(
    name: str, sm100: tuple[str, ...], spelling: Spelling, *, helper: bool, model: str | None
) -> Branch:
    """The SM120 branch of a model whose SM100 branch derives the quantization from the
    checkpoint's config (GLM-4 MoE, the Qwen3 MoE family): the derivation into a local, read
    with `get_quantization_config` where upstream's branch uses that `helper`, then
    flashinfer_cutlass for modelopt_fp4 on `auto`, logged naming `model`, or the site's
    architecture where one override serves a family (`model` None)."""
    quantization = f"quantization = {spelling.args}.quantization"
    method = "quant_method = get_quantization_config(hf_config)" if helper else (
        _QUANT_METHOD_OF_CONFIG)
    derive = [quantization, method] if spelling.in_method else [method, quantization]
    if spelling.unset is None:
        unset = "if quantization is None and quant_method is not None:"
    else:
        unset = ("if (\n    quantization is None\n"
                 f"    and not {spelling.unset}._quantization_explicitly_unset\n"
                 "    and quant_method is not None\n):")
    said = f"Use {NEW_BACKEND} as MoE runner backend on sm120 for "
    log = f'"{said}{model}"' if model else f'"{said}"\n        f"{{{spelling.model_arch}}}"'
    choice = f"""\
if (
    quantization == "modelopt_fp4"
    and {spelling.args}.moe_a2a_backend == "none"
    and {spelling.args}.moe_runner_backend == "auto"
):
    {spelling.write} = "{NEW_BACKEND}"
    logger.info(
        {log}
    )"""
    body = "\n".join([*derive, unset, "    quantization = quant_method", choice])
    return Branch(name, sm100, f"elif {spelling.arch}:\n{textwrap.indent(body, '    ')}")


def config_branch(name: str, sm100: tuple[str, ...], spelling: Spelling, *, model: str) -> Branch:
    """The SM120 branch of a model whose SM100 choice is one `if` testing the model config's
    quantization (MiniMax-M2): the same conditions with the arch changed, flashinfer_cutlass,
    logged in upstream's words for `model`."""
    if spelling.model_config is None:
        raise ValueError(f"the SM120 branch {name!r}: no model config in {spelling}")
    return Branch(name, sm100, f"""\
elif (
    {spelling.arch}
    and {spelling.args}.moe_runner_backend == "auto"
    and {spelling.model_config}.quantization == "modelopt_fp4"
):
    {spelling.write} = "{NEW_BACKEND}"
    logger.info(
        "Use {NEW_BACKEND} as MoE runner backend on SM120 "
        "for {model} with modelopt_fp4."
    )
""")


def add_sm120_choice(
    module: cst.Module, model: str, overrides: str, branches: tuple[Branch, ...], *,
    absent: str | None = None,
) -> Result:
    """The SM120 branch of `branches` twinning `model`'s SM100 MoE runner choice (at `site`),
    right after it.

    Already applied where that branch is there; refused for an SM120 branch of another form or
    an SM100 branch no `Branch` twins. With `absent`, a site testing no GPU arch at all is
    not-applicable (upstream picks no backend for that model there) instead of refused. The
    call form requests `is_sm120_supported` (next to `is_sm100_supported`)."""
    import libcst as cst

    from sm120patch.patchkit import arch
    from sm120patch.patchkit import operations as op
    from sm120patch.patchkit import syntax as h

    name, suite = site(module, model, overrides)  # these two raise where they stop (the
    anchor, check = sm100_branch(name, suite, absent)  # runner records Refuse/NotApplicable)
    found = fingerprint(anchor)
    branch = next((b for b in branches if found in b.sm100), None)
    new = _literal(branch, module) if branch else None
    twin = arch.sglang_arch_twin(h.key(check))
    form = arch.sglang_arch(check)  # ("sm100", "call" or "platform"): `sm100_branch` found it
    needs = arch.sglang_arch_import("sm120", form[1]) if form else None

    # An SM120 branch already there: ours (already applied) or someone else's (refused).
    theirs = [n for n in h.statements(suite)
              if isinstance(n, cst.If) and arch.mentions_sglang_arch(n.test, "sm120")]
    if theirs:
        ours = anchor.orelse
        if new and len(theirs) == 1 and theirs[0] is ours and _code(ours) == _code(new):
            return already_applied(name, f"`elif {twin}:` choosing {NEW_BACKEND}").needing(needs)
        raise Refuse(
            name,
            f"no SM120 branch, or an `elif {twin}:` right after the SM100 branch "
            f"choosing {NEW_BACKEND}",
            f"`if {h.code(theirs[0].test)}:` (an SM120 branch in another form)",
        )
    if branch is None or new is None:
        known = "; ".join(b.name for b in branches)
        raise Refuse(name, f"the SM100 branch of a release this patch knows ({known})",
                       f"`if {h.code(anchor.test)}:` in another form (fingerprint {found})")
    shape = f"`elif {twin}:` after `if {h.key(check)}:` (the SM120 branch for {branch.name})"
    return op.add_elif(module, anchor, new.with_changes(orelse=anchor.orelse), site=name,
                       shape=shape).needing(needs)


def site(module: cst.Module, model: str, overrides: str) -> tuple[str, cst.IndentedBlock]:
    """(site name, block): the body of `def <overrides>`, else the `model_arch in [...]` branch
    naming `model` in `ServerArgs._handle_model_specific_adjustments`; exactly one of them."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    branch = f"{SERVER_ARGS_FUNC}[{model}]"
    found = [(overrides, f.body) for f in h.functions(module, overrides)] + [
        (branch, n.body)
        for func in h.functions(module, SERVER_ARGS_FUNC)
        for n in h.statements(func)
        if isinstance(n, cst.If) and _names_model(n.test, model)
    ]
    if not found:
        raise NotApplicable(branch, f'no `def {overrides}` and no `elif model_arch in '
                            f'["{model}"]:` branch in `def {SERVER_ARGS_FUNC}`')
    if len(found) > 1:
        raise Refuse(found[0][0], f"one {model} MoE site",
                     f"{len(found)} ({', '.join(s for s, _ in found)})")
    name, suite = found[0]
    if not isinstance(suite, cst.IndentedBlock):
        raise Refuse(name, "an indented block", f"`{h.code(suite)}`")
    return name, suite


def _names_model(test: cst.BaseExpression, model: str) -> bool:
    """`model_arch == "<model>"` or `model_arch in [..., "<model>", ...]`, as a whole if-test
    (the fusion auto-enable lists models too, inside an `and` chain: not this site)."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    if not (isinstance(test, cst.Comparison) and h.key(test.left) == "model_arch"
            and len(test.comparisons) == 1):
        return False
    operator, value = test.comparisons[0].operator, test.comparisons[0].comparator
    if isinstance(operator, cst.Equal):
        return h.string(value) == model
    return isinstance(operator, cst.In) and isinstance(value, (cst.List, cst.Tuple, cst.Set)) and (
        any(h.string(el.value) == model for el in value.elements))


def sm100_branch(
    name: str, suite: cst.IndentedBlock, absent: str | None = None
) -> tuple[cst.If, cst.BaseExpression]:
    """(branch, its SM100 check): the one `if`/`elif` directly in `suite` testing
    `is_sm100_supported()` or `get_platform().is_sm100`, as its whole test or the first
    operand of its `and`. Not-applicable with `absent` where `suite` tests no arch at all."""
    from sm120patch.patchkit import arch
    from sm120patch.patchkit import operations as op
    from sm120patch.patchkit import syntax as h

    chains = op.branches_in(suite)
    anchors = []
    for b in chains:
        for check in dict.fromkeys((b.test, h.and_operands(b.test)[0])):
            if arch.sglang_arch(check) in (("sm100", "call"), ("sm100", "platform")):
                anchors.append((b, check))
                break
    if len(anchors) == 1:
        return anchors[0]
    expected = "one `if is_sm100_supported():` or `if get_platform().is_sm100:` branch"
    mentions = [b for b in chains if "sm100" in h.code(b.test)]
    if len(anchors) > 1:
        raise Refuse(name, expected, f"{len(anchors)} such branches")
    if mentions:
        raise Refuse(name, expected, f"`if {h.code(mentions[0].test)}:`")
    if absent and not arch.mentions_sglang_arch(suite):
        raise NotApplicable(name, absent)
    raise Refuse(name, expected, "no SM100 branch")


def _literal(branch: Branch, module: cst.Module) -> cst.If:
    """`branch` parsed as the `if` it becomes (an `elif` once after the SM100 branch), in the
    module's own indentation (the branches are written with four spaces a level)."""
    import libcst as cst

    from sm120patch.patchkit import syntax as h

    code = re.sub(r"^(    )+", lambda m: module.default_indent * (len(m.group()) // 4),
                  branch.code.removeprefix("el"), flags=re.MULTILINE)
    new = h.parse_statement(code, module)
    assert isinstance(new, cst.If)  # `Branch` holds its code to `elif ...`
    return new


def _code(branch: cst.CSTNode) -> str:
    """The source of an `if` branch alone: without the branches after it, its leading
    comments and its indentation."""
    import libcst as cst

    assert isinstance(branch, cst.If)
    return cst.Module(body=[]).code_for_node(branch.with_changes(orelse=None, leading_lines=()))


def fingerprint(branch: cst.If) -> str:
    """The form of an SM100 branch, as a `Branch` lists it: the sha256 of its source alone
    (`_code`), first 16 hex digits. Comments and layout count, a literal twin being written
    for one text; a tab leading a line counts as four spaces (a file indented with tabs)."""
    code = re.sub(r"^[ \t]+", lambda m: m.group().replace("\t", "    "), _code(branch),
                  flags=re.MULTILINE)
    return hashlib.sha256(code.encode("utf-8")).hexdigest()[:16]
