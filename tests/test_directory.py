"""Authenticated envelopes, envelope key files and the deployment directory (no Flower)."""

import json
import stat

import pytest

from fedattr.errors import UserError
from fedattr.secagg.directory import Directory, run_digest
from fedattr.secagg.envelope import Recipient, seal, verify
from fedattr.secagg.errors import QueryRefused, SecAggError


def test_an_authenticated_envelope_opens_only_naming_its_sender():
    alice, bob, eve = Recipient(), Recipient(), Recipient()
    box = seal(bob.public_key, b"share", "ctx", sender=alice)
    assert bob.open(box, "ctx", sender=alice.public_key) == b"share"
    with pytest.raises(SecAggError, match=r"does not open .*not by the pinned sender"):
        bob.open(box, "ctx", sender=eve.public_key)
    # A party without the directory cannot open what a pinned sender sealed: it is told why.
    with pytest.raises(SecAggError, match="give this party the directory too"):
        bob.open(box, "ctx")
    # An anonymous envelope (or one sealed by eve) does not pass as alice's.
    for forged in (seal(bob.public_key, b"x", "ctx"), seal(bob.public_key, b"x", "ctx", eve)):
        with pytest.raises(SecAggError, match="not by the pinned sender"):
            bob.open(forged, "ctx", sender=alice.public_key)
    with pytest.raises(SecAggError, match="a sender key is 32 bytes, got 3"):
        bob.open(box, "ctx", sender=b"abc")


def test_a_key_file_is_private_kept_and_read_back(tmp_path):
    key = Recipient()
    path = key.save(tmp_path / "a.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Recipient.load(path).public_key == key.public_key
    with pytest.raises(UserError, match="exists; a key is never overwritten"):
        Recipient().save(path)
    assert Recipient.load(path).public_key == key.public_key
    (tmp_path / "bad.key").write_text("not hex\n")
    with pytest.raises(UserError, match="is not an envelope key"):
        Recipient.load(tmp_path / "bad.key")
    with pytest.raises(UserError, match="key-file: cannot read"):
        Recipient.load(tmp_path / "missing.key")


def _directory(**change):
    keys = [Recipient().identity.hex() for _ in range(5)]
    d = {
        "run": run_digest('{"b": 1, "a": [1, 2]}'),
        "nonce": "ab" * 16,
        "servers": {"A": keys[0], "B": keys[1]},
        "owners": {"0": keys[2]},
        "clients": {"0": keys[3], "1": keys[4]},
    }
    return {**d, **change}


def test_the_directory_reads_back_and_refuses_what_it_does_not_pin(tmp_path):
    data = _directory()
    d = Directory.from_dict(data)
    assert Directory.load(d.save(tmp_path / "d.json")) == d
    assert json.loads((tmp_path / "d.json").read_text()) == data
    # The run's digest does not depend on key order or spacing.
    d.check_run('{"a": [1,2], "b": 1}', "server A")
    with pytest.raises(QueryRefused, match="server A refused: the coordinator's configuration"):
        d.check_run('{"a": [1, 2], "b": 2}', "server A")
    with pytest.raises(QueryRefused, match="client 7 is not in its directory"):
        d.client(7, "server A")
    with pytest.raises(QueryRefused, match="owner 3 is not in its directory"):
        d.owner(3, "server A")
    with pytest.raises(QueryRefused, match="gave server B the key"):
        d.expect(bytes(32), d.server("B"), "server B", "owner 0")
    # The run's nonce binds every envelope context and key signature.
    assert d.context("sealed/x") == "sealed/x/run=" + "ab" * 16
    other = Directory.from_dict({**data, "nonce": "cd" * 16})
    assert other.key_message(1, 0, b"k") != d.key_message(1, 0, b"k")


def test_a_key_signature_verifies_only_for_its_signer_round_and_run():
    alice, eve = Recipient(), Recipient()
    message = b"fedattr/sa-key/v1/run=x/round=1/client=0/" + bytes(32)
    signature = alice.sign(message)
    verify(alice.identity, signature, message, "key")
    for identity, msg in ((eve.identity, message), (alice.identity, message + b"!")):
        with pytest.raises(SecAggError, match="key: the signature does not verify"):
            verify(identity, signature, msg, "key")


def test_a_low_order_key_is_refused_in_one_line():
    with pytest.raises(SecAggError, match="a key of low order; refused"):
        seal(bytes(32), b"x", "ctx")
    with pytest.raises(SecAggError, match="a key of low order; refused"):
        Recipient().open(bytes(32) + bytes(16), "ctx")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"servers": {"A": "00" * 64}}, "servers must be A and B"),
        ({"clients": {"0": "abc"}}, "clients.0 must be a party's public identity, 128 hex"),
        ({"extra": 1}, r"unknown field\(s\) \['extra'\]"),
        ({"clients": {"0": "11" * 64, "1": "11" * 64}}, "listed for two parties"),
        ({"nonce": "1234"}, "nonce must be 32\\+ hex digits"),
    ],
)
def test_a_malformed_directory_is_one_line(change, message):
    with pytest.raises(UserError, match=message):
        Directory.from_dict(_directory(**change))
    data = _directory()
    del data["servers"]
    with pytest.raises(UserError, match="missing field 'servers'"):
        Directory.from_dict(data)


def test_keygen_and_directory_write_what_every_party_pins(tmp_path, capsys):
    pytest.importorskip("flwr", reason="the Flower extra is not installed")
    from fedattr.cli import main
    from fedattr.config import load, to_dict
    from fedattr.pipeline.config import RunConfig

    public = {}
    for party in ("A", "B", "o0", "o1", "o2", *(f"c{i}" for i in range(10))):
        assert main(["flower", "keygen", str(tmp_path / f"{party}.key")]) == 0
        public[party] = capsys.readouterr().out.strip()
        assert Recipient.load(tmp_path / f"{party}.key").identity.hex() == public[party]
    run = tmp_path / "run.toml"
    run.write_text('[attribution.protocol]\nmode = "sealed"\n')
    settings = ["--config", str(run)]
    keys = ["--server", f"A={public['A']}", "--server", f"B={public['B']}"]
    keys += [a for j in range(3) for a in ("--owner", f"{j}={public[f'o{j}']}")]
    out = tmp_path / "directory.json"
    # One owner short: one line, nothing written.
    assert main(["flower", "directory", str(out), *settings, *keys[:-2]]) == 2
    assert "--owner: the run has 3 owners" in capsys.readouterr().err and not out.exists()
    keys += [a for i in range(10) for a in ("--client", f"{i}={public[f'c{i}']}")]
    assert main(["flower", "directory", str(out), *settings, *keys]) == 0
    d = Directory.load(out)
    assert d.servers["A"].hex() == public["A"] and d.client_identity(9, "x").hex() == public["c9"]
    cfg = load(RunConfig, str(run))  # as the ServerApp reads --run-config config=...
    d.check_run(json.dumps(to_dict(cfg)), "x")
    assert Directory.load(out).nonce == d.nonce
    assert main(["flower", "directory", str(tmp_path / "again.json"), *settings, *keys]) == 0
    assert Directory.load(tmp_path / "again.json").nonce != d.nonce  # one run, one nonce
