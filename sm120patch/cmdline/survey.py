"""The commands that read and write nothing into a tree, `doctor`, `explain`, `scan` and
`matrix`: their options, the verbs they call (`sm120patch/commands/survey.py`) and what each
prints of its result."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from sm120patch import app
from sm120patch.cmdline.options import json_option, session, verbose_option, with_targets
from sm120patch.commands import survey as verbs
from sm120patch.errors import UsageError
from sm120patch.render import PATCH_WIDTH, Text, echo_err, emit_json, show

if TYPE_CHECKING:
    from sm120patch.commands.survey import Matrix
    from sm120patch.explain.doctor import Examination
    from sm120patch.explain.explain import Explanation
    from sm120patch.scan.run import Report as ScanReport

# ---- what each prints --------------------------------------------------------------------


def doctor(found: Examination) -> Text:
    text = Text()
    gpus = found.gpus
    if gpus.problem or not gpus.gpus:
        text.out.append(f"GPUs: {gpus.summary()}")
    else:
        text.out.append(f"GPUs (driver {gpus.driver}, CUDA {gpus.cuda_driver}):")
        for g in gpus.gpus:
            mark = "SM120" if g.is_sm120 else "not SM120"
            text.out.append(f"  {g.describe()} ({mark})")
    for t in found.targets:
        text.out.append(f"{t['kind']}: {t['version']} ({t['layout']}) at {t['root']}")
        if t["version"] == "unknown":
            text.out.append(f"  version unknown: {t['version_source']}")
        text.out += [f"  {b['package']}: {b['state']}" for b in t.get("beside", ())]
    text.out += found.missing
    for p in found.profiles:
        text.out.append(f"profile {p.name} [{p.status}]: {p.verdict}")
        for o in p.outcomes:
            where = f"{o['file']}::{o['site']}" if o["file"] else o["site"]  # as `outcomes`
            text.out.append(f"  {o['status']:16} {o['patch']:{PATCH_WIDTH}} {where}")
        text.out += [f"  applied now on {root}" for root in p.applied_on]
        text.out += [f"  {p.flag}"] if p.flag else []
    for a in found.applied:
        if a.get("problem"):
            text.out.append(f"status: {a['problem']}")
    text.out += found.known
    text.out.append(found.recommendation)
    return text


def explained(found: Explanation, simulate: str | None) -> Text:
    text = Text()
    gpu = f"simulated {simulate.upper()}" if simulate else "this machine's GPU"
    text.out.append(f"# {gpu}, {found.python}")
    for t in found.targets:
        text.out.append(f"# {t['kind']} {t['version']} at {t['root']}")
    if found.launch:
        text.out.append(f"# launch: {' '.join(found.launch)}")
    side = "patched (on disk)" if found.applied else "patched (planned)"

    def cell(value: str, most: int = 56) -> str:
        return value if len(value) <= most else value[: most - 3] + "..."

    rows = [("", "pristine", side), *((k, cell(a), cell(b)) for k, a, b in found.rows())]
    width = max(len(r[0]) for r in rows)
    left = max(len(r[1]) for r in rows)
    for label, before, after in rows:
        mark = "  " if before == after or not label else "->"
        text.out.append(f"{label:{width}}  {before:{left}}  {mark} {after}")
    text.out += [f"note: {note}" for note in found.notes]
    return text


def matrix(found: Matrix, as_json: bool) -> Text:
    from sm120patch.maintain import matrix as planning

    if as_json:
        return Text(out=[planning.to_json(found.rows, [found.warning] if found.warning else [])])
    return Text(out=[planning.markdown(found.rows, found.profiles)])


def scan(found: ScanReport, *, as_json: bool, all_: bool) -> Text:
    """A scan: JSON for tools, else the gates by class (sm120patch.scan.report)."""
    from sm120patch.scan import report

    if as_json:
        import json

        return Text(out=[json.dumps(found.to_dict(), indent=2)])
    return Text(raw=report.text(found, all_=all_))


# ---- the commands ------------------------------------------------------------------------


@click.command("doctor")
@with_targets
@verbose_option
@json_option
def doctor_cmd(targets: app.Named, verbose: bool, as_json: bool) -> None:
    """What this machine has (GPUs, SGLang, FlashInfer) and one verdict per profile here.

    The known outcomes that match this box come after the profiles, one line each (--verbose:
    in full), then the summary.
    """
    found = verbs.doctor(session(targets, verbose=verbose))
    if as_json:
        emit_json(found.to_dict())
        return
    show(doctor(found))


@click.command("matrix")
@click.option(
    "--sglang",
    "sglang_spec",
    metavar="SPEC",
    help="SGLang releases to plan, a PEP 440 specifier (e.g. '>=0.5.8', '==0.5.10.post1').",
)
@click.option(
    "--flashinfer",
    "flashinfer_spec",
    metavar="SPEC",
    help="FlashInfer releases to plan, a PEP 440 specifier.",
)
@click.option(
    "--vllm",
    "vllm_spec",
    metavar="SPEC",
    help="vLLM releases to plan ('' for every one tracked); only when named.",
)
@click.option("--profile", "profiles", multiple=True, help="Only these profiles (repeatable).")
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    help="Releases planned in parallel (default: the CPU count).",
)
@json_option
@click.option("--markdown", "as_markdown", is_flag=True, help="Print Markdown tables (default).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar on stderr.")
@click.option("--scan", is_flag=True, help="Scan each whole release too: its new candidate gates.")
def matrix_cmd(
    sglang_spec: str | None,
    flashinfer_spec: str | None,
    vllm_spec: str | None,
    profiles: tuple[str, ...],
    jobs: int | None,
    as_json: bool,
    as_markdown: bool,
    quiet: bool,
    scan: bool,
) -> None:
    """Plan every profile on every SGLang and FlashInfer release on pip's index (vLLM with
    --vllm): outcome per site. Naming some kinds plans only those. Releases come from pip's
    configured index (pip config, PIP_INDEX_URL) into the release cache; offline, the cached
    release list is used with a warning."""
    if as_json and as_markdown:
        raise UsageError(
            "give at most one of --json and --markdown", "Markdown is the default; drop one"
        )
    found = verbs.matrix(
        session(),
        {"sglang": sglang_spec, "flashinfer": flashinfer_spec, "vllm": vllm_spec},
        profiles,
        jobs,
        on_warning=lambda line: echo_err(f"sm120patch: warning: {line}"),
        progress_quiet=quiet,
        scan=scan,
    )
    show(matrix(found, as_json))
    if found.failed:
        sys.exit(1)


@click.command("scan")
@with_targets
@json_option
@click.option("--all", "all_", is_flag=True, help="List the upstream and kernel gates too.")
@click.option("--fail-on-candidate", is_flag=True, help="Exit 1 when a new candidate is found.")
@click.option("--known", metavar="FILE", help="A `scan --json` whose candidates are not new.")
def scan_cmd(targets: app.Named, known: str | None, **o: bool) -> None:
    """The GPU-arch gates that leave SM120 out, read from the sources (nothing is imported), by
    class. Given a path, only that target; else the ones installed in this Python."""
    found = verbs.scan(session(targets), known)
    show(scan(found, as_json=o["as_json"], all_=o["all_"]))
    if o["fail_on_candidate"] and found.new_candidates():
        sys.exit(1)


@click.command("explain", context_settings={"ignore_unknown_options": True})
@with_targets
@click.option(
    "--python",
    "python",
    metavar="PATH",
    help="The interpreter the server runs in (default: the venv's python beside the target).",
)
@click.option(
    "--simulate",
    type=click.Choice(["sm120", "sm100", "sm90"]),
    help="Decide as on a GPU of this architecture instead of the real one.",
)
@click.option(
    "--profile",
    "profile",
    default=None,
    metavar="PROFILE",
    help="Where nothing is applied, the patched side is what this profile would write "
    "(default: all, which leaves out fp4-gemm and attention; with --vllm, the profile that "
    "patches vLLM where only one does).",
)
@json_option
@click.argument("launch", nargs=-1, type=click.UNPROCESSED)
def explain_cmd(
    targets: app.Named,
    python: str | None,
    simulate: str | None,
    profile: str | None,
    as_json: bool,
    launch: tuple[str, ...],
) -> None:
    """What upstream's own code decides, pristine vs patched, for `-- SGLANG LAUNCH ARGS`.

    Runs SGLang's server-argument resolution, the allreduce-fusion gate, _resolve_backend, the
    FP4 GEMM backend `auto` resolves to and FlashInfer's comm module flags in the target's
    interpreter: no weights, no server. With --vllm PATH: what vLLM's patches read there.
    """
    found = verbs.explain(session(targets), python, simulate, launch, profile)
    if as_json:
        emit_json(found.to_dict())
        return
    show(explained(found, simulate))
