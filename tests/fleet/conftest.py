"""The fleet tier: the Ansible collection through real ansible-playbook, and the image recipe.

One environment per session (`fleet`): `examples/Containerfile` performed in a fresh virtual
environment (SGLang 0.5.8 and FlashInfer 0.6.1 from the release cache, sm120patch built from
this checkout, a lock applied), a pristine copy of both packages for the playbooks to patch, and
the collection installed with `ansible-galaxy collection install` from the repository path.
The tier skips, saying why, when ansible-core is missing or the releases cannot be had.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from fleetkit import COLLECTION, EXAMPLES, Image, ansible_bin, build_context, run_containerfile

from sm120patch.maintain import dists, releases

SGLANG, FLASHINFER = "0.5.8", "0.6.1"
IMAGE_PROFILE = "fusion"  # the image's lock: both targets touched (moe and all refuse FI 0.6.1)


@dataclass
class Fleet:
    root: Path
    python: Path  # the fresh venv's interpreter: sm120patch from this checkout's wheel
    pristine: Path  # SGLang + FlashInfer as pip installs them, never patched
    collections: Path  # ANSIBLE_COLLECTIONS_PATH
    wheels: dict[str, Path]
    lock: Path  # the image's lock (profile IMAGE_PROFILE on the pristine releases)
    image: Image
    image_state: Path  # SM120PATCH_STATE_DIR the image build used
    build_log: Path

    @property
    def site_packages(self) -> Path:
        return next((self.python.parent.parent / "lib").glob("python3*/site-packages"))

    def tool(
        self, *args: str, state: Path | None = None, check: bool = False
    ) -> subprocess.CompletedProcess:
        """The venv's `python -m sm120patch ARGS` (state: the test's, unless given)."""
        env = dict(os.environ)
        if state is not None:
            env["SM120PATCH_STATE_DIR"] = str(state)
        return subprocess.run(
            [str(self.python), "-m", "sm120patch", *args],
            env=env,
            # Not the checkout: `-m` puts the working directory first on sys.path, where this
            # repository's sm120patch/ would shadow the venv's installed wheel.
            cwd=self.root,
            capture_output=True,
            text=True,
            check=check,
        )

    def image_env(self) -> dict[str, str]:
        """What a process started in the image sees: its ENV, its Python first on PATH."""
        return {
            **os.environ,
            "PATH": f"{self.python.parent}{os.pathsep}{os.environ['PATH']}",
            "SM120PATCH_STATE_DIR": str(self.image_state),
            **self.image.env,
        }


def _need_ansible() -> None:
    if (
        importlib.util.find_spec("ansible") is None
        or not Path(ansible_bin("ansible-playbook")).exists()
    ):
        pytest.skip("ansible-core is not installed here (pip install -e '.[test]' brings it)")


def _wheel(kind: str, version: str) -> Path:
    if dists.cached(kind, version) is None and not releases.pypi_reachable():
        pytest.skip(
            f"{kind} {version} is not in the release cache {releases.dist_dir()} and PyPI is "
            "unreachable; the fleet tier installs it"
        )
    return dists.fetch(kind, version)


def _run(argv: list[str], log: Path, **kw) -> None:
    with log.open("a", encoding="utf-8") as fh:
        fh.write(f"\n$ {' '.join(argv)}\n")
        fh.flush()
        started = time.monotonic()
        proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, **kw)
        fh.write(f"({time.monotonic() - started:.1f} s)\n")
    if proc.returncode != 0:
        raise AssertionError(f"{argv} exited {proc.returncode}:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    _need_ansible()
    wheels = {"sglang": _wheel("sglang", SGLANG), "flashinfer": _wheel("flashinfer", FLASHINFER)}
    root = tmp_path_factory.mktemp("fleet")
    log = root / "build.log"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]

    pristine = root / "pristine"
    _run(
        [
            *pip,
            "install",
            "--no-deps",
            "--no-compile",
            "--target",
            str(pristine),
            *map(str, wheels.values()),
        ],
        log,
    )

    # The lock, made on the reference box (here: the pristine packages) by this checkout.
    lock_dir = root / "lock"
    lock_dir.mkdir()
    lock = lock_dir / "sm120patch.lock"
    _run(
        [
            sys.executable,
            "-m",
            "sm120patch",
            "pin",
            IMAGE_PROFILE,
            "--sglang",
            str(pristine),
            "--flashinfer",
            str(pristine),
            "-o",
            str(lock),
        ],
        log,
        env={**os.environ, "SM120PATCH_STATE_DIR": str(root / "pin-state")},
    )

    # The image: a fresh venv stands in for the base image's Python; the Containerfile's steps
    # run with its paths moved under `root` and the releases taken from the cache.
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], log)
    context = build_context(root / "context")
    shutil.copy2(lock, context / "sm120patch.lock")
    image_state = root / "image-state"
    image = run_containerfile(
        EXAMPLES / "Containerfile",
        context,
        build_args={
            "SGLANG": str(wheels["sglang"]),
            "FLASHINFER": str(wheels["flashinfer"]),
            "PIP_FLAGS": "--no-deps --no-compile",
            "SRC": str(root / "image" / "src"),
            "PREFIX": str(root / "image" / "opt"),
        },
        run_env={
            **os.environ,
            "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "VIRTUAL_ENV": str(venv),
            "SM120PATCH_STATE_DIR": str(image_state),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        },
        log=log,
    )

    collections = root / "collections"
    _run(
        [
            ansible_bin("ansible-galaxy"),
            "collection",
            "install",
            str(COLLECTION),
            "-p",
            str(collections),
        ],
        log,
        env={**os.environ, "ANSIBLE_HOME": str(root / "ansible-home")},
    )
    return Fleet(
        root=root,
        python=venv / "bin" / "python",
        pristine=pristine,
        collections=collections,
        wheels=wheels,
        lock=lock,
        image=image,
        image_state=image_state,
        build_log=log,
    )


@pytest.fixture
def site(fleet: Fleet, tmp_path: Path) -> Path:
    """A private copy of the pristine SGLang + FlashInfer site-packages for one test."""
    dest = tmp_path / "site-packages"
    shutil.copytree(fleet.pristine, dest, symlinks=True)
    return dest
