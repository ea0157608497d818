import functools
import json
import operator
from collections import Counter
from pathlib import Path

import pytest

from fedattr.data.corpus import GENERATORS, generate_corpus
from fedattr.data.loaders import DataError, load_records
from fedattr.data.partition import aggregation_weights, partition_dirichlet, partition_iid

SHARED_ALPACA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "alpaca_5000.json"


def test_corpus_is_deterministic_and_varied():
    a, b = generate_corpus(3000, seed=3), generate_corpus(3000, seed=3)
    assert a == b and a != generate_corpus(3000, seed=4)
    cats = Counter(r.category for r in a)
    assert set(cats) == set(GENERATORS) and min(cats.values()) > 100
    assert len({(r.instruction, r.input, r.output) for r in a}) > 0.8 * len(a)


def test_word_banks_load_from_package_data():
    from importlib import resources

    from fedattr.data import corpus

    files = [f.name for f in (resources.files("fedattr.data") / "words").iterdir()]
    banks = {
        name.removesuffix(".txt").upper(): getattr(corpus, name.removesuffix(".txt").upper())
        for name in files
        if name.endswith(".txt")
    }
    assert {"ANIMALS", "THINGS", "CAPITALS", "UNITS", "WORD_BANK"} <= set(banks)
    lists = [b for b in banks.values() if isinstance(b, list)]
    lists += [*corpus.ACTIVITIES.values(), *corpus.THINGS.values()]
    for bank in [*banks.values(), *lists]:
        assert bank and all(bank)
    for bank in lists:  # the generators r.sample() from them: a repeat would repeat an item
        assert len(set(bank)) == len(bank), bank
    # The most a generator samples from one bank at a time.
    assert min(len(b) for b in corpus.THINGS.values()) >= 8
    assert min(len(b) for b in corpus.ACTIVITIES.values()) >= 5
    assert len(corpus.WORD_BANK) >= 10 and len(corpus.PET_NAMES) >= 8
    for bank in (corpus.WORD_BANK, corpus.PET_NAMES):  # sorted, whatever the file's order
        assert sorted(bank) == bank
    assert corpus.NUMBER_WORDS[:3] == ["zero", "one", "two"] and corpus.NUMBER_WORDS[12] == "twelve"
    assert all(isinstance(f, int) and f > 1 for _, _, f in corpus.UNITS)
    assert corpus.CAPITALS["India"] == "New Delhi"  # "key: value" keeps a value's spaces


def test_alpaca_json_jsonl_and_chat(tmp_path):
    rows = [
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"instruction": "Add", "input": "1 2", "output": "3"},
        {"instruction": "", "input": "", "output": "dropped"},
    ]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    recs = load_records(str(tmp_path / "a.json"))
    assert [r.output for r in recs] == ["hi", "3"] and recs[1].input == "1 2"
    chat = [
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "Q?"},
                {"role": "assistant", "content": "A."},
            ]
        }
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in chat) + "\n")
    (rec,) = load_records(str(tmp_path / "c.jsonl"))
    assert (rec.instruction, rec.output) == ("Q?", "A.")
    assert len(load_records(str(tmp_path / "a.json"), limit=1)) == 1


def test_jsonl_rows_may_hold_unicode_line_separators(tmp_path):
    row = {"instruction": "Say\u2028it", "input": "", "output": "a\u2029b\x85c"}
    line = json.dumps(row, ensure_ascii=False) + "\r\n"
    (tmp_path / "u.jsonl").write_text(line, encoding="utf-8")
    (rec,) = load_records(str(tmp_path / "u.jsonl"))
    assert (rec.instruction, rec.output) == ("Say\u2028it", "a\u2029b\x85c")


def test_loader_errors_are_clear(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_records(str(tmp_path / "missing.json"))
    (tmp_path / "bad.jsonl").write_text('{"instruction": "x", "output": "y"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_records(str(tmp_path / "bad.jsonl"))
    (tmp_path / "shape.json").write_text(json.dumps([{"text": "plain"}]))
    with pytest.raises(DataError, match="expected Alpaca keys"):
        load_records(str(tmp_path / "shape.json"))


@pytest.mark.skipif(not SHARED_ALPACA.is_file(), reason="../shared/data/alpaca_5000.json absent")
def test_real_alpaca_subset_loads():
    recs = load_records(str(SHARED_ALPACA))
    assert len(recs) > 4900 and all(r.instruction and r.output for r in recs)
    assert sum(bool(r.input) for r in recs) > 500


def test_partitions():
    recs = generate_corpus(1000, seed=0)
    iid = partition_iid(recs, 10, seed=1)
    assert sorted(len(s) for s in iid) == [100] * 10
    assert sorted(map(id, functools.reduce(operator.iadd, iid, []))) == sorted(map(id, recs))
    skew = partition_dirichlet(recs, 10, alpha=0.3, seed=1, min_size=20)
    sizes = [len(s) for s in skew]
    assert sum(sizes) == 1000 and min(sizes) >= 20 and max(sizes) > 120
    # label skew: some client's dominant category holds far more than the IID share (1/12)
    top = max(Counter(r.category for r in s).most_common(1)[0][1] / len(s) for s in skew)
    assert top > 0.25
    assert aggregation_weights([1, 3]) == [0.25, 0.75]
    with pytest.raises(ValueError, match="dirichlet_alpha"):
        partition_dirichlet(recs, 10, alpha=0)
