"""`python -m sm120patch`: the console entry point, then without the working directory on
sys.path.

`python -m` puts the working directory first on `sys.path` before it imports this package: an
`sm120patch/` planted there is imported instead, and nothing here can prevent that (run the
`sm120patch` script, or `python -P -m sm120patch`). What this module does prevent is later: an
entry point (a patch pack, which is code) or a module found there would otherwise run with this
process's privileges, often root's.
"""

import os
import sys

if sys.path and sys.path[0] not in ("",) and os.path.isdir(sys.path[0]):
    try:
        if os.path.samefile(sys.path[0], os.getcwd()):
            del sys.path[0]
    except OSError:
        pass
elif sys.path and sys.path[0] == "":
    del sys.path[0]

from sm120patch.cli import run  # noqa: E402

run()
