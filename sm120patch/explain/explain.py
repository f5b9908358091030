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
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sm120patch import safeio
from sm120patch.errors import Refused, Sm120Error, UsageError
from sm120patch.targets import Target, files
from sm120patch.targets.resolved import Given, owned

if TYPE_CHECKING:
    from sm120patch.patchkit.model import Patch
    from sm120patch.patchkit.readers import Explain
    from sm120patch.plan.catalog import Catalog

PROBE = Path(__file__).with_name("probe.py")
PROFILE = "all"  # what the planned patched side applies unless --profile says another
ARCHS = ("sm120", "sm100", "sm90")
TIMEOUT_S = 300.0


class ProbeCannotImport(Sm120Error):
    """The target's interpreter cannot import what the probe needs (torch, SGLang, ...)."""

    exit_code = 7  # 5 and 6 are trial --measure verdicts


# ----------------------------------------------------------------------------- the probe


def run_probe(
    python: str | Path, request: Mapping[str, Any], *, timeout: float = TIMEOUT_S
) -> dict[str, Any]:
    """Run the probe in `python` with `request` (see probe.py); its result, parsed. A request
    without `readers` carries those the loaded patches declare for the targets it probes."""
    if "readers" not in request:
        kinds = [
            k
            for k, on in (
                ("sglang", request.get("sglang", True)),
                ("flashinfer", request.get("flashinfer", False)),
                ("vllm", request.get("vllm", False)),
            )
            if on
        ]
        request = {**request, "readers": reader_requests(kinds)}
    with tempfile.TemporaryDirectory(prefix="sm120patch-probe-") as tmp:
        req, res = Path(tmp, "request.json"), Path(tmp, "result.json")
        req.write_text(json.dumps(request), encoding="utf-8")
        # The server's own environment (its PYTHONPATH, SGLANG_* and CUDA_* variables decide
        # what it imports and resolves), run by path (no `-m`: the working directory is not on
        # sys.path) from `/`, so that nothing of the caller's directory is in reach.
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        # Quiet the upstream modules' own warnings; the result is in the file.
        env.setdefault("PYTHONWARNINGS", "ignore")
        try:
            proc = subprocess.run(
                [_absolute(python), str(PROBE), str(req), str(res)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
                check=False,
                cwd=safeio.CHILD_CWD,
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
            f"check that {python} is the interpreter the server runs in (or pass --python PATH)",
        )
    return dict(result)


def _absolute(python: str | Path) -> str:
    """`python` as the child, started in `/`, finds it: a relative path made absolute here, a
    bare name left for PATH."""
    text = str(python)
    return os.path.abspath(text) if os.sep in text else text


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


# ----------------------------------------------------------------------------- the readers

# Checking a declaration parses its reader's text (`Explain.problems`), and CPython's `ast` is
# not safe in two threads at once ("AST constructor recursion depth mismatch", 3.11).
_PARSING = threading.Lock()
# The keys of the probe's result that are its own (probe.py, `run`): no reader may take them.
PROBE_KEYS = frozenset(
    {
        "python",
        "torch",
        "simulate",
        "device",
        "capability",
        "sglang",
        "flashinfer",
        "vllm",
        "predicates",
        "launches",
        "fatal",
    }
)


def declared(cat: Catalog | None = None) -> list[tuple[Patch, Explain]]:
    """What the patches of `cat` (the command's catalog; None: the environment's) declare
    `explain` reads (`Patch.explain`), SGLang's first, in the catalog's order. A reader the
    probe could not run from its text alone, or a name taken twice, is a usage error naming
    the patch and where it comes from."""
    from sm120patch.patchkit.model import TARGETS

    cat = _catalog(cat)  # every patch's target is one of TARGETS (the catalog checks)
    found = sorted(
        ((p, p.explain) for p in cat.patches.values() if p.explain is not None),
        key=lambda pe: TARGETS.index(pe[0].target),
    )
    taken: dict[str, str] = {}
    for patch, reader in found:
        with _PARSING:  # callers probe from threads; `ast` must not parse in two at once
            problems = reader.problems()
        for key in dict.fromkeys((reader.name, reader.key)):
            if key in PROBE_KEYS or key in LAUNCH_ROWS:
                problems.append(f"explain: the name {key!r} is the probe's own")
            elif key in taken:
                problems.append(f"explain: the name {key!r} is also {taken[key]}'s")
            taken[key] = patch.id
        if problems:
            raise UsageError(
                f"patch {patch.id} ({cat.source(patch.id).name}): {problems[0]}",
                "fix the patch's explain reader (see sm120patch.patchkit.readers)",
            )
    return found


def _catalog(cat: Catalog | None) -> Catalog:
    from sm120patch.plan import catalog

    return cat if cat is not None else catalog.load()


def labels(cat: Catalog | None = None) -> list[tuple[str, str]]:
    """(field, label) of the rows the loaded patches declare, in the order `explain` shows."""
    return [(reader.key, reader.label) for _, reader in declared(cat)]


def reader_requests(kinds: Sequence[str], cat: Catalog | None = None) -> list[dict[str, Any]]:
    """The readers of the patches of the targets `kinds`, as the probe's request carries them:
    the reader's source text, and where its site is by the patch's facts."""
    out = []
    for patch, reader in declared(cat):
        if patch.target not in kinds:
            continue
        file, line, source = reader.source()
        functions = (f.function for f in reversed(patch.facts) if f.function)
        out.append(
            {
                "patch": patch.id,
                "target": patch.target,
                "name": reader.name,
                "function": reader.read.__name__,
                "source": source,
                "file": file,
                "line": line,
                "modules": [module_name(f) for f in patch.files],
                "functions": list(dict.fromkeys(functions)),
            }
        )
    return out


# ----------------------------------------------------------------------------- the two texts


def profile_for(target: Target, profile_name: str | None, cat: Catalog | None = None) -> str:
    """The profile whose planned text is the patched side of `target`: the one named, else
    `all` for SGLang and FlashInfer, and for vLLM the one profile of the catalog that patches
    it (several: name one)."""
    if profile_name is not None:
        return profile_name
    if target.kind != "vllm":
        return PROFILE
    names = [n for n, p in _catalog(cat).profiles.items() if target.kind in p.targets]
    if len(names) != 1:
        raise UsageError(
            f"{len(names) or 'no'} profiles patch {target.name}"
            + (f" ({', '.join(names)})" if names else ""),
            "name the patched side with --profile PROFILE"
            if names
            else "load a pack that patches it (--patches DIR)",
        )
    return names[0]


def check_profile(
    found: Sequence[Target], profile_name: str | None, cat: Catalog | None = None
) -> None:
    """A profile named that patches none of the targets found is refused: its patched side
    would be the pristine text, every row "the same" for no reason."""
    if profile_name is None:
        return
    kinds = _catalog(cat).profile(profile_name).targets
    if not any(t.kind in kinds for t in found):
        names = " and ".join(t.name for t in found)
        raise UsageError(
            f"profile {profile_name} patches nothing of {names}",
            "`sm120patch list` shows what each profile patches",
        )


def patched_texts(
    target: Target, profile_name: str = PROFILE, cat: Catalog | None = None
) -> dict[str, str]:
    """What the planner would write into `target` for `profile_name`: file -> new text."""
    from sm120patch.plan.planner import plan_target

    cat = _catalog(cat)
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


def sides(
    target: Target, directory: Path, profile: str | None = PROFILE, cat: Catalog | None = None
) -> Sides:
    from sm120patch.engine import pristine

    files = applied_files(target)
    if files is None:
        planned = patched_texts(target, profile_for(target, profile, cat), cat)
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


# What every launch resolves (ServerArgs fields, the same for every patch), in words.
LAUNCH_ROWS = {
    "moe_runner_backend": "MoE runner backend",
    "quantization": "quantization",
    "allreduce_fusion": "allreduce fusion",
    "attention_backend": "attention backend",
}
NOT_CHECKED = "not checked"


@dataclass(frozen=True)
class Decision:
    """What one side decides, in the words `explain` prints: the launch's resolved fields
    (`LAUNCH_ROWS`; None without a launch) and each declared reader's row under its field."""

    launch: dict[str, str | None]
    sites: dict[str, str]

    def to_dict(self) -> dict[str, str | None]:
        return {**self.launch, **self.sites}

    def __getitem__(self, key: str) -> str | None:
        return self.to_dict()[key]

    def __getattr__(self, key: str) -> str | None:
        """A row by its field, as an attribute (`decision.gate`)."""
        if key in ("launch", "sites") or key.startswith("__"):
            raise AttributeError(key)
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def decision(
    result: Mapping[str, Any],
    launch: str | None = "launch",
    readers: Sequence[Explain] | None = None,
) -> Decision:
    """The summary of one probe result (for the named launch, when there is one); each
    reader's row by its patch's declaration (`readers`: the loaded patches' when None)."""
    if readers is None:
        readers = [reader for _, reader in declared()]
    rows: dict[str, str | None] = dict.fromkeys(LAUNCH_ROWS)
    run = (result.get("launches") or {}).get(launch) if launch else None
    if run is not None:
        if "error" in run:
            rows = dict.fromkeys(LAUNCH_ROWS, f"error: {run['error'].splitlines()[0]}")
        else:
            args = run["server_args"]
            rows["moe_runner_backend"] = args.get("moe_runner_backend")
            rows["quantization"] = args.get("quantization")
            rows["attention_backend"] = args.get("attention_backend")
            backend = args.get("flashinfer_allreduce_fusion_backend")
            # Up to 0.5.13 a flag; from 0.5.14 a backend (the flag is deprecated, then gone).
            on = bool(args.get("enable_flashinfer_allreduce_fusion")) or backend is not None
            fusion = "on" if on else "off"
            rows["allreduce_fusion"] = fusion + ("" if backend is None else f" (backend {backend})")
    sites = {}
    for reader in readers:
        answer = result.get(reader.name)
        sites[reader.key] = NOT_CHECKED if answer is None else reader.row(answer)
    return Decision(rows, sites)


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

    # (field, label) of each declared reader's row, in the order shown: the loaded patches'
    labels: list[tuple[str, str]] = field(default_factory=lambda: labels())

    def rows(self) -> list[tuple[str, str, str]]:
        """(what, pristine, patched) for each decision the probe could make here."""
        out = []
        shown = [*(LAUNCH_ROWS.items() if self.launch else ()), *self.labels]
        for key, label in shown:
            before, after = self.pristine[key], self.patched[key]
            if before == after == NOT_CHECKED:
                continue
            out.append(
                (label, "none" if before is None else before, "none" if after is None else after)
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "python": self.python,
            "simulate": self.simulate,
            "launch": self.launch,
            "targets": self.targets,
            "applied": self.applied,
            "pristine": self.pristine.to_dict(),
            "patched": self.patched.to_dict(),
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
        f"pass --python PATH: the interpreter {target.name} runs in",
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
    profile: str | None = None,
) -> Explanation:
    """Run the probe on the pristine and the patched code of the targets at `paths`; where
    nothing is applied, the patched side is what `profile` would write (`profile_for`).
    `paths`: the command's targets (`Resolved`), each found once. A vLLM named (`--vllm`) is
    explained with the targets named beside it only: the SGLang or FlashInfer this Python
    would find is another server's."""
    if simulate is not None and simulate not in ARCHS:
        raise UsageError(f"--simulate {simulate!r}", f"use one of {', '.join(ARCHS)}")
    with owned(paths) as named:
        found: list[Target] = []
        with_vllm = named.given("vllm")
        for kind in ("vllm", "sglang", "flashinfer") if with_vllm else ("sglang", "flashinfer"):
            try:
                if kind == "vllm" or not with_vllm or named.given(kind):
                    found.append(named.find(kind))
            except Sm120Error:
                if named.given(kind):
                    raise
        if not found:
            raise UsageError(
                "found neither SGLang nor FlashInfer",
                "pass --sglang/--flashinfer PATH (or --vllm PATH)",
            )
        from sm120patch.plan import catalog

        cat = catalog.load(named.config)
        check_profile(found, profile, cat)
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
        kinds = [t.kind for t in found]
        if launch and "sglang" not in kinds:
            # The probe resolves SGLang's ServerArgs only; vLLM's engine arguments need its
            # config machinery (a model config, a device config) that no reader needs yet.
            notes.append(
                f"launch arguments not resolved: the probe resolves SGLang's; for "
                f"{', '.join(t.name for t in found)} the rows are what each patch reads"
            )
            launch = []
        elif not launch and "sglang" in kinds:
            notes.append(
                "no launch arguments: give `-- --model-path DIR [...]` for the server "
                "argument decisions"
            )
        with tempfile.TemporaryDirectory(prefix="sm120patch-explain-") as tmp:
            overlay: dict[str, dict[str, str]] = {"pristine": {}, "patched": {}}
            applied = False
            for target in found:
                s = sides(target, Path(tmp) / target.kind, profile, cat)
                applied = applied or s.applied
                overlay["pristine"].update(s.pristine)
                overlay["patched"].update(s.patched)
            base = {
                "readers": reader_requests(kinds, cat),
                "simulate": simulate,
                "sys_path": [str(t.parent) for t in found],
                "launches": {"launch": launch} if launch else {},
                **{kind: kind in kinds for kind in ("sglang", "flashinfer", "vllm")},
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
        readers = [reader for _, reader in declared(cat)]
        return Explanation(
            python=str(interp),
            simulate=simulate,
            launch=launch,
            targets=[t.to_dict() for t in found],
            applied=applied,
            pristine=decision(results["pristine"], key, readers),
            patched=decision(results["patched"], key, readers),
            notes=notes,
            labels=[(reader.key, reader.label) for reader in readers],
        )
