"""Apply, revert, recover, ensure, status: the engine: the only writer of targets. Never prints.

One module per verb (apply.py, revert.py, recover.py, ensure.py, pin.py) over what they share:
the run of one target (run.py), its state (store.py, records.py), its layout (layouts.py), its
verdict from the bytes (assess.py) and the signal and kill hooks (interrupts.py). The contract
is written out in docs/ARCHITECTURE.md.

Every verb is given the command's targets (`targets.resolved.Resolved`, held by
`app.Session`), found once; it never finds one again, and assesses each once.

Every verdict is decided from the bytes on disk (`assess`), never from the manifest alone.
An apply is one transaction over every target of the profile:
    preflight (shared with the dry run) -> journal (+ pristine copies) -> write (on a
    checkout: one commit per patch built in git's object database, the branch moved once, one
    checkout) -> verify -> manifest -> close journal.
Any failure before the journal is closed rolls every target back; a kill leaves the journal
behind, and `recover` finishes the rollback. A revert is rolled forward by `recover` instead:
both end states are exact.

Across targets, the journals of one run share a transaction id (`txn`) and name each other
(`peers`). An apply is committed once every target's manifest of that txn is written:
`recover` then closes the journals left open instead of rolling back, so a kill between two
journal closes cannot leave one target patched and the other pristine. A revert writes every
target's journal before it changes anything, and `recover` rolls the whole of it forward,
journaling peers the killed run had not reached yet.
"""
