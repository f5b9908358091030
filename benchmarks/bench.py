"""Speed and memory of sm120patch, as ratios to floors, on real releases from the cache.

Run: `python benchmarks/bench.py [--runs N] [--skip-matrix] [--pairs N]` (not a test: targets
live here; `--pairs` gives the paired ratios instead of the table).

- floor: a process that imports libcst and parses once each file `all` touches on SGLang 0.5.8
  and FlashInfer 0.6.8 (a FlashInfer `all` accepts: it refuses one before 0.6.7);
- cold (every plan is): `apply all --dry-run` target <= 1.35x the floor; `apply all` then
  `revert --all` on git checkouts target <= 2.5x the floor; `apply --locked` (it plans, and
  holds the lock to that plan) reported against the floor, no target;
- peak RSS of `apply all`: target <= 1.5x the floor's;
- `--help`, `list`: target <= 2.5x `python -c "import click"`;
- warm paths, no parse: `status`, `ensure all` and `ensure --locked` on an applied tree:
  target <= 2.5x `python -c "import click"`;
- `matrix` over every tracked SGLang and FlashInfer release on a warm cache: target <= 25 s
  with `-j 2`;
- `scan` of a whole SGLang release (0.5.23 installed: 4,719 files, 68 MB of Python): target
  <= 5 s, shown beside its text floor, a process that reads every file and searches it for
  the SM100 predicates (what a plain `grep` does).
Commands run interleaved (one of each per round), and each figure is the median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sm120patch
from sm120patch.maintain import releases, trees

SM = [sys.executable, "-m", "sm120patch"]
SGLANG, FLASHINFER = "0.5.8", "0.6.8"


TOUCHED = (
    "import json, sys\nfrom sm120patch.plan import planner\n"
    "plan = planner.plan('all', {'sglang': sys.argv[1], 'flashinfer': sys.argv[2]})\n"
    "print(json.dumps([str(tp.target.path_of(f.file)) for tp in plan.targets for f in tp.changed]))"
)


# CPU seconds (user + system) of each child, by the name `record` times it under: on a shared
# box wall time is mostly the neighbours' load, while a process's own CPU time moves far less.
CPU: dict[str, list[float]] = {}


def record(times: dict[str, list[float]], name: str, cmd: list[str], env: dict[str, str]) -> int:
    """Time `cmd` under `name` (its wall and CPU seconds); its peak RSS (KiB)."""
    seconds, kib, cpu = timed_cpu(cmd, env)
    times.setdefault(name, []).append(seconds)
    CPU.setdefault(name, []).append(cpu)
    return kib


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS (KiB) of one child process."""
    seconds, kib, _ = timed_cpu(cmd, env)
    return seconds, kib


def timed_cpu(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, float]:
    """Wall seconds, peak RSS (KiB) and CPU seconds of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0,):
        raise SystemExit(f"benchmark command failed ({proc.returncode}): {' '.join(cmd)}")
    return elapsed, usage.ru_maxrss, usage.ru_utime + usage.ru_stime


def git_copy(src: Path, dest: Path, version_txt: str | None = None) -> Path:
    """A release tree as a checkout. FlashInfer's repository keeps its version in
    `version.txt` at its root (`version_txt`); a wheel's tree has none, and a checkout's version
    is read from the tree as committed, not from a dist-info beside it."""
    shutil.copytree(src, dest)
    if version_txt is not None:
        (dest / "version.txt").write_text(version_txt + "\n")
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
    parser.add_argument(
        "--pairs", type=int, default=0,
        help="instead of the table: N interleaved pairs of each target command and its "
        "reference, the median of the per-pair ratios (steadier on a shared box)",
    )
    args = parser.parse_args()

    sg = trees.tree("sglang", SGLANG)
    fi = trees.tree("flashinfer", FLASHINFER)
    # Planned in a child: a child forked from this process would otherwise start with its
    # pages, and report this process's peak RSS (a plan's) as its own.
    touched = subprocess.run([sys.executable, "-c", TOUCHED, str(sg), str(fi)], check=True,
                             capture_output=True, text=True)  # fmt: skip
    files = json.loads(touched.stdout)
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

    for package in (Path(sm120patch.__file__).parent, Path(next(iter(patches.__path__)))):
        compileall.compile_dir(str(package), quiet=1)
    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env = {**base, "SM120PATCH_CACHE": str(tmp / "cache")}
    gsg, gfi = git_copy(sg, tmp / "sg"), git_copy(fi, tmp / "fi", version_txt=FLASHINFER)
    where = ["--sglang", str(gsg), "--flashinfer", str(gfi)]
    # The warm paths are those of a serving box: installed packages (a git checkout adds its
    # commits, which no cache removes).
    isg, ifi = shutil.copytree(sg, tmp / "isg"), shutil.copytree(fi, tmp / "ifi")
    inst = ["--sglang", str(isg), "--flashinfer", str(ifi)]
    lock = tmp / "all.lock"
    subprocess.run([*SM, "pin", "all", *inst, "-o", str(lock)], check=True, env=env,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    commands = {
        "floor (import libcst + parse)": (floor, env),
        "apply all --dry-run": ([*SM, "apply", "all", "--dry-run", "--no-gpu-check", *where], env),
        "import click": ([sys.executable, "-c", "import click"], env),
        "--help": ([*SM, "--help"], env),
        "list": ([*SM, "list"], env),
    }
    if args.pairs:
        timed([*SM, "apply", "--locked", str(lock), "--no-gpu-check", *inst], env)
        paired(args.pairs, commands, {
            "status": [*SM, "status", *inst],
            "ensure all": [*SM, "ensure", "all", "--no-gpu-check", *inst],
            "ensure --locked": [*SM, "ensure", "--locked", str(lock), "--no-gpu-check", *inst],
        }, env)  # fmt: skip
        shutil.rmtree(tmp, ignore_errors=True)
        return
    times: dict[str, list[float]] = {}
    rss: dict[str, list[int]] = {"floor": [], "apply all": []}
    for _ in range(args.runs):
        for name, (cmd, e) in commands.items():
            kib = record(times, name, cmd, e)
            if name.startswith("floor"):
                rss["floor"].append(kib)
        rss["apply all"].append(
            record(times, "apply all (git)", [*SM, "apply", "all", "--no-gpu-check", *where], env)
        )
        record(times, "revert --all (git)", [*SM, "revert", "--all", *where], env)
        record(times, "apply --locked", [*SM, "apply", "--locked", str(lock), "--no-gpu-check",
                                         *inst], env)  # fmt: skip
        # The commands of every service start, on the tree the locked apply left applied.
        record(times, "status", [*SM, "status", *inst], env)
        record(times, "ensure all", [*SM, "ensure", "all", "--no-gpu-check", *inst], env)
        record(times, "ensure --locked", [*SM, "ensure", "--locked", str(lock), "--no-gpu-check",
                                          *inst], env)  # fmt: skip
        timed([*SM, "revert", "--all", *inst], env)
    for clock in (times, CPU):
        clock["apply all + revert --all (git)"] = [
            a + r
            for a, r in zip(clock["apply all (git)"], clock["revert --all (git)"], strict=True)
        ]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}, Python {platform.python_version()}, {args.runs} interleaved "
        "rounds, medians of wall and of CPU (user + system) seconds; `met` is of the wall ratio"
    )
    print("| measure | wall | ratio | CPU | ratio | target | met |")
    print("|---|---|---|---|---|---|---|")
    wall = {name: statistics.median(values) for name, values in times.items()}
    cpu = {name: statistics.median(values) for name, values in CPU.items()}
    floor_name, click_name = "floor (import libcst + parse)", "import click"
    rows = [
        (floor_name, floor_name, None),
        ("apply all --dry-run", floor_name, 1.35),
        ("apply all + revert --all (git)", floor_name, 2.5),
        ("apply --locked", floor_name, None),  # it plans: reported against the floor
        (click_name, click_name, None),
        ("--help", click_name, 2.5),
        ("list", click_name, 2.5),
        ("status", click_name, 2.5),  # on an applied tree
        ("ensure all", click_name, 2.5),  # on an applied tree
        ("ensure --locked", click_name, 2.5),  # on an applied tree
    ]
    for name, ref, target in rows:
        w, c = wall[name] / wall[ref], cpu[name] / cpu[ref]
        met = "" if target is None else ("yes" if w <= target else "NO")
        tgt = "floor" if name == ref else ("" if target is None else f"<= {target}x")
        print(f"| {name} | {wall[name]:.3f} s | {w:.2f}x | {cpu[name]:.3f} s | {c:.2f}x | "
              f"{tgt} | {met} |")  # fmt: skip
    rss_floor = statistics.median(rss["floor"])
    rss_apply = statistics.median(rss["apply all"])
    ratio = rss_apply / rss_floor
    print(f"| peak RSS: floor | {rss_floor / 1024:.1f} MiB | 1.00x | | | floor | |")
    print(
        f"| peak RSS: apply all | {rss_apply / 1024:.1f} MiB | {ratio:.2f}x | | | <= 1.5x | "
        f"{'yes' if ratio <= 1.5 else 'NO'} |"
    )
    if not args.skip_scan:
        for line in scan_rows(tmp, env, args.runs):
            print(line)
    if not args.skip_matrix:
        work = [(k, v) for k in ("sglang", "flashinfer") for v in releases.available(k)]
        for kind, version in work:  # warm the cache, untimed
            trees.tree(kind, version)
        # The release cache just warmed is this process's: `env` points elsewhere.
        seconds, _ = timed([*SM, "matrix", "-j", "2", "--json", "--quiet"], base)
        n_sg = sum(1 for k, _ in work if k == "sglang")
        n_fi = len(work) - n_sg
        print(
            f"| matrix ({n_sg} SGLang + {n_fi} FlashInfer, -j 2, warm) | {seconds:.1f} s | | | | "
            f"<= 25 s | {'yes' if seconds <= 25 else 'NO'} |"
        )
    shutil.rmtree(tmp, ignore_errors=True)


def paired(
    n: int,
    commands: dict[str, tuple[list[str], dict[str, str]]],
    warm: dict[str, list[str]],
    env: dict[str, str],
) -> None:
    """Each target command right after its reference, `n` rounds: the median of the ratios
    pair by pair, of wall and of CPU seconds (the warm commands on the applied tree)."""
    floor, click = commands["floor (import libcst + parse)"][0], commands["import click"][0]
    pairs = {"apply all --dry-run": (commands["apply all --dry-run"][0], floor)}
    pairs |= {name: (cmd, click) for name, cmd in warm.items()}
    ratios: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in pairs}
    for _ in range(n):
        for name, (cmd, ref) in pairs.items():
            r_wall, _, r_cpu = timed_cpu(ref, env)
            c_wall, _, c_cpu = timed_cpu(cmd, env)
            ratios[name][0].append(c_wall / r_wall)
            ratios[name][1].append(c_cpu / r_cpu)
    print(f"{n} interleaved pairs, load average {os.getloadavg()[0]:.1f}; median ratios")
    print("| measure | reference | wall ratio | CPU ratio | target |")
    print("|---|---|---|---|---|")
    for name, (wall, cpu) in ratios.items():
        ref, target = ("floor", 1.35) if name == "apply all --dry-run" else ("import click", 2.5)
        print(f"| {name} | {ref} | {statistics.median(wall):.2f}x | "
              f"{statistics.median(cpu):.2f}x | <= {target}x |")  # fmt: skip


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
        f"| floor: read and search {files} files of {kind} {version} | {f:.3f} s | 1.00x | | | "
        "floor | |",
        f"| scan ({kind} {version}, whole release) | {s:.3f} s | {s / f:.2f}x | | | <= 5 s | "
        f"{'yes' if s <= 5 else 'NO'} |",
    ]


if __name__ == "__main__":
    main()
