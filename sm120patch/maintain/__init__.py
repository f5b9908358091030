"""Maintainer tooling: the release cache and `matrix`, for the people who maintain pins.

Nothing a production box runs imports this package: `status`, `apply`, `ensure` and the other
runtime commands never reach it (tests/test_maintain_imports.py checks), and `matrix` imports it
only when it runs. `pip install 'sm120patch[maintain]'` installs what it needs beyond the runtime.
"""
