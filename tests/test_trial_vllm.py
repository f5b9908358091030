"""`trial` with vLLM: the server command read with vLLM's flags (`vllm serve MODEL`, the
api_server module, `--flag=value`, underscores), readiness on /health at the derived port, the
model name from /v1/models (vLLM answers 404 to any other), and the wiring read from log lines
in vLLM's format (process prefix, ANSI colours, one line per worker, multi-line messages).

The vLLM profile is a test pack's (a vLLM patch of the fixture tree, target "vllm", wiring
matching vLLM's real NvFp4 MoE line, `Using <BACKEND> NvFp4 MoE backend out of potential
backends: [...]`, vllm/model_executor/layers/fused_moe/oracle/base.py `make_log_backend`), run
against tests/fake_server.py in its vLLM flavour. The engine comes from the profile's targets."""

from __future__ import annotations

import hashlib
import json
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
from trees import make_tree, tree_hash
from trialkit import free_port, run_cli
from vllmpack import write_pack

from sm120patch.config import Config
from sm120patch.plan import catalog
from sm120patch.trial import engines, known, serve
from sm120patch.trial import measured as measured_

FAKE = str(Path(__file__).with_name("fake_server.py"))
GATES = "vllm/platforms/gates.py"  # the fixture tree's file the pack's patch changes
B12X = "Using FLASHINFER_B12X NvFp4 MoE backend out of potential backends: ['FLASHINFER_B12X']"
CUTLASS = "Using VLLM_CUTLASS NvFp4 MoE backend out of potential backends: ['VLLM_CUTLASS']"



@pytest.fixture
def pack(tmp_path):
    return write_pack(tmp_path / "pack")


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path, "vllm", "0.34.0", "installed")


# ---- the command line, per engine ----------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "api", "model", "served", "tp"),
    [
        (["vllm", "serve", "/models/glm", "--port", "8001", "-tp", "4"],
         "http://127.0.0.1:8001", "/models/glm", "/models/glm", "4"),
        (["vllm", "serve", "org/m", "--host", "10.0.0.5", "--served-model-name", "a", "b",
          "--tensor-parallel-size", "2"], "http://10.0.0.5:8000", "org/m", "a", "2"),
        ([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m",
          "--port=9000", "--tensor_parallel_size=8", "--host", "::"],
         "http://127.0.0.1:9000", "/m", "/m", "8"),
        (["vllm", "serve", "/m", "--model", "/other", "--host", "fd00::1", "--port", "1",
          "--port", "2"], "http://[fd00::1]:2", "/m", "/m", None),
        (["vllm", "serve", "--port", "8002"], "http://127.0.0.1:8002", None, None, None),
    ],
)
def test_vllm_command_lines(command, api, model, served, tp):
    e = engines.VLLM
    assert (e.api(command), e.model_path(command), e.served_name(command), e.tp(command)) == (
        api, model, served, tp)


def test_sglang_command_lines_keep_their_defaults():
    e = engines.SGLANG
    cmd = ["python", "-m", "sglang.launch_server", "--model-path", "/m", "--tp", "4"]
    assert (e.api(cmd), e.model_path(cmd), e.tp(cmd)) == ("http://127.0.0.1:30000", "/m", "4")
    assert e.api([*cmd, "--port", "31000", "--host", "0.0.0.0"]) == "http://127.0.0.1:31000"
    opts = measured_.Options()
    assert measured_.api_of(opts, cmd) == "http://127.0.0.1:30000"
    assert measured_.api_of(opts, ["vllm", "serve", "m"], engines.VLLM) == "http://127.0.0.1:8000"
    ready = measured_.Options(ready_url="http://127.0.0.1:7000/health")
    assert measured_.api_of(ready, ["vllm", "serve", "m"], engines.VLLM) == "http://127.0.0.1:7000"


def test_the_engine_is_the_profiles(pack):
    cat = catalog.load(Config((str(pack),)))
    assert engines.of_profile("vmoe-test", cat) is engines.VLLM
    assert engines.of_profile("moe", cat) is engines.SGLANG
    assert engines.of_kinds(("sglang", "flashinfer")) is engines.SGLANG


def test_known_outcomes_read_a_vllm_command(tmp_path, tree):
    model = tmp_path / "glm"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Glm4MoeForCausalLM"]}))
    box = known.box_of({"vllm": str(tree)}, ["vllm", "serve", str(model), "-tp", "4", "-q",
                                             "modelopt_fp4"],
                       read_gpus=lambda: SimpleNamespace(family="sm120", gpus=[]), statuses=[])
    assert (box.tp, box.architecture, box.quantization) == (4, ["Glm4MoeForCausalLM"],
                                                            "modelopt_fp4")


def test_ansi_is_stripped_before_matching():
    coloured = ("\x1b[0;36m(EngineCore_DP0 pid=7)\x1b[0;0m \x1b[32mINFO\x1b[0m "
                "\x1b[90m12-03 19:00:00\x1b[0m \x1b[90m[base.py:237]\x1b[0m " + B12X)
    assert serve.plain(coloured) == f"(EngineCore_DP0 pid=7) INFO 12-03 19:00:00 [base.py:237] {B12X}"
    assert serve.plain("no escapes") == "no escapes"


# ---- measured trials against the vLLM-flavoured stand-in -----------------------------------


@pytest.fixture
def fake_nvml(mocker, tree):
    """Two SM120 GPUs; 250 W while the tree is pristine, 125 W patched."""
    watched = tree / GATES
    pristine = hashlib.sha256(watched.read_bytes()).hexdigest()

    def patched() -> bool:
        return hashlib.sha256(watched.read_bytes()).hexdigest() != pristine

    fake = {
        "nvmlInit": lambda: None, "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 2, "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: "NVIDIA RTX PRO 6000 Blackwell",
        "nvmlDeviceGetCudaComputeCapability": lambda h: (12, 0),
        "nvmlDeviceGetPowerUsage": lambda h: 125_000 if patched() else 250_000,
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: 300_000,
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=50),
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=96 * 2**30, used=2**30),
        "nvmlSystemGetDriverVersion": lambda: "580.0",
        "nvmlSystemGetCudaDriverVersion": lambda: 12080,
    }  # fmt: skip
    for name, fn in fake.items():
        mocker.patch.object(pynvml, name, side_effect=fn)


LOAD = ("--requests", "4", "--concurrency", "4", "--max-tokens", "16", "--warmup", "0")


def vllm_trial(pack, tree, tmp_path, *options, repeat="2", most=None, extra=()):
    """`vllm serve MODEL` (the stand-in, as vLLM is run) measured: no --ready-url, no
    --model, no --api: the trial reads them from the command as vLLM's."""
    watched = tree / GATES
    crc = f"{zlib.crc32(watched.read_bytes()):08x}"
    command = [sys.executable, "-S", FAKE, "serve", "/models/glm-nvfp4",
               f"--port={free_port()}", "--served-model-name", "glm", "-tp", "2",
               "--watch", str(watched), "--pristine-crc", crc, "--lifetime", "60", *options]
    code, out, err = run_cli(
        "--patches", str(pack), "trial", "vmoe-test", "--measure", "--vllm", str(tree),
        "--no-gpu-check", "--timeout", "20", *LOAD, "--repeat", repeat, "--max-repeat", most or repeat,
        *extra, "--json", "--", *command,
    )  # fmt: skip
    return code, (json.loads(out) if out.strip().startswith("{") else None), err


def test_vllm_trial_kept_on_its_own_log_lines(pack, tree, tmp_path, fake_nvml):
    code, doc, err = vllm_trial(
        pack, tree, tmp_path, "--delay-ms-pristine", "60", "--delay-ms-patched", "12",
        "--workers", "2", "--color", "--log-line", CUTLASS,
        "--log-when-patched", B12X, "--multiline-when-patched", "warning", repeat="3", most="4",
        extra=("--export", str(tmp_path / "mine.toml")),
    )  # fmt: skip
    assert doc is not None, err
    assert doc["verdict"] == "kept", (doc["message"], err)
    assert code == 0
    assert doc["versions"] == {"vllm": "0.34.0"}
    runs = doc["runs"]
    # Every start logs the backend vLLM chose; the patched one then B12X (the last decides).
    assert [r["wiring"]["vllm.test-moe"]["seen"] for r in runs] == ["skipped", "ran"] * (
        len(runs) // 2)
    line = runs[1]["wiring"]["vllm.test-moe"]["line"]
    assert line.startswith("(Worker_TP1 pid=") and line.endswith(B12X) and "\x1b" not in line
    # The model came from /v1/models: every request answered (vLLM 404s another name).
    assert runs[0]["figures"]["completed"] == 4 and not runs[0]["load_errors"]
    assert all(a["error"] is None for a in runs[0]["answers"])
    # A continued line of a multi-line message is a line of its own, its prefix whole.
    assert any(t.endswith("second line of the message") and t.startswith("(EngineCore_DP0")
               for t in runs[1]["tail"])
    # The export is a known.toml record about this vLLM release, read back as one.
    from sm120patch.plan.known import Box, _parse, matches

    entry, = _parse((tmp_path / "mine.toml").read_text(), "mine.toml", "")
    assert entry.condition["vllm"] == "==0.34.0" and entry.condition["tp"] == "==2"
    assert entry.outcome == "faster" and "vllm == 0.34.0" in entry.line()
    here = Box(versions={"vllm": "0.34.0"}, gpu_family="sm120", gpus=2, tp=2)
    assert matches(entry, "vmoe-test", here)
    assert not matches(entry, "vmoe-test", Box(versions={"vllm": "0.33.0"}, gpu_family="sm120",
                                                gpus=2, tp=2))
    assert (tree / GATES).read_text() != make_tree(tmp_path / "x", "vllm", "0.34.0",
                                                   "installed").joinpath(GATES).read_text()


def test_vllm_trial_inert_when_its_log_names_another_backend(pack, tree, tmp_path, fake_nvml):
    before = tree_hash(tree)
    code, doc, err = vllm_trial(pack, tree, tmp_path, "--color", "--log-when-patched", CUTLASS)
    assert doc is not None, err
    assert (code, doc["verdict"], doc["evidence"]) == (5, "inert", False)
    assert "skipped vllm.test-moe's path in run 1" in doc["message"]
    assert CUTLASS in doc["message"] and "\\x1b" not in doc["message"]
    assert tree_hash(tree) == before


def test_vllm_trial_crash_is_reverted_and_diagnosed(pack, tree, tmp_path, fake_nvml):
    before = tree_hash(tree)
    code, doc, err = vllm_trial(pack, tree, tmp_path, "--crash-when-patched")
    assert doc is not None, err
    assert (code, doc["verdict"], doc["evidence"]) == (3, "crashed", True)
    assert [r["outcome"] for r in doc["runs"]] == ["ok", "crashed"]
    assert doc["signature"]["id"] == "flashinfer-comm-arch"
    assert tree_hash(tree) == before


def test_hints_show_the_profiles_server(pack, tree):
    code, out, err = run_cli("--patches", str(pack), "trial", "vmoe-test", "--vllm", str(tree),
                             "--no-gpu-check")
    assert code == 2 and "vllm serve MODEL" in err
    code, out, err = run_cli("--patches", str(pack), "trial", "vmoe-test", "--measure",
                             "--vllm", str(tree), "--no-gpu-check", "--bench-cmd", "x", "--",
                             "vllm", "serve", "m")
    assert code == 2 and "vllm bench serve" in err
