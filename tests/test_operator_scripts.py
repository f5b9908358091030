"""The operator's first ten minutes, as scripts and shells meet them: `next:` lines that paste
(quoted, the user's paths and flags), a reader's dry run, `status --check`, a closed pipe,
Ctrl-C from the first millisecond, JSON keys shared across commands, `pin -o` over a file."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from attackers import PYTHON, Attacker, _retry
from test_states import cli, tree_hash, where
from trees import make_tree

from sm120patch import render
from sm120patch.cmdline import tree

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = Path(sys.executable).with_name("sm120patch")  # the console script of this venv


def next_commands(err: str) -> list[list[str]]:
    """Every `next:` line as the words a shell passes: a `next:` line is one command."""
    return [shlex.split(line[len("  next: ") :]) for line in err.splitlines()
            if line.startswith("  next: ")]  # fmt: skip


# ---- hints that paste --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["with space", "v$(touch pwned)", "it's", "semi;colon"])
def test_a_next_line_pastes_with_the_users_path_and_flags(tmp_path, name):
    """An apply refused because another profile is applied: both follow-ups, run through a
    real shell as pasted, do what they say, on the user's own tree, with --no-gpu-check kept;
    nothing in the path runs."""
    base = tmp_path / name
    sg = make_tree(base, "sglang", "0.5.8", "installed")
    fi = make_tree(base, "flashinfer", "0.6.8", "installed")
    assert cli("apply", "moe", *where(sg, fi), "--no-gpu-check")[0] == 0
    code, _, err = cli("apply", "fusion", *where(sg, fi), "--no-gpu-check")
    assert code == 1, err
    lines = [line for line in err.splitlines() if line.startswith("  next: ")]
    revert, again = next_commands(err)
    assert revert == ["sm120patch", "revert", "moe", *where(sg, fi)], err
    assert again == ["sm120patch", "apply", "fusion", *where(sg, fi), "--no-gpu-check"], err
    env = {**os.environ, "PATH": f"{SCRIPT.parent}{os.pathsep}{os.environ['PATH']}"}
    for line in lines:
        proc = subprocess.run(["sh", "-c", line[len("  next: ") :]], cwd=tmp_path, env=env,
                              capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 0, (line, proc.stderr)
    assert not (tmp_path / "pwned").exists()
    assert json.loads(cli("status", *where(sg, fi), "--json")[1])["targets"][0]["profile"] == "fusion"


def test_a_hint_is_commands_then_words_on_their_own_line():
    hint = "revert it first (`sm120patch revert moe`), then `sm120patch apply all`"
    completed = render.pasteable(hint, {"sglang": "/a b", "flashinfer": None}, (),
                                 ["apply", "all", "--no-gpu-check"])  # fmt: skip
    lines = render.hint_lines(completed)
    assert lines[:2] == ["  next: sm120patch revert moe --sglang '/a b'",
                         "  next: sm120patch apply all --sglang '/a b' --no-gpu-check"]  # fmt: skip
    assert lines[2].startswith("  revert it first (") and "next:" not in lines[2]
    assert render.hint_lines("wait for it to finish, then try again") == [
        "  wait for it to finish, then try again"
    ]  # words only: no `next:` line
    # a command to fill in is no command to paste
    assert render.hint_lines("`sm120patch trial show ID`") == ["  `sm120patch trial show ID`"]
    # the user's own command line, again, with a flag added
    again = render.pasteable("`sm120patch <again> --no-gpu-check`", {}, (),
                             ["apply", "moe", "--sglang", "/x y"])  # fmt: skip
    assert again == "`sm120patch apply moe --sglang '/x y' --no-gpu-check`"


def test_no_gpu_hint_is_the_users_command_again(tmp_path, mocker):
    from sm120patch.trial import gpu

    mocker.patch.object(gpu, "read_gpus", return_value=gpu.GpuInventory())
    sg = make_tree(tmp_path / "my env", "sglang", "0.5.8", "installed")
    code, _, err = cli("apply", "moe", "--sglang", str(sg))
    assert code == 1 and "no SM120 GPU" in err, err
    assert next_commands(err) == [["sm120patch", "apply", "moe", "--sglang", str(sg),
                                   "--no-gpu-check"]]  # fmt: skip
    assert "pass --no-gpu-check" not in err


def test_printed_text_escapes_bidi_and_separators():
    assert render.printable("ok \u202eexe.txt\u2066x\u2069 \u2028 \u2029 \u200b é") == (
        "ok \\u202eexe.txt\\u2066x\\u2069 \\u2028 \\u2029 \\u200b é"
    )
    assert render.printable("\x1b[2J") == "\\x1b[2J"


# ---- a reader's commands -----------------------------------------------------------------


@pytest.fixture(scope="module")
def reader():
    """Another local user, made for these tests (as test_attacks.py makes its attacker, under a
    name of its own so that both can run in one session); skipped where that needs root."""
    import shutil

    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("useradd", "userdel", "setpriv")):
        pytest.skip("a second user is made for the test: needs root, useradd and setpriv")
    import pwd

    name = f"sm120r{os.getpid() % 100000:05d}"
    _retry(["useradd", "-M", "-U", "-s", "/usr/sbin/nologin", "-d", "/", name])
    try:
        user = pwd.getpwnam(name)
        yield Attacker(name, user.pw_uid, user.pw_gid, name, user.pw_gid)
    finally:
        _retry(["userdel", name])


@pytest.fixture
def shared():
    """A directory every user can enter (pytest's own tmp_path is root's alone)."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="sm120read-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


_TOOL = ("import site, sys; site.addsitedir(sys.argv.pop(1)); from sm120patch.cli import run;"
         " sys.argv[0] = 'sm120patch'; run()")  # fmt: skip


def _command(user, python: str, code: str, *args: str) -> list[str]:
    """`code` run by `python` as `user` (another uid), with this venv's packages on its path."""
    site = sysconfig.get_paths()["purelib"]
    return ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups", "--",
            python, "-c", code, site, *args]  # fmt: skip


def _env(home: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "LC_ALL": "C"}


def readers_python(user) -> str:
    """The interpreter `user` can run the tool with: this venv's, else the system's with this
    venv's packages. Skips, saying why, where that uid can run neither or cannot read the
    checkout (a venv or a checkout under a home other users cannot enter, as /root often is)."""
    probe = "import site, sys; site.addsitedir(sys.argv.pop(1)); import sm120patch.cli"
    tried = []
    for python in dict.fromkeys((sys.executable, PYTHON)):
        proc = subprocess.run(_command(user, python, probe), capture_output=True, text=True,
                              cwd="/", env=_env(Path("/")))  # fmt: skip
        if proc.returncode == 0:
            return python
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        tried.append(f"{python}: {last}")
    pytest.skip(
        f"uid {user.uid} cannot run the tool from this checkout ({ROOT}) with this venv's "
        f"packages ({sysconfig.get_paths()['purelib']}): {'; '.join(tried)}. Put the checkout "
        "and the venv where other users may read them to run this test"
    )


def _as(user, *args: str, home: Path, python: str) -> subprocess.CompletedProcess[str]:
    """The tool run as `user` (another uid), from this venv's packages."""
    return subprocess.run(_command(user, python, _TOOL, *args), capture_output=True, text=True,
                          cwd="/", env=_env(home))  # fmt: skip


def test_a_reader_dry_runs_checks_and_reads_a_tree_it_cannot_write(reader, shared):
    """A root-owned environment another user may read but not write: the dry run prints the
    diff and says what the apply would refuse; status, doctor, list and show answer; the apply
    refuses naming the owner (no "as root (or root)"); nothing is written anywhere."""
    python = readers_python(reader)
    sg = make_tree(shared, "sglang", "0.5.8", "installed")
    for path in [shared, *shared.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    home = reader.give(shared / "home")
    before = tree_hash(sg)

    dry = _as(reader, "apply", "moe", "--dry-run", "--sglang", str(sg), "--no-gpu-check",
              home=home, python=python)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith("diff --git") or "+++ b/sglang/srt/server_args.py" in dry.stdout
    assert "the apply would refuse" in dry.stderr and "may not write" in dry.stderr, dry.stderr
    for args in (["status", "--check"], ["doctor"], ["list"], ["show", "moe"]):
        proc = _as(reader, *args, *(["--sglang", str(sg)] if args[0] in ("status", "doctor")
                                      else []), home=home, python=python)  # fmt: skip
        assert proc.returncode == 0, (args, proc.stderr)
    real = _as(reader, "apply", "moe", "--sglang", str(sg), "--no-gpu-check", home=home,
               python=python)
    assert real.returncode == 1 and "may not write" in real.stderr, real.stderr
    assert "(or root)" not in real.stderr
    assert tree_hash(sg) == before and not (sg / ".sm120patch").exists()


def test_a_read_only_filesystem_gets_its_own_message(tmp_path, mocker):
    """No user can write a read-only mount: the hint does not ask for one who can."""
    from sm120patch import errors

    class ReadOnly:
        f_flag = os.ST_RDONLY

    mocker.patch("os.statvfs", return_value=ReadOnly())
    refusal = errors.not_writable("cannot write in", tmp_path / "site", "permission denied")
    assert "mounted read-only" in refusal.message and "remount" in refusal.hint
    assert "as the owner" not in refusal.hint


# ---- status for scripts --------------------------------------------------------------------


def test_status_check_exit_codes(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    assert cli("status", "--check", "--sglang", str(sg))[0] == 0  # pristine: as recorded
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    code, out, _ = cli("status", "--check", "--sglang", str(sg), "--json")
    assert code == 0 and json.loads(out)["exit_code"] == 0
    server_args = sg / "sglang" / "srt" / "server_args.py"
    server_args.write_text(server_args.read_text() + "# an edit\n")
    assert cli("status", "--sglang", str(sg))[0] == 0  # without --check: a report, exit 0
    code, out, _ = cli("status", "--check", "--sglang", str(sg), "--json")
    assert code == 1 and json.loads(out)["targets"][0]["state"] == "drifted"
    server_args.unlink()
    assert cli("status", "--check", "--sglang", str(sg))[0] == 1  # missing
    state = sg / ".sm120patch" / "sglang"
    (state / "journal.json").write_text((state / "manifest.json").read_text())
    code, _, err = cli("status", "--check", "--sglang", str(sg))
    assert code in (1, 75), err  # a journal (here malformed, so refused: 1; an open one: 75)


def test_status_check_exit_75_when_unfinished():
    from sm120patch.engine.assess import State

    class Found:
        def __init__(self, state: State) -> None:
            self.state = state

    assert tree.status_exit([Found(State.APPLIED), Found(State.UNFINISHED)]) == 75  # type: ignore[list-item]
    assert tree.status_exit([Found(State.PRISTINE), Found(State.APPLIED)]) == 0  # type: ignore[list-item]
    assert tree.status_exit([Found(State.GONE)]) == 1  # type: ignore[list-item]
    assert tree.status_exit([]) == 1


def test_a_closed_pipe_ends_quietly_with_exit_0():
    """`sm120patch show all | head -1`: the reader leaves after one line; as git, no word."""
    with subprocess.Popen([str(SCRIPT), "show", "all"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.readline()
        proc.stdout.close()  # `| head -1`
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=60)
    assert code == 0 and err == "", (code, err)


# The console script's code, run as Python runs it, with a SIGINT `delay_ms` after it starts:
# timed from there, since no code of the tool's runs before. The window left is the
# interpreter's own start-up and the loading of sm120patch/__init__.py, whose first statements
# install the guard (a few milliseconds where no bytecode is cached, as in this test run).
_CTRL_C = """
import os, signal, sys
delay = float(sys.argv[1])
sys.argv = ["sm120patch", "doctor", "--sglang", sys.argv[2]]
__file__ = SCRIPT
code = compile(open(SCRIPT).read(), SCRIPT, "exec")
signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
signal.setitimer(signal.ITIMER_REAL, delay / 1000)
exec(code)
"""


@pytest.mark.parametrize("delay_ms", [10, 20, 30, 60, 120, 250])
def test_ctrl_c_at_any_moment_is_one_line_and_130(delay_ms, tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    code = f"SCRIPT = {str(SCRIPT)!r}\n{_CTRL_C}"
    proc = subprocess.run([sys.executable, "-c", code, str(delay_ms), str(sg)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    if proc.returncode == 0:
        pytest.skip(f"doctor finished within {delay_ms} ms")
    ours = [line for line in proc.stderr.splitlines()
            if line.strip().startswith("File ") and f"{os.sep}sm120patch{os.sep}" in line]  # fmt: skip
    if proc.returncode != 130 and not ours:
        # landed before the package's first statement ran (a loaded box, no bytecode cached)
        pytest.skip(f"the interrupt came before sm120patch's code ran: {proc.stderr[-200:]}")
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    [line] = proc.stderr.strip().splitlines()  # one line, which says the state
    assert line.startswith("sm120patch: interrupted (SIGINT)"), proc.stderr
    assert line.endswith("nothing was changed"), proc.stderr


# ---- JSON and overwriting ------------------------------------------------------------------


def test_show_json_and_shared_keys(tmp_path):
    code, out, _ = cli("show", "moe", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["name"] == "moe" and doc["patches"][0]["why"]
    assert any(k["outcome"] == "wrong-output" for k in doc["known"])
    listed = json.loads(cli("list", "--json")[1])["profiles"]
    [same] = [p for p in listed if p["name"] == "moe"]
    assert {k: doc[k] for k in same if k != "patches"} == {k: v for k, v in same.items()
                                                         if k != "patches"}  # fmt: skip
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    dry = json.loads(cli("apply", "moe", "--dry-run", "--json", "--sglang", str(sg))[1])
    assert (dry["action"], dry["changed"], dry["dry_run"]) == ("applied", True, True)
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    dry = json.loads(cli("apply", "moe", "--dry-run", "--json", "--sglang", str(sg))[1])
    assert (dry["action"], dry["changed"]) == ("nothing-to-do", False)
    undo = json.loads(cli("revert", "moe", "--dry-run", "--json", "--sglang", str(sg))[1])
    assert set(dry) >= {"action", "changed", "dry_run", "profile", "outcomes", "notes", "diff"}
    assert set(undo) >= {"action", "changed", "dry_run", "profile", "outcomes", "notes", "diff"}


def test_pin_over_an_existing_file_needs_force(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    lock = tmp_path / "my locks" / "fleet.lock"
    lock.parent.mkdir()
    lock.write_text("keep me\n")
    code, _, err = cli("pin", "moe", "--sglang", str(sg), "-o", str(lock))
    assert code == 2 and "exists" in err and lock.read_text() == "keep me\n", err
    [again] = next_commands(err)
    assert "--force" in again and str(lock) in again
    assert cli(*again[1:])[0] == 0
    assert lock.read_text().startswith(("#", "schema", "[")) and "keep me" not in lock.read_text()


# ---- --help ----------------------------------------------------------------------------------


def test_help_lists_the_commands_in_the_order_of_the_work_each_with_an_example():
    from sm120patch.cli import COMMANDS
    from sm120patch.render import HELP

    code, out, _ = cli("--help")
    listed = [line.split()[0] for line in out.split("Commands:")[1].splitlines() if line.strip()]
    assert listed[:8] == ["doctor", "apply", "status", "ensure", "revert", "recover", "pin",
                          "trial"]  # fmt: skip
    assert set(listed) == set(COMMANDS) == set(HELP)
    assert "..." not in out.split("Commands:")[1]  # no summary cut off
    for name in COMMANDS:
        code, text, _ = cli(name, "--help")
        assert code == 0 and f"Example: {HELP[name][1]}" in text, name


# ---- doctor ----------------------------------------------------------------------------------


def test_doctor_gives_one_verdict_per_profile_and_names_every_experimental_one(tmp_path, mocker):
    from sm120patch.plan import catalog
    from sm120patch.trial import gpu

    mocker.patch.object(gpu, "read_gpus", return_value=gpu.GpuInventory())
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.1", "installed")  # moe refuses it
    code, out, err = cli("doctor", *where(sg, fi))
    assert code == 0, err
    lines = out.splitlines()
    heads = [line for line in lines if line.startswith("profile ")]
    profiles = catalog.load().profiles
    assert [h.split()[1] for h in heads] == list(profiles)  # one verdict line each
    at = next(i for i, line in enumerate(lines) if line.startswith("profile moe "))
    assert "refused here: profile moe refuses FlashInfer 0.6.1" in lines[at], lines[at]
    # No planned rows under it: the next line but the flag beside the patch is the next verdict.
    after = [line for line in lines[at + 1 :] if not line.startswith("  upstream's flag")]
    assert after[0].startswith("profile "), after[0]
    summary = lines[-1]
    for p in profiles.values():
        if p.status == "refused":  # vllm-fp8-moe: no trial, a reason
            assert p.name in summary.split("Refused by design (")[1].split(")")[0], summary
        elif p.status != "recommended":
            assert p.name in summary.split("Experimental (")[1].split(")")[0], (p.name, summary)
