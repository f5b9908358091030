"""A trial's record as the state keeps it: what the builders write reads back into the same
JSON, byte for byte, and a forged or mangled record in trials.json is one line wherever it
is read (`status`, `trial show`, its report, its export), never a traceback and never shown."""

from __future__ import annotations

import json

import pytest
from killing import cli
from trees import make_tree

from sm120patch.engine import trials
from sm120patch.engine.trialrecord import TrialRecord
from sm120patch.errors import Refused
from sm120patch.trial import gpu, serve
from sm120patch.trial import measured as measured_


def one_line(err: str) -> bool:
    lines = err.strip("\n").split("\n")  # the message, then what to do (`next:`, words)
    return (lines[0].startswith("sm120patch: ") and len(lines) >= 2
            and all(x.startswith("  ") for x in lines[1:]) and "internal error" not in err)


def measured_doc() -> dict:
    """A measured trial as `trial --measure` records one, every part of a run filled in."""
    figures = {"output_tok_s": 812.5, "req_s": 3.25, "ttft_p50_ms": 41.0, "ttft_p99_ms": 90.5,
               "itl_p50_ms": 7.5, "itl_p99_ms": None, "completed": 64, "failed": 0,
               "output_tokens": 8192, "duration_s": 10.1, "tokens_from_usage": True}  # fmt: skip
    result = measured_.MeasuredTrial("moe", ["python", "-m", "sglang.launch_server", "--tp", "2"],
                                   {"figure": "output_tok_s", "repeat": 2}, 1_800_000_000.25)  # fmt: skip
    result.versions = {"sglang": "0.5.8"}
    result.gpu_names = ["NVIDIA RTX PRO 6000", "NVIDIA RTX PRO 6000"]
    result.gpu_family = "sm120"
    for i, side in enumerate(("baseline", "patched", "baseline", "patched")):
        reading = gpu.Reading(0, "NVIDIA RTX PRO 6000", 390.5, 600.0, 93.0)
        result.runs.append(measured_.Run(
            side, i // 2, 1_800_000_010.0 + i, ready_s=20.5, figures=dict(figures),
            window_start=1_800_000_030.0 + i, window_end=1_800_000_040.5 + i,
            timeline=[{"t": 0.5, "tok_s": 800.0}], power=[{"t": 0.25, "gpus": [reading.__dict__]}],
            gpus=[gpu.summarise([{"t": 0.25, "gpus": [reading.__dict__]}])[0].__dict__],
            answers=[{"prompt": "2+2=", "text": " 4", "error": None, "tokens": None}],
            wiring={"sglang.moe": {"seen": "ran", "line": "using the sm120 moe path"}},
            load_texts=["dropped"], tail=["ready"],
        ))  # fmt: skip
    result.summary = {"baseline": {"output_tok_s": {"median": 812.5, "spread": 0.01, "runs": 2}}}
    result.pairs, result.gain, result.noise = [0.02, 0.03], 0.025, 0.01
    result.verdict, result.message = "inconclusive", "+2.5% is inside the noise"
    result.sanity = {"similarity": 1.0, "agreement": None, "reasons": [], "notes": ["no eval"]}
    result.ended = 1_800_000_100.5
    result.id = "20270115-080000-abcd"
    return result.to_dict()


def plain_doc() -> dict:
    return serve.TrialResult("moe", ["serve", "--port", "1"], "crashed", 1_800_000_000.0,
                             1_800_000_003.0, -9, None, True, None, tail=["Killed"],
                             signature={"id": "oom", "pattern": "x", "diagnosis": "d",
                                        "action": "lower --mem-fraction"},
                             id="20270115-070000-0001").to_dict()  # fmt: skip


# Records earlier releases wrote: no `evidence`, no `kind`, an int time, a null list.
LEGACY = {"command": None, "exit_code": None, "id": "20260101-000000-00ab", "profile": "moe",
          "started": 1767225600, "verdict": "ready"}  # fmt: skip


@pytest.mark.parametrize("doc", [measured_doc(), plain_doc(), LEGACY], ids=["measured", "plain",
                                                                            "legacy"])  # fmt: skip
def test_a_record_writes_back_the_json_it_was_read_from(doc):
    record = TrialRecord.from_json(doc)
    assert json.dumps(record.to_json()) == json.dumps(doc)  # keys, their order, the values
    sorted_back = TrialRecord.from_json(json.loads(json.dumps(doc, sort_keys=True)))
    assert json.dumps(sorted_back.to_json()) == json.dumps(doc, sort_keys=True)
    assert record == sorted_back


def test_the_typed_fields_are_what_the_record_says():
    record = TrialRecord.from_json(measured_doc())
    assert record.is_measured and record.verdict == "inconclusive" and record.exit_code == 5
    assert record.command[-2:] == ("--tp", "2") and record.versions == {"sglang": "0.5.8"}
    assert record.evidence is False and record.gain == 0.025 and record.gpu_family == "sm120"
    assert "load_texts" not in record.measured["runs"][0]
    legacy = TrialRecord.from_json(LEGACY)
    assert legacy.evidence is None and legacy.command == () and legacy.key == LEGACY["id"]
    assert TrialRecord.from_json({"profile": "moe", "verdict": "ready", "started": 1}).key == "1:moe"


def test_the_history_on_disk_keeps_earlier_records_byte_for_byte(tmp_path):
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    path = site / ".sm120patch" / "sglang" / "trials.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": 1, "trials": [LEGACY, plain_doc()]}, indent=2,
                               sort_keys=True) + "\n")  # fmt: skip
    before = json.loads(path.read_text())["trials"]
    measured = TrialRecord.from_json(measured_doc())
    trials.record_trial({"sglang": site}, "moe", measured)
    after = json.loads(path.read_text())["trials"]
    assert after[:2] == before and json.dumps(after[:2]) == json.dumps(before)
    assert after[2] == json.loads(json.dumps(measured_doc()))
    code, out, err = cli("trial", "show", measured.id, "--sglang", str(site), "--json")
    assert code == 0, err
    assert out == json.dumps(json.loads(json.dumps(measured_doc(), sort_keys=True)), indent=2) + "\n"


def _run(**changes):
    doc = measured_doc()
    doc["runs"][1].update(changes)
    return doc


@pytest.mark.parametrize("trial, needle", [
    ({"verdict": "ready"}, "a trial without its profile"),
    ({**LEGACY, "id": "20260101\n\x1b[2Jtrial 1 moe: kept"}, "a trial's id"),
    ({**LEGACY, "profile": "moe everything is fine"}, "a trial's profile"),
    ({**LEGACY, "started": 1e300}, "a trial's started is not a time"),
    ({**LEGACY, "started": float("inf")}, "a trial's started is not a time"),
    ({**LEGACY, "exit_code": 2**70}, "a trial's exit_code is not a number"),
    ({**LEGACY, "versions": {"sglang": 8}}, "a trial's versions"),
    ({**LEGACY, "signature": {"id": "oom"}}, "a trial's signature"),
    (_run(round=10**30), "round out of range"),
    (_run(outcome=None), "a trial's run has a outcome"),
    (_run(window_start=1e30), "window_start"),
    (_run(timeline=[{"t": 1}]), "timeline"),
    (_run(power=[{"t": 0, "gpus": [{"power_w": 1}]}]), "power"),
    (_run(gpus=[{"index": 0, "name": "x", "mean_w": 1, "extra": 1}]), "gpus"),
    (_run(wiring={"sglang.moe": {"line": "x"}}), "wiring"),
    (_run(figures={"output_tok_s": float("nan")}), "figures that are not numbers"),
    ({**measured_doc(), "summary": {"baseline": {"req_s": {"median": "fast"}}}}, "summary"),
    ({**measured_doc(), "sanity": {"eval": {"key": "score", "patched": "1"}}}, "sanity"),
])  # fmt: skip
def test_a_forged_trial_record_is_one_line_wherever_it_is_read(trial, needle, tmp_path):
    with pytest.raises(Refused, match="a trial record is corrupt"):
        TrialRecord.from_json(trial)
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    state = site / ".sm120patch" / "sglang"
    state.mkdir(parents=True)
    (state / "trials.json").write_text(json.dumps({"schema": 1, "trials": [LEGACY, trial]}))
    html = str(tmp_path / "report.html")
    for args in (["status"], ["trial", "show"], ["trial", "show", "--html", html],
                 ["trial", "forget", "--all"]):  # fmt: skip
        code, out, err = cli(*args, "--sglang", str(site))
        assert code == 1 and needle in err and one_line(err), (args, err)
        assert "trials.json is corrupt" in err and "\x1b" not in out + err
    assert not (tmp_path / "report.html").exists()


def test_a_deeply_nested_trials_file_is_one_line(tmp_path):
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    state = site / ".sm120patch" / "sglang"
    state.mkdir(parents=True)
    (state / "trials.json").write_text('{"schema": 1, "trials": ' + "[" * 100_000)
    code, _, err = cli("status", "--sglang", str(site))
    assert code == 1 and "trials.json is corrupt or truncated" in err and one_line(err), err


def test_a_figure_the_benchmark_did_not_report_shows_as_unknown(tmp_path):
    doc = _run(figures={"output_tok_s": None, "req_s": None})
    site = make_tree(tmp_path, "sglang", "0.5.8", "installed")
    trials.record_trial({"sglang": site}, "moe", TrialRecord.from_json(doc))
    code, out, err = cli("trial", "show", "--sglang", str(site))
    assert code == 0, err
    assert "patched  run 1: ? tok/s, ? req/s" in out
    code, _, err = cli("trial", "show", "--sglang", str(site), "--html", str(tmp_path / "r.html"))
    assert code == 0, err
