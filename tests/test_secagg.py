import threading

import numpy as np
import pytest
import torch

from fedattr.secagg import (
    BACKENDS,
    FixedPointCodec,
    PairwiseMaskAggregator,
    QueryRefused,
    SecAggConfig,
    SecAggError,
    TwoServerAggregator,
    make_aggregator,
)
from fedattr.secagg.pairwise_mask import PairwiseMaskServer, pair_seed
from fedattr.secagg.prg import expand


def _round(backend, updates, min_members=3, **kw):
    sa = make_aggregator(SecAggConfig(backend=backend, min_members=min_members, **kw))
    sa.open_round(7, sorted(updates))
    for j, u in updates.items():
        sa.submit(j, u)
    return sa


@pytest.mark.parametrize("prg", ["aes-ctr", "chacha20"])
def test_all_backends_agree_on_dict_updates(lora_updates, prg):
    subsets = [(0, 1, 2), (1, 3, 4, 5), (0, 1, 2, 3, 4, 5)]
    results = {}
    for name in BACKENDS:
        sa = _round(name, lora_updates, prg=prg)
        results[name] = [sa.subset_sum(w) for w in subsets]
    for k, w in enumerate(subsets):
        truth = {n: sum(lora_updates[j][n].double() for j in w) for n in lora_updates[0]}
        for name in BACKENDS:
            got = results[name][k]
            assert set(got) == set(truth)
            for n in truth:
                # float32 output; fixed point adds at most |W| * 2^-33
                assert got[n].dtype == torch.float32
                assert torch.allclose(got[n].double(), truth[n], atol=1e-7, rtol=0)


def test_backends_agree_on_tensor_updates_in_32_bit_ring():
    gen = torch.Generator().manual_seed(3)
    ups = {j: torch.randn(5, 7, generator=gen, dtype=torch.float64) for j in range(5)}
    outs = [
        _round(n, ups, ring_bits=32, frac_bits=20, clip=64.0).subset_sum([0, 2, 3])
        for n in BACKENDS
    ]
    truth = ups[0] + ups[2] + ups[3]
    for out in outs:
        assert out.shape == (5, 7)
        assert torch.allclose(out, truth, atol=3 * 2.0**-21, rtol=0)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_refusals(backend, lora_updates):
    sa = _round(backend, lora_updates, min_members=3)
    with pytest.raises(
        QueryRefused, match=r"below the secure-aggregation threshold; allowed sizes are 3\.\.6"
    ):
        sa.subset_sum([0, 1])
    with pytest.raises(QueryRefused, match="empty"):
        sa.subset_sum([])
    with pytest.raises(QueryRefused, match="duplicate"):
        sa.subset_sum([0, 1, 1, 2])
    with pytest.raises(QueryRefused, match=r"clients \[42\] are not registered"):
        sa.subset_sum([0, 1, 42])
    with pytest.raises(SecAggError, match="already submitted"):
        sa.submit(0, lora_updates[0])
    with pytest.raises(SecAggError, match="not registered"):
        sa.submit(9, lora_updates[0])
    assert len(sa.log) == 0  # refused queries are not answered, so not logged
    sa.subset_sum([0, 1, 2])
    rec = sa.log[-1]
    assert rec.round == 7 and rec.subset == (0, 1, 2) and rec.bytes_moved > 0 and rec.seconds >= 0
    sa.close_round()
    with pytest.raises(QueryRefused, match="no round is open"):
        sa.subset_sum([0, 1, 2])


def test_query_before_all_members_submitted_is_refused(lora_updates):
    sa = make_aggregator(SecAggConfig(min_members=2))
    sa.open_round(0, range(6))
    sa.submit(0, lora_updates[0])
    sa.submit(1, lora_updates[1])
    with pytest.raises(QueryRefused, match=r"clients \[2\] have not submitted"):
        sa.subset_sum([0, 1, 2])
    with pytest.raises(SecAggError, match="still open"):
        sa.open_round(1, range(6))


def test_codec_errors_name_the_parameter():
    codec = FixedPointCodec(64, 32, clip=1.0)
    with pytest.raises(SecAggError, match=r"exceeds the fixed-point clip bound 1\.0"):
        codec.encode(np.array([0.5, -1.5]))
    with pytest.raises(SecAggError, match="NaN"):
        codec.encode(np.array([np.nan]))
    with pytest.raises(SecAggError, match="ring_bits: must be 32 or 64"):
        FixedPointCodec(16, 8, 1.0)
    with pytest.raises(SecAggError, match="frac_bits"):
        FixedPointCodec(32, 40, 1.0)
    small = FixedPointCodec(32, 24, clip=16.0)  # 16 * 2^24 = 2^28: 7 values fit in 2^31
    small.check_capacity(7)
    with pytest.raises(SecAggError, match="at most 7 clients"):
        small.check_capacity(8)
    sa = make_aggregator(SecAggConfig(ring_bits=32, frac_bits=24, clip=16.0, min_members=2))
    with pytest.raises(SecAggError, match="at most 7 clients"):
        sa.open_round(0, range(8))


def test_codec_roundtrip_negative_values_both_rings():
    x = np.array([-3.25, 0.0, 2.5, -1e-6])
    for bits, frac in ((32, 20), (64, 32)):
        c = FixedPointCodec(bits, frac, clip=8.0)
        y = c.decode(c.encode(x) + c.encode(x))  # ring addition of two encodings
        assert np.allclose(y, 2 * x, atol=2 * c.resolution)


def test_pair_seeds_are_symmetric_and_fresh_per_query():
    s = b"\x01" * 32
    assert pair_seed(s, 1, 0, 3, 5) == pair_seed(s, 1, 0, 5, 3)
    assert pair_seed(s, 1, 0, 3, 5) != pair_seed(s, 1, 1, 3, 5)
    assert pair_seed(s, 1, 0, 3, 5) != pair_seed(s, 2, 0, 3, 5)


def test_prg_streams_differ_by_seed_and_generator():
    a = expand(b"\x00" * 32, 1000, np.uint64, "aes-ctr")
    b = expand(b"\x00" * 31 + b"\x01", 1000, np.uint64, "aes-ctr")
    c = expand(b"\x00" * 32, 1000, np.uint64, "chacha20")
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.array_equal(a, expand(b"\x00" * 32, 1000, np.uint64, "aes-ctr"))


def _correlation(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.corrcoef(x, y)[0, 1])


def test_single_masked_upload_is_uncorrelated_with_the_update():
    n = 20_000
    gen = torch.Generator().manual_seed(5)
    ups = {j: torch.randn(n, generator=gen, dtype=torch.float64) for j in range(4)}
    sa = PairwiseMaskAggregator(min_members=2)
    sa.open_round(0, range(4))
    for j, u in ups.items():
        sa.submit(j, u)
    captured = {}
    inner = sa._collect

    def spy(j, *args):  # what the server receives from client j
        y = inner(j, *args)
        captured.setdefault(j, []).append(y.clone().numpy().view(np.uint64))
        return y

    sa._collect = spy
    sa.subset_sum([0, 1, 2, 3])
    sa.subset_sum([0, 1, 2, 3])
    encoded = sa.codec.encode(ups[0].numpy()).numpy().view(np.uint64)
    for y in captured[0]:
        # As signed ring values and as uniform [0,1) variates: no linear relation to the update.
        bound = 5 / np.sqrt(n)
        assert abs(_correlation(y.view(np.int64).astype(float), ups[0].numpy())) < bound
        assert abs(_correlation(y.astype(float) / 2.0**64, ups[0].numpy())) < bound
        assert not np.array_equal(y, encoded)
        # Top byte of each coordinate is uniform (chi-square, 255 dof: mean 255, sd ~22.6).
        counts = np.bincount((y >> np.uint64(56)).astype(np.int64), minlength=256)
        chi2 = float(np.sum((counts - n / 256) ** 2 / (n / 256)))
        assert chi2 < 255 + 6 * 22.6
    # Two uploads of the same client use unrelated masks: their difference is not 0 and
    # is itself uncorrelated with the update.
    diff = (captured[0][0] - captured[0][1]).view(np.int64).astype(float)
    assert abs(_correlation(diff, ups[0].numpy())) < 5 / np.sqrt(n)
    # The server-side object holds public keys only.
    assert set(vars(sa.server)) == {"public_keys"}
    assert all(isinstance(k, bytes) and len(k) == 32 for k in sa.server.public_keys.values())


def test_two_server_shares_alone_reveal_nothing():
    n = 20_000
    gen = torch.Generator().manual_seed(6)
    ups = {j: torch.randn(n, generator=gen, dtype=torch.float64) for j in range(3)}
    sa = TwoServerAggregator(min_members=2)
    sa.open_round(0, range(3))
    for j, u in ups.items():
        sa.submit(j, u)
    for holder in (sa.aggregator_a, sa.aggregator_b):
        share = holder.shares[0].numpy().astype(float)  # int64: the signed reading
        assert abs(_correlation(share, ups[0].numpy())) < 5 / np.sqrt(n)
    with pytest.raises(QueryRefused, match="aggregator A refused"):
        sa.aggregator_a.partial_sum((0,))
    sa.close_round()
    assert sa.aggregator_a.shares == {} and sa.aggregator_b.shares == {}


def test_config_rejects_unknown_backend_and_prg():
    with pytest.raises(SecAggError, match="allowed: plaintext, pairwise-mask, two-server"):
        SecAggConfig(backend="homomorphic")
    with pytest.raises(SecAggError, match="allowed: aes-ctr, chacha20, auto"):
        SecAggConfig(prg="rc4")
    assert make_aggregator(SecAggConfig(backend="plaintext")).holds_plaintext
    assert not make_aggregator(SecAggConfig()).holds_plaintext


def test_auto_prg_is_aes_on_one_cpu_and_chacha20_on_gpus_and_across_machines(monkeypatch):
    cpu = SecAggConfig(device="cpu")
    assert cpu.prg == "auto" and cpu.resolved_prg() == "aes-ctr"
    assert make_aggregator(cpu).prg == "aes-ctr"
    assert make_aggregator(SecAggConfig(backend="two-server", device="cpu")).prg == "aes-ctr"
    # Clients on other machines resolve their own devices: one cipher for every pair.
    assert cpu.resolved_prg(distributed=True) == "chacha20"
    assert SecAggConfig(device="cpu", prg="chacha20").resolved_prg() == "chacha20"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert SecAggConfig(device="auto").resolved_prg() == "chacha20"
    assert SecAggConfig(device="cuda:1").resolved_prg() == "chacha20"


@pytest.mark.parametrize(("threads", "workers"), [(None, 1), (2, 2), (3, 3), (4, 9)])
def test_server_sums_every_upload_once_whatever_its_threads(threads, workers):
    from concurrent.futures import ThreadPoolExecutor

    members = (3, 5, 8, 11, 12)
    top = np.iinfo(np.int64)
    gen = np.random.default_rng(4)
    uploads = {
        j: torch.from_numpy(gen.integers(top.min, top.max, 1000, dtype=np.int64, endpoint=True))
        for j in members
    }
    asked, recycled = [], []
    # The first upload of each thread waits for the others' first: every thread adds some.
    started = threading.Barrier(threads or 1, timeout=30)

    def collect(j, round_id, query_id, who, keys):
        assert (round_id, query_id, who) == (2, 7, members)
        asked.append(j)
        if len(asked) <= (threads or 1):
            started.wait()
        return uploads[j].clone()

    pool = None if threads is None else ThreadPoolExecutor(threads)
    server = PairwiseMaskServer()
    total, moved = server.run_query(
        2, 7, members, collect, pool=pool, workers=workers, recycle=recycled.append
    )
    want = np.zeros(1000, dtype=np.int64)
    for y in uploads.values():
        want = want + y.numpy()  # wrapping int64: the ring Z_2^64
    assert sorted(asked) == list(members)  # each member asked once
    assert np.array_equal(total.numpy(), want)
    assert moved == 5 * 1000 * 8
    assert len(recycled) == 4 and all(r is not total for r in recycled)


def test_a_failing_upload_stops_the_query_and_no_thread_outlives_it():
    from concurrent.futures import ThreadPoolExecutor

    members = (1, 0, 2, 3, 4, 5, 6, 7)  # the first thread takes the failing member
    asked = []

    def collect(j, *_):
        asked.append(j)
        if j == 1:
            raise ValueError("member 1 broke")
        threading.Event().wait(0.01)  # an upload takes a while
        return torch.zeros(4, dtype=torch.int64)

    with pytest.raises(ValueError, match="member 1 broke"):
        PairwiseMaskServer().run_query(
            0, 0, members, collect, pool=ThreadPoolExecutor(3), workers=3
        )
    seen = len(asked)
    threading.Event().wait(0.1)
    assert len(asked) == seen  # no thread was still uploading when the error came back
    assert seen < len(members)  # and the others stopped taking members
