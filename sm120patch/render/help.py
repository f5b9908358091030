"""`sm120patch --help`: the commands in the order of the work, each with a summary that fits on
its line and an example in its own help."""

from __future__ import annotations

# In the order of the work, which is the order `sm120patch --help` lists them in
# (render.Group.list_commands).
HELP = {
    "doctor": ("What this box has and what each profile would do", "sm120patch doctor"),
    "apply": ("Apply a profile (--dry-run: the diff, nothing written)",
              "sm120patch apply moe --dry-run"),
    "status": ("Each target's state, from the bytes on disk (--check)",
               "sm120patch status --check"),
    "ensure": ("At service start: exactly as wanted, or exit 1",
               "sm120patch ensure --locked /etc/sm120patch.lock"),
    "revert": ("Put every touched file back, byte for byte", "sm120patch revert moe"),
    "recover": ("Finish an interrupted apply or revert", "sm120patch recover"),
    "pin": ("Write a lock file of the profile as applied here",
            "sm120patch pin moe -o /etc/sm120patch.lock"),
    "trial": ("Run a server under a profile; keep it only if it helps",
              "sm120patch trial moe --measure -- python -m sglang.launch_server ..."),
    "explain": ("What SGLang decides, pristine against patched",
                "sm120patch explain --simulate sm120 -- --model-path M --tp 4"),
    "list": ("The profiles, their pins and patches", "sm120patch list"),
    "show": ("One profile in full, its known outcomes included", "sm120patch show moe --json"),
    "export": ("Write the patches as mail files (git am)", "sm120patch export moe -o patches/"),
    "scan": ("The arch gates that leave SM120 out", "sm120patch scan --json"),
    "matrix": ("Plan every profile on every release (maintainers)",
               "sm120patch matrix --sglang '>=0.5.23'"),
    "new-patch": ("Start a patch in a pack of your own",
                  "sm120patch new-patch my.site --target sglang --file F --function FN --pins P"),
}  # fmt: skip
