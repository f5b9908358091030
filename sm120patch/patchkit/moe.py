"""SGLang's per-model MoE runner choice, and its SM120 twin, as literal templates.

For some MoE models SGLang picks a MoE runner backend by GPU arch, in the model's override
(`_<model>_overrides` in arg_groups/overrides.py or arg_groups/model_overrides/, from 0.5.15)
or in its `elif model_arch in [...]:` branch of `ServerArgs._handle_model_specific_adjustments`
(before): only on SM100, a TRT-LLM-gen backend (`flashinfer_trtllm`, `flashinfer_trtllm_routed`)
whose kernels do not run on SM120. `add_sm120_choice` puts an SM120 branch right after that
SM100 branch: literal source the patch declares (`Branch`), one per form upstream's SM100 branch
takes across releases. Each SM120 branch, written once by hand in the release's own spelling:

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
