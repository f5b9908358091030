"""Speed and memory of sm120patch, as ratios to floors, on real releases from the cache.

Run: `python benchmarks/bench.py [--runs N] [--skip-matrix]` (not a test: targets live here).

- floor: a process that imports libcst and parses once each file `all` touches on SGLang 0.5.8
  and FlashInfer 0.6.1;
- `apply all --dry-run`: target <= 1.2x the floor;
- `apply all` then `revert --all` on git checkouts: target <= 2x the floor;
- peak RSS of `apply all`: target <= 1.5x the floor's;
- `--help`, `list`, `status`: target <= 2.5x `python -c "import click"`;
- `matrix` over every tracked SGLang and FlashInfer release on a warm cache: target <= 25 s
  with `-j 2`.
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

from sm120patch import plan as planner
from sm120patch.maintain import releases

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
    args = parser.parse_args()

    sg = releases.tree("sglang", "0.5.8")
    fi = releases.tree("flashinfer", "0.6.1")
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
    env = {**os.environ, "SM120PATCH_STATE_DIR": str(tmp / "state")}
    gsg, gfi = git_copy(sg, tmp / "sg"), git_copy(fi, tmp / "fi")
    where = ["--sglang", str(gsg), "--flashinfer", str(gfi)]
    commands = {
        "floor (import libcst + parse)": floor,
        "apply all --dry-run": [*SM, "apply", "all", "--dry-run", "--no-gpu-check", *where],
        "import click": [sys.executable, "-c", "import click"],
        "--help": [*SM, "--help"],
        "list": [*SM, "list"],
        "status": [*SM, "status", *where],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    times["apply all + revert --all (git)"] = []
    rss: dict[str, list[int]] = {"floor": [], "apply all": []}
    for _ in range(args.runs):
        for name, cmd in commands.items():
            seconds, kib = timed(cmd, env)
            times[name].append(seconds)
            if name.startswith("floor"):
                rss["floor"].append(kib)
        a, kib = timed([*SM, "apply", "all", "--no-gpu-check", *where], env)
        r, _ = timed([*SM, "revert", "--all", *where], env)
        times["apply all + revert --all (git)"].append(a + r)
        rss["apply all"].append(kib)
    med = {name: statistics.median(values) for name, values in times.items()}
    floor_s, click_s = med["floor (import libcst + parse)"], med["import click"]
    rows = [
        ("floor (import libcst + parse)", med["floor (import libcst + parse)"], 1.0, None),
        (
            "apply all --dry-run",
            med["apply all --dry-run"],
            med["apply all --dry-run"] / floor_s,
            1.2,
        ),
        (
            "apply all + revert --all (git)",
            med["apply all + revert --all (git)"],
            med["apply all + revert --all (git)"] / floor_s,
            2.0,
        ),
        ("import click", click_s, 1.0, None),
        ("--help", med["--help"], med["--help"] / click_s, 2.5),
        ("list", med["list"], med["list"] / click_s, 2.5),
        ("status", med["status"], med["status"] / click_s, 2.5),
    ]
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
    if not args.skip_matrix:
        work = [(k, v) for k in ("sglang", "flashinfer") for v in releases.available(k)]
        for kind, version in work:  # warm the cache, untimed
            releases.tree(kind, version)
        seconds, _ = timed([*SM, "matrix", "-j", "2", "--json"], env)
        n_sg = sum(1 for k, _ in work if k == "sglang")
        n_fi = len(work) - n_sg
        print(
            f"| matrix ({n_sg} SGLang + {n_fi} FlashInfer, -j 2, warm) | {seconds:.1f} s | | "
            f"<= 25 s | {'yes' if seconds <= 25 else 'NO'} |"
        )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
