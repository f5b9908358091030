"""What the trial tests share: the CLI in-process, a free local port, the two fixture trees,
waiting for a process to be gone."""

from __future__ import annotations

import os
import socket
import time

from click.testing import CliRunner
from trees import make_tree

from sm120patch.cli import main


def run_cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_trees(tmp_path):
    """SGLang 0.5.8 as a git checkout and FlashInfer 0.6.7 installed (moe refuses a FlashInfer
    before 0.6.7)."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path, "flashinfer", "0.6.7", "installed")
    return sg, fi


def gone(pid: int, wait: float = 5.0) -> bool:
    deadline = time.time() + wait
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False
