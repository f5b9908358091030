"""vLLM 0.34.0's own log formatters (vllm/logging_utils/formatter.py, with vllm/logger.py's
`_FORMAT` and `_DATE_FORMAT`) print the NvFp4 MoE backend line as a server would, plain and
coloured, one line and continued over two; what a trial reads of that output (text mode's line
splitting, then `serve.plain`) reaches vllm.moe-b12x's wiring whole, and so does the record
prefix the test pack's anchored pattern and tests/fake_server.py's vLLM flavour rely on.

The release comes from the release cache as its `.py` files (`maintain/sources.py`); without
the network the test skips, saying so."""

from __future__ import annotations

import ast
import importlib.util
import io
import logging
import re
from pathlib import Path

import pytest

from sm120patch.maintain import releases, sources
from sm120patch.patchkit.model import Seen
from sm120patch.plan import catalog
from sm120patch.trial import serve

pytestmark = pytest.mark.real

VERSION = "0.34.0"


@pytest.fixture(scope="module")
def vllm_dir() -> Path:
    if not releases.index_reachable():
        pytest.skip(f"the index ({releases.index_sources()}) is unreachable: vLLM's sources "
                    "are fetched from it")  # fmt: skip
    return sources.tree("vllm", VERSION) / "vllm"


def _format_of(logger_py: Path) -> tuple[str, str]:
    """`_FORMAT` (its VLLM_LOGGING_PREFIX, empty by default, left out) and `_DATE_FORMAT`."""
    found: dict[str, str] = {}
    for node in ast.parse(logger_py.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
            if name == "_DATE_FORMAT" and isinstance(value, ast.Constant):
                found[name] = value.value
            elif name == "_FORMAT" and isinstance(value, ast.JoinedStr):
                found[name] = "".join(
                    v.value for v in value.values if isinstance(v, ast.Constant))
    return found["_FORMAT"], found["_DATE_FORMAT"]


def _lines_as_a_trial_reads_them(text: str) -> list[str]:
    """The bytes through text mode's universal newlines (serve.spawn's pipe), each `plain`."""
    stream = io.TextIOWrapper(io.BytesIO(text.encode()), errors="replace")
    return [serve.plain(line.rstrip("\n")) for line in stream]


def test_vllms_moe_backend_line_reaches_the_wiring_whole(vllm_dir: Path) -> None:
    base = (vllm_dir / "model_executor/layers/fused_moe/oracle/base.py").read_text()
    assert 'return f"Using {backend.value} {self.name} MoE {lora}backend{available}."' in base
    nvfp4 = (vllm_dir / "model_executor/layers/fused_moe/oracle/nvfp4.py").read_text()
    assert re.search(r'^\s+name = "NvFp4"$', nvfp4, re.M)
    message = ("Using FLASHINFER_B12X NvFp4 MoE backend out of potential backends: "
               "['FLASHINFER_TRTLLM', 'FLASHINFER_B12X', 'MARLIN'].")
    spec = importlib.util.spec_from_file_location(
        "vllm_formatter_under_test", vllm_dir / "logging_utils/formatter.py")
    assert spec and spec.loader
    formatter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(formatter)  # imports logging and pathlib only
    fmt, datefmt = _format_of(vllm_dir / "logger.py")
    wiring = catalog.load().patches["vllm.moe-b12x"].wiring
    assert wiring is not None
    from vllmpack import PATCH as PACK

    prefix = re.search(r'^PREFIX = r"(.*)"$', PACK, re.M)
    assert prefix is not None
    anchored = re.compile(prefix.group(1) + "Using FLASHINFER_B12X NvFp4 MoE backend")
    for cls in (formatter.NewLineFormatter, formatter.ColoredFormatter):
        for text in (message, message + "\nsecond line"):
            record = logging.LogRecord("vllm.x", logging.INFO, str(vllm_dir / "base.py"), 237,
                                       text, None, None)
            record.vllm_process_name = "Worker_TP1"
            printed = cls(fmt, datefmt, log_level="INFO").format(record) + "\n"
            lines = _lines_as_a_trial_reads_them(printed)
            assert "\x1b" not in "".join(lines)
            assert wiring.read(lines[0]).seen is Seen.RAN, (cls.__name__, lines)
            assert anchored.search(lines[0]), (cls.__name__, lines[0])
            if "\n" in text:  # continued after "\r\n" and the prefix again
                assert len(lines) == 2 and lines[1].endswith(" second line")
                assert lines[1].startswith("(Worker_TP1 pid=")
    coloured = formatter.ColoredFormatter(fmt, datefmt, log_level="INFO").format(record)
    assert "\x1b[0;36m(Worker_TP1 pid=" in coloured  # what the stand-in prints with --color
