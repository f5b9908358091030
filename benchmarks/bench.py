"""Speed and memory of sm120patch, as ratios to floors, on real releases from the cache.

Run: `python benchmarks/bench.py [--runs N] [--skip-matrix]` (not a test: targets live here).

- floor: a process that imports libcst and parses once each file `all` touches on SGLang 0.5.8
  and FlashInfer 0.6.8 (a FlashInfer `all` accepts: it refuses one before 0.6.7);
- cold (the plan cache off): `apply all --dry-run` target <= 1.3x the floor; `apply all` then
  `revert --all` on git checkouts target <= 2.5x the floor;
- peak RSS of `apply all`: target <= 1.5x the floor's;
- `--help`, `list`: target <= 2.5x `python -c "import click"`;
- warm paths, no parse: `status`, `ensure all` on an applied tree, `apply all` after a
  `--dry-run` on the same bytes, and `apply --locked` on a node whose own plan cache holds the
  plan (after a `--dry-run` of the lock; a lock is a claim to verify, never a source of
  bytes): target <= 3x `python -c "import click"`; `apply --locked` on a node that never
  planned plans once (reported, no target);
- `matrix` over every tracked SGLang and FlashInfer release on a warm cache: target <= 25 s
  with `-j 2`;
- `scan` of a whole SGLang release (0.5.23 installed: 4,719 files, 68 MB of Python): target
  <= 5 s, shown beside its text floor, a process that reads every file and searches it for
  the SM100 predicates (what a plain `grep` does).
Commands run interleaved (one of each per round), and each figure is the median of the rounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sm120patch.maintain import releases, trees
from sm120patch.plan import planner

SM = [sys.executable, "-m", "sm120patch"]


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS (KiB) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0,):
        raise SystemExit(f"benchmark command failed ({proc.returncode}): {' '.join(cmd)}")
    return elapsed, usage.ru_maxrss


def git_copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    for args in (
        ["init", "-q"],
        ["add", "-A"],
        [
            "-c",
            "user.name=bench",
            "-c",
            "user.email=bench@localhost",
            "commit",
            "-q",
            "-m",
            "release",
        ],
    ):
        subprocess.run(["git", "-C", str(dest), *args], check=True)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--skip-matrix", action="store_true")
    parser.add_argument("--skip-scan", action="store_true")
    args = parser.parse_args()

    sg = trees.tree("sglang", "0.5.8")
    fi = trees.tree("flashinfer", "0.6.8")
    plan = planner.plan("all", {"sglang": sg, "flashinfer": fi})
    files = [str(tp.target.path_of(f.file)) for tp in plan.targets for f in tp.changed]
    floor = [
        sys.executable,
        "-c",
        "import sys, libcst\nfor f in sys.argv[1:]:\n"
        "    libcst.parse_module(open(f, encoding='utf-8').read())",
        *files,
    ]
    tmp = Path(tempfile.mkdtemp(prefix="sm120patch-bench-"))
    # As installed: a wheel install compiles bytecode; a PYTHONDONTWRITEBYTECODE environment
    # (this project's machines set it) would charge every run a recompile of sm120patch that
    # click, installed from a wheel, never pays.
    import compileall

    from sm120patch import patches

    for package in (Path(planner.__file__).parents[1], Path(next(iter(patches.__path__)))):
        compileall.compile_dir(str(package), quiet=1)
    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env = {**base, "SM120PATCH_CACHE": str(tmp / "cache")}
    cold = {**env, "SM120PATCH_PLAN_CACHE": "0"}
    gsg, gfi = git_copy(sg, tmp / "sg"), git_copy(fi, tmp / "fi")
    where = ["--sglang", str(gsg), "--flashinfer", str(gfi)]
    # The warm paths are those of a serving box: installed packages (a git checkout adds its
    # commits, which no cache removes).
    isg, ifi = shutil.copytree(sg, tmp / "isg"), shutil.copytree(fi, tmp / "ifi")
    inst = ["--sglang", str(isg), "--flashinfer", str(ifi)]
    lock = tmp / "all.lock"
    subprocess.run([*SM, "pin", "all", *inst, "-o", str(lock)], check=True, env=env,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    commands = {
        "floor (import libcst + parse)": (floor, cold),
        "apply all --dry-run": ([*SM, "apply", "all", "--dry-run", "--no-gpu-check", *where], cold),
        "import click": ([sys.executable, "-c", "import click"], env),
        "--help": ([*SM, "--help"], env),
        "list": ([*SM, "list"], env),
        "status": ([*SM, "status", *inst], env),
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for name in ("apply all + revert --all (git)", "apply after --dry-run (warm)",
                 "ensure all (applied)", "apply --locked (warm node)",
                 "apply --locked (fresh node)"):  # fmt: skip
        times[name] = []
    rss: dict[str, list[int]] = {"floor": [], "apply all": []}
    for n in range(args.runs):
        for name, (cmd, e) in commands.items():
            seconds, kib = timed(cmd, e)
            times[name].append(seconds)
            if name.startswith("floor"):
                rss["floor"].append(kib)
        a, kib = timed([*SM, "apply", "all", "--no-gpu-check", *where], cold)
        r, _ = timed([*SM, "revert", "--all", *where], cold)
        times["apply all + revert --all (git)"].append(a + r)
        rss["apply all"].append(kib)
        # Warm: a reviewed dry run fills the plan cache, the apply after it reads it.
        timed([*SM, "apply", "all", "--dry-run", "--no-gpu-check", *inst], env)
        times["apply after --dry-run (warm)"].append(
            timed([*SM, "apply", "all", "--no-gpu-check", *inst], env)[0]
        )
        times["ensure all (applied)"].append(
            timed([*SM, "ensure", "all", "--no-gpu-check", *inst], env)[0]
        )
        timed([*SM, "revert", "--all", *inst], env)
        node = {**env, "SM120PATCH_CACHE": str(tmp / f"node-{n}")}  # never planned anything
        times["apply --locked (fresh node)"].append(
            timed([*SM, "apply", "--locked", str(lock), "--no-gpu-check", *inst], node)[0]
        )
        timed([*SM, "revert", "--all", *inst], env)
        # The same node again: its own cache now holds the plan the lock is checked against.
        times["apply --locked (warm node)"].append(
            timed([*SM, "apply", "--locked", str(lock), "--no-gpu-check", *inst], node)[0]
        )
        timed([*SM, "revert", "--all", *inst], env)
    med = {name: statistics.median(values) for name, values in times.items()}
    floor_s, click_s = med["floor (import libcst + parse)"], med["import click"]
    rows = [
        ("floor (import libcst + parse)", floor_s, 1.0, None),
        ("apply all --dry-run (cold)", med["apply all --dry-run"],
         med["apply all --dry-run"] / floor_s, 1.3),
        ("apply all + revert --all (git, cold)", med["apply all + revert --all (git)"],
         med["apply all + revert --all (git)"] / floor_s, 2.5),
        ("import click", click_s, 1.0, None),
        ("--help", med["--help"], med["--help"] / click_s, 2.5),
        ("list", med["list"], med["list"] / click_s, 2.5),
        ("status", med["status"], med["status"] / click_s, 3.0),
        *(
            (name, med[name], med[name] / click_s, 3.0)
            for name in ("apply after --dry-run (warm)", "ensure all (applied)",
                         "apply --locked (warm node)")
        ),
        ("apply --locked (fresh node, plans once)", med["apply --locked (fresh node)"],
         med["apply --locked (fresh node)"] / floor_s, None),
    ]  # fmt: skip
    rss_floor = statistics.median(rss["floor"])
    rss_apply = statistics.median(rss["apply all"])
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, {args.runs} interleaved rounds, medians"
    )
    print("| measure | median | ratio | target | met |")
    print("|---|---|---|---|---|")
    for name, seconds, ratio, target in rows:
        met = "" if target is None else ("yes" if ratio <= target else "NO")
        tgt = "floor" if target is None else f"<= {target}x"
        print(f"| {name} | {seconds:.3f} s | {ratio:.2f}x | {tgt} | {met} |")
    ratio = rss_apply / rss_floor
    print(f"| peak RSS: floor | {rss_floor / 1024:.1f} MiB | 1.00x | floor | |")
    print(
        f"| peak RSS: apply all | {rss_apply / 1024:.1f} MiB | {ratio:.2f}x | <= 1.5x | "
        f"{'yes' if ratio <= 1.5 else 'NO'} |"
    )
    if not args.skip_scan:
        for line in scan_rows(tmp, env, args.runs):
            print(line)
    if not args.skip_matrix:
        work = [(k, v) for k in ("sglang", "flashinfer") for v in releases.available(k)]
        for kind, version in work:  # warm the cache, untimed
            trees.tree(kind, version)
        # The release cache just warmed is this process's: `env` points elsewhere (plans).
        seconds, _ = timed([*SM, "matrix", "-j", "2", "--json", "--quiet"], base)
        n_sg = sum(1 for k, _ in work if k == "sglang")
        n_fi = len(work) - n_sg
        print(
            f"| matrix ({n_sg} SGLang + {n_fi} FlashInfer, -j 2, warm) | {seconds:.1f} s | | "
            f"<= 25 s | {'yes' if seconds <= 25 else 'NO'} |"
        )
    shutil.rmtree(tmp, ignore_errors=True)


SCANNED = ("sglang", "0.5.23")
GREP = (
    "import os, re, sys\nhit = re.compile(rb'is_sm100|sm_major|major == 10')\nn = 0\n"
    "for d, _, fs in os.walk(sys.argv[1]):\n    for f in fs:\n        if f.endswith('.py'):\n"
    "            n += bool(hit.search(open(os.path.join(d, f), 'rb').read()))\nprint(n)"
)


def scan_rows(tmp: Path, env: dict[str, str], runs: int) -> list[str]:
    """`scan` of a whole SGLang release, installed as a wheel installs it (every .py file and
    the dist-info), against reading and searching the same files."""
    kind, version = SCANNED
    tree = tmp / "scanned"
    for rel, data in trees.package_files(kind, version):
        path = tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    info = tree / f"{kind}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {kind}\nVersion: {version}\n")
    floor, took = [], []
    for _ in range(runs):
        floor.append(timed([sys.executable, "-c", GREP, str(tree / kind)], env)[0])
        took.append(timed([*SM, "scan", f"--{kind}", str(tree)], env)[0])
    files = sum(1 for _ in (tree / kind).rglob("*.py"))
    f, s = statistics.median(floor), statistics.median(took)
    return [
        f"| floor: read and search {files} files of {kind} {version} | {f:.3f} s | 1.00x | "
        "floor | |",
        f"| scan ({kind} {version}, whole release) | {s:.3f} s | {s / f:.2f}x | <= 5 s | "
        f"{'yes' if s <= 5 else 'NO'} |",
    ]


if __name__ == "__main__":
    main()
