"""What the pristine and the patched upstream code decide, on this machine or a simulated GPU.

The deciding is done by `probe.py`, a script run by path in the interpreter that owns the
target (the venv's `python` beside its site-packages, or `--python`), once with the pristine
text of the touched modules and once with the patched text. sm120patch itself never imports
torch, SGLang or FlashInfer: the probe does, in that other interpreter, and the alternate text
of a module reaches it as a file in a temporary directory (an import finder in the probe),
never by touching the user's files.

Which text is which: when a profile is applied, the files on disk are the patched side and
the pristine side is the engine's pristine copy (installed target) or the original branch's
blob (git target), read through `engine.pristine.pristine_bytes`; when nothing is applied,
the files on disk are the pristine side and the patched side is what the planner would write.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sm120patch.errors import Refused, Sm120Error, UsageError
from sm120patch.targets import Target, files
from sm120patch.targets.resolved import Given, resolved

PROBE = Path(__file__).with_name("probe.py")
PROFILE = "all"  # what the planned patched side applies unless --profile says another
ARCHS = ("sm120", "sm100", "sm90")
TIMEOUT_S = 300.0


class ProbeCannotImport(Sm120Error):
    """The target's interpreter cannot import what the probe needs (torch, SGLang, ...)."""

    exit_code = 7  # 5 and 6 are trial --measure verdicts


# ----------------------------------------------------------------------------- the probe


def run_probe(python: str | Path, request: Mapping[str, Any], *, timeout: float = TIMEOUT_S
              ) -> dict[str, Any]:
    """Run the probe in `python` with `request` (see probe.py); its result, parsed."""
    with tempfile.TemporaryDirectory(prefix="sm120patch-probe-") as tmp:
        req, res = Path(tmp, "request.json"), Path(tmp, "result.json")
        req.write_text(json.dumps(request), encoding="utf-8")
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        # Quiet the upstream modules' own warnings; the result is in the file.
        env.setdefault("PYTHONWARNINGS", "ignore")
        try:
            proc = subprocess.run(
                [str(python), str(PROBE), str(req), str(res)],
                capture_output=True, text=True, timeout=timeout, env=env, check=False,
            )
        except FileNotFoundError:
            raise UsageError(f"no interpreter at {python}", "pass --python PATH") from None
        except subprocess.TimeoutExpired:
            raise ProbeCannotImport(
                f"the probe in {python} did not finish in {timeout:.0f} s",
                "rerun with SM120PATCH_DEBUG=1 to see where it stops",
            ) from None
        try:
            result = json.loads(res.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ProbeCannotImport(
                f"the probe in {python} stopped (exit {proc.returncode}): {last}",
                "rerun with SM120PATCH_DEBUG=1 for the whole output",
            ) from None
    if proc.returncode == 5 or "fatal" in result:
        raise ProbeCannotImport(
            result.get("fatal", f"the probe exited {proc.returncode}"),
            f"check that {python} is the interpreter SGLang runs in (or pass --python PATH)",
        )
    return dict(result)


def module_name(file: str) -> str:
    """`sglang/srt/server_args.py` -> `sglang.srt.server_args` (package __init__ too)."""
    parts = file[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def write_overlay(texts: Mapping[str, str | bytes], directory: Path) -> dict[str, str]:
    """Write each (package-parent-relative) file's text under `directory`; module -> file."""
    overlay = {}
    for file, text in texts.items():
        path = directory / file
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, str):
            text = text.encode("utf-8")
        path.write_bytes(text)
        overlay[module_name(file)] = str(path)
    return overlay


# ----------------------------------------------------------------------------- the two texts


def patched_texts(target: Target, profile_name: str = PROFILE) -> dict[str, str]:
    """What the planner would write into `target` for `profile_name`: file -> new text."""
    from sm120patch.plan import catalog
    from sm120patch.plan.planner import plan_target

    cat = catalog.load()
    profile = cat.profile(profile_name)
    planned = plan_target(profile, cat.patches_of(profile), target)
    return {f.file: f.after for f in planned.files if f.changed}


def applied_files(target: Target) -> list[dict[str, Any]] | None:
    """The touched files when the bytes say a profile is applied to `target`, else None (the
    planner then makes the patched side). Drifted, missing or unfinished trees are refused:
    neither side would be what a server runs."""
    from sm120patch.engine import assess

    found = assess.assess(target)
    if found.state == assess.State.APPLIED and found.manifest is not None:
        return [{"path": f.path, "module": f.module} for f in found.manifest.files]
    if found.state.holds_no_patch:
        return None
    raise UsageError(
        f"{target.name} at {target.root} is {found.state}: {found.message}",
        "see `sm120patch status`; explain compares a pristine or an applied tree",
    )


@dataclass
class Sides:
    """The overlay (module -> file) that makes each side's code, for one target."""

    applied: bool
    pristine: dict[str, str] = field(default_factory=dict)
    patched: dict[str, str] = field(default_factory=dict)


def sides(target: Target, directory: Path, profile: str = PROFILE) -> Sides:
    from sm120patch.engine import pristine

    files = applied_files(target)
    if files is None:
        planned = patched_texts(target, profile)
        return Sides(False, patched=write_overlay(planned, directory / "patched"))
    texts: dict[str, str | bytes] = {}
    for f in files:
        data = pristine.pristine_bytes(target, f["path"])
        if data is None:
            raise UsageError(
                f"no pristine copy of {f['path']} for the applied {target.name}",
                "run `sm120patch status` to see the target's state",
            )
        texts[f["module"]] = data
    return Sides(True, pristine=write_overlay(texts, directory / "pristine"))


# ----------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class Decision:
    """What one side decides, in the words `explain` prints."""

    moe_runner_backend: str | None
    quantization: str | None
    allreduce_fusion: str | None  # "on (backend auto)", "off", or the launch's error
    gate: str
    resolve_backend: str
    comm_arch: str
    preflight: str = "not checked"  # the fusion workspace preflight (0.5.11 on)
    attention_backend: str | None = None  # the launch's resolved --attention-backend
    fp4_gemm_backend: str = "not checked"  # what `--fp4-gemm-backend auto` resolves to
    # what the NVFP4 MoE method resolves `--moe-runner-backend auto` to (no expert parallelism)
    moe_runner_auto: str = "not checked"


def decision(result: Mapping[str, Any], launch: str | None = "launch") -> Decision:
    """The summary of one probe result (for the named launch, when there is one)."""
    moe = quant = fusion = attention = None
    run = (result.get("launches") or {}).get(launch) if launch else None
    if run is not None:
        if "error" in run:
            fusion = moe = quant = attention = f"error: {run['error'].splitlines()[0]}"
        else:
            args = run["server_args"]
            moe, quant = args.get("moe_runner_backend"), args.get("quantization")
            attention = args.get("attention_backend")
            backend = args.get("flashinfer_allreduce_fusion_backend")
            # Up to 0.5.13 a flag; from 0.5.14 a backend (the flag is deprecated, then gone).
            on = bool(args.get("enable_flashinfer_allreduce_fusion")) or backend is not None
            fusion = "on" if on else "off"
            if backend is not None:
                fusion += f" (backend {backend})"
    return Decision(moe, quant, fusion, _gate(result), _resolve(result), _comm(result),
                    _preflight(result), attention, _fp4(result), _moe_runner(result))


def _gate(result: Mapping[str, Any]) -> str:
    gate = result.get("gate")
    if gate is None:
        return "not checked"
    if "error" in gate:
        return f"error: {gate['error']}"
    return ("passes" if gate["passes"] else "closed") + f" ({gate['function']})"


def _resolve(result: Mapping[str, Any]) -> str:
    res = result.get("resolve_backend")
    if res is None:
        return "not checked"
    if "error" in res:
        return "not in this release" if "cannot import name" in res["error"] else res["error"]
    auto = res["backends"]["auto"]
    return f"returns {auto['value']}" if "value" in auto else f"raises {auto['error']}"


def _preflight(result: Mapping[str, Any]) -> str:
    pre = result.get("preflight")
    if pre is None:
        return "not checked"
    if pre.get("error") == "not in this release":
        return "not in this release"
    driver = "" if pre.get("driver") == "real" else (
        " (simulated driver, multicast)" if pre.get("multicast") else
        " (simulated driver, no multicast)"
    )
    if pre.get("proceeds"):
        return "creates the workspace" + driver
    why = pre.get("error") or next(iter(pre.get("log") or []), "")
    return "skips allreduce fusion" + driver + (f": {why}" if why else "")


def _unanswered(res: Mapping[str, Any] | None) -> str | None:
    """The row of a check that gave no answer (not run, or its error), else None."""
    if res is None:
        return "not checked"
    if "error" in res:
        return "not in this release" if "No module named" in res["error"] else res["error"]
    return None


def _fp4(result: Mapping[str, Any]) -> str:
    res = result.get("fp4_gemm")
    if (row := _unanswered(res)) is not None or res is None:
        return row or "not checked"
    auto = res["backends"]["auto"]
    return auto["value"] if "value" in auto else f"raises {auto['error']}"


def _moe_runner(result: Mapping[str, Any]) -> str:
    res = result.get("moe_runner")
    if (row := _unanswered(res)) is not None or res is None:
        return row or "not checked"
    if res["backend"] is None:
        return "no auto choice (the runner follows --moe-runner-backend)"
    prepared = "; weights prepared for CUTLASS" if res["cutlass_weights"] else ""
    return f"{res['backend']}{prepared}"


def _comm(result: Mapping[str, Any]) -> str:
    comm = result.get("comm_arch")
    if comm is None:
        return "not checked"
    if "error" in comm:
        return f"raises {comm['error']}"
    return ", ".join(comm["archs"]) or "(none)"


# ----------------------------------------------------------------------------- explain


@dataclass
class Explanation:
    python: str
    simulate: str | None
    launch: list[str]
    targets: list[dict[str, Any]]
    applied: bool
    pristine: Decision
    patched: Decision
    notes: list[str] = field(default_factory=list)

    ROWS = (
        ("moe_runner_backend", "MoE runner backend"),
        ("quantization", "quantization"),
        ("allreduce_fusion", "allreduce fusion"),
        ("attention_backend", "attention backend"),
        ("gate", "runtime fusion gate"),
        ("resolve_backend", "_resolve_backend('auto')"),
        ("preflight", "fusion workspace preflight"),
        ("fp4_gemm_backend", "FP4 GEMM backend (auto)"),
        ("moe_runner_auto", "NVFP4 MoE runner (auto, no expert parallelism)"),
        ("comm_arch", "FlashInfer trtllm comm archs"),
    )

    LAUNCH_ROWS = ("moe_runner_backend", "quantization", "allreduce_fusion", "attention_backend")

    def rows(self) -> list[tuple[str, str, str]]:
        """(what, pristine, patched) for each decision the probe could make here."""
        out = []
        for key, label in self.ROWS:
            before, after = getattr(self.pristine, key), getattr(self.patched, key)
            if key in self.LAUNCH_ROWS and not self.launch:
                continue
            if before == after == "not checked":
                continue
            out.append((label, "none" if before is None else before,
                        "none" if after is None else after))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "python": self.python,
            "simulate": self.simulate,
            "launch": self.launch,
            "targets": self.targets,
            "applied": self.applied,
            "pristine": asdict(self.pristine),
            "patched": asdict(self.patched),
            "notes": self.notes,
        }


def interpreter_for(target: Target) -> Path:
    """The target environment's own interpreter: the `python` of the virtual environment
    whose root (its `pyvenv.cfg`) holds the target's `lib/pythonX.Y/site-packages`, or the
    interpreter running sm120patch when the target's directory is on its own `sys.path`.
    Nothing else: no `pyvenv.cfg` found further up (a directory above a `pip --target` tree
    that others may write), no interpreter of another environment's."""
    site = target.parent
    if site.name in ("site-packages", "dist-packages") and site.parent.name.startswith("python"):
        root = site.parents[2]
        if site.parents[1].name in ("lib", "lib64") and (root / "pyvenv.cfg").is_file():
            for name in ("bin/python", "bin/python3"):
                if os.path.lexists(root / name):
                    return root / name
    own = {os.path.realpath(p) for p in sys.path if p}
    if os.path.realpath(site) in own:
        return Path(sys.executable)
    raise UsageError(
        f"no interpreter of the environment that holds {target.parent} (no pyvenv.cfg at its "
        "root, and it is not the environment sm120patch runs in)",
        "pass --python PATH: the interpreter SGLang runs in",
    )


def untrusted_interpreter(python: Path) -> str | None:
    """Why someone other than its owner or root could change what `python` runs, or None:
    the interpreter, the file it leads to and every directory above either must be owned by
    its owner or root and writable by no one else (a sticky directory of root's or the
    owner's, such as /tmp, aside: nobody renames another's entry there). A path that does not
    exist is left to the probe's run."""
    if not python.exists():
        return None
    owner = os.lstat(python).st_uid
    real = Path(os.path.realpath(python))
    for path in dict.fromkeys([python, *python.parents, real, *real.parents]):
        try:
            st = os.lstat(path)
        except OSError as exc:
            return f"{path} cannot be read ({exc.strerror})"
        if stat.S_ISLNK(st.st_mode):
            continue  # where it leads is judged too (`real`)
        bits = stat.S_IMODE(st.st_mode)
        sticky = stat.S_ISDIR(st.st_mode) and bits & stat.S_ISVTX and st.st_uid in (0, owner)
        if st.st_uid not in (0, owner):
            return f"{path} is owned by {files.owner_name(st.st_uid)}"
        if bits & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
            return f"{path} is writable by its group or by others (mode {bits:o})"
    return None


def explain(
    paths: Given,
    *,
    python: str | Path | None = None,
    simulate: str | None = None,
    launch: Sequence[str] = (),
    profile: str = PROFILE,
) -> Explanation:
    """Run the probe on the pristine and the patched code of the targets at `paths`; where
    nothing is applied, the patched side is what `profile` would write. `paths`: the
    command's targets (`Resolved`), each found once."""
    if simulate is not None and simulate not in ARCHS:
        raise UsageError(f"--simulate {simulate!r}", f"use one of {', '.join(ARCHS)}")
    named = resolved(paths)
    found: list[Target] = []
    for kind in ("sglang", "flashinfer"):
        try:
            found.append(named.find(kind))
        except Sm120Error:
            if named.given(kind):
                raise
    if not found:
        raise UsageError("found neither SGLang nor FlashInfer", "pass --sglang/--flashinfer PATH")
    interp = Path(python).absolute() if python else interpreter_for(found[0])
    problem = untrusted_interpreter(interp)
    if problem:
        raise Refused(
            f"refusing to run {interp}: {problem}, so someone else could choose what it runs "
            "(explain runs the interpreter and the target's code with your privileges)",
            "pass --python PATH of an interpreter that only its owner or root can change",
        )
    launch = list(launch)
    notes = []
    if not launch:
        notes.append("no launch arguments: give `-- --model-path DIR [...]` for the server "
                     "argument decisions")
    with tempfile.TemporaryDirectory(prefix="sm120patch-explain-") as tmp:
        overlay: dict[str, dict[str, str]] = {"pristine": {}, "patched": {}}
        applied = False
        for target in found:
            s = sides(target, Path(tmp) / target.kind, profile)
            applied = applied or s.applied
            overlay["pristine"].update(s.pristine)
            overlay["patched"].update(s.patched)
        base = {
            "simulate": simulate,
            "sys_path": [str(t.parent) for t in found],
            "launches": {"launch": launch} if launch else {},
            "sglang": any(t.kind == "sglang" for t in found),
            "flashinfer": any(t.kind == "flashinfer" for t in found),
        }
        # The two sides are independent processes: run them side by side.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {
                side: pool.submit(run_probe, interp, {**base, "overlay": overlay[side]})
                for side in ("pristine", "patched")
            }
            results = {side: f.result() for side, f in futures.items()}
    key = "launch" if launch else None
    return Explanation(
        python=str(interp),
        simulate=simulate,
        launch=launch,
        targets=[t.to_dict() for t in found],
        applied=applied,
        pristine=decision(results["pristine"], key),
        patched=decision(results["patched"], key),
        notes=notes,
    )
