"""Small fixture trees in the shapes of SGLang 0.5.8 and FlashInfer 0.6.1 (written by us, a few
lines per site, never copies of upstream files), as git checkouts or installed packages."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

SGLANG_FILES = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/layers/__init__.py": "",
    "sglang/srt/utils/__init__.py": "from sglang.srt.utils.common import *\n",
    "sglang/srt/utils/common.py": """\
def is_cuda(): ...
def is_sm90_supported(): ...
def is_sm100_supported(): ...
def is_sm120_supported(): ...
def check_pkg_version_at_least(name, version): ...
def get_quantization_config(config): ...
""",
    "sglang/srt/layers/communicator.py": """\
from sglang.srt.utils import (
    is_cuda,
    is_sm90_supported,
    is_sm100_supported,
)

_is_cuda = is_cuda()
_is_sm90_supported = _is_cuda and is_sm90_supported()
_is_sm100_supported = _is_cuda and is_sm100_supported()


def apply_flashinfer_allreduce_fusion(batch_size: int):
    return (
        (_is_sm90_supported or _is_sm100_supported)
        and batch_size > 0
    )
""",
    "sglang/srt/server_args.py": """\
import logging

from sglang.srt.utils import (
    check_pkg_version_at_least,
    get_quantization_config,
    is_sm90_supported,
    is_sm100_supported,
    is_sm120_supported,
)

logger = logging.getLogger(__name__)


class ServerArgs:
    def _handle_model_specific_adjustments(self):
        hf_config = self.hf_config
        model_arch = self.get_model_arch()
        if model_arch in ["DeepseekV3ForCausalLM"]:
            pass
        elif model_arch in ["Glm4MoeForCausalLM"]:
            if is_sm100_supported():
                quantization_config = getattr(hf_config, "quantization_config", None)
                quant_method = (
                    quantization_config.get("quant_method")
                    if quantization_config is not None
                    else None
                )
                if self.quantization is None and quant_method is not None:
                    self.quantization = quant_method
                if (
                    self.quantization == "modelopt_fp4"
                    and self.moe_a2a_backend == "none"
                    and self.moe_runner_backend == "auto"
                ):
                    # Only enable flashinfer_trtllm if flashinfer-python version is >= 0.6.2
                    if check_pkg_version_at_least("flashinfer-python", "0.6.2"):
                        self.moe_runner_backend = "flashinfer_trtllm"
                        logger.info(
                            "Use flashinfer_trtllm as MoE runner backend on sm100 for Glm4MoeForCausalLM"
                        )
        elif model_arch in ["Qwen3MoeForCausalLM", "Qwen3VLMoeForConditionalGeneration"]:
            if is_sm100_supported():
                quant_method = get_quantization_config(hf_config)
                if self.quantization is None and quant_method is not None:
                    self.quantization = quant_method
                if (
                    (
                        self.quantization in ("fp8", "modelopt_fp4")
                        or self.quantization is None
                    )
                    and self.moe_a2a_backend == "none"
                    and self.moe_runner_backend == "auto"
                ):
                    self.moe_runner_backend = "flashinfer_trtllm"
                    logger.info(
                        "Use flashinfer_trtllm as MoE runner backend on sm100 for "
                        f"{model_arch}"
                    )

        if (
            not self.enable_flashinfer_allreduce_fusion
            and model_arch in ["DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"]
            and (is_sm90_supported() or is_sm100_supported())
            and not self.enable_dp_attention
        ):
            self.enable_flashinfer_allreduce_fusion = True
""",
}

FLASHINFER_FILES = {
    "flashinfer/__init__.py": "",
    "flashinfer/jit/__init__.py": "",
    "flashinfer/jit/comm.py": """\
def gen_trtllm_comm_module():
    nvcc_flags = current_compilation_context.get_nvcc_flags_list(
        supported_major_versions=[9, 10]
    )
    return gen_jit_spec("trtllm_comm", [], extra_cuda_cflags=nvcc_flags)


def gen_vllm_comm_module():
    nvcc_flags = current_compilation_context.get_nvcc_flags_list(
        supported_major_versions=[9, 10]
    )
    return gen_jit_spec("vllm_comm", [], extra_cuda_cflags=nvcc_flags)
""",
}

# vLLM's shape (written by us): the package at the repository's root, a capability gate in
# the manner of its platform code.
VLLM_FILES = {
    "vllm/__init__.py": "",
    "vllm/platforms/__init__.py": "",
    "vllm/platforms/gates.py": """\
def use_cutlass_moe(current_platform):
    return current_platform.is_device_capability(100)
""",
}

DIST = {"sglang": "sglang", "flashinfer": "flashinfer_python", "vllm": "vllm"}

# vLLM's pyproject.toml, the part that versions a checkout: setuptools-scm with its defaults
# (its setup.py writes the record to vllm/_version.py, which git ignores).
VLLM_SCM_PYPROJECT = """\
[project]
name = "vllm"
dynamic = ["version"]

[tool.setuptools_scm]
# no extra settings needed, presence enables setuptools-scm
"""

# SGLang's python/pyproject.toml since 0.5.10, the part that gives a checkout its version:
# setuptools-scm, counting from the tag its python/tools/get_version_tag.py names, its record
# written to sglang/_version.py (which git ignores).
SGLANG_SCM_PYPROJECT = """\
[project]
name = "sglang"
dynamic = ["version"]

[tool.setuptools_scm]
root = ".."
version_file = "sglang/_version.py"
git_describe_command = ["python3", "python/tools/get_version_tag.py"]
fallback_version = "0.0.0.dev0"
"""


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], check=True, capture_output=True, text=True
    ).stdout


def make_tree(base: Path, kind: str, version: str, layout: str) -> Path:
    """A target: `layout` "git" gives a checkout root (SGLang under python/), "installed" a
    site-packages directory with a dist-info recording `version`. Returns the path to pass."""
    files = {"sglang": SGLANG_FILES, "flashinfer": FLASHINFER_FILES, "vllm": VLLM_FILES}[kind]
    root = base / f"{kind}-{layout}"
    parent = root / "python" if (kind == "sglang" and layout == "git") else root
    for rel, text in files.items():
        path = parent / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if layout == "installed":
        info = parent / f"{DIST[kind]}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {kind}\nVersion: {version}\n")
    else:
        (parent / kind / "version.py").write_text(f'__version__ = "{version}"\n')
        commit_all(init_repo(root), "base")
    return root


def init_repo(root: Path) -> Path:
    """A new repository at `root` (branch main) with a committer of its own."""
    root.mkdir(parents=True, exist_ok=True)
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.name", "Test User")
    git(root, "config", "user.email", "test@example.com")
    return root


def commit_all(root: Path, message: str) -> str:
    """Commit everything in the work tree; the new commit's id."""
    git(root, "add", "-A")
    git(root, "commit", "-q", "--allow-empty", "-m", message)
    return git(root, "rev-parse", "HEAD").strip()


def tree_hash(root: Path) -> str:
    """A digest of every file under `root` (bytes and mode), `.git` internals excluded except
    HEAD and refs, so a test sees any change to the work tree, the branch or the branches.
    sm120patch's own state beside an installed package (`.sm120patch/`) is not the tree."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(".git/") or rel == ".git" or ".sm120patch" in rel.split("/"):
            continue
        if "__pycache__" in rel:
            continue
        if path.is_file():
            h.update(rel.encode() + b"\0" + oct(path.stat().st_mode).encode() + b"\0")
            h.update(path.read_bytes())
    if (root / ".git").is_dir():
        h.update(git(root, "rev-parse", "HEAD").encode())
        h.update(
            git(root, "symbolic-ref", "-q", "HEAD").encode() if _attached(root) else b"detached"
        )
        h.update(git(root, "for-each-ref", "--format=%(refname) %(objectname)").encode())
    return h.hexdigest()


def _attached(root: Path) -> bool:
    return (
        subprocess.run(
            ["git", "-C", str(root), "symbolic-ref", "-q", "HEAD"], capture_output=True
        ).returncode
        == 0
    )


def upstream_checkout(base: Path, kind: str, version: str) -> Path:
    """A git checkout of a real release (from the release cache, `maintain.trees`) laid out as
    upstream keeps it: SGLang under python/, the release tagged `v<version>` on `main`, none of
    the version files a build generates (SGLang's _version.py, FlashInfer's _build_meta.py),
    FlashInfer's version.txt at the root. Returns the checkout root."""
    import shutil

    from sm120patch.maintain import trees

    root = base / f"{kind}-checkout"
    parent = root / "python" if kind == "sglang" else root
    shutil.copytree(trees.tree(kind, version) / kind, parent / kind)
    (parent / kind / "_version.py").unlink(missing_ok=True)
    if kind == "flashinfer":
        (root / "version.txt").write_text(version + "\n")
    else:
        # SGLang's python/pyproject.toml since 0.5.10, the part that versions a checkout:
        # setuptools-scm from the tag python/tools/get_version_tag.py names; its record
        # (sglang/_version.py) is ignored by git.
        (parent / "pyproject.toml").write_text(
            '[project]\nname = "sglang"\ndynamic = ["version"]\n\n[tool.setuptools_scm]\n'
            'root = ".."\nversion_file = "sglang/_version.py"\n'
            'git_describe_command = ["python3", "python/tools/get_version_tag.py"]\n'
            'fallback_version = "0.0.0.dev0"\n'
        )
        (root / ".gitignore").write_text("python/sglang/_version.py\n__pycache__/\n")
    git(base, "init", "-q", "-b", "main", str(root))
    git(root, "add", "-A")
    git(root, "-c", "user.name=T", "-c", "user.email=t@example.com", "commit", "-q", "-m", version)
    git(root, "tag", f"v{version}")
    return root
