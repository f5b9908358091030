"""The behaviour checks, as functions returning what is wrong (an empty list: all good), so a
test can also show that each of them fails on a tree made wrong on purpose."""

from __future__ import annotations

from typing import Any

# Upstream copies the MoE runner backend into the speculative one when that is "auto".
MOE_FIELDS = {"moe_runner_backend", "speculative_moe_runner_backend"}
FUSION_FIELDS = {"enable_flashinfer_allreduce_fusion", "flashinfer_allreduce_fusion_backend"}
CUTLASS = "flashinfer_cutlass"
# From 0.5.13 upstream's own MoE handler picks flashinfer_cutlass on SM120 when
# `--quantization modelopt_fp4` is on the command line (each model's `nvfp4-flag` launch; the
# plan notes it, test_behaviour.test_upstream_flag_path_is_known).
GLM = "Glm4MoeForCausalLM"
# The MoE models whose SM100-only runner choice the moe profile gives an SM120 twin: model ->
# the prefix of its launches' names (GLM-4 MoE's launches keep their first names).
MOE_MODELS = {GLM: "moe", "Qwen3MoeForCausalLM": "moe-qwen3", "MiniMaxM2ForCausalLM": "moe-minimax"}


def moe_launch(model: str, kind: str) -> str:
    """The name of `model`'s MoE launch `kind` ("nvfp4-config", ...): `moe-nvfp4-config` for
    GLM-4 MoE, `moe-qwen3-nvfp4-config`..."""
    return f"{MOE_MODELS[model]}-{kind}"

Result = dict[str, Any]


def args_of(result: Result, launch: str) -> dict[str, Any] | None:
    run = result["launches"].get(launch, {})
    return run.get("server_args")


def fusion_on(args: dict[str, Any]) -> bool:
    return bool(args.get("enable_flashinfer_allreduce_fusion")) or (
        args.get("flashinfer_allreduce_fusion_backend") is not None
    )


def fusion_launches(pristine_sm100: Result) -> list[str]:
    """The fusion launches upstream auto-enables on SM100: the ones SM120 should follow."""
    out = []
    for name in pristine_sm100["launches"]:
        args = args_of(pristine_sm100, name)
        if name.startswith("fusion-") and args is not None and fusion_on(args):
            out.append(name)
    return out


def has_resolve_backend(result: Result) -> bool:
    """Whether the release has `_resolve_backend` (0.5.14 on); an import that failed for
    another reason counts as having it, so the check reports the error."""
    return "cannot import name" not in result["resolve_backend"].get("error", "")


def resolved_auto(result: Result) -> dict[str, Any]:
    """`_resolve_backend('auto')`'s value or error; the import's error when it did not load."""
    res = result["resolve_backend"]
    return res["backends"]["auto"] if "backends" in res else {"error": res.get("error")}


def control_problems(pristine_sm120: Result, pristine_sm100: Result,
                     models: tuple[str, ...] = (GLM,)) -> list[str]:
    """Pristine upstream on SM120 does not take the SM120 path (where it does, it is listed):
    for the MoE `models` whose patch applies on this release, among the rest."""
    problems = []
    for model in models:
        args = args_of(pristine_sm120, moe_launch(model, "nvfp4-config"))
        if args is None or args["moe_runner_backend"] == CUTLASS:
            problems.append(f"pristine SM120 {model} NVFP4-from-config MoE backend: "
                            f"{args and args['moe_runner_backend']}")
    for name in fusion_launches(pristine_sm100):
        a = args_of(pristine_sm120, name)
        if a is None or fusion_on(a):
            problems.append(f"pristine SM120 {name}: fusion already on or error")
    if pristine_sm120["gate"].get("passes") is not False:  # an error is a problem too
        problems.append(f"pristine SM120 gate: {pristine_sm120['gate']}")
    if has_resolve_backend(pristine_sm120):
        auto = resolved_auto(pristine_sm120)
        if "error" not in auto or "SM90" not in str(auto["error"]):
            problems.append(f"pristine SM120 _resolve_backend('auto'): {auto}")
    return problems


def sm120_problems(pristine: Result, patched: Result, pristine_sm100: Result,
                   models: tuple[str, ...] = (GLM,)) -> list[str]:
    """The patched code takes the SM120 path (for the MoE `models` whose patch applies on this
    release); what must not change did not (for every model)."""
    problems = []
    for name in (moe_launch(m, k) for m in models for k in ("nvfp4-config", "nvfp4-flag")):
        a = args_of(patched, name)
        if a is None or a["moe_runner_backend"] != CUTLASS:
            problems.append(f"patched SM120 {name}: MoE backend {a and a['moe_runner_backend']}, "
                            f"expected {CUTLASS}")
    others = [n for n in patched["launches"] if n.endswith(("-bf16", "-fp8"))]
    for name in others:
        before, after = args_of(pristine, name), args_of(patched, name)
        if before is None or after is None or before["moe_runner_backend"] != after["moe_runner_backend"]:
            problems.append(f"patched SM120 {name}: MoE backend changed "
                            f"{before and before['moe_runner_backend']} -> "
                            f"{after and after['moe_runner_backend']}")
    for name in fusion_launches(pristine_sm100):
        a = args_of(patched, name)
        if a is None or not fusion_on(a):
            problems.append(f"patched SM120 {name}: fusion not auto-enabled")
    problems += tp4_problems(pristine, patched, pristine_sm100)
    if patched["gate"].get("passes") is not True:
        problems.append(f"patched SM120 gate: {patched['gate']}")
    if has_resolve_backend(patched):
        auto = resolved_auto(patched)
        if "value" not in auto:
            problems.append(f"patched SM120 _resolve_backend('auto'): {auto}")
    problems += field_problems(pristine, patched, MOE_FIELDS | FUSION_FIELDS)
    return problems


def tp4_problems(pristine: Result, patched: Result, pristine_sm100: Result) -> list[str]:
    """SM120 auto-enables fusion at TP2 only: at TP4, where upstream auto-enables it on SM100,
    patched SM120 leaves it off; with the user's explicit flag it is on, pristine and patched."""
    problems = []
    plain, flag = "fusion4-plain", "fusion4-flag"
    if plain not in pristine_sm100["launches"]:
        return problems  # the release does not list the TP4 model for fusion
    sm100 = args_of(pristine_sm100, plain)
    if sm100 is None or not fusion_on(sm100):
        problems.append(f"pristine SM100 {plain}: fusion not auto-enabled at TP4: {sm100}")
    a = args_of(patched, plain)
    if a is None or fusion_on(a):
        problems.append(f"patched SM120 {plain}: fusion auto-enabled at TP4 (or error)")
    for side, result in (("pristine", pristine), ("patched", patched)):
        a = args_of(result, flag)
        if a is None or not fusion_on(a):
            problems.append(f"{side} SM120 {flag}: the user's explicit flag did not stand")
    return problems


def field_problems(pristine: Result, patched: Result, allowed: set[str]) -> list[str]:
    """Every launch resolves to the same whole ServerArgs but for `allowed` fields."""
    problems = []
    for name in sorted(set(pristine["launches"]) | set(patched["launches"])):
        a, b = pristine["launches"].get(name, {}), patched["launches"].get(name, {})
        if "server_args" not in a or "server_args" not in b:
            if a.get("error") != b.get("error"):
                problems.append(f"{name}: error {a.get('error')!r} -> {b.get('error')!r}")
            continue
        before, after = a["server_args"], b["server_args"]
        changed = sorted(k for k in set(before) | set(after)
                         if before.get(k) != after.get(k) and k not in allowed)
        for key in changed:
            problems.append(f"{name}: {key} {before.get(key)!r} -> {after.get(key)!r}")
    return problems


def same_problems(pristine: Result, patched: Result) -> list[str]:
    """Off SM120 the patched code decides exactly as the pristine code: every launch's whole
    ServerArgs, the gate, _resolve_backend, the comm arch list."""
    problems = field_problems(pristine, patched, set()) if "launches" in pristine else []
    for key in ("predicates", "resolve_backend", "comm_arch", "preflight"):
        if _unplaced(pristine.get(key)) != _unplaced(patched.get(key)):
            problems.append(f"{key}: {pristine.get(key)} -> {patched.get(key)}")
    if "gate" in pristine:
        # The patched module has one flag more (_is_sm120_supported); the others must agree.
        a, b = pristine["gate"], patched["gate"]
        flags = {k: v for k, v in b.get("flags", {}).items() if k in a.get("flags", {})}
        if (a.get("passes"), a.get("error"), a.get("flags")) != (
            b.get("passes"), b.get("error"), flags
        ):
            problems.append(f"gate: {a} -> {b}")
    return problems


def _unplaced(value: Any) -> Any:
    """`value` with the paths of source files left out of its text: an import error names the
    file it read, which for the patched side is the overlay's copy of the same module."""
    import json
    import re

    return re.sub(r"\(/[^()]*\.py\)", "(<file>)", json.dumps(value, sort_keys=True))


def comm_problems(pristine: Result, patched: Result) -> list[str]:
    problems = []
    error = pristine["comm_arch"].get("error", "")
    if "No supported CUDA architectures" not in error:
        problems.append(f"pristine SM120 comm module did not raise: {pristine['comm_arch']}")
    archs = patched["comm_arch"].get("archs", [])
    if "error" in patched["comm_arch"] or not any(a.startswith("compute_120") for a in archs):
        problems.append(f"patched SM120 comm module: {patched['comm_arch']}")
    return problems


def has_preflight(result: Result) -> bool:
    """Whether the release has the fusion workspace preflight (0.5.11 on)."""
    return result.get("preflight", {}).get("error") != "not in this release"


def preflight_problems(pristine: Result, patched: Result) -> list[str]:
    """On simulated SM120 (a driver without multicast): the pristine preflight turns fusion
    off and says so in the log; the patched one lets SGLang create the workspace."""
    problems = []
    before, after = pristine.get("preflight", {}), patched.get("preflight", {})
    if before.get("multicast") is not False or after.get("multicast") is not False:
        problems.append(f"not a driver without multicast: {before} / {after}")
    if before.get("proceeds") is not False or not any(
        "Skipping allreduce fusion" in line for line in before.get("log", [])
    ):
        problems.append(f"pristine SM120 preflight did not skip fusion: {before}")
    if after.get("proceeds") is not True or after.get("log"):
        problems.append(f"patched SM120 preflight did not proceed: {after}")
    sizes = after.get("sizes")
    if not isinstance(sizes, list) or not sizes or any(s % (1 << 21) for s in sizes):
        problems.append(f"patched SM120 preflight sizes: {sizes}")
    return problems
