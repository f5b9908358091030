"""An identical-server A/B at the default settings on a real GPU: does `trial --measure` keep
noise? Run on a machine with an NVIDIA GPU, torch and transformers (the lent H200's image has
them), from the repository root:

    python3 benchmarks/trial_h200.py --out DIR [--profile fusion] [-- extra trial options]

It makes the two fixture targets of the test suite (SGLang 0.5.8 and FlashInfer 0.6.1 as
installed packages: the files the patches touch, in their shapes, no upstream code), then runs

    python3 -m sm120patch trial PROFILE --measure --no-gpu-check --json ... -- \\
        python3 benchmarks/tiny_llama_server.py --port P

at the default settings (3 runs a side, 64 requests, 8 in flight, 128 tokens): the server is a
transformers Llama with random weights built in code, which never imports SGLang, so both sides
run the same code and the right verdict is `inconclusive` (never `kept`, never evidence).
Meanwhile `nvidia-smi` logs power and utilisation every 250 ms, to check the trial's NVML
figures against it over each measured window (the record's absolute `window_start` and
`window_end`). Into DIR: trial.json (the record), report.html, trial.txt (`trial show`),
nvidia-smi.csv, summary.json; the summary is printed last. Exit status: the trial's.

`--repeat-trials N` runs N such trials one after another (each on fresh targets; more files).

It runs the sm120patch that is installed (an editable install of this tree is one). On the
lent H200 (python3 3.12 with torch and transformers, nothing else fetchable), carry the wheels
sm120patch needs that its image lacks (libcst, GitPython, gitdb, smmap, platformdirs, cp312)
in `.whl`, install them and this tree, and run, from the repository root:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps \
        --no-build-isolation --target /tmp/sm120 . && \
        export PYTHONPATH=/tmp/sm120:/tmp/site || exit; \
    timeout 570 python3 benchmarks/trial_h200.py --out $OUT
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "benchmarks" / "tiny_llama_server.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def targets(base: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from trees import make_tree  # the test suite's fixture trees (no git needed: installed)

    return (
        make_tree(base, "sglang", "0.5.8", "installed"),
        make_tree(base, "flashinfer", "0.6.1", "installed"),
    )


def smi_log(path: Path) -> subprocess.Popen[bytes] | None:
    try:
        return subprocess.Popen(
            [
                "nvidia-smi",
                "--query-gpu=timestamp,index,power.draw,power.limit,utilization.gpu",
                "--format=csv,noheader,nounits",
                "-lms",
                "250",
            ],
            stdout=open(path, "wb"),  # noqa: SIM115 - closed with the process
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        return None


def smi_windows(path: Path, doc: dict) -> list[dict]:
    """nvidia-smi's mean watts and utilisation of GPU 0 inside each run's measured window."""
    rows = []
    try:
        for line in csv.reader(path.read_text().splitlines()):
            if len(line) < 5:
                continue
            stamp = datetime.strptime(line[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((stamp, int(line[1]), float(line[2]), float(line[4])))
    except (OSError, ValueError):
        return []
    out = []
    for run in doc.get("runs", []):
        start, end = run.get("window_start"), run.get("window_end")
        inside = [r for r in rows if start and end and start <= r[0] <= end and r[1] == 0]
        out.append(
            {
                "run": f"{run['side']} {run['round'] + 1}",
                "samples": len(inside),
                "mean_w": round(statistics.fmean(r[2] for r in inside), 1) if inside else None,
                "mean_util_pct": round(statistics.fmean(r[3] for r in inside), 1)
                if inside
                else None,
            }
        )
    return out


def one_trial(args: argparse.Namespace, extra: list[str], out: Path, n: int) -> int:
    base = Path(tempfile.mkdtemp(prefix="sm120patch-h200-"))
    sg, fi = targets(base)
    port = free_port()
    server = [sys.executable, str(SERVER), "--port", str(port), *args.server_args]
    cli = [sys.executable, "-m", "sm120patch"]
    paths = ["--sglang", str(sg), "--flashinfer", str(fi)]
    # sm120patch as installed (its patch library ships inside it as sm120patch.patches; the
    # source tree has it at the top, patches/), run from outside the source tree so that
    # `-m sm120patch` does not find the tree's package first.
    env = dict(os.environ)
    tag = "" if args.repeat_trials == 1 else f"-{n + 1}"
    smi_path = out / f"nvidia-smi{tag}.csv"
    smi = smi_log(smi_path)
    started = time.time()
    done = subprocess.run(
        [*cli, "trial", args.profile, "--measure", *paths, "--no-gpu-check", "--timeout", "600",
         "--log", str(out / f"server{tag}.log"), *extra, "--json", "--", *server],
        capture_output=True, text=True, env=env, cwd=base, check=False,
    )  # fmt: skip
    wall = time.time() - started
    (out / f"stderr{tag}.txt").write_text(done.stderr)
    if smi is not None:
        smi.terminate()
        smi.wait()
    try:
        doc = json.loads(done.stdout)
    except ValueError:
        print(done.stdout[-3000:], done.stderr[-6000:], sep="\n", file=sys.stderr)
        return done.returncode or 1
    (out / f"trial{tag}.json").write_text(json.dumps(doc, indent=1))
    subprocess.run(
        [*cli, "trial", "show", doc["id"], *paths, "--html", str(out / f"report{tag}.html")],
        stdout=open(out / f"trial{tag}.txt", "w"),  # noqa: SIM115
        env=env, cwd=base, check=False,
    )  # fmt: skip
    runs = doc.get("runs", [])
    summary = {
        "trial": doc.get("id"),
        "exit": done.returncode,
        "verdict": doc.get("verdict"),
        "evidence": doc.get("evidence"),
        "message": doc.get("message"),
        "gain": doc.get("gain"),
        "noise": doc.get("noise"),
        "pairs": doc.get("pairs"),
        "wall_s": round(wall, 1),
        "gpus": doc.get("gpu_names"),
        "runs": [
            {
                "run": f"{r['side']} {r['round'] + 1}",
                "ready_s": r.get("ready_s"),
                "window_s": round(r["window_end"] - r["window_start"], 2)
                if r.get("window_end")
                else None,
                "output_tok_s": (r.get("figures") or {}).get("output_tok_s"),
                "completed": (r.get("figures") or {}).get("completed"),
                "gpus": r.get("gpus"),
                "wiring": r.get("wiring"),
            }
            for r in runs
        ],
        "nvidia_smi": smi_windows(smi_path, doc),
        "sanity": {
            k: (doc.get("sanity") or {}).get(k)
            for k in ("ok", "similarity", "agreement", "agreement_positions", "notes", "reasons")
        },
    }
    (out / f"summary{tag}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return done.returncode


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--profile", default="fusion")
    ap.add_argument("--repeat-trials", type=int, default=1)
    ap.add_argument(
        "--server-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="Options for tiny_llama_server.py (last): --layers, --hidden, ...",
    )
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    codes = [one_trial(args, extra, args.out, n) for n in range(args.repeat_trials)]
    sys.exit(codes[-1])


if __name__ == "__main__":
    main()
