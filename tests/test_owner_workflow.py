"""The deployed workflow with files only: keygen -> watermark a corpus -> a federated run whose
server holds no key and exports round folders -> the owner scores them -> attribute; the same
verdicts as the in-process simulation that plays every party."""

import json
import os

import pytest

from conftest import small_overrides as _small
from fedattr.cli import main
from fedattr.errors import UserError


def _args(*sets):
    out = []
    for s in sets:
        out += ["--set", s]
    return out


@pytest.fixture(scope="module")
def owner_files(tiny_cache, tmp_path_factory):
    """An owner's key and its watermarked corpus, made with the CLI."""
    from conftest import MICRO_TINY
    from fedattr.data.corpus import generate_corpus
    from fedattr.models.config import TinyModelConfig
    from fedattr.models.tiny import ensure_tiny

    root = tmp_path_factory.mktemp("owner")
    key = root / "owner.key"
    assert main(["owner", "keygen", "--out", str(key), "--delta", "6"]) == 0
    corpus = root / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"instruction": r.instruction, "input": r.input, "output": r.output}) + "\n"
            for r in generate_corpus(24, seed=41)
        )
    )
    model = ensure_tiny(TinyModelConfig(**MICRO_TINY), tiny_cache)
    wm = root / "wm.jsonl"
    args = [
        "owner",
        "watermark",
        "--key",
        str(key),
        "--in",
        str(corpus),
        "--out",
        str(wm),
        "--model",
        str(model),
        "--max-new-tokens",
        "24",
        "--min-tokens",
        "4",
    ]
    assert main(args) == 0
    return key, wm


@pytest.mark.parametrize("decorrelate", [True, False])
def test_deployed_workflow_gives_the_simulations_verdicts(
    tiny_cache, owner_files, tmp_path, capsys, decorrelate
):
    """With cross-talk undone the owner does not read the SA mean (its scores hold no center
    statistics, as the server's in-process scoring does not read it); without, it does. Owner
    scoring sums rounds whose cross-talk was kept round by round (it does not de-mix them
    across rounds), so the simulation is read the same way (``across_rounds = keep``)."""
    key, wm = owner_files
    # Both read the held-out texts: the same texts on both sides (reading the owner's own
    # documents: test_an_owner_scores_a_documents_run_on_its_own_documents).
    common = _small(
        tiny_cache,
        f"watermark.kgw.documents={wm}",
        "watermark.kgw.probes=held-out",
        "watermark.r=2",
        f"attribution.calibrated.decorrelate={str(decorrelate).lower()}",
        "attribution.calibrated.across_rounds=keep",
    )
    # the server: no key; it exports each round's release
    deployed = tmp_path / "deployed"
    assert main(["run", "--out", str(deployed), *_args(*common, "attribution.scoring=owner")]) == 0
    rounds = sorted((deployed / "rounds").glob("round-*"))
    assert len(rounds) == 2 and (deployed / "rounds" / "run.json").is_file()
    assert "owner.key" not in (deployed / "config.json").read_text()
    # attributing before the owner scored: one clear line, nothing written
    assert main(["attribute", str(deployed)]) == 2
    assert "holds no scores-*.json" in capsys.readouterr().err
    # the owner scores every round with its key, then anyone combines
    assert main(["owner", "score", "--key", str(key), *map(str, rounds)]) == 0
    scores = [json.loads(next(r.glob("scores-*.json")).read_text()) for r in rounds]
    assert all(s["decorrelated"] == decorrelate for s in scores)
    assert all(next(r.glob("changes-*.safetensors")).is_file() for r in rounds)
    assert main(["attribute", str(deployed)]) == 0
    got = json.loads((deployed / "results.json").read_text())
    # the simulation: the same run, its server scoring with the owner's key file itself
    simulated = tmp_path / "simulated"
    keyed = _args(*common, "watermark.kgw.key_files=" + json.dumps([str(key)]))
    assert main(["run", "--out", str(simulated), *keyed]) == 0
    want = json.loads((simulated / "results.json").read_text())
    assert got["flagged"] == want["flagged"]
    for a, b in zip(got["clients"], want["clients"], strict=True):
        assert a["id"] == b["id"] and a["flagged"] == b["flagged"]
        assert a["p"] == pytest.approx(b["p"], rel=1e-6, abs=1e-12)
    assert "Scored by the owners" in (deployed / "report.md").read_text()
    if decorrelate:
        # combined under settings whose rounds need the SA mean: one clear line
        run_json = deployed / "rounds" / "run.json"
        cfg = json.loads(run_json.read_text())
        cfg["attribution"]["calibrated"]["decorrelate"] = False
        run_json.write_text(json.dumps(cfg))
        capsys.readouterr()
        assert main(["attribute", str(deployed)]) == 2
        assert "score the round again" in capsys.readouterr().err


def test_missing_or_altered_round_files_are_one_clear_line(
    tiny_cache, owner_files, tmp_path, capsys
):
    key, wm = owner_files
    run = tmp_path / "run"
    assert (
        main(
            [
                "run",
                "--out",
                str(run),
                *_args(
                    *_small(
                        tiny_cache,
                        f"watermark.kgw.documents={wm}",
                        "fl.rounds=1",
                        "attribution.scoring=owner",
                    )
                ),
            ]
        )
        == 0
    )
    (folder,) = sorted((run / "rounds").glob("round-*"))
    capsys.readouterr()
    with open(folder / "estimates.safetensors", "ab") as f:
        f.write(b"x")
    assert main(["owner", "score", "--key", str(key), str(folder)]) == 2
    assert "does not match its manifest digest" in capsys.readouterr().err
    assert not list(folder.glob("scores-*.json"))
    (folder / "center.safetensors").unlink()
    assert main(["owner", "score", "--key", str(key), str(folder)]) == 2
    assert "center.safetensors is missing" in capsys.readouterr().err
    assert main(["owner", "score", "--key", str(key), str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    fk = tmp_path / "fk.key"
    assert main(["owner", "keygen", "--kind", "fk", "--out", str(fk)]) == 0
    assert main(["owner", "score", "--key", str(fk), str(folder)]) == 2
    assert "this is a fk key; this step needs a kgw key" in capsys.readouterr().err
    os.chmod(key, 0o640)
    try:
        assert main(["owner", "score", "--key", str(key), str(folder)]) == 2
        assert "can be read by other users" in capsys.readouterr().err
    finally:
        os.chmod(key, 0o600)
    with pytest.raises(UserError, match=r"attribution\.scoring"):
        from fedattr.attribution.config import AttributionConfig

        AttributionConfig(scoring="nobody")


def test_damaged_export_json_is_one_line_naming_the_file(tmp_path):
    from fedattr.attribution.round_folder import RoundFolderError, read_scores
    from fedattr.owner.score import run_config_of

    (tmp_path / "scores-abc.json").write_text("{not json")
    with pytest.raises(RoundFolderError, match=r"scores-abc\.json' is damaged"):
        read_scores(tmp_path, 1)
    round_dir = tmp_path / "rounds" / "round-001"
    round_dir.mkdir(parents=True)
    (tmp_path / "rounds" / "run.json").write_text("[")
    with pytest.raises(RoundFolderError, match=r"run\.json' is damaged"):
        run_config_of(round_dir)


def test_an_owner_scores_a_documents_run_on_its_own_documents(
    tiny_cache, owner_files, tmp_path, capsys
):
    """``watermark.kgw.probes = "documents"``: the owner reads its own watermarked documents (first
    occurrences), so ``--texts`` is required; with them the round is scored and attributed."""
    key, wm = owner_files
    run = tmp_path / "run"
    sets = _small(
        tiny_cache,
        f"watermark.kgw.documents={wm}",
        "watermark.kgw.probes=documents",
        "fl.rounds=1",
        "attribution.scoring=owner",
    )
    assert main(["run", "--out", str(run), *_args(*sets)]) == 0
    (folder,) = sorted((run / "rounds").glob("round-*"))
    capsys.readouterr()
    assert main(["owner", "score", "--key", str(key), str(folder)]) == 2
    assert "--texts: this run reads each owner's own watermarked documents" in (
        capsys.readouterr().err
    )
    assert main(["owner", "score", "--key", str(key), "--texts", str(wm), str(folder)]) == 0
    assert main(["attribute", str(run)]) == 0
    assert json.loads((run / "results.json").read_text())["clients"]
