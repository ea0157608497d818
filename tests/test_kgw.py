import numpy as np
import pytest
import torch

from fedattr.watermarks.kgw import SCHEMES, KGWDetector, KGWLogitsProcessor, KGWScheme

V = 500


def test_green_lists_are_keyed_seeded_and_gamma_sized():
    s = KGWScheme(7, V, gamma=0.25)
    m = s.green_mask(3)
    assert int(m.sum()) == 125 and torch.equal(m, KGWScheme(7, V).green_mask(3))
    assert not torch.equal(m, s.green_mask(4)) and not torch.equal(m, KGWScheme(8, V).green_mask(3))
    with pytest.raises(ValueError, match="gamma"):
        KGWScheme(1, V, gamma=1.5)


def _sample(scheme, processor, steps=400, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq = [0]
    for _ in range(steps):
        logits = torch.randn(1, V, generator=gen)
        if processor is not None:
            logits = processor(torch.tensor([seq]), logits)
        seq.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
    return seq


def test_processor_raises_green_fraction_and_detector_separates():
    scheme = KGWScheme(11, V, gamma=0.25, delta=3.0)
    det = KGWDetector(scheme)
    wm = det.score([_sample(scheme, KGWLogitsProcessor(scheme))])
    clean = det.score([_sample(scheme, None, seed=1)])
    assert wm.green / wm.scored > 0.6 and wm.z > 8 and wm.p < 1e-10
    assert abs(clean.z) < 3
    # The detector under another key sees nothing in the watermarked text.
    assert (
        abs(KGWDetector(KGWScheme(12, V)).score([_sample(scheme, KGWLogitsProcessor(scheme))]).z)
        < 3
    )


def test_processor_never_biases_padded_vocabulary():
    scheme = KGWScheme(1, 10, gamma=0.5, delta=2.0)
    out = KGWLogitsProcessor(scheme)(torch.tensor([[3]]), torch.zeros(1, 12))
    assert torch.all(out[0, 10:] == 0) and float(out.sum()) == pytest.approx(5 * 2.0)


def test_dedupe_counts_repeated_pairs_once():
    scheme = KGWScheme(5, V)
    green_tok = int(next(t for t in np.flatnonzero(scheme.green_mask(2).numpy()) if t != 2))
    seq = [2, green_tok] * 50  # the same (2, green) pair 50 times, and its reverse
    plain = KGWDetector(scheme, dedupe=False).score([seq])
    dedup = KGWDetector(scheme, dedupe=True).score([seq])
    assert plain.scored == 99 and dedup.scored == 2
    assert (
        plain.green >= 50 and plain.z > 5 > dedup.z
    )  # repetition alone would look like a watermark
    assert KGWDetector(scheme).score([[1]]).scored == 0


def test_processor_bias_is_each_rows_green_mask_with_or_without_its_cache():
    scheme = KGWScheme(3, 50, gamma=0.25, delta=1.5)
    prevs = torch.tensor([[0, 7], [1, 7], [4, 9], [2, 7]])  # a repeated context in one batch
    scores = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    expect = scores + torch.stack([scheme.green_mask(p).float() for p in (7, 7, 9, 7)]) * 1.5
    cached, uncached = KGWLogitsProcessor(scheme), KGWLogitsProcessor(scheme, cache_bytes=0)
    for _ in range(2):  # the second step reads the device cache
        assert torch.equal(cached(prevs, scores), expect)
        assert torch.equal(uncached(prevs, scores), expect)
    assert len(cached._on_device) == 2 and not uncached._on_device


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_green_masks_of_many_new_contexts_at_once_are_each_contexts_mask(name):
    make = SCHEMES[name]
    one_by_one, together = make(11, 997), make(11, 997)
    together.green_mask(5)  # a context seen before, beside new ones and repeats
    prevs = [5, 3, 996, 3, 0, 42, 5, *range(100, 160)]
    expect = torch.stack([one_by_one.green_mask(p) for p in prevs])
    assert torch.equal(together.green_masks(prevs), expect)
    assert set(together._cache) == set(prevs)
    assert torch.equal(together.green_masks(prevs[::-1]), expect.flip(0))  # from the cache now
    assert together.green_masks([]).shape == (0, 997)
    assert int(expect[1].sum()) == together.green_size


_FORKED_CHILD = """
import os, signal, sys
import torch
from fedattr.watermarks.kgw import KGWScheme

torch.set_num_threads(16)  # many pool threads start in the child together: torch's race
KGWScheme(1, 4096).green_masks(range(50))  # the parent's pool exists and has threads
pid = os.fork()
if pid == 0:
    code = 3  # the child always ends here, whatever happens (never runs on as the parent)
    try:
        signal.alarm(30)  # a child stuck on threads it did not inherit dies instead of hanging
        a = KGWScheme(2, 4096)
        ok = torch.equal(a.green_masks([3, 4]), torch.stack([KGWScheme(2, 4096).green_mask(3),
                                                             KGWScheme(2, 4096).green_mask(4)]))
        code = 0 if ok else 1
    except BaseException as exc:
        print(f"child: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        sys.stderr.flush()
        os._exit(code)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.slow
def test_green_masks_in_a_forked_child_do_not_wait_on_the_parents_threads():
    # In a fresh interpreter: a fork of the test process would copy the suite's threads and
    # state, and a child that failed there went on running the rest of the suite.
    import subprocess
    import sys

    for _ in range(3):  # without _mask_pool's guard, torch's race failed one run in three
        done = subprocess.run(
            [sys.executable, "-c", _FORKED_CHILD], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
