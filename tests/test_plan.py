"""The planner: what one patch cannot see from its own file."""

from __future__ import annotations

from trees import make_tree

from sm120patch import plan
from sm120patch.transform import Status


def test_an_import_the_release_lacks_refuses_the_file(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.1", "installed")
    common = sg / "sglang/srt/utils/common.py"
    common.write_text(common.read_text().replace("def is_sm120_supported(): ...\n", ""))
    p = plan.plan("fusion", {"sglang": sg, "flashinfer": fi})
    by_patch = {o.patch: o for o in p.outcomes}
    flag = by_patch["sglang.sm120-flag"]
    assert flag.status is Status.REFUSED
    assert "sglang.srt.utils.is_sm120_supported" in flag.reason
    # The whole file is left alone, not half patched; other files are unaffected.
    assert by_patch["sglang.fusion-gate"].status is Status.REFUSED
    assert by_patch["flashinfer.comm-arch"].status is Status.APPLIED
    assert all(not f.changed for tp in p.targets for f in tp.files if f.file.endswith("communicator.py"))


def test_imports_resolve_through_star_imports(tmp_path):
    sg = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    fi = make_tree(tmp_path, "flashinfer", "0.6.1", "installed")
    p = plan.plan("fusion", {"sglang": sg, "flashinfer": fi})
    assert not p.refused
    assert "+    is_sm120_supported,\n" in p.diff()
