"""vLLM's release cache (maintain/sources.py): the .py files and dist-info of a wheel, read by
HTTP range requests where the server answers them, never the wheel. A fixture wheel we build,
served from memory through httpx's mock transport."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import zipfile
from pathlib import Path

import httpx
import pytest

from sm120patch.maintain import dists, releases, sources
from sm120patch.maintain.index import make_file
from sm120patch.maintain.trees import tree_problem

VERSION = "0.34.0"
WHEEL = f"vllm-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
KERNEL = os.urandom(3 << 20)  # incompressible, as compiled kernels are; never fetched


def wheel_bytes(*, tamper: str | None = None) -> bytes:
    """A vLLM-shaped wheel: sources around a large kernel, a dist-info whose RECORD lists each
    file's sha256; `tamper` names a member whose bytes differ from what RECORD says."""
    files = {
        "vllm/__init__.py": b"from vllm.version import __version__\n",
        "vllm/_C.abi3.so": KERNEL,
        "vllm/platforms/cuda.py": b"def gate(p):\n    return p.is_device_capability(100)\n",
        "vllm/version.py": f'__version__ = "{VERSION}"\n'.encode(),
        f"vllm-{VERSION}.dist-info/METADATA": f"Name: vllm\nVersion: {VERSION}\n".encode(),
    }
    rows = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{name},sha256={digest},{len(data)}")
    files[f"vllm-{VERSION}.dist-info/RECORD"] = ("\n".join(rows) + "\n").encode()
    if tamper:
        files[tamper] += b"# not as released\n"
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return out.getvalue()


class Server:
    """The index's file host: answers `Range` (or, with `ranges=False`, sends the whole file)
    and counts the bytes it sent."""

    def __init__(self, data: bytes, *, ranges: bool = True) -> None:
        self.data, self.ranges, self.sent = data, ranges, 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        spec = request.headers.get("range", "")
        if not self.ranges or not spec.startswith("bytes="):
            self.sent += len(self.data)
            return httpx.Response(200, content=self.data)
        first, _, last = spec.removeprefix("bytes=").partition("-")
        size = len(self.data)
        start, end = (size - int(last), size) if not first else (int(first), int(last) + 1)
        start = max(start, 0)
        self.sent += end - start
        return httpx.Response(206, content=self.data[start:end],
                              headers={"Content-Range": f"bytes {start}-{end - 1}/{size}"})


@pytest.fixture
def serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("SM120PATCH_CACHE", str(cache))
    url = f"https://files.example/{WHEEL}"
    entry = make_file("vllm", WHEEL, url, None, False)
    monkeypatch.setattr(sources, "_listed_files", lambda kind, version: [entry])
    real_client = httpx.Client

    def start(server: Server) -> Server:
        monkeypatch.setattr(httpx, "Client", lambda **kw: real_client(
            transport=httpx.MockTransport(server), **{k: v for k, v in kw.items()
                                                      if k != "verify"}))
        return server

    return start


def test_a_ranged_read_keeps_the_sources_and_fetches_no_kernel(serve):
    data = wheel_bytes()
    server = serve(Server(data))
    root = sources.tree("vllm", VERSION)
    kept = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert kept == [".sm120patch-tree.json", "vllm-0.34.0.dist-info/METADATA",
                    "vllm-0.34.0.dist-info/RECORD", "vllm/__init__.py",
                    "vllm/platforms/cuda.py", "vllm/version.py"]  # fmt: skip
    assert server.sent < len(KERNEL) // 2, "the kernel's bytes were fetched"
    assert tree_problem(root) is None
    assert not list(releases.cache_dir().rglob("*.whl"))
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert (root / "vllm/platforms/cuda.py").read_bytes() == zf.read("vllm/platforms/cuda.py")
    assert dict(sources.package_files("vllm", VERSION))["vllm/version.py"].startswith(b"__ver")


def test_without_ranges_the_whole_wheel_is_checked_and_deleted(serve, monkeypatch, tmp_path):
    data = wheel_bytes()
    serve(Server(data, ranges=False))
    fetched: list[Path] = []

    def download(entry, staging: Path) -> Path:  # the URL download: the index's sha256 checked
        (staging / entry.filename).write_bytes(data)
        fetched.append(staging / entry.filename)
        return staging / entry.filename

    monkeypatch.setattr(dists, "_download_url", download)
    root = sources.tree("vllm", VERSION)
    assert (root / "vllm/__init__.py").is_file() and not (root / "vllm/_C.abi3.so").exists()
    assert fetched and not fetched[0].exists(), "the wheel was kept"
    assert not list(releases.cache_dir().rglob("*.whl"))


@pytest.mark.parametrize("tamper", ["vllm/platforms/cuda.py", f"vllm-{VERSION}.dist-info/METADATA"])
def test_a_file_that_is_not_its_records_refuses_the_release(serve, tamper):
    serve(Server(wheel_bytes(tamper=tamper)))
    with pytest.raises(releases.ReleaseError, match="differs from RECORD"):
        sources.tree("vllm", VERSION)
    assert not (releases.trees_dir() / f"vllm-{VERSION}").exists()


def test_a_member_whose_crc_does_not_match_refuses_the_release(serve):
    data = bytearray(wheel_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as zf:
        info = zf.getinfo("vllm/platforms/cuda.py")
    # The CRC32 of the central directory (what zipfile checks a member's bytes against).
    at = data.rindex(b"vllm/platforms/cuda.py") - 46 + 16
    data[at : at + 4] = (info.CRC ^ 1).to_bytes(4, "little")
    serve(Server(bytes(data)))
    with pytest.raises(releases.ReleaseError, match="CRC"):
        sources.tree("vllm", VERSION)


def test_the_release_cache_never_fetches_a_vllm_wheel():
    with pytest.raises(releases.ReleaseError, match="not cached"):
        dists.fetch("vllm", VERSION)
