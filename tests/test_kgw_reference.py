"""KGW green lists bit-exact with the reference codes (context width 1, CPU generator).

Known answers were printed by the reference code itself (lm-watermarking's
``watermark_processor.py`` and ``extended_watermark_processor.py`` at fb602de9; MarkLLM 0.1.5's
``KGWUtils``), V = 1000, gamma = 0.25, hash key 15485863, torch 2.13 CPU, 2026-11-23. Where
MarkLLM installs (``pip install --no-deps --target``), the whole vocabulary is compared too."""

import pytest
import torch

from conftest import import_markllm
from fedattr.watermarks.keys import generate_key
from fedattr.watermarks.kgw import KGWDetector, LMWatermarkingScheme, MarkLLMScheme

V, GAMMA, HASH = 1000, 0.25, 15485863

MARKLLM = {
    0: [0, 2, 5, 7, 9, 11, 13, 27, 29, 32],
    1: [2, 7, 8, 10, 13, 16, 17, 20, 21, 23],
    7: [1, 7, 8, 9, 11, 14, 15, 21, 31, 34],
    999: [0, 4, 5, 9, 10, 19, 22, 28, 33, 37],
}
LM_WATERMARKING = {
    0: [6, 15, 19, 23, 28, 31, 37, 44, 46, 47],
    1: [10, 11, 17, 20, 22, 27, 28, 32, 33, 44],
    7: [4, 5, 9, 12, 14, 17, 20, 22, 29, 33],
}


def _first(scheme, prev):
    return sorted(scheme.green_ids(prev).tolist())[:10]


@pytest.mark.parametrize(
    ("cls", "answers"), [(MarkLLMScheme, MARKLLM), (LMWatermarkingScheme, LM_WATERMARKING)]
)
def test_green_lists_match_the_reference_code(cls, answers):
    scheme = cls(HASH, V, GAMMA)
    assert scheme.green_size == int(V * GAMMA)
    for prev, ids in answers.items():
        assert _first(scheme, prev) == ids
        assert scheme.green_mask(prev).sum() == scheme.green_size


def test_the_two_references_differ_and_keys_pick_them():
    a, b = MarkLLMScheme(HASH, V, GAMMA), LMWatermarkingScheme(HASH, V, GAMMA)
    assert all(_first(a, p) != _first(b, p) for p in range(20))
    key = generate_key("kgw", scheme="markllm", gamma=GAMMA)
    assert isinstance(key.kgw_scheme(V), MarkLLMScheme)
    assert _first(key.kgw_scheme(V), 7) == MARKLLM[7]
    # the z-test is the references' formula (T scored pairs, gamma)
    assert KGWDetector(a, dedupe=False).test(80, 200).z == pytest.approx(4.898979485566357)


@pytest.fixture(scope="module")
def markllm(markllm_target):
    (config,) = import_markllm(
        markllm_target, "markllm.utils.transformers_config", "TransformersConfig"
    )
    kgw_config, utils = import_markllm(
        markllm_target, "markllm.watermark.kgw.kgw", "KGWConfig", "KGWUtils"
    )
    return markllm_target, kgw_config, utils, config


def test_every_green_list_matches_installed_markllm(markllm, tmp_path):
    import json

    target, KGWConfig, KGWUtils, TransformersConfig = markllm
    config = json.loads((target / "markllm" / "config" / "KGW.json").read_text())
    path = tmp_path / "KGW.json"
    path.write_text(json.dumps({**config, "gamma": GAMMA}))
    transformers_config = TransformersConfig(model=None, tokenizer=None, vocab_size=V, device="cpu")
    utils = KGWUtils(KGWConfig(str(path), transformers_config))
    ours = MarkLLMScheme(config["hash_key"], V, GAMMA)
    for prev in range(V):
        ref = utils.get_greenlist_ids(torch.tensor([prev]))
        assert list(map(int, ref)) == ours.green_ids(prev).tolist()
