"""The fp4-gemm and attention profiles on real releases: what their patched code relies on is
in every release their pins take (FlashInfer's b12x backend and CUDA probe, SGLang's SM120
refusals for trtllm_mha), fp4-gemm applies on SGLang 0.5.23 + FlashInfer 0.7.4 installed in a
virtual environment and reverts byte for byte, refuses FlashInfer 0.6.12, and attention applies
on 0.5.23."""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from realcache import RealReleases, release_set

from sm120patch.cli import main
from sm120patch.maintain import dists, releases, trees
from sm120patch.plan import catalog

pytestmark = pytest.mark.real

# FlashInfer releases read on top of the session's set: the first with b12x (0.6.9), the one
# refused (0.6.12), the first pinned (0.6.13), the first with SM12x sinks (0.6.16), the newest.
FLASHINFER_EXTRA = ("0.6.8", "0.6.9", "0.6.12", "0.6.13", "0.6.16", "0.7.4")
SGLANG_EXTRA = ("0.5.12", "0.5.18", "0.5.19", "0.5.23")


def flashinfer_releases() -> list[str]:
    from packaging.version import Version

    return sorted({*release_set("flashinfer"), *FLASHINFER_EXTRA}, key=Version)


def _parse(real: RealReleases, kind: str, version: str, rel: str) -> ast.Module | None:
    path = real.tree(kind, version) / rel
    return ast.parse(path.read_text(encoding="utf-8")) if path.is_file() else None


def _release(version: str):
    from packaging.version import Version

    return Version(Version(version).base_version)


# ---- what the fp4-gemm helper and pins rely on ---------------------------------------------


@pytest.mark.parametrize("version", sorted(set(FLASHINFER_EXTRA) | {"0.6.1", "0.6.15", "0.6.17"}))
def test_flashinfer_mm_fp4_has_b12x_from_0_6_9(real: RealReleases, version: str) -> None:
    """mm_fp4's backend table names b12x from FlashInfer 0.6.9 (not 0.6.10); its outermost
    decorator is backend_requirement, whose wrapper carries `is_backend_supported` (what the
    patched `auto` asks); jit/cpp_ext.py defines get_cuda_version (what b12x's requirement
    reads and the helper too)."""
    from packaging.version import Version

    tree = _parse(real, "flashinfer", version, "flashinfer/gemm/gemm_base.py")
    has_b12x = tree is not None and any(
        isinstance(n, ast.Dict)
        and any(isinstance(k, ast.Constant) and k.value == "b12x" for k in n.keys)
        and any(isinstance(v, ast.Name) and v.id == "_b12x_gemm_fp4_requirement" for v in n.values)
        for n in ast.walk(tree)
    )
    assert has_b12x is (_release(version) >= Version("0.6.9")), version
    if not has_b12x:
        return
    [mm_fp4] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "mm_fp4"]
    first = mm_fp4.decorator_list[0]
    assert ast.unparse(getattr(first, "func", first)) == "backend_requirement"
    cpp_ext = _parse(real, "flashinfer", version, "flashinfer/jit/cpp_ext.py")
    assert cpp_ext is not None and any(
        isinstance(n, ast.FunctionDef) and n.name == "get_cuda_version" for n in cpp_ext.body
    )
    minimum = any(
        isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "_MIN_B12X_CUDA_VERSION"
        for n in tree.body
    )
    assert minimum is (_release(version) >= Version("0.7.0")), "where b12x names 12.9"


def test_fp4_gemm_pins_and_refusal() -> None:
    from packaging.version import Version

    prof = catalog.load().profile("fp4-gemm")
    for version in flashinfer_releases():
        inside = prof.pinned("flashinfer", version)
        assert inside is (_release(version) >= Version("0.6.13")), version
    assert catalog.pin_problems(prof, {"flashinfer": "0.6.12"}), "0.6.12 is outside the pins"
    [refusal] = catalog.refusal_problems(prof, {"flashinfer": "0.6.12"})
    assert "issues/3398" in refusal and "0.6.13" in refusal, refusal
    assert catalog.refusal_problems(prof, {"flashinfer": "0.6.13"}) == []


@pytest.mark.parametrize("version", ["0.5.8", "0.5.12", "0.5.13", "0.5.23"])
def test_sglang_fp4_gemm_passes_the_mapped_name_to_mm_fp4(real: RealReleases, version: str) -> None:
    """modelopt_quant.py calls mm_fp4 with `backend=` the runner backend's
    get_flashinfer_backend(): flashinfer_b12x reaches FlashInfer as "b12x"."""
    tree = _parse(real, "sglang", version, "sglang/srt/layers/quantization/modelopt_quant.py")
    assert tree is not None
    text = ast.unparse(tree)
    assert "fp4_backend.get_flashinfer_backend()" in text
    assert "mm_fp4 as flashinfer_fp4_gemm" in text


# ---- what the attention helper relies on ---------------------------------------------------


def _trtllm_mha_block(tree: ast.Module) -> ast.If:
    [block] = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.If)
        and ast.unparse(n.test) == "'trtllm_mha' in (prefill_backend, decode_backend)"
    ]
    return block


@pytest.mark.parametrize("version", SGLANG_EXTRA)
def test_sglang_sm120_trtllm_mha_refusals(real: RealReleases, version: str) -> None:
    """From 0.5.19 the attention hook accepts trtllm_mha on SM120 and refuses it there for
    exactly an fp8_e4m3 KV cache, a skip-softmax threshold (prefill) and prefill context
    parallelism: the cases the patched default avoids. Before (0.5.10 to 0.5.18) server_args.py
    refuses trtllm_mha prefill off SM100 altogether: the profile is not pinned there."""
    from packaging.version import Version

    hook = _parse(real, "sglang", version, "sglang/srt/arg_groups/attention_hook.py")
    if _release(version) < Version("0.5.19"):
        args = ast.unparse(_parse(real, "sglang", version, "sglang/srt/server_args.py"))
        assert "prefill_backend == 'trtllm_mha' and (not is_sm100_supported())" in args
        assert not catalog.load().profile("attention").pinned("sglang", version)
        return
    assert hook is not None
    raises = [
        n
        for n in ast.walk(_trtllm_mha_block(hook))
        if isinstance(n, ast.If) and any(isinstance(s, ast.Raise) for s in n.body)
    ]
    tests = [ast.unparse(n.test) for n in raises]
    # The raises that take SM120 in (not the ones for GPUs outside SM90/SM100/SM120).
    sm120 = [
        t
        for t in tests
        if ("is_sm120" in t and "not (" not in t) or "not get_platform().is_sm100" in t
    ]
    assert len(sm120) == 2, sm120
    fmha, cp = sm120
    assert "cfg.kv_cache_dtype == 'fp8_e4m3'" in fmha
    assert "SGLANG_SKIP_SOFTMAX_PREFILL_THRESHOLD_SCALE_FACTOR" in fmha
    assert "cfg.attn_cp_size > 1" in cp
    hybrid = _parse(real, "sglang", version, "sglang/srt/configs/hybrid_arch.py")
    assert hybrid is not None and any(
        isinstance(n, ast.FunctionDef) and n.name == "mambaish_config" for n in hybrid.body
    )
    environ = (real.tree("sglang", version) / "sglang/srt/environ.py").read_text()
    assert "SGLANG_SKIP_SOFTMAX_PREFILL_THRESHOLD_SCALE_FACTOR = EnvFloat(" in environ


# ---- apply and revert ----------------------------------------------------------------------


def cli(*args: str):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def snapshot(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def installed(tmp_path: Path, *releases_: tuple[str, str]) -> Path:
    """A site directory holding each (kind, version) as pip installs it: the release's cached
    install tree (its package and dist-info, `trees.tree`), copied."""
    site = tmp_path / "site"
    for kind, version in releases_:
        if not releases.index_reachable() and dists.cached(kind, version) is None:
            pytest.skip(f"{kind} {version} is not cached and the index is unreachable")
        for entry in trees.tree(kind, version).iterdir():
            if entry.is_dir():
                shutil.copytree(entry, site / entry.name)
    return site


def test_fp4_gemm_on_sglang_0_5_23_with_flashinfer_0_7_4(tmp_path: Path) -> None:
    site = installed(tmp_path, ("sglang", "0.5.23"), ("flashinfer", "0.7.4"))
    before = {k: snapshot(site / k) for k in ("sglang", "flashinfer")}
    where = ["--sglang", str(site), "--flashinfer", str(site)]
    code, out, err = cli("apply", "fp4-gemm", *where, "--dry-run")
    assert code == 0, err
    for line in (
        '+    FLASHINFER_B12X = "flashinfer_b12x"',
        "+        if get_platform().is_sm120 and _flashinfer_offers_b12x():",
        '+    "flashinfer_b12x",',
        "+        or get_fp4_gemm_runner_backend().is_flashinfer_b12x()",
    ):
        assert line in out, line
    code, _, err = cli("apply", "fp4-gemm", *where, "--no-gpu-check")
    assert code == 0, err
    doc = json.loads(cli("status", *where, "--json")[1])
    states = {t["kind"]: {f["state"] for f in t["files"]} for t in doc["targets"]}
    assert states["sglang"] == {"patched"}
    for rel in (
        "sglang/srt/layers/quantization/fp4_utils.py",
        "sglang/srt/arg_groups/choices.py",
        "sglang/srt/model_executor/runner/flashinfer_autotune.py",
    ):
        compile((site / rel).read_text(encoding="utf-8"), rel, "exec", dont_inherit=True)
    assert snapshot(site / "flashinfer") == before["flashinfer"]  # nothing of FlashInfer
    code, _, err = cli("revert", "--all", *where)
    assert code == 0, err
    after = {k: snapshot(site / k) for k in before}
    changed = [
        f"{k}/{f}"
        for k in before
        for f in set(before[k]) | set(after[k])
        if before[k].get(f) != after[k].get(f)
    ]
    assert changed == []


def _checkout(tmp: Path, kind: str, version: str) -> Path:
    """A git repository of the release's tree, as a user's checkout."""
    root = tmp / f"{kind}-{version}"
    shutil.copytree(trees.tree(kind, version), root)
    (root / kind / "version.py").write_text(f'__version__ = "{version}"\n')
    for args in (
        ("init", "-q", "-b", "main"),
        ("add", "-A"),
        ("-c", "user.name=T", "-c", "user.email=t@example.com", "commit", "-q", "-m", "v"),
    ):
        subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)
    return root


def test_fp4_gemm_refuses_flashinfer_0_6_12(tmp_path: Path) -> None:
    sg = _checkout(tmp_path, "sglang", "0.5.23")
    fi = _checkout(tmp_path, "flashinfer", "0.6.12")
    before = snapshot(sg)
    code, _, err = cli(
        "apply", "fp4-gemm", "--sglang", str(sg), "--flashinfer", str(fi), "--no-gpu-check"
    )
    assert code != 0
    assert "0.6.12" in err and "fp4-gemm" in err and "issues/3398" in err
    assert snapshot(sg) == before


def test_attention_on_sglang_0_5_23(tmp_path: Path) -> None:
    sg = _checkout(tmp_path, "sglang", "0.5.23")
    fi = _checkout(tmp_path, "flashinfer", "0.7.4")
    before = snapshot(sg)
    where = ["--sglang", str(sg), "--flashinfer", str(fi)]
    code, out, err = cli("apply", "attention", *where, "--no-gpu-check")
    assert code == 0, err
    patched = snapshot(sg)
    assert patched != before
    for rel in (
        "sglang/srt/arg_groups/model_override_base.py",
        "sglang/srt/arg_groups/model_overrides/gpt_oss.py",
    ):
        compile((sg / rel).read_text(encoding="utf-8"), rel, "exec", dont_inherit=True)
    code, _, err = cli("revert", "--all", *where)
    assert code == 0, err
    after = {k: v for k, v in snapshot(sg).items() if not k.startswith(".git/")}
    assert after == {k: v for k, v in before.items() if not k.startswith(".git/")}
