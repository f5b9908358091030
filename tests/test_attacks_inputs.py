"""Inputs a user names, or plants where root reads, built to hang, exhaust or trick the tool:
lock files, `--known` files, a working directory root runs a child in, deep trees and deep
expressions, `new-patch`'s names, the Ansible module's profile. Each is planted as the user
would (the attacking user of `tests/attackers.py` where the kernel decides what they may
write) and what is printed and on disk is asserted afterwards."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from attackers import attacker_fixture, shared_fixture  # noqa: F401 (fixtures)
from click.testing import CliRunner
from killing import cli, command
from test_attacks import one_line, users_site
from trees import make_tree, tree_hash

from sm120patch.cli import main


def proc(*args: str, cwd: str | None = None, timeout: float = 60):
    return subprocess.run(command(*args), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)  # fmt: skip


# ---- 5. files the user names -------------------------------------------------------------------
def test_a_hostile_lock_file_is_one_line_and_echoes_nothing(attacker, shared, tmp_path):
    """A FIFO (which hung `ensure --locked` at service start), a link to /dev/zero (MemoryError),
    TOML nested 10,000 deep (RecursionError), a link to a root-only TOML file (its values were
    echoed), an empty and a truncated lock, and a lock of a profile nothing defines: each is
    one line naming the lock, and a `next:` line is a command that runs when pasted."""
    site = make_tree(shared, "sglang", "0.5.8", "installed")
    genuine = tmp_path / "moe.lock"
    assert cli("pin", "moe", "--sglang", str(site), "-o", str(genuine))[0] == 0
    drop = attacker.give(shared / "drop")
    secret = tmp_path / "secret.toml"  # root's alone
    secret.write_text('schema = 2\nprofile = "s3cr3t-token"\n[versions]\nsglang = "s3cr3t-2"\n')
    secret.chmod(0o600)
    text = genuine.read_text()
    planted = {
        "fifo": None,
        "zero": None,
        "secret": None,
        "deep": "x = " + "[" * 10000 + "]" * 10000 + "\n",
        "empty": "",
        "truncated": text[: len(text) // 2],
        "unknown": text.replace('profile = "moe"', 'profile = "nope"'),
    }
    for name, data in planted.items():
        if data is not None:
            attacker.write(drop / name, data)
    attacker.ok("import os, sys\nos.mkfifo(sys.argv[1], 0o644)", str(drop / "fifo"))
    attacker.symlink(Path("/dev/zero"), drop / "zero")
    attacker.symlink(secret, drop / "secret")
    needles = {
        "fifo": "is a FIFO, not a regular file",
        "zero": "is a symbolic link; sm120patch reads no lock file through one",
        "secret": "is a symbolic link; sm120patch reads no lock file through one",
        "deep": "nests tables or arrays too deep to be a lock",
        "empty": "is empty",
        "truncated": "lock file",
        "unknown": "locks profile 'nope', which neither this sm120patch nor its packs define",
    }
    before = tree_hash(site)
    hints: set[str] = set()
    for name, needle in needles.items():
        lock = drop / name
        for verb in ("ensure", "apply"):
            done = proc(verb, "--locked", str(lock), "--sglang", str(site), "--no-gpu-check")
            err = done.stderr
            assert done.returncode in (1, 2) and needle in err and one_line(err), (name, err)
            assert f"lock file {lock}" in err and "s3cr3t" not in err, (name, err)
            assert "('schema')" not in err and "Error" not in err, (name, err)
            hints |= {line[len("  next: "):] for line in err.splitlines()
                      if line.startswith("  next: ")}  # fmt: skip
        assert tree_hash(site) == before
    # The truncated lock keeps its profile: the hint is a pin of it, to the lock's own path.
    assert any(h.startswith(f"sm120patch pin moe -o {drop / 'truncated'}") for h in hints), hints
    # Every `next:` pastes: run from elsewhere, none is a usage error (after the loop: the
    # pin a hint names writes the lock at its path).
    assert hints
    for hint in sorted(hints):
        words = shlex.split(hint)
        assert words[0] == "sm120patch" and len(words) >= 2, hint
        assert proc(*words[1:], cwd="/").returncode != 2, hint
    # --json: the same line as a document.
    done = proc("ensure", "--locked", str(drop / "deep"), "--sglang", str(site), "--json")
    doc = json.loads(done.stdout)
    assert doc["exit_code"] == 1 and "too deep" in doc["error"], done.stdout
    # A --known file is read the same way.
    done = proc("scan", "--sglang", str(site), "--known", str(drop / "fifo"))
    assert done.returncode == 1 and "--known file" in done.stderr and "FIFO" in done.stderr
    assert one_line(done.stderr), done.stderr


def test_an_exhausted_interpreter_is_one_line_at_the_boundary(monkeypatch, tmp_path):
    """A RecursionError or MemoryError no reader refused by name ends as one line, and as a
    JSON document with --json, never as an internal error."""
    from sm120patch.commands import tree

    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    for exc in (RecursionError, MemoryError):
        def boom(*args, exc=exc, **kwargs):
            raise exc()

        monkeypatch.setattr(tree, "status", boom)
        code, out, err = cli("status", "--sglang", str(site))
        assert code == 1 and exc.__name__ in err and one_line(err), err
        code, out, err = cli("status", "--sglang", str(site), "--json")
        assert code == 1 and json.loads(out)["exit_code"] == 1, out


# ---- 6. the children the tool starts ---------------------------------------------------------
PLANTED_PIP = "import sys\nopen(sys.argv[0] + '.ran', 'w').write('ran')\nprint('global.index-url=\"http://evil\"')\n"


@pytest.mark.parametrize("via", ["the working directory", "PYTHONPATH"])
def test_a_planted_pip_in_the_callers_directory_never_runs(via, attacker, shared, monkeypatch):
    """`matrix` asks pip for its index configuration and fetches with `pip download`: a
    `pip/__main__.py` the user planted where root stands (or on a PYTHONPATH root inherited)
    is not what runs; pip's own configuration (PIP_*, its config files) still is."""
    from sm120patch.maintain import dists, pipconfig

    here = attacker.give(shared / "work")
    attacker.write(here / "pip" / "__init__.py", "")
    attacker.write(here / "pip" / "__main__.py", PLANTED_PIP)
    if via == "PYTHONPATH":
        monkeypatch.setenv("PYTHONPATH", str(here))
    monkeypatch.chdir(here)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://mirror.example/simple")
    pipconfig.pip_index.cache_clear()
    try:
        found = pipconfig.pip_index()
    finally:
        pipconfig.pip_index.cache_clear()
    assert not (here / "pip" / "__main__.py.ran").exists()
    assert found.index_url != "http://evil" and "https://mirror.example/simple" in found.sources
    args = dists.pip_download_args("sglang", "0.5.8")
    assert args[1] == "-I", args


# ---- 8. deep trees and deep expressions --------------------------------------------------------
def deep_sum(n: int) -> str:
    return "+".join(["1"] * n)


def test_a_deep_tree_or_expression_is_a_note_in_scan_and_a_refusal_in_apply(attacker, shared):
    """The user's environment holds 1,200 nested directories (os.walk's recursion) and a module
    with an expression 3,000 deep under an arch gate (the parser's): scan reads on and notes
    the module; the same expression in a file a patch reads refuses the apply in one line."""
    site = users_site(shared, attacker)
    attacker.ok("import os, sys\nos.chdir(sys.argv[1])\nfor _ in range(1200):\n"
                "    os.mkdir('d')\n    os.chdir('d')\nopen('m.py', 'w').write('x = 1\\n')",
                str(site / "sglang" / "srt"))  # fmt: skip
    attacker.write(site / "sglang" / "srt" / "deep_expr.py",
                   f"def f():\n    if is_sm100_supported():\n        return {deep_sum(3000)}\n")  # fmt: skip
    try:
        done = proc("scan", "--sglang", str(site), timeout=300)
    finally:
        # Gone again, from the bottom up (this test's tree walks, and rmtree, recurse).
        attacker.ok("import os, sys\nos.chdir(sys.argv[1])\nfor _ in range(1200):\n    os.chdir('d')\n"
                    "os.unlink('m.py')\nfor _ in range(1200):\n    os.chdir('..')\n    os.rmdir('d')",
                    str(site / "sglang" / "srt"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "sglang/srt/deep_expr.py: nests too deep for Python to parse" in done.stdout, done.stdout
    args = site / "sglang" / "srt" / "server_args.py"
    attacker.write(args, args.read_text() + f"\n\ndef deep():\n    return {deep_sum(3000)}\n")
    before = tree_hash(site)
    for dry in ([], ["--dry-run"]):
        done = proc("apply", "moe", *dry, "--sglang", str(site), "--no-gpu-check")
        err = done.stderr[done.stderr.index("sm120patch: "):]  # the known outcomes first
        assert done.returncode == 1 and one_line(err), err
        assert "server_args.py::<module>: the file nests too deep for Python to parse" in err, err
    assert tree_hash(site) == before


# ---- 10. the Ansible module's profile ------------------------------------------------------------
@pytest.mark.parametrize("state", ["present", "absent"])
@pytest.mark.parametrize("profile", ["--force", "-h", " "])
def test_the_ansible_module_refuses_a_profile_that_reads_as_an_option(state, profile, monkeypatch):
    """`profile: --force` in a play would have run `sm120patch apply --force` (outside the
    pins); the task fails naming it, and no sm120patch command runs at all."""
    import importlib.util
    import sys

    path = (Path(__file__).resolve().parents[1] / "ansible_collections" / "sm120" / "sm120patch"
            / "plugins" / "modules" / "sm120patch.py")  # fmt: skip
    spec = importlib.util.spec_from_file_location("sm120patch_ansible_module", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ran: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: ran.append(argv))

    class Failed(Exception):
        pass

    class Fake:
        params = {"python": sys.executable, "sglang": "/srv/site", "flashinfer": None,
                  "vllm": None, "profile": profile, "lock": None, "lock_content": None,
                  "state": state, "force": False, "gpu_check": True}  # fmt: skip
        check_mode = False
        _diff = False
        failed: dict = {}

        def fail_json(self, **kw):
            self.failed.update(kw)
            raise Failed()

    fake = Fake()
    verb = module.present if state == "present" else module.absent
    with pytest.raises(Failed):
        verb(fake, module.Tool(fake))
    assert ran == [] and repr(profile) in fake.failed["msg"], (ran, fake.failed)
    assert "would read it as an option" in fake.failed["msg"]


# ---- 7. releases read by HTTP range requests -------------------------------------------------
def bomb_wheel(version: str) -> bytes:
    """A vLLM wheel, self-consistent (its RECORD lists every member), one of whose .py members
    inflates to 40 MiB from a few KiB: what a hostile mirror serves."""
    import base64
    import hashlib
    import io
    import zipfile

    from fakeindex import FILES

    members = {**FILES["vllm"], "vllm/bomb.py": "\n" * (40 << 20)}
    info = f"vllm-{version}.dist-info"
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    rows = [f"{rel},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
            for rel, text in members.items()]  # fmt: skip
    members[f"{info}/RECORD"] = "\n".join([*rows, f"{info}/RECORD,,"]) + "\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel, text in members.items():
            zf.writestr(rel, text)
    return buf.getvalue()


def test_a_ranged_read_says_the_index_sha256_was_not_checked_and_caps_what_it_keeps(
    tmp_path, monkeypatch
):
    """A mirror serves a forged vLLM wheel under the genuine sha256. Read by range requests
    (the whole wheel is never fetched) it is kept, and the tree's record and `matrix` say the
    index's sha256 was not checked; read whole, it is refused. A member inflating past the cap
    (a zip bomb) refuses the release in one line, never a MemoryError."""
    from fakeindex import FILES, pip_env, serve, wheel_bytes

    from sm120patch.maintain import pipconfig, releases, sources, trees

    def use(index_url: str, cache: Path) -> None:
        for key in [k for k in os.environ if k.startswith("PIP_")]:
            monkeypatch.delenv(key)
        for key, value in pip_env(index_url, cache).items():
            monkeypatch.setenv(key, value)
        pipconfig.pip_index.cache_clear()
        releases.listing.cache_clear()
        releases.index_reachable.cache_clear()

    rel = next(r for r in FILES["vllm"] if r.endswith(".py"))
    forged = wheel_bytes("vllm", "0.34.0", {**FILES["vllm"], rel: FILES["vllm"][rel] + "X = 1\n"})
    with serve(tmp_path / "ranged", ranges=True) as index:
        index.add("vllm", "0.34.0", serve_instead=forged)
        use(index.url, tmp_path / "c1")
        tree = sources.tree("vllm", "0.34.0")
        assert (tree / rel).read_text().endswith("X = 1\n")  # what a range read cannot tell
        record = trees.tree_record(tree)
        assert record["read"] == sources.RANGED and record["index_sha256"] is False
        done = CliRunner().invoke(main, ["matrix", "-j", "1", "-q", "--vllm", "==0.34.0", "--json"])
        row = json.loads(done.stdout)["rows"][0]
        assert "not the index's sha256 of the whole wheel" in row["unchecked"], done.output
        done = CliRunner().invoke(main, ["matrix", "-j", "1", "-q", "--vllm", "==0.34.0"])
        assert "vLLM 0.34.0: not verified against the index, read by HTTP range" in done.stdout
    with serve(tmp_path / "whole") as index:
        index.add("vllm", "0.34.0", serve_instead=forged)
        use(index.url, tmp_path / "c2")
        with pytest.raises(releases.ReleaseError, match="sha256"):
            sources.tree("vllm", "0.34.0")
    with serve(tmp_path / "bomb", ranges=True) as index:
        index.add("vllm", "0.35.0", serve_instead=bomb_wheel("0.35.0"))
        use(index.url, tmp_path / "c3")
        with pytest.raises(releases.ReleaseError, match="'vllm/bomb.py' inflates to 41943040"):
            sources.tree("vllm", "0.35.0")
    pipconfig.pip_index.cache_clear()
    releases.listing.cache_clear()
    releases.index_reachable.cache_clear()
