"""``audit_run`` on damaged ``queries.jsonl`` files: one clear error naming file and line."""

import json
import math

import pytest

from fedattr.errors import UserError
from fedattr.reporting.run_folder import audit_run

# Round 1: three subsets of {0, 1, 2} spanning everything (all recoverable);
# round 2: one subset sum over {0, 1, 2} (nobody recoverable).
GOOD = [
    {"round": 1, "query_id": 0, "subset": [0, 1], "coefficients": [1, 1]},
    {"round": 1, "query_id": 1, "subset": [1, 2], "coefficients": [1, 1]},
    {"round": 1, "query_id": 2, "subset": [0, 2], "coefficients": [1, 1]},
    {"round": 2, "query_id": 3, "subset": [0, 1, 2]},
]


def _write(run_dir, lines):
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "queries.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _good_lines():
    return [json.dumps(q) for q in GOOD]


def test_valid_file_is_audited(tmp_path):
    _write(tmp_path / "run", [*_good_lines(), ""])  # a trailing blank line is fine
    rounds = audit_run(tmp_path / "run")
    assert [r.round for r in rounds] == [1, 2]
    assert [r.queries for r in rounds] == [3, 1]
    assert rounds[0].recoverable == [0, 1, 2]
    assert rounds[0].rank == 3
    assert rounds[1].recoverable == []
    assert all(math.isfinite(v) for v in rounds[1].leakage.values())


def test_corrupt_json_line_names_file_and_line(tmp_path):
    lines = _good_lines()
    lines[2] = "garbage{"
    path = _write(tmp_path / "run", lines)
    with pytest.raises(ValueError) as info:
        audit_run(tmp_path / "run")
    msg = str(info.value)
    assert str(path) in msg
    assert "line 3 " in msg
    assert "not a query record" in msg
    assert "Expecting value" in msg
    assert "corrupt" in msg
    assert not isinstance(info.value, json.JSONDecodeError)


def test_line_numbers_count_blank_lines(tmp_path):
    lines = _good_lines()
    path = _write(tmp_path / "run", [lines[0], "", lines[1], '{"round": 1, "subset": [0,'])
    with pytest.raises(ValueError, match=r"line 4 is not a query record") as info:
        audit_run(tmp_path / "run")
    assert str(path) in str(info.value)


def test_truncated_last_line(tmp_path):
    path = tmp_path / "run" / "queries.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(_good_lines()) + '\n{"round": 2, "subs')  # no final newline
    with pytest.raises(ValueError, match=r"line 5 is not a query record"):
        audit_run(tmp_path / "run")


@pytest.mark.parametrize(
    ("record", "detail"),
    [
        ({"query_id": 9, "subset": [0, 1]}, "'round'"),
        ({"round": 1, "query_id": 9}, "'subset'"),
        ({"query_id": 9}, "'round', 'subset'"),
    ],
)
def test_line_missing_keys(tmp_path, record, detail):
    lines = _good_lines()
    lines[1] = json.dumps(record)
    path = _write(tmp_path / "run", lines)
    with pytest.raises(ValueError) as info:
        audit_run(tmp_path / "run")
    msg = str(info.value)
    assert str(path) in msg
    assert "line 2 is not a query record" in msg
    assert f"missing key(s) {detail}" in msg
    assert not isinstance(info.value, KeyError)


@pytest.mark.parametrize(
    "line",
    [
        "[1, 2, 3]",
        '{"round": "one", "subset": [0, 1]}',
        '{"round": 1, "subset": 5}',
        '{"round": 1, "subset": [0, 1], "coefficients": [1, 1, 1]}',
    ],
)
def test_mistyped_record(tmp_path, line):
    lines = _good_lines()
    lines[0] = line
    _write(tmp_path / "run", lines)
    with pytest.raises(ValueError, match=r"line 1 is not a query record"):
        audit_run(tmp_path / "run")


def test_non_utf8_line(tmp_path):
    path = tmp_path / "run" / "queries.jsonl"
    path.parent.mkdir()
    good = [line.encode() for line in _good_lines()]
    path.write_bytes(b"\n".join([good[0], b"\xff\xfe\x00junk", *good[1:]]) + b"\n")
    with pytest.raises(ValueError, match=r"line 2 is not a query record \(not UTF-8"):
        audit_run(tmp_path / "run")


def test_missing_file_still_file_not_found(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(UserError, match=r"queries\.jsonl"):
        audit_run(tmp_path / "run")
