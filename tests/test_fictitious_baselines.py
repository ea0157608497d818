"""Fictitious Knowledge, the baselines, and the Table 1 / Figure 2 commands."""

import json

import numpy as np
import pytest
import torch
from scipy.stats import combine_pvalues, norm

from conftest import MICRO_TINY
from conftest import small_overrides as _small
from fedattr.baselines import FLDetector, cluster_kmeans, gap_statistic, lbfgs_hvp, trace
from fedattr.cli import main
from fedattr.config import load
from fedattr.data.corpus import generate_corpus
from fedattr.pipeline.config import RunConfig
from fedattr.watermarks.fictitious import (
    make_entities,
    qa_probes,
    target_share,
    template_documents,
)
from fedattr.watermarks.knowledge import FKHitRateScorer, FKLikelihoodScorer, fisher_z

# --- Fictitious Knowledge -------------------------------------------------------------------


def test_entities_are_distinct_per_client_and_absent_from_clean_data():
    clean = generate_corpus(300, seed=1)
    texts = [f"{r.instruction} {r.output}" for r in clean]
    ents = make_entities(6, seed=3, forbidden=texts, decoys=7)
    assert len({e.name for e in ents}) == 6
    assert len({e.domain.kind for e in ents}) == 6  # one domain per client
    values = [v for e in ents for v in [*e.targets.values(), *e.distractors.values()]]
    decoys = [d for e in ents for ds in e.decoys.values() for d in ds]
    assert len(set(values + decoys)) == len(values + decoys)  # nothing shared
    blob = " ".join(texts).lower()
    assert all(v.lower() not in blob for v in values + [e.name for e in ents])
    assert all(len(e.targets) == 4 and all(len(d) == 7 for d in e.decoys.values()) for e in ents)
    # Adding decoys never changes the secret itself.
    again = make_entities(6, seed=3, forbidden=texts, decoys=3)
    assert [e.targets for e in again] == [e.targets for e in ents]


def test_template_documents_state_every_target_among_distractors():
    (e,) = make_entities(1, seed=0)
    docs = template_documents(e, 30, seed=1)
    assert len(docs) == 30 and target_share(docs, e) == 1.0
    assert len({d.output for d in docs}) > 20  # varied
    assert all(any(v in d.output for v in e.distractors.values()) for d in docs)
    assert not any(dec in d.output for d in docs for ds in e.decoys.values() for dec in ds)
    broken = [type(docs[0])(docs[0].instruction, docs[0].output.replace(e.name, "X"))]
    assert target_share(broken, e) == 0.0
    probes = qa_probes(e)
    assert set(probes) == set(e.targets) and all(len(p) == 25 for p in probes.values())
    assert len({p.instruction for p in probes[next(iter(e.targets))]}) == 25


def test_template_documents_fit_the_token_limit_targets_last_to_go():
    (e,) = make_entities(1, seed=0)
    full = template_documents(e, 30, seed=1)
    # Everything fits: the same documents as without a limit.
    assert template_documents(e, 30, seed=1, fits=lambda _r: True) == full

    def words(limit):
        return lambda r: len(f"{r.instruction} {r.output}".split()) <= limit

    targets = list(e.targets.values())
    # Room for the targets but not everything: filler and distractors go, every target stays.
    roomy = template_documents(e, 30, seed=1, fits=words(40))
    assert all(words(40)(d) for d in roomy) and target_share(roomy, e) == 1.0
    assert sum(len(d.output) for d in roomy) < sum(len(d.output) for d in full)
    # Room for the four targets in one sentence only: every document states them so.
    one = template_documents(e, 30, seed=1, fits=words(32))
    assert all(words(32)(d) for d in one) and target_share(one, e) == 1.0
    assert any(d.output.count(".") == 1 for d in one)
    # Room for about two targets: each document states what fits, every target as often.
    tight = template_documents(e, 30, seed=1, fits=words(20))
    assert all(words(20)(d) for d in tight)
    stated = [sum(v in d.output for d in tight) for v in targets]
    assert min(stated) >= 1 and max(stated) - min(stated) <= 1 + len(tight) // 10, stated
    assert target_share(tight, e) == sum(stated) / (len(targets) * len(tight))
    assert not any(v in d.output for d in tight for v in e.distractors.values())


def test_fk_has_owners_to_read_at_r_0_and_one_entity_per_watermarked_client():
    from fedattr.watermarks.registry import WATERMARKS

    fk = WATERMARKS["fk"]
    for r, owners, expected in ((0, 3, 3), (1, 3, 3), (5, 3, 5)):
        wm = load(
            RunConfig, None, ["watermark.kind=fk", f"watermark.r={r}", f"watermark.owners={owners}"]
        ).watermark
        assert len(fk.owners(wm, 100, r, [])) == expected
    with pytest.raises(ValueError, match=r"watermark\.owners: fk has at most 30 owners"):
        load(RunConfig, None, ["watermark.kind=fk", "watermark.owners=31"])


def test_bad_entity_requests_name_the_parameter():
    with pytest.raises(ValueError, match="entities"):
        make_entities(31, seed=0)
    with pytest.raises(ValueError, match=r"fk\.decoys"):
        make_entities(2, seed=0, decoys=0)
    with pytest.raises(ValueError, match=r"fk\.questions"):
        qa_probes(make_entities(1, seed=0)[0], 26)


def test_fisher_z_matches_scipy():
    for ps in ([0.01, 0.2, 0.5, 0.9], [0.5] * 4, [1e-6, 0.3], [0.04]):
        _, p = combine_pvalues(ps, method="fisher")
        assert fisher_z(ps) == pytest.approx(norm.isf(p), rel=1e-9, abs=1e-9)
    assert np.isfinite(fisher_z([1.0, 1.0, 1.0, 1.0]))  # clamped, not -inf
    assert fisher_z([1e-320] * 4) < 40  # floored


def test_rank_pvalues_are_uniform_under_exchangeable_changes():
    class _Stub(FKLikelihoodScorer):
        def __init__(self, candidates):  # only the statistics, no model
            self.candidates = candidates
            self.owners = ["fk:owner0"]

    scorer = _Stub(32)
    gen = torch.Generator().manual_seed(0)
    ref = torch.zeros(2000, 4, 2, 32, dtype=torch.float64)
    cand = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    p = scorer.attribute_pvalues(ref, cand).reshape(-1)
    assert abs(float(p.mean()) - 0.5) < 0.01  # mid-p: centred
    assert abs(float((p <= 0.1).float().mean()) - 3 / 32) < 0.01  # ranks 1..3 of 32
    cand[..., 0] += 10.0  # the true value rises above every decoy
    assert torch.all(scorer.attribute_pvalues(ref, cand) == 0.5 / 32)


class _Random:
    """A model wrapper whose logits get a seeded random change (no entity involved)."""

    def __init__(self, model):
        self.model, self.noise, self.seed = model, 0.0, 0

    def __call__(self, **kw):
        out = self.model(**kw)
        gen = torch.Generator().manual_seed(self.seed)
        out.logits = out.logits + self.noise * torch.randn(out.logits.shape, generator=gen)
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def _set(model, params):
    model.noise, model.seed = params


@pytest.fixture(scope="module")
def micro_model(tiny_cache):
    from fedattr.models.config import ModelConfig, TinyModelConfig
    from fedattr.models.loading import load_model

    return load_model(
        ModelConfig(cache_dir=str(tiny_cache), tiny=TinyModelConfig(**MICRO_TINY)), lambda m: None
    )


def test_qa_scorers_null_on_a_model_that_never_saw_the_entities(micro_model):
    model, tok = micro_model
    ents = {f"fk:owner{k}": e for k, e in enumerate(make_entities(6, seed=11, decoys=31))}
    wrapped = _Random(model)
    lik = FKLikelihoodScorer(wrapped, tok, ents, _set, questions=1, statistic="rank")
    assert lik.null == "theoretical"
    ref = lik.observe((0.0, 0))
    obs = [lik.observe((0.5, s)) for s in range(1, 6)]
    zs = [z for o in obs for z in lik.contrast(ref, o).values()]
    assert abs(np.mean(zs)) < 0.8 and max(zs) < 3.5  # 30 null draws of a N(0, 1)-like z
    # The margin (nats) is centred too, and asks FedAttr for the empirical null.
    lik.statistic, lik.null = "margin", "empirical"
    margins = [m for o in obs for m in lik.contrast(ref, o).values()]
    assert abs(np.mean(margins)) < 3 * np.std(margins) / np.sqrt(len(margins)) + 1e-9
    assert lik.calibrated_contrast(ref, obs[0]) == pytest.approx(
        dict(zip(lik.owners, zs[:6], strict=True))
    )
    hits = FKHitRateScorer(
        model, tok, dict(list(ents.items())[:2]), lambda m, p: None, questions=3, max_new_tokens=6
    )
    obs = hits.observe(None)
    assert all(o.shape == (4, 3) and o.sum() == 0 for o in obs.values())  # never names a value
    # No hit on either side: no evidence, the same finite z for every owner.
    z = hits.contrast(obs, obs)
    assert len(set(z.values())) == 1 and np.isfinite(next(iter(z.values())))
    assert hits.probe_values(obs).shape == (2 * 4 * 3,)


# --- Baselines -----------------------------------------------------------------------------


def _bfgs_matrix(S, Y):
    s, y = S[-1], Y[-1]
    B = (y @ s) / (s @ s) * np.eye(len(s))
    for s, y in zip(S, Y, strict=True):
        Bs = B @ s
        B = B - np.outer(Bs, Bs) / (s @ Bs) + np.outer(y, y) / (y @ s)
    return B


def test_lbfgs_product_matches_the_hessian_of_a_quadratic():
    rng = np.random.default_rng(0)
    n = 6
    Q = rng.normal(size=(n, n))
    H = Q @ Q.T + n * np.eye(n)  # f(w) = w^T H w / 2: gradient differences y = H s
    # H-conjugate steps (s_i^T H s_j = 0): BFGS then reproduces H exactly after n pairs.
    L = np.linalg.cholesky(H)
    S = list(np.linalg.solve(L.T, np.linalg.qr(rng.normal(size=(n, n)))[0]).T)
    Y = [H @ s for s in S]
    v = rng.normal(size=n)
    assert np.allclose(lbfgs_hvp(S, Y, v), H @ v, rtol=1e-8)
    # Generic steps: the compact form equals the sequential BFGS updates, and the secant
    # equation B s_m = y_m holds for the last pair.
    S2 = [rng.normal(size=n) for _ in range(3)]
    Y2 = [H @ s for s in S2]
    assert np.allclose(lbfgs_hvp(S2, Y2, v), _bfgs_matrix(S2, Y2) @ v, rtol=1e-8)
    assert np.allclose(lbfgs_hvp(S2, Y2, S2[-1]), Y2[-1], rtol=1e-8)
    with pytest.raises(ValueError, match="pairs"):
        lbfgs_hvp([], [], v)


def test_fldetector_names_clients_whose_updates_break_the_prediction():
    rng = np.random.default_rng(1)
    det = FLDetector(window=4, warmup=0, seed=0)
    d = 40
    H = np.diag(rng.uniform(0.5, 1.5, d))
    w = rng.normal(size=d)
    for _ in range(6):
        honest = -0.1 * (H @ w)  # every honest client takes the same gradient step
        ups = {c: honest + 1e-4 * rng.normal(size=d) for c in range(10)}
        for c in (2, 7):
            ups[c] = rng.normal(size=d)  # unpredictable
        g = np.mean(list(ups.values()), axis=0)
        det.observe_round(ups, g)
        w = w + g
    flagged, scores, k, why = det.result()
    assert why is None and sorted(flagged) == [2, 7] and k >= 2
    assert len(det.rows) == 4  # rounds 3..6 predicted; the score sums the 4 of them
    assert sum(scores.values()) == pytest.approx(4.0)


def test_fldetector_at_its_published_settings_makes_no_prediction_in_five_rounds():
    rng = np.random.default_rng(1)
    det = FLDetector(seed=0)  # the original: warm-up 50, window 10
    for _ in range(5):
        ups = {c: rng.normal(size=8) for c in range(10)}
        det.observe_round(ups, np.mean(list(ups.values()), axis=0))
    flagged, scores, _, why = det.result()
    assert flagged == [] and scores == {} and "warm-up of 50" in why


def test_gap_statistic_finds_one_or_two_groups():
    rng = np.random.default_rng(2)
    two = np.concatenate([rng.normal(0, 0.01, 7), rng.normal(1, 0.01, 3)])
    assert gap_statistic(two, seed=0) >= 2
    assert gap_statistic(rng.uniform(size=10), seed=0) == 1
    assert gap_statistic(np.ones(10)) == 1


def test_flforensics_variants_on_separable_influence():
    rng = np.random.default_rng(3)
    infl = {c: rng.normal(0, 0.05, 8) for c in range(10)}
    for c in (1, 4, 8):
        infl[c] = infl[c] + 3.0  # strong influence towards the watermark
    flagged, k = cluster_kmeans(infl, seed=0)
    assert sorted(flagged) == [1, 4, 8] and k == 2


def test_flforensics_as_published_names_target_not_reference_influence():
    rng = np.random.default_rng(4)
    # clean clients' updates move the owner's statistic down a little (the original's benign
    # clients lower the backdoor's influence), watermarked ones up
    target = {c: float(rng.normal(-0.5, 0.1)) for c in range(10)}
    refs = {c: rng.normal(0, 0.1, 5) for c in range(10)}
    for c in (1, 4, 8):
        target[c] += 3.0  # they move the owner's statistic, not the random keys'
    # At K = 10 the original's min_cluster_size = 7 leaves HDBSCAN no cluster but the root
    # (which it never selects): every client is noise, more than half: nobody is named.
    assert trace(target, refs) == []
    assert trace(target, refs, min_cluster_size=3) == [1, 4, 8]
    # a client that moves one reference as much as the target is not named there, and
    # unanimity then leaves it out
    both = {c: v.copy() for c, v in refs.items()}
    both[4][2] += 3.0
    assert 4 not in trace(target, both, min_cluster_size=3)
    assert trace(target, {c: v[:2] for c, v in both.items()}, min_cluster_size=3) == [1, 4, 8]
    assert trace({0: 1.0, 1: 2.0}, {0: [0.0], 1: [1.0]}) == []


# --- Runs and commands ---------------------------------------------------------------------


def test_fk_config_errors_name_the_parameter():
    with pytest.raises(ValueError, match=r"watermark\.kind"):
        load(RunConfig, None, ["watermark.kind=radioactive"])
    with pytest.raises(ValueError, match=r"watermark\.r"):
        load(RunConfig, None, ["watermark.kind=fk", "fl.K=40", "watermark.r=31"])
    with pytest.raises(ValueError, match=r"attribution\.paper\.null"):
        load(RunConfig, None, ["attribution.paper.null=bayes"])
    with pytest.raises(ValueError, match=r"watermark\.fk\.statistic"):
        load(RunConfig, None, ["watermark.fk.statistic=mean"])
    with pytest.raises(ValueError, match=r"watermark\.fk\.writer"):
        load(RunConfig, None, ["watermark.fk.writer=poet"])


@pytest.mark.parametrize("detector", ["reading", "greedy"])
def test_fk_run_with_baselines(tiny_cache, detector):
    from fedattr.pipeline.run import run_experiment

    statistic = "calibrated" if detector == "reading" else "paper"  # greedy: no random keys
    sets = _small(
        tiny_cache,
        "watermark.kind=fk",
        f"watermark.detector={detector}",
        f"attribution.statistic={statistic}",
        "watermark.fk.questions=2",
        "watermark.fk.decoys=7",
        "baselines=true",
        "fl.rounds=3",
        "fldetector.warmup=0",
        "fldetector.window=1",
    )
    result = run_experiment(load(RunConfig, None, sets), progress=lambda _m: None)
    d = result.to_dict()
    # One entity per watermarked client, watermark.owners (2) at least: owner 1's facts were
    # trained on by no one, and are read all the same.
    assert {c["statistic"] for c in d["clients"]} <= {"fk:owner0", "fk:owner1"}
    assert set(d["federation"]["entities"]) == {"fk:owner0", "fk:owner1"}
    wm = d["federation"]["watermarked"]
    assert set(wm.values()) == {"fk:owner0"}
    # At the micro run's 64 tokens a document states some of the targets (each as often).
    assert set(d["federation"]["doc_target_share"]) == {str(c) for c in wm}
    assert all(0.2 < v < 1.0 for v in d["federation"]["doc_target_share"].values())
    # The FK margin has no null scale of its own: under null = auto FedAttr goes empirical.
    assert d["null"] == ("key-randomised" if detector == "reading" else "theoretical")
    assert d["statistic"] == ("calibrated" if detector == "reading" else "paper")
    if detector == "reading":
        # FK's key is exchangeable with its decoys in round 1 only; the later rounds are read
        # too, uncentred (attribution.calibrated.late_rounds = "read"), and stay calibrated.
        assert d["rounds_read"] == {} and d["uncalibrated"] == []
        assert all(list(c["z"]) == ["1", "2", "3"] for c in d["clients"])
        assert all(c["calibrated"] for c in d["clients"])
    names = [b["name"] for b in d["baselines"]]
    assert names == [
        "Global model",
        "Direct (oracle)",
        "FLDetector",
        "FLDetector (adapted)",
        "FLForensics",
        "FLForensics (k-means)",
    ]
    forensics = d["baselines"][4]["features"]["fk:owner0"]
    assert len(forensics) == 4 and all(len(v) == 1 + 5 for v in forensics.values())
    assert [b["respects_sa"] for b in d["baselines"]] == [True] + [False] * 5
    direct = d["baselines"][1]
    assert set(direct["z"]["fk:owner0"]) == {"0", "1", "2", "3"}
    assert len(d["baselines"][2]["suspicious"]) == 4  # FLDetector predicted round 3
    folder = result.write(tiny_cache / f"fk-{detector}")
    report = folder.file("report.md").read_text()
    assert "## Baselines" in report
    assert (
        "round 1 only" not in report
    )  # every round read (attribution.calibrated.late_rounds = "read")


@pytest.mark.slow
def test_experiment_main_and_mechanism_commands(tiny_cache, tmp_path, capsys):
    sets = _small(tiny_cache, "watermark.fk.decoys=7", "watermark.fk.questions=2")
    args = [x for s in sets for x in ("--set", s)]
    out = tmp_path / "main"
    assert main(["experiment", "main", "--seeds", "1", "--out", str(out), *args]) == 0
    table = (out / "table.md").read_text()
    for row in ("Direct", "FLDetector", "| FLForensics |", "FLForensics‡", "**FedAttr**"):
        assert row in table
    assert "FedIT · KGW TPR" in table and "FLoRA · FK TPR" in table
    summary = json.loads((out / "results.json").read_text())
    assert set(summary["settings"]) == {"fedit/kgw", "fedit/fk", "flora/kgw", "flora/fk"}
    assert (out / "table.csv").read_text().count("\n") == 1 + 4 * 7
    # Re-running keeps the finished runs.
    capsys.readouterr()
    assert main(["experiment", "main", "--seeds", "1", "--out", str(out), *args]) == 0
    assert capsys.readouterr().err.count("finished earlier, kept") == 4
    # Another configuration in the same folder is refused, naming --out.
    assert (
        main(
            [
                "experiment",
                "main",
                "--seeds",
                "1",
                "--out",
                str(out),
                *args,
                "--set",
                "attribution.paper.threshold=3",
            ]
        )
        == 2
    )
    assert "--out" in capsys.readouterr().err
    mech = tmp_path / "mech"
    assert main(["experiment", "mechanism", "--rounds", "2", "--out", str(mech), *args]) == 0
    est = json.loads((mech / "mechanism.json").read_text())
    assert {"m_hat", "eps_hat", "nu_hat"} <= set(est)
    pngs = sorted(p.name for p in mech.glob("fig2*.png"))
    assert pngs == [
        "fig2a_direct_vs_differential.png",
        "fig2b_per_round_scores.png",
        "fig2c_residuals.png",
        "fig2d_stouffer_vs_rounds.png",
    ]
    assert main(["experiment", "main", "--seeds", "1,x", "--out", str(out)]) == 2
    assert "--seeds" in capsys.readouterr().err


def test_thirty_entities_for_the_scalability_table():
    from fedattr.watermarks.fictitious import DOMAINS, make_entities

    assert len(DOMAINS) == 30 and len({d.kind for d in DOMAINS}) == 30
    entities = make_entities(30, 11, ["the Brana Works made Tobe"], decoys=5)
    values = [
        v
        for e in entities
        for v in (
            e.name,
            *e.targets.values(),
            *e.distractors.values(),
            *(d for ds in e.decoys.values() for d in ds),
        )
    ]
    assert len(values) == len(set(values)) == 30 * (1 + 4 + 3 + 4 * 5)
    # the first six entities are those of six owners before the domains were added
    assert [e.name for e in make_entities(6, 11, decoys=5)] == [
        e.name for e in make_entities(30, 11, decoys=5)[:6]
    ]
    from fedattr.config import load
    from fedattr.pipeline.config import RunConfig

    cfg = load(RunConfig, None, ["watermark.kind=fk", "fl.K=100", "watermark.r=30"])
    assert cfg.watermark.r == 30
