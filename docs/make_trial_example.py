"""Regenerate docs/trial-report-example.* : a measured trial of `fusion` at the default
settings (3 runs a side) against the test suite's fake server (tests/fake_server.py, 10 ms per
token pristine, 37 ms patched, logprobs served, fusion's "workspace initialized" line logged
when patched) with NVML simulated (about 250 W pristine, 123 W patched, two GPUs), drawn by
`trial show --html`. The figures are the fake's, chosen to look like the seeds' box; nothing
here ran on a GPU.

Run from the repository root: `python docs/make_trial_example.py`.
"""

from __future__ import annotations

import math
import re
import sys
import tempfile
import time
import zlib
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import pynvml  # noqa: E402
from trees import make_tree  # noqa: E402
from trialkit import free_port, run_cli  # noqa: E402

FUSED = "FlashInfer AllReduce Fusion enabled and workspace initialized"


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="sm120patch-example-"))
    sg = make_tree(base, "sglang", "0.5.8", "git")
    fi = make_tree(base, "flashinfer", "0.6.1", "installed")
    watched = sg / "python/sglang/srt/server_args.py"
    pristine = f"{zlib.crc32(watched.read_bytes()):08x}"

    def patched() -> bool:
        return f"{zlib.crc32(watched.read_bytes()):08x}" != pristine

    t0 = time.time()

    def power(h: int) -> int:
        wobble = 8 * math.sin((time.time() - t0) * 3 + h)
        return int(((122 if patched() else 248) + 3 * h + wobble) * 1000)

    fake = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: "NVIDIA RTX PRO 6000 Blackwell (simulated)",
        "nvmlDeviceGetCudaComputeCapability": lambda h: (12, 0),
        "nvmlDeviceGetPowerUsage": power,
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: 300_000,
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=41 if patched() else 93),
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=96 * 2**30, used=2**30),
        "nvmlSystemGetDriverVersion": lambda: "580.0",
        "nvmlSystemGetCudaDriverVersion": lambda: 12080,
    }
    patches = [mock.patch.object(pynvml, k, side_effect=v) for k, v in fake.items()]
    for p in patches:
        p.start()
    port = free_port()
    server = [
        sys.executable, str(ROOT / "tests/fake_server.py"), "--port", str(port),
        "--watch", str(watched), "--pristine-crc", pristine, "--lifetime", "120",
        "--delay-ms-pristine", "10", "--delay-ms-patched", "37", "--logprobs",
        "--log-when-patched", FUSED,
    ]  # fmt: skip
    targets = ["--sglang", str(sg), "--flashinfer", str(fi)]
    code, out, _ = run_cli(
        "trial", "fusion", "--measure", *targets, "--no-gpu-check",
        "--ready-url", f"http://127.0.0.1:{port}/health", "--requests", "48",
        "--concurrency", "8", "--max-tokens", "32", "--", *server,
    )  # fmt: skip
    page = base / "report.html"
    run_cli("trial", "show", *targets, "--html", str(page))
    html = page.read_text(encoding="utf-8")
    # Paths of this machine and run out of the published example.
    server_argv = r"[^\s<>]*python3?[^\s<>]* [^\s<>]*fake_server\.py"
    html = re.sub(server_argv, "python tests/fake_server.py", html)
    html = html.replace(str(base) + "/", "")
    (ROOT / "docs/trial-report-example.html").write_text(html, encoding="utf-8")
    svgs = re.findall(r"<svg.*?</svg>", html, re.S)
    stacked = "".join(s.replace("<svg ", f'<svg y="{260 * i}" ', 1) for i, s in enumerate(svgs[:2]))
    (ROOT / "docs/trial-report-example.svg").write_text(
        '<svg xmlns="http://www.w3.org/2000/svg" width="720" height="520" '
        f'viewBox="0 0 720 520"><rect width="720" height="520" fill="white"/>{stacked}</svg>\n',
        encoding="utf-8",
    )
    print(f"exit {code}\n{out}")


if __name__ == "__main__":
    main()
