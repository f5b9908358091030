"""sm120patch: apply, verify and revert the SM120 enablement patches for SGLang and FlashInfer."""

__version__ = "0.4.0"


def _interrupted_at_start(signum: int, frame: object) -> None:
    """SIGINT until the command line takes over (`cli.run`): one line, exit 130."""
    import os

    os.write(2, b"sm120patch: interrupted (SIGINT) while starting: nothing was changed\n")
    os._exit(130)


def _guard_the_start() -> None:
    """A Ctrl-C while the tool starts (the imports of click and the command layer take tens of
    milliseconds, more where no bytecode is cached) would end in the interpreter's traceback,
    outside every handler of the tool's. This package is the first of its code to run, so when
    it is imported to run the tool (the console script, `python -m sm120patch`), a Ctrl-C
    until `cli.run` takes over prints one line and exits 130. A program that imports the
    package keeps its own handling."""
    import os
    import signal
    import sys

    entry = sys.modules.get("__main__")
    spec = getattr(entry, "__spec__", None)
    script = os.path.basename(getattr(entry, "__file__", None) or "")
    # `python -m sm120patch` imports this package before its __main__ is set up: the command
    # line says so (sys.argv[0] is "-m" while the module is located).
    orig = list(getattr(sys, "orig_argv", []))
    by_m = sys.argv[:1] == ["-m"] and any(
        a == "-m" and b == "sm120patch" for a, b in zip(orig, orig[1:], strict=False)
    )
    as_tool = by_m or script == "sm120patch" or getattr(spec, "name", None) == "sm120patch.__main__"
    if as_tool and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_at_start)


_guard_the_start()
