"""What the SA answers reveal across rounds: the stacked audit, the GLS attack, the CLI."""

import json
import math

import numpy as np
import pytest

from fedattr.attribution.audit import audit_queries
from fedattr.attribution.crossround import CrossRoundAttack, audit_cross_round
from fedattr.cli import main
from fedattr.config import load
from fedattr.errors import UserError
from fedattr.pipeline.config import DemoConfig
from fedattr.pipeline.run import run_demo
from fedattr.reporting.run_folder import audit_run, audit_run_cross_round
from fedattr.secagg.queries import QueryRecord

AGGREGATE = (0, 1, 2), (1, 1, 1)
# Neither round's span holds any e_j; together they span R^3.
TWO_ROUNDS = {
    1: [AGGREGATE, ((0, 1), (1, -1))],
    2: [AGGREGATE, ((1, 2), (1, -1))],
}


def _records(design):
    """Query-log records: the aggregate outside any session, the rest in ``fedattr``."""
    out = []
    for rnd, rows in design.items():
        for k, (subset, coefs) in enumerate(rows):
            out.append(
                QueryRecord(
                    rnd, k, tuple(subset), 0, 0.0, 0.0, tuple(coefs), 1, "" if k == 0 else "fedattr"
                )
            )
    return out


def test_identifiable_across_rounds_though_no_single_round_recovers_anyone():
    records = [r.to_dict() for r in _records(TWO_ROUNDS)]
    per_round = audit_queries(records)
    assert [r.recoverable for r in per_round] == [[], []]
    (a,) = audit_cross_round(records)
    assert a.session == "fedattr" and a.rounds == 2 and a.rank == 3
    assert a.identifiable == [0, 1, 2]
    assert a.recoverable_in_a_round == []
    assert a.only_across_rounds == [0, 1, 2]
    assert all(math.isfinite(v) and v > 0 for v in a.variance_factor.values())


def test_the_same_rows_every_round_identify_no_one():
    records = [r.to_dict() for r in _records({1: TWO_ROUNDS[1], 2: TWO_ROUNDS[1]})]
    (a,) = audit_cross_round(records)
    assert a.rank == 2 and a.identifiable == []
    assert all(math.isinf(v) for v in a.variance_factor.values())
    assert a.to_dict()["variance_factor"] == {"0": "inf", "1": "inf", "2": "inf"}


def test_variance_factor_is_one_over_rounds_when_every_round_recovers_everyone():
    full = [((0, 1, 2), (1, 1, 1)), ((0,), (1,)), ((1,), (1,))]
    records = [r.to_dict() for r in _records({1: full, 2: full, 3: full, 4: full})]
    (a,) = audit_cross_round(records)
    assert a.recoverable_in_a_round == [0, 1, 2]
    assert a.only_across_rounds == []
    assert a.variance_factor == pytest.approx({0: 0.25, 1: 0.25, 2: 0.25})


def _attack(design, updates, session="fedattr"):
    """Run the attack on exact answers of ``design`` to ``updates[round]`` (K x d): the
    results of ``session`` (all sessions' with ``None``)."""
    attack = CrossRoundAttack(3)
    for rec in _records(design):
        row = np.zeros(3)
        row[list(rec.subset)] = rec.coefficients
        attack.answer(rec, row @ updates[rec.round])
        if rec.query_id == len(design[rec.round]) - 1:
            attack.close_round(dict(enumerate(updates[rec.round])))
    return attack.results() if session is None else attack.results()[session]


def test_gls_recovers_a_persistent_mean_exactly_without_noise():
    rng = np.random.default_rng(0)
    mu = rng.normal(size=(3, 8))
    out = _attack(TWO_ROUNDS, {1: mu, 2: mu})
    assert out["identifiable"] == 3
    for c in out["clients"].values():
        assert c["error_gls"] < 1e-10 and c["error_ols"] < 1e-10
        assert c["error_public_mean"] > 0.1  # the public guess alone does not recover it


def test_round_noise_leaves_the_error_the_variance_factor_predicts():
    rng = np.random.default_rng(1)
    sigma, d = 0.5, 4000
    mu = rng.normal(size=(3, d))
    noisy = {t: mu + sigma * rng.normal(size=mu.shape) for t in (1, 2)}
    out = _attack(TWO_ROUNDS, noisy)
    (a,) = audit_cross_round([r.to_dict() for r in _records(TWO_ROUNDS)])
    mean = (noisy[1] + noisy[2]) / 2
    for j, c in out["clients"].items():
        # GLS minus the mean over T rounds has variance sigma^2 (v_j - 1/T) per coordinate.
        v = a.variance_factor[int(j)]
        predicted = sigma * math.sqrt(d * (v - 1 / 2)) / np.linalg.norm(mean[int(j)])
        assert c["error_gls"] == pytest.approx(predicted, rel=0.1)


def test_demo_records_the_attack_and_the_audit_reads_it(tmp_path):
    cfg = load(
        DemoConfig,
        None,
        [
            "synthetic.dim=64",
            "synthetic.rounds=3",
            "attribution.protocol.mode=hardened",
            "secagg.backend=plaintext",
        ],
    )
    run_demo(cfg, progress=lambda _m: None).write(tmp_path / "run")
    per_round = audit_run(tmp_path / "run")
    assert all(not r.recoverable for r in per_round)  # hardened: none per round
    (a,) = audit_run_cross_round(tmp_path / "run")
    rec = a.reconstruction
    assert rec is not None and set(rec["clients"]) == {str(c) for c in range(10)}
    # The attack's identifiability (from its answers) is the log's (from the rows alone).
    assert [c for c in range(10) if rec["clients"][str(c)]["identifiable"]] == a.identifiable
    assert main(["audit", str(tmp_path / "run"), "--json", "--cross-round"]) == 0


def test_paper_mode_demo_reconstructs_every_mean_exactly(tmp_path, capsys):
    cfg = load(
        DemoConfig,
        None,
        ["synthetic.dim=32", "synthetic.rounds=2", "secagg.backend=plaintext"],
    )
    run_demo(cfg, progress=lambda _m: None).write(tmp_path / "run")
    assert main(["audit", str(tmp_path / "run"), "--json", "--cross-round"]) == 0
    (a,) = json.loads(capsys.readouterr().out)["cross_round"]
    assert a["only_across_rounds"] == [] and len(a["identifiable"]) == 10
    assert a["reconstruction"]["median_error_gls"] < 1e-9  # every round recovers everyone


def test_audit_json_without_cross_round_is_the_list_of_rounds(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "queries.jsonl").write_text(
        "\n".join(json.dumps(r.to_dict()) for r in _records(TWO_ROUNDS))
    )
    assert main(["audit", str(run), "--json"]) == 0
    assert [r["round"] for r in json.loads(capsys.readouterr().out)] == [1, 2]
    assert main(["audit", str(run)]) == 0
    out = capsys.readouterr().out
    assert "3 of 3 clients' mean updates identifiable across rounds" in out
    assert "exactly recoverable in no single round (0, 1, 2)" in out


def test_bad_run_dir_is_one_line(tmp_path, capsys):
    assert main(["audit", str(tmp_path / "missing")]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "RUN_DIR" in err


def test_damaged_results_json_is_one_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "queries.jsonl").write_text(json.dumps(_records(TWO_ROUNDS)[0].to_dict()))
    (run / "config.json").write_text("{}")
    (run / "results.json").write_text("{not json")
    with pytest.raises(UserError, match=r"RUN_DIR: .*results\.json"):
        audit_run_cross_round(run)


def test_answer_taps_see_every_logged_answer_in_process_and_remote():
    from test_secagg_batch import MIXED, _updates
    from test_secagg_remote import _reference, _remote

    updates = np.stack([u.numpy() for u in _updates()])
    for sa in (_reference(), _remote()[0]):
        seen = []
        sa.answer_taps.append(lambda rec, total, seen=seen: seen.append((rec, total)))
        sa.run_queries(MIXED)
        # every released answer, those of groups stopped later included (the log has them)
        assert [rec for rec, _ in seen] == sa.log and seen
        for rec, total in seen:  # sum_j c_j Delta_j, before the denominator
            expected = np.array(rec.coefficients) @ updates[list(rec.subset)]
            assert np.allclose(total, expected, atol=1e-6)


def test_a_round_with_public_rows_only_counts_for_every_session():
    # Round 3 has no session's query: its aggregate is still seen by the fedattr session.
    design = {**TWO_ROUNDS, 3: [AGGREGATE]}
    records = [r.to_dict() for r in _records(design)]
    (a,) = audit_cross_round(records)
    assert a.session == "fedattr" and a.rounds == 3
    assert a.rounds_present == {0: 3, 1: 3, 2: 3}
    rng = np.random.default_rng(2)
    mu = rng.normal(size=(3, 8))
    out = _attack(design, {1: mu, 2: mu, 3: mu}, session=None)
    assert list(out) == ["fedattr"]
    assert all(c["error_gls"] < 1e-10 for c in out["fedattr"]["clients"].values())
    # Round 1 alone identifies no one; its rows with round 3's aggregate still do not.
    out = _attack({1: TWO_ROUNDS[1], 3: [AGGREGATE]}, {1: mu, 3: mu}, session=None)
    assert list(out) == ["fedattr"] and out["fedattr"]["identifiable"] == 0
