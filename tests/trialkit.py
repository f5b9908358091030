"""What the trial tests share: the CLI in-process, a free local port, the two fixture trees."""

from __future__ import annotations

import socket

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
    """SGLang 0.5.8 as a git checkout and FlashInfer 0.6.1 installed."""
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path, "flashinfer", "0.6.1", "installed")
    return sg, fi
