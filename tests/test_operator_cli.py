"""The command line as an operator reads it: hints that paste (the command's own paths and
packs, no placeholder, and every refusal has one), usage errors under --json, malformed TOML
anywhere as one line naming the file, a pack's known outcomes, the smaller things (pins as a
range, the trial history in status, shell completion of profile names, coloured diffs)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from killing import command
from test_states import SERVER_ARGS, cli, where  # noqa: F401
from trees import make_tree, tree_hash

from sm120patch import patches, render
from sm120patch.cli import main
from sm120patch.plan import catalog


def hint_of(err: str) -> str:
    """What a refusal says to do: its `next:` lines and its words, after the message."""
    lines = err.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("sm120patch: "))
    rest = [line for line in lines[at + 1 :] if line.startswith("  ")]
    assert rest, err
    return "\n".join(rest)


def next_commands(err: str) -> list[list[str]]:
    """Each `next:` line of a refusal as the words a shell passes (without the name): a `next:`
    line is a command and nothing else."""
    out = []
    for line in err.splitlines():
        if line.startswith("  next: "):
            words = shlex.split(line[len("  next: ") :])
            assert words[0] == "sm120patch", line
            out.append(words[1:])
    return out


def commands_in(text: str) -> list[list[str]]:
    """Each `sm120patch ...` in a hint, as the words a shell would pass (without the name)."""
    out = []
    for part in text.split("`")[1::2]:
        words = shlex.split(part)
        if words and words[0] == "sm120patch":
            out.append(words[1:])
    return out


# ---- hints that paste --------------------------------------------------------------------


def test_the_undo_hint_names_the_checkout_and_undoes_it(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    pristine = tree_hash(sg)
    code, out, err = cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")
    assert code == 0, err
    [undo] = commands_in(out.splitlines()[-1])
    assert undo == ["revert", "moe", "--sglang", str(sg)]
    code, out, err = cli(*undo)
    assert code == 0 and "restored" in out, (out, err)
    assert tree_hash(sg) == pristine


def test_a_refusal_hint_repeats_paths_and_packs_and_does_what_it_says(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")  # moe wants 0.6.7 or later
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "profiles.toml").write_text("schema = 1\n")
    assert cli("apply", "moe", *where(sg, fi), "--no-gpu-check")[0] == 0
    code, _, err = cli("--patches", str(pack), "apply", "fusion", *where(sg, fi), "--no-gpu-check")
    assert code == 1
    first, then = next_commands(err)
    assert first == ["--patches", str(pack), "revert", "moe", *where(sg, fi)]
    # the user's --no-gpu-check is kept: the follow-up pastes as it is on this GPU-less box
    assert then == ["--patches", str(pack), "apply", "fusion", *where(sg, fi), "--no-gpu-check"]
    assert cli(*first)[0] == 0
    assert cli(*then)[0] == 0


def test_a_refused_plan_names_the_profile_not_a_placeholder(tmp_path):
    pack = tmp_path / "pack"
    code, _, err = cli("new-patch", "sglang.other-site", "--target", "sglang", "--file",
                       "sglang/srt/server_args.py", "--function", "_handle_model_specific_adjustments",
                       "--pins", ">=0.5.8", "--dir", str(pack))  # fmt: skip
    assert code == 0, err
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    code, _, err = cli("--patches", str(pack), "apply", "other-site", "--sglang", str(sg),
                       "--no-gpu-check")  # fmt: skip
    assert code == 1 and "PROFILE" not in err, err
    [dry] = next_commands(err)
    assert dry == ["--patches", str(pack), "apply", "other-site", "--dry-run", "--sglang", str(sg),
                   "--no-gpu-check"]  # fmt: skip
    assert cli(*dry)[0] == 1  # the same refusal, with every site shown


def test_pasteable_leaves_what_it_cannot_complete():
    paths = {"sglang": "/s p", "flashinfer": None}
    assert render.pasteable("`sm120patch list`", paths) == "`sm120patch list`"
    assert render.pasteable("`sm120patch status --sglang /x`", paths) == (
        "`sm120patch status --sglang /x`"
    )
    assert render.pasteable("`sm120patch trial moe -- python -m x`", paths) == (
        "`sm120patch trial moe --sglang '/s p' -- python -m x`"
    )
    assert render.pasteable("`git -C /x status`", paths) == "`git -C /x status`"
    # a verb named, not a command: left as it is
    assert (
        render.pasteable("a lock `sm120patch pin` wrote", paths) == "a lock `sm120patch pin` wrote"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["apply", "nosuch", "--dry-run"],
        ["apply", "moe", "--sglang", "/nowhere/at/all", "--dry-run"],
        ["revert"],
        ["apply", "--dry-run"],
        ["apply", "--locked", "/nowhere/x.lock", "--dry-run"],
        ["trial", "moe", "--no-gpu-check"],
        ["matrix", "--sglang", "<<1"],
    ],
    ids=lambda a: " ".join(a),
)
def test_no_refusal_without_next(args):
    code, out, err = cli(*args, "--json")
    assert code in (1, 2), (code, out, err)
    doc = json.loads(out)
    assert doc["next"], doc
    assert hint_of(err)


def test_a_usage_error_under_json_is_json_exit_2():
    for args in (["apply", "--bogus", "--json"], ["--json", "status"], ["status", "--json", "x"]):
        code, out, err = cli(*args)
        assert code == 2, (args, out, err)
        doc = json.loads(out)
        assert doc["exit_code"] == 2 and doc["error"] and "--help" in doc["next"], doc
    code, out, _ = cli("apply", "--bogus")
    assert code == 2 and out == ""  # without --json: click's text only, on stderr


def test_matrix_jobs_is_at_least_one():
    code, _, err = cli("matrix", "-j", "0")
    assert code == 2 and "0 is not in the range" in err


def test_recover_names_each_target_of_one_site_packages(tmp_path):
    sg = make_tree(tmp_path / "a", "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path / "b", "flashinfer", "0.6.8", "installed")
    shutil.copytree(fi, sg, dirs_exist_ok=True)  # both in one site-packages
    proc = subprocess.run(
        command("apply", "all", *where(sg, sg), "--no-gpu-check"),
        env={**os.environ, "SM120PATCH_KILL_AT": "after-write"},
        capture_output=True,
    )
    assert proc.returncode == -9
    code, out, err = cli("recover", *where(sg, sg))
    assert code == 0, err
    lines = [line for line in out.splitlines() if "interrupted apply" in line]
    assert len(set(lines)) == len(lines) >= 1, out
    assert all(line.startswith(("SGLang at ", "FlashInfer at ")) for line in lines), out


# ---- trial hints -------------------------------------------------------------------------


def test_a_silent_crash_says_it_printed_nothing(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    code, _, err = cli("trial", "moe", "--sglang", str(sg), "--no-gpu-check", "--",
                       sys.executable, "-c", "raise SystemExit(4)")  # fmt: skip
    assert code == 3
    hint = hint_of(err)
    assert "printed nothing" in hint and "above" not in hint, hint


def test_a_crash_that_printed_points_at_the_record_and_the_log(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    log = tmp_path / "server.log"
    code, out, err = cli("trial", "moe", "--sglang", str(sg), "--no-gpu-check", "--log",
                         str(log), "--json", "--", sys.executable, "-c",
                         "print('loading'); raise SystemExit(4)")  # fmt: skip
    assert code == 3
    record = json.loads(out)
    hint = record["next"]
    assert f"sm120patch trial show {record['id']} --sglang {sg}" in hint, hint
    assert str(log) in hint


# ---- TOML anywhere -----------------------------------------------------------------------


def test_a_packs_malformed_profiles_toml_is_one_line_naming_the_file(tmp_path):
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "profiles.toml").write_text("schema = [\n")
    code, _, err = cli("--patches", str(pack), "list")
    assert code == 2 and "internal error" not in err, err
    assert f"{pack / 'profiles.toml'} is not valid TOML" in err.splitlines()[0]


@pytest.fixture
def library_copy(tmp_path, monkeypatch):
    """The built-in library read from a copy (to break one of its files)."""
    copy = tmp_path / "library"
    shutil.copytree(Path(patches.__file__).parent, copy,
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    monkeypatch.setattr(patches, "__file__", str(copy / "__init__.py"))
    monkeypatch.setattr(patches, "__path__", [str(copy)])
    catalog._load.cache_clear()
    yield copy
    catalog._load.cache_clear()


@pytest.mark.parametrize("name", ["profiles.toml", "known.toml"])
def test_a_broken_built_in_toml_is_one_line_naming_the_file(library_copy, name, tmp_path):
    (library_copy / name).write_text((library_copy / name).read_text() + "\n[[broken\n")
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    code, _, err = cli("doctor", "--sglang", str(sg))
    assert code == 2, err
    lines = err.splitlines()
    assert f"{library_copy / name} is not valid TOML" in lines[0], err
    assert "reinstall sm120patch" in hint_of(err)


def test_a_broken_signatures_toml_names_the_file(library_copy):
    from sm120patch.errors import UsageError
    from sm120patch.trial import serve

    (library_copy / "signatures.toml").write_text("[[signature]\n")
    with pytest.raises(UsageError, match="signatures.toml is not valid TOML"):
        serve.signatures()


def test_a_packs_known_toml_is_read(tmp_path):
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "profiles.toml").write_text("schema = 1\n")
    (pack / "known.toml").write_text(
        'schema = 1\n[[outcome]]\nid = "ours"\nprofile = "moe"\noutcome = "faster"\n'
        'figure = "our own +4% on the lab box"\ndate = "2026-11"\nsource = "lab notes"\n'
        'evidence = "measured"\n'
    )
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    code, out, err = cli("--patches", str(pack), "doctor", "--sglang", str(sg), "--verbose")
    assert code == 0, err
    assert "known: moe faster" in out and "our own +4% on the lab box" in out
    (pack / "known.toml").write_text('[[outcome]]\nid = "x"\n')
    code, _, err = cli("--patches", str(pack), "doctor", "--sglang", str(sg))
    assert code == 2 and f"{pack / 'known.toml'} entry x: missing" in err, err


# ---- the smaller ones --------------------------------------------------------------------


def test_list_prints_pins_as_a_range():
    code, out, _ = cli("list")
    assert code == 0
    assert "pins: sglang >=0.5.8,<0.5.24" in out and "<0.5.24,>=" not in out


def test_list_says_which_releases_a_profile_refuses():
    code, out, _ = cli("list")
    assert code == 0
    blocks = {b.split()[0]: b for b in out.split("\n") if b and not b.startswith(" ")}
    assert blocks.keys() >= {"moe", "all", "fusion"}
    lines = out.splitlines()
    after = {name: lines[lines.index(block) + 2] for name, block in blocks.items()}
    assert after["moe"].strip() == "refuses (unless --force): flashinfer <0.6.7"
    assert after["all"].strip() == "refuses (unless --force): flashinfer <0.6.7"
    assert "refuses" not in after["fusion"]
    code, out, _ = cli("list", "--json")
    doc = {p["name"]: p for p in json.loads(out)["profiles"]}
    [moe] = doc["moe"]["refuses"]
    assert moe["kind"] == "flashinfer" and moe["releases"] == "<0.6.7"
    assert "issues/2723" in moe["reason"] and doc["fusion"]["refuses"] == []


def test_status_shows_the_last_trials_and_says_how_many_more(tmp_path):
    from sm120patch.engine import trials
    from sm120patch.engine.trialrecord import TrialRecord

    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    for n in range(8):
        record = {"id": f"t{n}", "profile": "moe", "verdict": "crashed", "exit_code": 1,
                  "command": ["x"]}  # fmt: skip
        trials.record_trial({"sglang": sg}, "moe", TrialRecord.from_json(record))
    code, out, _ = cli("status", "--sglang", str(sg))
    assert code == 0
    assert "trial t5 " in out and "trial t7 " in out and "trial t4 " not in out
    assert "... and 5 earlier trial(s): `sm120patch trial show ID --sglang " in out
    assert f"`sm120patch trial show ID --sglang {sg}`" in out  # pastes with the target


def test_shell_completion_offers_profile_names_packs_included(tmp_path):
    pack = tmp_path / "pack"
    assert cli("new-patch", "sglang.lab-site", "--target", "sglang", "--file", "sglang/x.py",
               "--function", "f", "--pins", ">=0.5.8", "--dir", str(pack))[0] == 0  # fmt: skip

    def complete(words: str) -> list[str]:
        result = CliRunner().invoke(main, [], prog_name="sm120patch", env={
            "_SM120PATCH_COMPLETE": "bash_complete", "COMP_WORDS": words,
            "COMP_CWORD": str(len(words.split(" ")) - 1)})  # fmt: skip
        return [line.split(",", 1)[1] for line in result.output.splitlines() if line]

    assert {"moe", "fusion", "all", "pcie-allreduce"} <= set(complete("sm120patch apply "))
    assert complete("sm120patch revert fu") == ["fusion"]
    assert "pcie-allreduce" in complete("sm120patch trial p")
    assert "lab-site" in complete(f"sm120patch --patches {pack} apply l")


def test_diffs_are_coloured_on_a_terminal_only(tmp_path, monkeypatch):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    args = ["apply", "moe", "--sglang", str(sg), "--dry-run"]
    plain = cli(*args)[1]  # not a terminal
    assert "\x1b[" not in plain and "\n+" in plain
    monkeypatch.setattr(render, "colour_wanted", lambda: True)
    coloured = CliRunner().invoke(main, args).stdout
    assert "\x1b[32m+" in coloured and "\x1b[1mdiff --git" in coloured, coloured[:300]
    monkeypatch.undo()

    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(render.sys, "stdout", Terminal())
    assert render.colour_wanted()
    monkeypatch.setenv("NO_COLOR", "1")
    assert not render.colour_wanted()


def test_export_works_on_the_reference_box_as_it_is(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    assert cli("apply", "moe", "--sglang", str(sg), "--no-gpu-check")[0] == 0
    code, out, err = cli("export", "moe", "--sglang", str(sg), "-o", str(tmp_path / "series"))
    assert code == 0, err
    mails = sorted((tmp_path / "series" / "sglang").glob("*.patch"))
    assert mails and any(f"+++ b/python/{SERVER_ARGS}" in m.read_text() for m in mails)


def test_a_dry_run_under_json_still_warns_of_no_sm120_gpu(tmp_path):
    """The Ansible module's check mode reads this warning to fail as the apply would."""
    from sm120patch.trial import gpu

    if gpu.read_gpus().has_sm120:
        pytest.skip("this machine has an SM120 GPU")
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    code, out, err = cli("apply", "moe", "--sglang", str(sg), "--dry-run", "--json")
    assert code == 0, err
    assert json.loads(out)["gpu"]["has_sm120"] is False
    assert "warning: no SM120 GPU here" in err


def test_a_trial_records_terminal_escapes_are_shown_not_obeyed(tmp_path):
    """A trial record is read from the state directory: a message or a command word holding a
    terminal escape (here: clear the screen, a carriage return that would rewrite the line)
    prints as `\\xNN`, in `status` and in a refusal's line alike."""
    from sm120patch.engine import trials
    from sm120patch.engine.trialrecord import TrialRecord

    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    record = {"id": "t1", "profile": "moe", "verdict": "crashed", "exit_code": 1,
              "command": ["serve\x1b[2J"], "message": "boom\rall fine"}  # fmt: skip
    trials.record_trial({"sglang": sg}, "moe", TrialRecord.from_json(record))
    code, out, _ = cli("status", "--sglang", str(sg))
    assert code == 0
    assert "\x1b" not in out and "\r" not in out
    assert "serve\\x1b[2J" in out
    code, _, err = cli("apply", "moe", "--sglang", str(tmp_path / "no\x1b]0;title\x07where"))
    assert code == 2 and "\x1b" not in err and "\x07" not in err and "\\x1b]0;title\\x07" in err
    code, out, _ = cli("apply", "moe", "--sglang", str(tmp_path / "x\x1b"), "--json")
    assert json.loads(out)["error"]  # the JSON document stays JSON (its own escaping)


def test_each_known_line_is_printed_once_per_command(tmp_path, mocker):
    """40.6: `doctor` and `apply` print each known line once, however many entries say the
    same thing (two sources of one verdict are one line; `show` and --verbose list both)."""
    from sm120patch.trial import gpu

    mocker.patch.object(gpu, "read_gpus", return_value=gpu.GpuInventory())
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    fi = make_tree(tmp_path, "flashinfer", "0.6.8", "installed")
    paths = ("--sglang", str(sg), "--flashinfer", str(fi))
    code, out, err = cli("doctor", *paths)
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("known: ")]
    assert len(lines) > 5 and len(lines) == len(set(lines)), out
    code, out, err = cli("apply", "all", "--dry-run", *paths, "--no-gpu-check")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("known: ")]
    assert lines and len(lines) == len(set(lines)), err
    # An entry repeated word for word in a pack is still one line.
    from sm120patch.plan import known

    e = next(e for e in known.entries() if e.id == "fusion-tp2-sm120-sglang-dsv4")
    twice = [e, e]
    mocker.patch.object(known, "entries", return_value=twice)
    assert known.lines("fusion", known.Box()) == [e.line()]


def test_show_and_doctor_name_upstreams_flag_beside_the_patch(tmp_path, mocker):
    """39.8: where upstream has a flag or variable for one launch, `show` and `doctor` name it
    and say why the patch still helps (SM120 only, every launch, a fleet's fixed commands)."""
    from sm120patch.trial import gpu

    cat = catalog.load()
    flagged = {name: p for name, p in cat.profiles.items() if p.flag}
    assert {"moe", "fusion", "pcie-allreduce", "vllm-moe"} <= set(flagged)
    assert flagged["moe"].flag == "--moe-runner-backend flashinfer_cutlass"
    assert flagged["vllm-moe"].flag == "--moe-backend flashinfer_b12x"
    for name, p in flagged.items():
        assert p.flag_why and p.flag_release.split()[0] in p.targets, name
    code, out, _ = cli("show", "moe")
    assert code == 0
    # The flag's paragraph, wrapped at the page's width: from its first line to the blank after.
    (para,) = [p for p in out.split("\n\n") if p.startswith("upstream's flag")]
    line = " ".join(para.split())
    assert "--moe-runner-backend flashinfer_cutlass (read in sglang 0.5.23)" in line
    assert "SM120 alone" in line and "every launch" in line and "cannot edit" in line
    code, out, _ = cli("show", "moe", "--json")
    assert json.loads(out)["flag"]["flag"] == "--moe-runner-backend flashinfer_cutlass"
    code, out, _ = cli("show", "fp4-gemm")
    assert "upstream's flag" not in out  # no flag of the same effect: none named
    mocker.patch.object(gpu, "read_gpus", return_value=gpu.GpuInventory())
    sg = make_tree(tmp_path, "sglang", "0.5.8", "git")
    code, out, err = cli("doctor", "--sglang", str(sg))
    assert code == 0, err
    moe = out.split("profile moe ")[1].split("\nprofile ")[0]
    assert "upstream's flag for one launch: --moe-runner-backend flashinfer_cutlass" in moe
