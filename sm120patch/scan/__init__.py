"""`sm120patch scan`: the GPU-arch gates of a target that leave SM120 out, and which patch
covers each (filescan.py and gates.py find them, classify.py says what each is, report.py
renders)."""
