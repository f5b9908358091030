"""What reaches the terminal: what a refusal says to do (`next:` lines that paste, each
`sm120patch ...` completed with the user's own paths, packs and flags and every word
shell-quoted, and the words on their own line), text a terminal only shows (`printable`), the
notice of a deferred signal, and the process's end (`run_tool`)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import click

from sm120patch.errors import AGAIN, Refused


def error_doc(
    message: str, hint: str, exit_code: int, details: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """An error as `--json` prints it."""
    return {"error": message, "next": hint or None, "exit_code": exit_code, **(details or {})}


def json_asked(flag: bool, argv: Sequence[str]) -> bool:
    """--json given: its flag parsed, or in the words before `--` (a trial's command) when
    the command line failed to parse before the flag's callback ran."""
    return flag or "--json" in list(argv)[: ([*argv, "--"]).index("--")]


def exhausted(exc: RecursionError | MemoryError) -> Refused:
    """An input built to exhaust the interpreter (nested thousands deep, inflating to
    gigabytes) that no reader refused by name: one line, as any refusal, never an internal
    error."""
    why = (
        "nests deeper than Python can read"
        if isinstance(exc, RecursionError)
        else "needs more memory than this process has"
    )
    return Refused(
        f"stopped: an input of this command {why} ({type(exc).__name__})",
        "`sm120patch status` shows the state of the trees",
    )


def fallback_hint(exit_code: int, verb: str | None) -> str:
    """What to do after an error that brings no hint of its own."""
    if exit_code == 2:
        return f"see `sm120patch {verb} --help`" if verb else "see `sm120patch --help`"
    return "`sm120patch status` shows the state of the trees"


# The commands whose --sglang/--flashinfer name targets (matrix's name release specifiers).
TARGET_VERBS = frozenset(
    {
        "apply",
        "revert",
        "ensure",
        "status",
        "recover",
        "doctor",
        "pin",
        "export",
        "explain",
        "trial",
    }
)
# ...and those that are no command without an argument (`sm120patch pin` names the tool's verb)
NEED_ARGUMENT = frozenset({"apply", "revert", "ensure", "pin", "export", "trial"})
# The flags of the user's command that a follow-up command keeps, and the verbs that take them:
# a user who gave --no-gpu-check on a box without an SM120 GPU needs it on the next apply too.
KEPT_FLAGS = {"--no-gpu-check": frozenset({"apply", "ensure", "trial"})}
# Words that mark a command as a pattern to fill in, not one to paste (`trial show ID`).
_PLACEHOLDERS = re.compile(r"^(\.\.\.|[A-Z][A-Z_]+|<[^>]*>)$")
_COMMAND = re.compile(r"`sm120patch((?: [^`]*)?)`")
_SPAN = re.compile(r"`([^`]+)`")


def _given(argv: Sequence[str]) -> list[str]:
    """The user's own words before a trial's `--`."""
    words = list(argv)
    return words[: words.index("--")] if "--" in words else words


def absolute_paths(words: Sequence[str], path_options: frozenset[str]) -> list[str]:
    """`words` with the value of each option in `path_options` (`--vllm t/vllm`, `--locked=x`)
    made absolute: a hint pastes from any directory."""
    out: list[str] = []
    take = False
    for word in words:
        name, eq, value = word.partition("=")
        if take:
            out.append(os.path.abspath(word) if word and word != "-" else word)
        elif eq and name in path_options and value and value != "-":
            out.append(f"{name}={os.path.abspath(value)}")
        else:
            out.append(word)
        take = not take and word in path_options
    return out


def pasteable(
    text: str,
    paths: Mapping[str, str | None],
    packs: Sequence[str] = (),
    argv: Sequence[str] = (),
    path_options: frozenset[str] = frozenset(),
) -> str:
    """Every `sm120patch ...` in `text` as the user can paste it: each word shell-quoted, with
    the --patches of the command it follows, for a command on targets its --sglang/
    --flashinfer paths (made absolute) and the flags it keeps (KEPT_FLAGS) where the words do
    not name them already. `sm120patch <again> ...` is the user's own command line (`argv`)
    with the words after it added (before a trial's `--`), the values of its `path_options`
    made absolute."""
    import shlex

    def complete(match: re.Match[str]) -> str:
        try:
            words = shlex.split(match.group(1))
        except ValueError:  # an unbalanced quote: not a command to complete
            return match.group(0)
        if words[:1] == [AGAIN]:
            mine = list(argv)
            at = mine.index("--") if "--" in mine else len(mine)
            mine[:at] = absolute_paths(mine[:at], path_options)
            return "`" + shlex.join(["sm120patch", *mine[:at], *words[1:], *mine[at:]]) + "`"
        if not words or (len(words) == 1 and words[0] in NEED_ARGUMENT):
            return match.group(0)
        front = [w for d in packs for w in ("--patches", os.path.abspath(d))]
        if "--patches" in words:
            front = []
        extra = []
        if words[0] in TARGET_VERBS and "--help" not in words:
            for kind, path in paths.items():
                if path and f"--{kind}" not in words:
                    extra += [f"--{kind}", os.path.abspath(path)]
        given = _given(argv)
        for flag, verbs in KEPT_FLAGS.items():
            if flag in given and words[0] in verbs and flag not in words:
                extra.append(flag)
        if "--" in words:  # a trial's own options go before its command
            at = words.index("--")
            words = [*words[:at], *extra, *words[at:]]
        else:
            words = [*words, *extra]
        return "`" + shlex.join(["sm120patch", *front, *words]) + "`"

    return _COMMAND.sub(complete, text)


# What a hint's words mean beyond its commands (`run X first` says nothing X does not).
_FILLER = frozenset("run then first and or see with to it again , ; : . ( )".split())


def hint_lines(hint: str) -> list[str]:
    """A (completed) hint as printed: one `next:` line per command in it that pastes as it
    is, then the hint's words on a line of their own (indented, no `next:`) where they say
    more than the commands: a `next:` line is only ever a command."""
    commands = [
        c
        for c in _SPAN.findall(hint)
        if not any(_PLACEHOLDERS.match(w) for w in c.split())
        and c.split()[1:] not in ([v] for v in NEED_ARGUMENT)  # a mention: `sm120patch pin`
    ]
    rest = _SPAN.sub(" ", hint)
    for mark in ",;:.()":
        rest = rest.replace(mark, f" {mark} ")
    says_more = any(w.lower() not in _FILLER for w in rest.split())
    lines = [f"  next: {c}" for c in dict.fromkeys(commands)]
    if says_more or not commands:
        lines.append(f"  {_named_above(hint, list(dict.fromkeys(commands)))}")
    return lines


_ORDINALS = ("first", "second", "third", "fourth", "fifth")


def _named_above(hint: str, commands: list[str]) -> str:
    """The hint's words with each command its `next:` line shows named, not printed again:
    "the command above", or "the second command above" where there are several."""

    def name(match: re.Match[str]) -> str:
        command = match.group(1)
        if command not in commands:
            return match.group(0)
        at = commands.index(command)
        if len(commands) == 1:
            return "the command above"
        return f"the {_ORDINALS[at] if at < len(_ORDINALS) else f'#{at + 1}'} command above"

    return _SPAN.sub(name, hint)


# C0 and C1 control characters but tab and newline: a record read from a state directory, a
# server's log line or a path may hold terminal escapes (clear the screen, rewrite the line
# before it, set the title); a line the tool prints shows them as `\xNN`, never acts on them.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# ...and the format characters (Unicode Cf: the bidi overrides and isolates that reorder what a
# line shows, zero-width joiners) and the line and paragraph separators (Zl, Zp): a path that
# reads one way and pastes another is no less a trick than an escape sequence.
_HIDDEN = ("Cf", "Zl", "Zp")


def _escaped(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(line: str) -> str:
    """`line` as text a terminal only shows: each control character written as `\\xNN`, each
    format or separator character as `\\uNNNN`."""
    import unicodedata

    line = _CONTROL.sub(lambda m: _escaped(m.group()), line)
    if line.isascii():
        return line
    return "".join(_escaped(c) if unicodedata.category(c) in _HIDDEN else c for c in line)


def interrupt_notice(signum: int, count: int) -> None:
    """Acknowledge a deferred SIGINT/SIGTERM/SIGHUP at once, so that a user does not press
    Ctrl-C again and again. It runs inside the signal handler: os.write, no click.echo."""
    import signal

    name = signal.Signals(signum).name
    text = (
        f"\nsm120patch: {name}: finishing this step safely, then stopping\n"
        if count == 1
        else f"sm120patch: {name} again: still finishing safely (nothing is cut short)\n"
    )
    os.write(2, text.encode())


def run_tool(main: Callable[[], Any], early: Any) -> None:
    """The console entry point (and `python -m sm120patch`): `main`, its status, and one line
    for a Ctrl-C that no command's own handling saw; standard output and error are flushed
    here, so that a reader that left is a status (0 for a closed pipe, as git), not a
    traceback at exit."""
    code: Any = 1
    import signal

    if signal.getsignal(signal.SIGINT) is early:  # the package's guard of the start
        signal.signal(signal.SIGINT, signal.default_int_handler)  # ours now: one line, 130
    try:
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            click.echo(printable(str(code)), err=True)  # sys.exit("message"): status 1
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BrokenPipeError:  # the reader left (`status | head`): as git, quietly
                _unwritten_to_devnull(stream)
            except (OSError, ValueError):  # a closed stream, a full disk
                code = code or 1
                _unwritten_to_devnull(stream)
    except KeyboardInterrupt:
        # A Ctrl-C outside every command's own handling: while click parses the arguments, or
        # once the command has ended. Nothing of a run is cut short here; the line says the
        # state the command's last run left.
        hooks = sys.modules.get("sm120patch.engine.interrupts")
        state, hint = (
            hooks.after_interrupt()
            if hooks is not None
            else ("no apply, revert or recover had started: nothing was changed", "")
        )
        os.write(2, printable(f"sm120patch: interrupted (SIGINT): {state}\n").encode())
        if hint:
            os.write(2, "".join(f"{line}\n" for line in hint_lines(hint)).encode())
        code = 130
    sys.exit(code)


def _unwritten_to_devnull(stream: Any) -> None:
    """What is left unwritten goes nowhere, not into a warning at the interpreter's exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (OSError, ValueError):
        pass


# A page read by a person (`show`): at most this wide where stdout is not a terminal (a pager,
# a file, a mail), the terminal's own width where it is.
PAGE_WIDTH = 100


def page_width() -> int:
    """The width `show` wraps at: the terminal's, else PAGE_WIDTH."""
    import shutil

    if sys.stdout.isatty():
        return max(40, shutil.get_terminal_size((PAGE_WIDTH, 24)).columns)
    return PAGE_WIDTH


def wrapped(line: str, width: int) -> list[str]:
    """`line` wrapped at `width`, its continuation lines indented two more than its own
    indentation; a word longer than the width (a URL) stands whole on its own line."""
    import textwrap

    if len(line) <= width:
        return [line]
    lead = line[: len(line) - len(line.lstrip())]
    return textwrap.wrap(
        line.strip(),
        width,
        initial_indent=lead,
        subsequent_indent=lead + "  ",
        break_long_words=False,
        break_on_hyphens=False,
    ) or [line]


def path_options(command: click.Command) -> frozenset[str]:
    """Every option of `command` and its subcommands that names a file or directory (a
    click.Path, or a PATH, DIR or FILE metavar): what a hint makes absolute."""
    found: set[str] = set()
    for param in command.params:
        if isinstance(param, click.Option) and (
            isinstance(param.type, click.Path)
            or (param.metavar or "").split("=")[-1] in ("PATH", "DIR", "FILE", "LOCKFILE")
        ):
            found.update(o for o in param.opts if o.startswith("--"))
    for sub in getattr(command, "commands", {}).values():
        found |= path_options(sub)
    return frozenset(found)


def waiting(seconds: float) -> Callable[[object], None]:
    """What `ensure` says, on stderr, when it starts waiting for another run's lock."""

    def notice(root: object) -> None:
        line = (
            f"sm120patch: another sm120patch run holds the lock on {root}; waiting for it "
            f"(at most {seconds:g} s), then deciding from the bytes"
        )
        click.echo(printable(line), err=True)

    return notice


_DIFF_STYLES = (
    ("+++", "bold"),
    ("---", "bold"),
    ("diff ", "bold"),
    ("@@", "cyan"),
    ("+", "green"),
    ("-", "red"),
)


def coloured(diff: str) -> str:
    """A unified diff with the colours of `git diff` (for a terminal): added lines green,
    removed red, hunk headers cyan, file headers bold."""
    out = []
    for line in diff.splitlines(True):
        style = next((s for prefix, s in _DIFF_STYLES if line.startswith(prefix)), None)
        if style is None:
            out.append(line)
            continue
        body, end = (line[:-1], "\n") if line.endswith("\n") else (line, "")
        out.append(
            click.style(body, bold=True) + end
            if style == "bold"
            else click.style(body, fg=style) + end
        )
    return "".join(out)


def colour_wanted() -> bool:
    """Colours on a terminal, unless NO_COLOR is set (https://no-color.org)."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")
