"""`trial --measure` end to end: the real trial code, real server processes (tests/fake_server.py,
whose speed and answers follow whether the SGLang tree is patched), real HTTP load; NVML
replaced by a fake whose power trace also follows the tree (250 W pristine, 125 W patched)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
from trees import tree_hash
from trialkit import free_port, gone, run_cli, two_trees

from sm120patch.trial import gpu, known, loadgen, sanity

FAKE = str(Path(__file__).with_name("fake_server.py"))
WATCHED = "python/sglang/srt/server_args.py"  # the file the moe profile patches


@pytest.fixture
def trees(tmp_path):
    return two_trees(tmp_path)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fake_nvml(mocker, trees):
    """Two SM120 GPUs with a 300 W limit drawing 250 W (util 90%) while the tree is pristine and
    125 W (util 42%) while it is patched: the seeds' symptom, read through gpu.py's real code."""
    sg, _ = trees
    watched = sg / WATCHED
    pristine = sha(watched)

    def patched() -> bool:
        return sha(watched) != pristine

    fake = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: "NVIDIA RTX PRO 6000 Blackwell",
        "nvmlDeviceGetCudaComputeCapability": lambda h: (12, 0),
        "nvmlDeviceGetPowerUsage": lambda h: (125_000 if patched() else 250_000) + 1000 * h,
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: 300_000,
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=42 if patched() else 90),
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=96 * 2**30, used=2**30),
        "nvmlSystemGetDriverVersion": lambda: "580.0",
        "nvmlSystemGetCudaDriverVersion": lambda: 12080,
    }
    for name, fn in fake.items():
        mocker.patch.object(pynvml, name, side_effect=fn)
    return fake


def measure(trees, tmp_path, *server: str, repeat: int = 1, extra: tuple[str, ...] = ()):
    sg, fi = trees
    port = free_port()
    command = [
        sys.executable, FAKE, "--port", str(port), "--watch", str(sg / WATCHED),
        "--pristine-sha", sha(sg / WATCHED), "--lifetime", "60",
        "--counter", str(tmp_path / "starts"), *server,
    ]
    code, out, err = run_cli(
        "trial", "moe", "--measure", "--sglang", str(sg), "--flashinfer", str(fi),
        "--no-gpu-check", "--timeout", "20", "--ready-url", f"http://127.0.0.1:{port}/health",
        "--requests", "16", "--concurrency", "4", "--max-tokens", "16",
        "--repeat", str(repeat), *extra, "--json", "--", *command,
    )
    doc = json.loads(out) if out.strip().startswith("{") else None
    return code, doc, err


def test_patched_faster_is_kept_with_both_sides_recorded(trees, tmp_path, fake_nvml):
    sg, fi = trees
    code, doc, err = measure(
        trees, tmp_path, "--delay-ms-pristine", "8", "--delay-ms-patched", "3"
    )
    assert code == 0, err
    assert "known: moe wrong-output" in err.split("fake server")[0]  # shown before acting
    assert doc["verdict"] == "kept"
    assert doc["message"].startswith("patched ") and ": kept (one run each" in doc["message"]
    assert "power 126 W vs 250 W" in doc["message"]  # mean over the two GPUs
    assert [r["side"] for r in doc["runs"]] == ["baseline", "patched"]
    base, patched = doc["runs"]
    assert patched["figures"]["output_tok_s"] > 1.5 * base["figures"]["output_tok_s"]
    assert base["figures"]["tokens_from_usage"] is True
    assert base["figures"]["output_tokens"] == 16 * 16  # warm-up not counted
    assert base["gpus"][0]["mean_w"] == 250.0 and patched["gpus"][0]["mean_w"] == 125.0
    assert base["gpus"][0]["limit_share"] == pytest.approx(250 / 300, abs=1e-3)
    assert patched["gpus"][1]["mean_util_pct"] == 42.0
    assert doc["sanity"]["ok"] and doc["sanity"]["similarity"] == 1.0
    assert doc["versions"] == {"sglang": "0.5.8", "flashinfer": "0.6.1"}
    assert doc["gpu_names"] == ["NVIDIA RTX PRO 6000 Blackwell"] * 2
    # The profile stays applied and the trial is in the history, both sides in it.
    code, out, _ = run_cli("status", "--sglang", str(sg), "--flashinfer", str(fi), "--json")
    sgl = json.loads(out)["targets"][0]
    assert sgl["profile"] == "moe"
    assert sgl["trials"][-1]["id"] == doc["id"]
    assert len(sgl["trials"][-1]["runs"]) == 2
    code, out, _ = run_cli("status", "--sglang", str(sg), "--flashinfer", str(fi))
    assert f"trial {doc['id']} moe measured: patched" in out


def test_patched_slower_is_reverted_and_says_why(trees, tmp_path, fake_nvml):
    sg, _ = trees
    before = tree_hash(sg)
    code, doc, err = measure(
        trees, tmp_path, "--delay-ms-pristine", "3", "--delay-ms-patched", "8"
    )
    assert code == 5, err
    assert doc["verdict"] == "reverted-slower"
    assert doc["reverted"] is True
    assert doc["gain"] < -0.3
    assert "tok/s vs baseline" in doc["message"] and "(-" in doc["message"]
    assert doc["message"].endswith("power 126 W vs 250 W: reverted")
    assert tree_hash(sg) == before


def test_fast_but_degenerate_is_reverted_as_wrong_output(trees, tmp_path, fake_nvml):
    sg, _ = trees
    before = tree_hash(sg)
    code, doc, err = measure(
        trees, tmp_path, "--delay-ms-pristine", "8", "--delay-ms-patched", "3",
        "--degenerate-when-patched",
    )
    assert code == 6, err
    assert doc["verdict"] == "reverted-wrong-output"
    assert doc["gain"] > 0.5  # faster, and still reverted
    assert "degenerate text '!!!!!!!!'" in doc["message"]
    assert doc["sanity"]["ok"] is False
    assert tree_hash(sg) == before


def test_crash_with_json_prints_verdict_and_signature(trees, tmp_path, fake_nvml):
    sg, _ = trees
    before = tree_hash(sg)
    code, doc, err = measure(trees, tmp_path, "--crash-when-patched")
    assert code == 3, err
    assert doc["verdict"] == "crashed"
    assert doc["signature"]["id"] == "flashinfer-comm-arch"
    assert doc["message"].startswith("patched server exited with code 1 in run 1")
    assert [r["outcome"] for r in doc["runs"]] == ["ok", "crashed"]
    assert "No supported CUDA architectures" in "\n".join(doc["runs"][1]["tail"])
    assert tree_hash(sg) == before


def test_gain_inside_the_spread_is_reverted_and_says_so(trees, tmp_path, fake_nvml):
    sg, _ = trees
    before = tree_hash(sg)
    # Baseline delays give a 40% spread between runs; patched is about 17% faster each time.
    # Long delays, so that sleeping, not this busy CPU, sets the pace.
    code, doc, err = measure(
        trees, tmp_path, "--delay-ms-pristine", "12,16,10",
        "--delay-ms-patched", "10,13.5,8.5", repeat=3, extra=("--requests", "8"),
    )
    assert code == 5, err
    assert [r["side"] for r in doc["runs"]] == ["baseline", "patched"] * 3
    assert doc["verdict"] == "reverted-noise", doc["message"]
    assert doc["gain"] > 0.02 and doc["noise"] > doc["gain"]
    assert "inside the measured spread" in doc["message"]
    spread = doc["summary"]["baseline"]["output_tok_s"]["spread"]
    assert spread > 0.2
    assert tree_hash(sg) == before


def test_report_and_export_and_local_evidence(trees, tmp_path, fake_nvml):
    sg, fi = trees
    code, doc, err = measure(
        trees, tmp_path, "--delay-ms-pristine", "3", "--delay-ms-patched", "8",
        extra=("--export", str(tmp_path / "mine.toml")),
    )
    assert code == 5, err
    page = tmp_path / "report.html"
    code, out, err = run_cli(
        "trial", "show", doc["id"][:15], "--sglang", str(sg), "--flashinfer", str(fi),
        "--html", str(page),
    )
    assert code == 0, err
    assert "verdict: reverted-slower" in out
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<svg" in text
    lines = re.findall(r'<polyline class="series (\w+)"([^>]*) points="([^"]*)"', text)
    for side in ("baseline", "patched"):
        throughput = [pts for s, attrs, pts in lines if s == side and "data-gpu" not in attrs]
        power = [pts for s, attrs, pts in lines if s == side and 'data-gpu="1"' in attrs]
        assert throughput and len(throughput[0].split()) >= 5, side  # a series, not a dot
        assert power and len(power[0].split()) >= 2, side
        assert f'class="bar {side}"' in text
    assert "reverted-slower" in text and "src=" not in text  # self-contained
    # The export is one record in known.toml's schema.
    [entry] = known.entries((tmp_path / "mine.toml").read_text())
    assert entry.outcome == "slower" and entry.condition["profile"] == "moe"
    assert entry.condition["sglang"] == "==0.5.8" and entry.condition["gpus"] == "==2"
    # The next doctor shows this box's own measurement.
    code, out, err = run_cli("doctor", "--sglang", str(sg), "--flashinfer", str(fi))
    assert code == 0, err
    assert "you measured moe -" in out and "on this box on" in out


def test_bench_cmd_figures_are_read_from_its_json(trees, tmp_path, fake_nvml):
    bench = tmp_path / "bench.py"
    bench.write_text(
        "import json, sys\n"
        "out = sys.argv[sys.argv.index('--output-file') + 1]\n"
        "fast = 'patched' in open(sys.argv[1]).read()\n"
        "open(out, 'a').write(json.dumps({'output_throughput': 900.0 if fast else 800.0,\n"
        "  'request_throughput': 3.0, 'median_ttft_ms': 40.0, 'p99_ttft_ms': 90.0,\n"
        "  'median_itl_ms': 9.0, 'p99_itl_ms': 20.0, 'completed': 10}) + '\\n')\n"
    )
    side = tmp_path / "side.txt"
    side.write_text("pristine")
    sg, _ = trees
    # The benchmark reads which side it measures from a file the NVML fake keeps up to date.
    original = fake_nvml["nvmlDeviceGetPowerUsage"]

    def power(h):
        watts = original(h)
        side.write_text("patched" if watts < 200_000 else "pristine")
        return watts

    pynvml.nvmlDeviceGetPowerUsage.side_effect = power
    code, doc, err = measure(
        trees, tmp_path, extra=("--bench-cmd", f"{sys.executable} {bench} {side} --output-file {{output}}"),
    )
    assert code == 0, err
    assert [r["figures"]["output_tok_s"] for r in doc["runs"]] == [800.0, 900.0]
    assert doc["runs"][0]["figures"]["source"] == "bench-cmd"
    assert doc["gain"] == pytest.approx(0.125)


def test_a_failing_benchmark_on_the_patched_side_reverts(trees, tmp_path, fake_nvml):
    sg, _ = trees
    before = tree_hash(sg)
    bench = tmp_path / "bench.py"
    bench.write_text(
        "import json, pathlib, sys\n"
        "count = pathlib.Path(sys.argv[1]); n = int(count.read_text()) if count.exists() else 0\n"
        "count.write_text(str(n + 1))\n"
        "if n: print('benchmark broke', file=sys.stderr); sys.exit(2)\n"
        "out = sys.argv[sys.argv.index('--output-file') + 1]\n"
        "open(out, 'w').write(json.dumps({'output_throughput': 800.0}))\n"
    )
    cmdline = f"{sys.executable} {bench} {tmp_path / 'count'} --output-file {{output}}"
    code, doc, err = measure(trees, tmp_path, extra=("--bench-cmd", cmdline))
    assert code == 1, err
    assert "--bench-cmd exited with code 2" in err and "benchmark broke" in err
    assert tree_hash(sg) == before  # the patched side was applied, and is reverted


def test_bench_cmd_needs_an_output_placeholder(trees):
    sg, _ = trees
    code, out, err = run_cli(
        "trial", "moe", "--measure", "--sglang", str(sg), "--no-gpu-check",
        "--bench-cmd", "python -m sglang.bench_serving", "--", sys.executable, "-c", "pass",
    )
    assert code == 2
    assert "{output}" in err and "next:" in err


def test_another_profile_applied_refuses(trees):
    sg, fi = trees
    code, _, err = run_cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    before = tree_hash(sg)
    code, out, err = run_cli(
        "trial", "fusion", "--measure", "--sglang", str(sg), "--flashinfer", str(fi),
        "--no-gpu-check", "--", sys.executable, "-c", "pass",
    )
    assert code == 1
    assert "profile moe is applied" in err
    assert tree_hash(sg) == before


def test_interrupt_under_load_stops_the_server_and_reverts(trees, tmp_path):
    sg, fi = trees
    before = tree_hash(sg)
    port = free_port()
    pidfile = tmp_path / "server.pid"
    command = [
        sys.executable, FAKE, "--port", str(port), "--watch", str(sg / WATCHED),
        "--pristine-sha", sha(sg / WATCHED), "--lifetime", "60", "--pidfile", str(pidfile),
        "--delay-ms-pristine", "5", "--delay-ms-patched", "200",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sm120patch", "trial", "moe", "--measure", "--sglang", str(sg),
         "--flashinfer", str(fi), "--no-gpu-check", "--timeout", "20",
         "--requests", "8", "--concurrency", "2", "--max-tokens", "16", "--", *command],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if "fake server: patched" in line:  # the patched server is up; the load will be slow
            break
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert tree_hash(sg) == before
    assert gone(int(pidfile.read_text())), "the server outlived the interrupt"
    code, out, _ = run_cli("trial", "show", "--sglang", str(sg), "--flashinfer", str(fi), "--json")
    assert json.loads(out)["verdict"] == "interrupted"


# ---- the pieces --------------------------------------------------------------------------


def test_sampler_reads_power_and_utilisation_of_every_gpu(fake_nvml):
    sampler = gpu.Sampler(every=0.01).start()
    time.sleep(0.1)
    samples = sampler.stop()
    assert sampler.problem is None
    assert len(samples) >= 3
    figures = gpu.summarise(samples)
    assert [f.index for f in figures] == [0, 1]
    assert figures[1].mean_w == 251.0 and figures[1].max_w == 251.0
    assert figures[0].limit_share == pytest.approx(0.833, abs=1e-3)
    assert figures[0].describe() == "GPU 0: mean 250 W, max 250 W (83% of 300 W), util 90%"


def test_sampler_without_nvml_says_why():
    sampler = gpu.Sampler(every=0.01).start()
    samples = sampler.stop()
    # On a machine with a GPU the fake is not in place and real samples come back instead.
    assert (sampler.problem is not None and samples == []) or samples


def test_degenerate_answers():
    assert sanity.degenerate("") == "empty answer"
    assert sanity.degenerate("  \n") == "empty answer"
    assert sanity.degenerate("the loss is nan today") == "NaN in the answer"
    assert sanity.degenerate("Paris!!!!!!!!!!!!") == "degenerate text '!!!!!!!!'..."
    assert sanity.degenerate("a " * 9).startswith("one word repeated")
    assert sanity.degenerate("Paris. ----------") is None  # a ruler is not garbage
    assert sanity.degenerate(" Paris, the city of light.") is None


def test_divergence_beyond_the_threshold_fails():
    base = [loadgen.Answer("p1", " one two three four five six"), loadgen.Answer("p2", " alpha beta")]
    close = [loadgen.Answer("p1", " one two three four five seven"), loadgen.Answer("p2", " alpha beta")]
    other = [loadgen.Answer("p1", " lorem ipsum dolor sit amet"), loadgen.Answer("p2", " zeta eta")]
    assert sanity.judge(base, close).ok
    bad = sanity.judge(base, other)
    assert not bad.ok and "differ from the baseline" in bad.reasons[0]
    # A degenerate baseline makes the comparison meaningless: skipped, and said.
    skipped = sanity.judge([loadgen.Answer("p1", "!!!!!!!!!!"), base[1]], other[:1] + base[1:])
    assert skipped.ok and skipped.similarity is None and skipped.baseline_reasons


def test_percentile_interpolates():
    assert loadgen.percentile([], 50) is None
    assert loadgen.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert loadgen.percentile([float(i) for i in range(101)], 99) == 99.0
