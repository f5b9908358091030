"""Hash what every profile does on every release: for refactors that must not change a byte.

    python benchmarks/output_hashes.py -o before.json     # with the old code importable
    python benchmarks/output_hashes.py -o after.json      # with the new code
    python benchmarks/output_hashes.py --compare before.json after.json

Plans each profile on each release of the full range
(`sm120patch.maintain.releases.available`, fetched into the release cache once) with
`plan.plan_target`, and records per (profile, kind, version)
each site's status and, per file, the sha256 of the text after every applied patch (the texts
the engine commits one by one) and after the last. Not a test: the full range downloads about
a gigabyte on a cold cache and takes minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from concurrent.futures import ProcessPoolExecutor


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def one_release(job: tuple[str, str]) -> dict[str, object]:
    from sm120patch.maintain import trees
    from sm120patch.plan import catalog
    from sm120patch.plan.planner import plan_target
    from sm120patch.targets import finding

    kind, version = job
    cat = catalog.load()
    target = finding.find(kind, trees.tree(kind, version))
    out: dict[str, object] = {}
    for name, profile in sorted(cat.profiles.items()):
        if kind not in profile.pins:
            continue
        planned = plan_target(profile, cat.patches_of(profile), target)
        record: dict[str, object] = {}
        for f in planned.files:
            for o in f.outcomes:
                record[f"status:{o.patch}"] = o.status.value
            if f.changed:
                record[f"file:{f.file}"] = [_sha(f.after)] + [
                    f"{pid}={_sha(text)}" for pid, text in f.step_texts()
                ]
        out[f"{name}|{kind}|{version}"] = record
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("-o", "--output")
    parser.add_argument("-j", "--jobs", type=int, default=2)
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    from sm120patch.maintain import releases, trees

    jobs = [(k, v) for k in releases.KINDS for v in releases.available(k)]
    # Download and unpack first, one at a time (the cache locks per release anyway).
    for kind, version in jobs:
        trees.tree(kind, version)
    result: dict[str, object] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for part in pool.map(one_release, jobs):
            result.update(part)
    import sm120patch

    result["_meta"] = {"code": sm120patch.__file__, "releases": [f"{k} {v}" for k, v in jobs]}
    with open(args.output, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1, sort_keys=True)
    files = sum(1 for k, r in result.items() if k != "_meta" for x in r if x.startswith("file:"))
    plans = len(result) - 1
    print(f"{len(jobs)} releases, {plans} (profile, release) plans, {files} patched files")
    return 0


def compare(before_path: str, after_path: str) -> int:
    with open(before_path, encoding="utf-8") as fh:
        before = json.load(fh)
    with open(after_path, encoding="utf-8") as fh:
        after = json.load(fh)
    before.pop("_meta", None)
    after.pop("_meta", None)
    diffs = []
    files = hashes = statuses = 0
    for key, old in sorted(before.items()):
        new = after.get(key)
        if new is None:
            diffs.append(f"{key}: missing after")
            continue
        for item, value in old.items():
            files += item.startswith("file:")
            hashes += len(value) if item.startswith("file:") else 0
            statuses += item.startswith("status:")
            if new.get(item) != value:
                diffs.append(f"{key} {item}: {value} -> {new.get(item)}")
        for item in set(new) - set(old):
            diffs.append(f"{key} {item}: new {new[item]}")
    extra = sorted(set(after) - set(before))
    print(
        f"{len(before)} (profile, release) plans compared: {statuses} site outcomes, "
        f"{files} patched files, {hashes} file hashes (final + per step); "
        f"{len(diffs)} differences; {len(extra)} plans only after"
    )
    for line in diffs:
        print("  " + line)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
