"""`trial` end to end with real child processes: crash, HTTP readiness, timeout, interrupt,
readiness progress."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from trees import tree_hash
from trialkit import free_port, gone, run_cli, two_trees

from sm120patch.trial import serve


@pytest.fixture
def trees(tmp_path):
    return two_trees(tmp_path)


FI_CRASH = (
    "import sys; print('loading model', flush=True); "
    "print('RuntimeError: No supported CUDA architectures found for major versions [9, 10].',"
    " flush=True); sys.exit(1)"
)


def status_of(sg, fi) -> list[dict]:
    code, out, _ = run_cli("status", "--sglang", str(sg), "--flashinfer", str(fi), "--json")
    assert code == 0
    return json.loads(out)["targets"]


def test_crash_with_flashinfer_message_reverts_and_diagnoses(trees, tmp_path):
    sg, fi = trees
    before = [tree_hash(sg), tree_hash(fi)]
    log = tmp_path / "serve.log"
    code, out, err = run_cli(
        "trial", "fusion", "--sglang", str(sg), "--flashinfer", str(fi), "--no-gpu-check",
        "--timeout", "30", "--log", str(log), "--", sys.executable, "-c", FI_CRASH,
    )
    assert code == 3
    assert "exited with code 1" in err and "reverted" in err
    assert "FlashInfer's TRT-LLM comm module was not built for SM120" in err
    assert "0.6.17" in err  # what to do
    assert [tree_hash(sg), tree_hash(fi)] == before
    assert "No supported CUDA architectures" in log.read_text()
    recorded = status_of(sg, fi)[0]["trials"]
    assert recorded[-1]["verdict"] == "crashed"
    assert recorded[-1]["exit_code"] == 1
    assert recorded[-1]["signature"]["id"] == "flashinfer-comm-arch"
    assert recorded[-1]["reverted"] is True


def test_http_ready_keeps_the_patch(trees, tmp_path):
    sg, fi = trees
    port = free_port()
    pidfile = tmp_path / "server.pid"
    server = (
        f"import os, http.server as h; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
        f"h.HTTPServer(('127.0.0.1', {port}), h.SimpleHTTPRequestHandler).serve_forever()"
    )
    code, out, err = run_cli(
        "trial", "moe", "--sglang", str(sg), "--no-gpu-check", "--timeout", "30",
        "--ready-url", f"http://127.0.0.1:{port}/", "--", sys.executable, "-c", server,
    )
    assert code == 0, err
    assert "trial of moe: ready" in out
    sgl = status_of(sg, fi)[0]
    assert sgl["profile"] == "moe"
    assert {f["state"] for f in sgl["files"]} == {"patched"}
    assert sgl["trials"][-1]["verdict"] == "ready"
    assert sgl["trials"][-1]["time_to_ready_s"] is not None
    # The server was stopped (no --leave-running).
    assert gone(int(pidfile.read_text()))


def test_ready_pattern(trees):
    sg, fi = trees
    cmd = "import time; print('warming up', flush=True); print('The server is fired up', flush=True); time.sleep(30)"
    code, out, err = run_cli(
        "trial", "moe", "--sglang", str(sg), "--no-gpu-check", "--timeout", "20",
        "--ready-pattern", "fired up", "--", sys.executable, "-c", cmd,
    )
    assert code == 0, err
    assert "warming up" in out


def test_never_ready_times_out_and_reverts(trees):
    sg, fi = trees
    before = tree_hash(sg)
    code, out, err = run_cli(
        "trial", "moe", "--sglang", str(sg), "--no-gpu-check", "--timeout", "1.5",
        "--ready-pattern", "never printed", "--", sys.executable, "-c", "import time; time.sleep(60)",
    )
    assert code == 3
    assert "was not ready before the timeout" in err
    assert tree_hash(sg) == before
    assert status_of(sg, fi)[0]["trials"][-1]["verdict"] == "timeout"


def test_interrupt_stops_the_command_and_reverts(trees, tmp_path):
    sg, _ = trees
    before = tree_hash(sg)
    pidfile = tmp_path / "child.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); print('child up', flush=True); time.sleep(60)"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sm120patch", "trial", "moe", "--sglang", str(sg), "--no-gpu-check",
         "--timeout", "60", "--ready-pattern", "never", "--", sys.executable, "-c", child],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "child up" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert tree_hash(sg) == before
    assert gone(int(pidfile.read_text())), "the trial's command outlived the interrupt"


def test_unknown_output_has_no_diagnosis():
    assert serve.diagnose(["all good", "exit"]) is None
    assert serve.diagnose(["torch.OutOfMemoryError: CUDA out of memory."]).id == "cuda-oom"
    assert serve.diagnose(["SM 12.x requires CUDA >= 12.9"]).id == "flashinfer-cuda-too-old"
    assert serve.diagnose(["ValueError: FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs."]).id == "sglang-fusion-backend"
    assert serve.diagnose(["CUDA error: no kernel image is available for execution on the device"]).id == "cuda-no-kernel-image"


def test_sample_power_reports_draw_against_the_limit(trees, mocker):
    from sm120patch.trial import gpu

    found = gpu.GpuInventory(gpus=[gpu.Gpu(0, "NVIDIA RTX PRO 6000", 12, 0, 240.0, 600.0, 98304, 1024)])
    mocker.patch.object(gpu, "read_gpus", return_value=found)
    sg, fi = trees
    cmd = "import time; time.sleep(1.5); print('ready', flush=True); time.sleep(30)"
    code, out, err = run_cli(
        "trial", "moe", "--sglang", str(sg), "--no-gpu-check", "--timeout", "20",
        "--ready-pattern", "^ready$", "--sample-power", "--", sys.executable, "-c", cmd,
    )
    assert code == 0, err
    assert "GPU 0: mean 240 W (40% of the 600 W limit), max 240 W" in out
    samples = status_of(sg, fi)[0]["trials"][-1]["power_samples"]
    assert samples and samples[0]["gpus"][0]["power_w"] == 240.0


def test_readiness_progress_every_few_seconds_with_the_last_line(mocker):
    """While a server loads, `on_wait` hears how long it has been and its last line (the CLI
    prints it on a terminal)."""
    mocker.patch.object(serve, "PROGRESS_EVERY", 0.3)
    cmd = (
        "import time; print('loading weights', flush=True); time.sleep(1.2); "
        "print('ready', flush=True); time.sleep(30)"
    )
    proc = serve.spawn([sys.executable, "-c", cmd])
    heard: list[tuple[float, str | None]] = []
    import re

    watcher = serve._Watcher(proc, re.compile("^ready$"), lambda line: None, None)
    try:
        verdict, _ = serve._judge(
            proc, watcher, None, True, 20, 0.0, lambda s, last: heard.append((s, last))
        )
    finally:
        serve._stop(proc)
    assert verdict == "ready"
    assert len(heard) >= 2
    assert all(0.25 < s < 5 for s, _ in heard)
    assert heard[0][1] == "loading weights"


def test_waiting_line():
    assert serve.waiting_line(35.2, None) == "waiting for readiness: 35 s, no output yet"
    assert serve.waiting_line(5, "  Load weight: 40%  ") == (
        "waiting for readiness: 5 s, last line: Load weight: 40%"
    )
    assert serve.waiting_line(5, "x" * 200).endswith("x" * 117 + "...")


def test_a_trial_says_how_long_it_has_waited(trees, mocker):
    """The command layer turns readiness progress into lines (the CLI passes its stderr on a
    terminal)."""
    from sm120patch import app
    from sm120patch.commands import trial

    mocker.patch.object(serve, "PROGRESS_EVERY", 0.3)
    sg, fi = trees
    cmd = "import time; print('Load weight begin', flush=True); time.sleep(1.2); print('ready', flush=True); time.sleep(30)"
    said: list[str] = []
    request = trial.TrialRequest(
        "moe", (sys.executable, "-c", cmd), ready_pattern="^ready$", timeout=20, gpu_check=False
    )
    found = trial.trial(
        app.Session(paths={"sglang": str(sg), "flashinfer": str(fi)}), request, None, on_known=lambda line: None,
        on_line=lambda line: None, on_event=lambda line: None, on_progress=said.append,
    )  # fmt: skip
    assert found.result is not None and found.result.verdict == "ready"
    assert said and said[0].startswith("sm120patch: waiting for readiness: ")
    assert said[0].endswith("s, last line: Load weight begin")


def test_a_servers_terminal_escapes_are_shown_not_obeyed(trees):
    """The server's own lines pass through `trial` as they come, and so does their escape: a
    line that clears the screen prints as `\\xNN`."""
    sg, fi = trees
    crash = "import sys; print('\\x1b[2Jwiped\\rrewritten', flush=True); sys.exit(1)"
    code, out, err = run_cli(
        "trial", "fusion", "--sglang", str(sg), "--flashinfer", str(fi), "--no-gpu-check",
        "--timeout", "30", "--", sys.executable, "-c", crash,
    )
    assert code == 3
    assert "\x1b" not in out + err and "\r" not in out + err
    assert "\\x1b[2Jwiped" in out + err  # (a carriage return reaches us as a line break)
