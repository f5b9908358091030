"""The Ansible example's systemd drop-in, rendered from the play's variables (no ansible-playbook
run: the template alone, with Ansible's own `bool`), and the collection's version."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import jinja2
import pytest
import yaml

from sm120patch import __version__

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "examples" / "ansible" / "templates" / "sm120patch.conf.j2"
ROLLOUT = ROOT / "examples" / "ansible" / "rollout.yml"
GALAXY = ROOT / "ansible_collections" / "sm120" / "sm120patch" / "galaxy.yml"


def render(**variables: object) -> str:
    from ansible.module_utils.parsing.convert_bool import boolean

    env = jinja2.Environment(keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    env.filters["bool"] = boolean
    base = {"systemd_unit_dir": "/etc/systemd/system", "sglang_unit": "sglang.service"}
    return env.from_string(TEMPLATE.read_text()).render({**base, **variables})


def exec_start_pre(text: str) -> list[str]:
    """The words systemd passes (its quoting, for these words, is the shell's double quotes)."""
    [line] = [x for x in text.splitlines() if x.startswith("ExecStartPre=")]
    return shlex.split(line[len("ExecStartPre=") :])


def test_the_drop_in_is_built_from_non_default_variables():
    text = render(
        sm120patch_bin="/srv/my venv/bin/sm120patch",
        sm120patch_lock="/etc/fleet/$(id)/50%.lock",
        sm120patch_gpu_check="false",  # as an INI inventory gives it: a string
        sglang_tree="/src/sglang",
        flashinfer_tree="/src/flash infer",
        sglang_unit="llm.service",
    )
    assert "[Service]" in text and "llm.service" in text
    assert exec_start_pre(text) == [
        "/srv/my venv/bin/sm120patch", "ensure", "--locked", "/etc/fleet/$(id)/50%%.lock",
        "--no-gpu-check", "--sglang", "/src/sglang", "--flashinfer", "/src/flash infer",
    ]  # fmt: skip  (systemd reads `%%` as `%`)


@pytest.mark.parametrize("gpu_check", [True, "true", "yes"])
def test_the_default_drop_in_runs_the_environments_own_script(gpu_check):
    text = render(sm120patch_bin="/opt/sglang/venv/bin/sm120patch",
                  sm120patch_lock="/etc/sm120patch.lock", sm120patch_gpu_check=gpu_check)  # fmt: skip
    assert exec_start_pre(text) == [
        "/opt/sglang/venv/bin/sm120patch", "ensure", "--locked", "/etc/sm120patch.lock",
    ]  # fmt: skip


def test_the_rollout_templates_the_drop_in_with_the_script_beside_its_python():
    [play] = yaml.safe_load(ROLLOUT.read_text())
    assert play["vars"]["sm120patch_bin"] == "{{ sglang_python | dirname }}/sm120patch"
    sources = [t.get("ansible.builtin.template", {}).get("src", "") for t in play["tasks"]]
    assert any(s.endswith("templates/sm120patch.conf.j2") for s in sources), sources
    assert not any("sm120patch.conf\"" in str(t.get("ansible.builtin.copy")) for t in play["tasks"])


def test_the_collection_has_the_tools_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert yaml.safe_load(GALAXY.read_text())["version"] == project == __version__


def test_every_package_of_the_tool_ships():
    """pyproject lists the packages by name: one left out installs a tool that cannot start
    (a wheel without one of its packages fails at its first import)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])  # fmt: skip
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "sm120patch").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found <= listed, found - listed
