#!/usr/bin/python
# Copyright: sm120patch contributors
# Apache License 2.0 (see the sm120patch repository)
"""Ansible module: apply or revert an sm120patch profile or lock on the managed host.

It runs the sm120patch command line on the host with `--json` and reads what it prints; it never
patches anything itself, so the host's sm120patch (its preflight, journal, verification and
refusals) decides every change.
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sm120patch
short_description: Apply or revert sm120patch profiles and lock files on SGLang, FlashInfer and vLLM
version_added: "0.1.0"
description:
  - Runs the C(sm120patch) command line on the managed host (C(--json)), so the tool's own
    plan, preflight, journal and verification decide every change; the module never edits a
    file itself.
  - C(changed) is reported only when files changed. Check mode runs the tool's dry run
    (C(apply --dry-run), C(revert --dry-run)), whose preflight is the real command's, so a
    refusal fails in check mode too.
  - Diff mode returns the unified diff the tool would apply (C(git apply) accepts it) or, with
    O(state=absent), the diff of what the revert would write back.
  - A refusal (a site that moved, a lock made on another release, a patched file edited since
    the apply) fails the task with the tool's one-line message and its C(next) hint.
options:
  profile:
    description:
      - Profile to apply or revert (C(moe), C(fusion), C(all), C(pcie-allreduce), ...; a
        C(vllm-*) profile needs O(vllm)). C(sm120patch list) on the host names them all.
      - A value starting with C(-) fails the task (the tool would read it as an option).
      - Exclusive with O(lock) and O(lock_content).
    type: str
  lock:
    description:
      - Path on the managed host of a lock file written by C(sm120patch pin). The host gets
        exactly what the lock records or the task fails, changing nothing.
      - With O(state=absent), whatever sm120patch applied on the targets is reverted.
      - Exclusive with O(profile) and O(lock_content).
    type: path
  lock_content:
    description:
      - The text of a lock file, for a lock that is not on the host (yet), typically
        C(lookup('ansible.builtin.file', 'sm120patch.lock', rstrip=false)) on the controller.
        The module hands it to the tool as a file in its own temporary directory, removed
        when the task ends, and otherwise acts as with O(lock).
      - In check mode this is what lets a play predict a rollout whose copy of the lock has
        not been written yet (check mode copies nothing).
      - Exclusive with O(profile) and O(lock).
    type: str
  state:
    description: C(present) applies, C(absent) reverts.
    type: str
    choices: [present, absent]
    default: present
  sglang:
    description:
      - SGLang target (checkout root, package parent or site-packages).
      - Default, the SGLang installed for O(python).
    type: path
  flashinfer:
    description:
      - FlashInfer target (checkout root, package parent or site-packages).
      - Default, the FlashInfer installed for O(python).
    type: path
  vllm:
    description:
      - vLLM target (checkout root, package parent or site-packages), for the C(vllm-*)
        profiles and their locks.
      - vLLM is looked for only when named: no default.
    type: path
    version_added: "0.3.0"
  python:
    description:
      - Interpreter whose sm120patch runs (the C(sm120patch) script beside it, else
        C(PYTHON -m sm120patch) in C(/)) and whose installed SGLang and FlashInfer are the
        default targets, typically the serving virtual environment's.
      - Default, C(sm120patch) on the host's PATH, else the interpreter running this module.
    type: path
  force:
    description: Apply outside the profile's pins; on revert, discard edits made after the apply.
    type: bool
    default: false
  gpu_check:
    description:
      - Require an SM120 GPU on the host. Set to V(false) for image builds and CI.
    type: bool
    default: true
requirements:
  - sm120patch on the managed host (in the interpreter named by O(python) or on PATH)
author:
  - sm120patch contributors
notes:
  - Supports check mode and diff mode.
  - The tool runs with a clean environment (C(PATH) of the system directories, the user's
    C(HOME), the C locale) in C(/); nothing of the task's or the play's environment reaches
    it, so no C(SM120PATCH_PATCHES) pack, C(PYTHONPATH) module or other git is run by it.
  - A handler restarting the server, notified by this task, runs only when files changed.
"""

EXAMPLES = r"""
- name: Apply the fleet's lock to the serving environment
  sm120.sm120patch.sm120patch:
    lock: /etc/sm120patch.lock
    python: /opt/sglang/venv/bin/python
  notify: restart sglang

- name: Predict and apply the lock on the controller, before it is copied to the host
  sm120.sm120patch.sm120patch:
    lock_content: "{{ lookup('ansible.builtin.file', 'sm120patch.lock', rstrip=false) }}"
    python: /opt/sglang/venv/bin/python

- name: Apply a profile to a checkout, without the GPU check (CI)
  sm120.sm120patch.sm120patch:
    profile: moe
    sglang: /src/sglang
    gpu_check: false

- name: Revert
  sm120.sm120patch.sm120patch:
    profile: moe
    state: absent
    python: /opt/sglang/venv/bin/python

- name: Apply a vLLM profile to the vLLM of the serving environment
  sm120.sm120patch.sm120patch:
    profile: vllm-moe
    vllm: /opt/vllm/venv/lib/python3.12/site-packages
    python: /opt/vllm/venv/bin/python
  notify: restart vllm
"""

RETURN = r"""
action:
  description: >-
    What the tool did or, in check mode, would do: C(applied), C(nothing-to-do), C(reverted).
  returned: always
  type: str
profile:
  description: The profile applied or reverted (a lock's profile with O(lock)).
  returned: when known
  type: str
outcomes:
  description: One entry per site (patch, target, file, site, status, reason) from the tool.
  returned: always
  type: list
  elements: dict
targets:
  description: >-
    C(sm120patch status --json) per target after the task (in check mode, before; on a
    failure, as the refusal left them), without the trial history (C(sm120patch trial show)
    on the host has it).
  returned: always
  type: list
  elements: dict
state:
  description: >-
    The state of each target from C(status --json), by kind (C(pristine), C(applied),
    C(drifted), C(gone), C(replaced), C(missing), C(unfinished)).
  returned: always
  type: dict
notes:
  description: The tool's notes (for example that the profile is already applied).
  returned: always
  type: list
  elements: str
cmd:
  description: The sm120patch command lines run.
  returned: always
  type: list
  elements: list
next:
  description: On failure, the tool's hint on what to do.
  returned: failure
  type: str
"""

import json
import os
import sys

from ansible.module_utils.basic import AnsibleModule

# The tool's own prefixes on stderr: `sm120patch: <message>` then `  next: <hint>`.
ERROR_PREFIX = "sm120patch: "
NEXT_PREFIX = "next: "
# The tool runs with a clean environment: only what the task's parameters say reaches it, never
# the environment the module was started with (a play's `environment:`, the become user's
# shell, the controller's variables): `SM120PATCH_PATCHES` there would load a pack as code,
# `PYTHONPATH` a module, `PATH` another git.
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def clean_environment():
    """PATH, HOME and the C locale: what the tool needs, and nothing of the caller's."""
    import pwd

    try:
        home = pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        home = "/"
    return {"PATH": SAFE_PATH, "HOME": home, "LC_ALL": "C", "LANG": "C"}
NO_GPU_WARNING = "warning: no SM120 GPU here"


def _json_object(text):
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def tool_error(stdout, stderr, rc):
    """The tool's error as (message, hint): its JSON on stdout, else its lines on stderr.

    sm120patch prints `{"error", "next", "exit_code"}` on stdout with `--json`; older versions
    print `sm120patch: ...` and `  next: ...` on stderr. A message may span lines (a refusal
    shows the edit it would throw away), so everything up to the hint belongs to it.
    """
    doc = _json_object(stdout)
    if doc and doc.get("error"):
        return str(doc["error"]), str(doc.get("next") or "")
    message, hint, seen = [], "", False
    for line in stderr.splitlines():
        stripped = line.strip()
        if not seen and line.startswith(ERROR_PREFIX):
            seen = True
            message.append(line[len(ERROR_PREFIX) :])
        elif seen and stripped.startswith(NEXT_PREFIX):
            hint = stripped[len(NEXT_PREFIX) :]
            break
        elif seen:
            message.append(line)
    if not message:
        # Not the tool speaking (no sm120patch in that interpreter, a crash before its CLI).
        tail = (stderr.strip() or stdout.strip()).splitlines()[-1:] or ["no output"]
        return f"sm120patch exited {rc}: {tail[0]}", (
            "check that sm120patch is installed for the interpreter given as `python`"
        )
    return "\n".join(message), hint


class Tool:
    """The sm120patch command line on this host, run with --json."""

    def __init__(self, module):
        self.module = module
        self.params = module.params
        self.commands = []
        # The environment's own `sm120patch` script, beside its interpreter: `python -m
        # sm120patch` puts the working directory on sys.path before the package is imported (a
        # planted sm120patch/ there would run). `-m` only where no script is installed, and
        # then in "/" (below).
        python = self.params["python"]
        if python:
            script = os.path.join(os.path.dirname(python), "sm120patch")
            self.argv = [script] if os.access(script, os.X_OK) else [python, "-m", "sm120patch"]
        else:
            found = module.get_bin_path("sm120patch")
            self.argv = [found] if found else [sys.executable, "-m", "sm120patch"]

    def target_args(self):
        args = []
        for kind in ("sglang", "flashinfer", "vllm"):
            if self.params[kind]:
                args += [f"--{kind}", os.path.abspath(self.params[kind])]
        return args

    def call(self, *args):
        argv = [*self.argv, *args, *self.target_args(), "--json"]
        self.commands.append(argv)
        # A clean environment (`clean_environment`): LC_ALL=C keeps the tool's text (the stderr
        # form of errors) as the parser expects. cwd "/": `python -m` puts the working
        # directory first on sys.path, where a stray sglang/ or sm120patch/ directory would be
        # taken for the installed one.
        import subprocess

        try:
            proc = subprocess.run(
                argv,
                env=clean_environment(),
                cwd="/",
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                check=False,
            )
        except OSError as exc:
            self.module.fail_json(
                msg=f"cannot run {argv[0]}: {exc.strerror}",
                next="check that sm120patch is installed for the interpreter given as `python`",
                cmd=self.commands,
            )
        return argv, proc.returncode, proc.stdout, proc.stderr

    def run(self, *args, result=None):
        """Run one command; its JSON document, or fail the task with the tool's message."""
        argv, rc, stdout, stderr = self.call(*args)
        for line in stderr.splitlines():
            if line.startswith("warning: "):
                self.module.warn(line[len("warning: ") :])
        if rc != 0:
            message, hint = tool_error(stdout, stderr, rc)
            first = message.splitlines()[0]
            # What the targets are in when a command refuses (a drifted file, a journal left
            # open) is what the operator looks at next; a failing status adds nothing.
            seen = {}
            refused = _json_object(stdout)
            if refused and "outcomes" in refused:
                seen["outcomes"] = refused["outcomes"]  # a refused plan: which site and why
            if args[0] != "status":
                _, status_rc, status_out, _ = self.call("status")
                status = _json_object(status_out) if status_rc == 0 else None
                if status:
                    seen.update(self.states(status))
            self.module.fail_json(
                msg=f"{first} (next: {hint})" if hint else first,
                error=message,
                next=hint,
                rc=rc,
                stdout=stdout,
                stderr=stderr,
                **{**(result or {}), **seen, "cmd": self.commands},
            )
        try:
            return json.loads(stdout), stderr
        except ValueError:
            self.module.fail_json(
                msg=f"could not read the JSON of `{' '.join(argv)}`: {stdout[:200]!r}",
                next="check that the sm120patch on the host is the one this collection expects",
                rc=rc,
                stdout=stdout,
                stderr=stderr,
                cmd=self.commands,
            )

    @staticmethod
    def states(doc):
        # Each target's status without its trial records: every trial ever run on the host
        # would otherwise land in the task's result (and in a failure's output).
        found = [{k: v for k, v in t.items() if k != "trials"} for t in doc.get("targets", [])]
        return {"targets": found, "state": {t["kind"]: t.get("state") for t in found}}

    def status(self):
        doc, _ = self.run("status")
        seen = self.states(doc)
        return seen["targets"], seen["state"]

    def wanted(self):
        """The apply arguments for the profile or the lock."""
        if self.params["lock_content"] is not None:
            return ["--locked", self.lock_file()]
        if self.params["lock"]:
            return ["--locked", os.path.abspath(self.params["lock"])]
        return [checked_profile(self.module)]

    def lock_file(self):
        """`lock_content` as a file the tool reads, in the module's own temporary directory
        (private to the user running the module; Ansible removes it when the module exits)."""
        path = os.path.join(self.module.tmpdir, "sm120patch.lock")
        if not os.path.exists(path):
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(self.params["lock_content"])
        return path

    def apply_flags(self):
        flags = []
        if self.params["force"]:
            flags.append("--force")
        if not self.params["gpu_check"]:
            flags.append("--no-gpu-check")
        return flags


def report_changed(report):
    """Whether the command changed files: the report's own `changed` where the tool gives it
    (with target states, a `dropped` record writes nothing), else an apply or revert that
    lists the files it wrote."""
    if "changed" in report:
        return bool(report["changed"])
    return report.get("action") in ("applied", "reverted") and any(
        t.get("files") for t in report.get("targets", [])
    )


def checked_profile(module):
    """The `profile` parameter, refused when the tool would read it as an option: a value
    such as `--force` passed as PROFILE would turn a task's apply into a forced one."""
    profile = module.params["profile"]
    if profile is not None and (not profile.strip() or profile.startswith("-")):
        module.fail_json(
            msg=f"profile {profile!r} is not a profile name (sm120patch would read it as an "
            "option)",
            next="set profile to a name `sm120patch list` shows on the host, such as moe",
        )
    return profile


def present(module, tool):
    result = {}
    plan = None
    if module.check_mode or module._diff:
        plan, stderr = tool.run("apply", *tool.wanted(), "--dry-run", *tool.apply_flags())
        if module.check_mode and module.params["gpu_check"] and NO_GPU_WARNING in stderr:
            # The dry run only warns; the apply it predicts would refuse on this host.
            warning = next(line for line in stderr.splitlines() if NO_GPU_WARNING in line)
            module.fail_json(
                msg=warning[warning.index(NO_GPU_WARNING) + len("warning: ") :],
                next="run on a node with an SM120 GPU, or set gpu_check: false (image builds, CI)",
                cmd=tool.commands,
            )
        if plan.get("diff"):
            result["diff"] = {"prepared": plan["diff"]}
    if module.check_mode:
        found, states = tool.status()
        changed = bool(plan.get("diff"))
        result.update(
            changed=changed,
            action="applied" if changed else "nothing-to-do",
            profile=plan.get("profile"),
            outcomes=plan.get("outcomes", []),
            notes=[],
        )
    else:
        report, _ = tool.run("apply", *tool.wanted(), *tool.apply_flags(), result=result)
        found, states = tool.status()
        changed = report_changed(report)
        if not changed:
            result.pop("diff", None)
        result.update(
            changed=changed,
            action=report.get("action"),
            profile=report.get("profile"),
            outcomes=report.get("outcomes") or (plan or {}).get("outcomes", []),
            notes=report.get("notes", []),
        )
    result.update(targets=found, state=states, cmd=tool.commands)
    return result


def absent(module, tool):
    profile = checked_profile(module)
    args = ["revert", profile] if profile else ["revert", "--all"]
    if module.params["force"]:
        args.append("--force")
    result = {}
    preview = None
    if module.check_mode or module._diff:
        # The revert's own dry run: its preflight refuses as the revert would (a file edited
        # since the apply, another profile, a journal left open), and its diff is what the
        # revert writes back.
        preview, _ = tool.run(*args, "--dry-run")
        if preview.get("diff"):
            result["diff"] = {"prepared": preview["diff"]}
    # In check mode the dry run's report says what the revert would do; its `changed` is
    # false where the revert only drops a record (a patch already gone) or finds nothing.
    report = preview if module.check_mode else tool.run(*args, result=result)[0]
    found, states = tool.status()
    changed = report_changed(report)
    if not changed:
        result.pop("diff", None)
    result.update(
        changed=changed,
        action=report.get("action"),
        profile=report.get("profile") or profile,
        outcomes=report.get("outcomes", []),
        notes=report.get("notes", []),
        targets=found,
        state=states,
        cmd=tool.commands,
    )
    return result


def main():
    module = AnsibleModule(
        argument_spec=dict(
            profile=dict(type="str"),
            lock=dict(type="path"),
            lock_content=dict(type="str"),
            state=dict(type="str", choices=["present", "absent"], default="present"),
            sglang=dict(type="path"),
            flashinfer=dict(type="path"),
            vllm=dict(type="path"),
            python=dict(type="path"),
            force=dict(type="bool", default=False),
            gpu_check=dict(type="bool", default=True),
        ),
        mutually_exclusive=[("profile", "lock", "lock_content")],
        required_if=[("state", "present", ("profile", "lock", "lock_content"), True)],
        supports_check_mode=True,
    )
    checked_profile(module)
    tool = Tool(module)
    if module.params["state"] == "present":
        module.exit_json(**present(module, tool))
    module.exit_json(**absent(module, tool))


if __name__ == "__main__":
    main()
