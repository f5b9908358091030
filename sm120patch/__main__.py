from sm120patch.cli import run

run()
