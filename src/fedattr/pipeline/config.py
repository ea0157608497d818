"""The configurations of the commands: ``fedattr run`` (:class:`RunConfig`) and
``fedattr demo-protocol`` (:class:`DemoConfig`), each a tree of the sections that live beside
their packages, loadable from a file."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..attribution.config import AttributionConfig, harden
from ..baselines.config import FLDetectorConfig, FLForensicsConfig
from ..config import ConfigError, canonical, check_client_ids, deep_merge, from_dict, to_dict
from ..data.config import DataConfig
from ..errors import UserError
from ..fl.clients import resolve_profiles
from ..fl.config import FLConfig
from ..fl.federation import watermarked_clients
from ..fl.synthetic import SyntheticConfig
from ..models.config import LoRAConfig, ModelConfig
from ..secagg.config import SecAggConfig
from ..watermarks.config import WatermarkConfig
from ..watermarks.registry import WATERMARKS


def canonical_variants(variants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each variant (a table of ``[attribution]`` keys plus an optional ``name``) with its old
    key names resolved (each noted once; a saved run's quietly), in the sparse form given."""
    out = []
    for i, variant in enumerate(variants):
        if not isinstance(variant, dict):
            raise ConfigError(f"variants[{i}]: expected a table of attribution keys")
        out.append(canonical(AttributionConfig, variant, prefix=f"variants[{i}]."))
    return out


def attribution_variants(
    main: AttributionConfig, variants: list[dict[str, Any]], per_round: int, min_members: int
) -> dict[str, AttributionConfig]:
    """``main`` as ``fedattr`` and every variant (its keys over the main one's, plus a name),
    each validated: same mode as the main one (one SA release policy per run), a valid N."""
    out = {"fedattr": main}
    base = to_dict(main)
    for i, variant in enumerate(canonical_variants(variants)):
        keys = dict(variant)
        name = str(keys.pop("name", f"variant{i + 1}"))
        if name in out:
            raise ConfigError(f"variants[{i}].name: {name!r} is taken; names must differ")
        cfg = from_dict(AttributionConfig, deep_merge(base, keys), prefix=f"variants[{i}].")
        if cfg.protocol.mode != main.protocol.mode:
            raise ConfigError(
                f"variants[{i}].protocol.mode: must equal "
                f"attribution.protocol.mode={main.protocol.mode!r} "
                "(one SA release policy per run)"
            )
        sealed = cfg.protocol.mode == "sealed"  # no subset sum: N unused
        if not sealed and (not per_round - 1 > cfg.protocol.N or min_members > cfg.protocol.N):
            raise ConfigError(
                f"variants[{i}].protocol.N: must be in {min_members}..{per_round - 2}, "
                f"got {cfg.protocol.N}"
            )
        out[name] = cfg
    return out


@dataclass
class DemoConfig:
    """Configuration of ``fedattr demo-protocol``."""

    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    secagg: SecAggConfig = field(default_factory=SecAggConfig)
    attribution: AttributionConfig = field(default_factory=AttributionConfig)
    variants: list[dict[str, Any]] = field(default_factory=list)
    """More FedAttr configurations on the same run (see :class:`RunConfig`)."""

    def __post_init__(self) -> None:
        self.variants = canonical_variants(self.variants)
        self.secagg = harden(self.attribution, self.secagg, self.synthetic.K)
        self.attribution_variants()

    def attribution_variants(self) -> dict[str, AttributionConfig]:
        """Name -> configuration of every FedAttr observer, the main one first."""
        return attribution_variants(
            self.attribution, self.variants, self.synthetic.K, self.secagg.min_members
        )


@dataclass
class RunConfig:
    """Everything ``fedattr run`` needs (defaults: the embedded default run)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    data: DataConfig = field(default_factory=DataConfig)
    watermark: WatermarkConfig = field(default_factory=WatermarkConfig)
    fl: FLConfig = field(default_factory=FLConfig)
    secagg: SecAggConfig = field(default_factory=SecAggConfig)
    attribution: AttributionConfig = field(default_factory=AttributionConfig)
    fldetector: FLDetectorConfig = field(default_factory=FLDetectorConfig)
    flforensics: FLForensicsConfig = field(default_factory=FLForensicsConfig)
    baselines: bool = False
    """Also run the baselines (global-model test, Direct, FLDetector, FLForensics) on the same
    training run; they read plaintext updates, which FedAttr never does."""
    ceiling: bool = False
    """Also read the same statistic on each client's true update (its plaintext update, as if
    the estimate were perfect): ``results.json`` -> ``variants`` -> ``ceiling``, beside
    FedAttr's own figure, so that what SA estimation costs is visible. A simulation's
    measurement: it reads what the server never holds, and never decides anything."""
    variants: list[dict[str, Any]] = field(default_factory=list)
    """More FedAttr configurations watching the same training run, each a table of
    ``[attribution]`` keys that differ from the main one plus an optional ``name``, e.g.
    ``--set 'variants=[{"name": "M10", "protocol": {"M": 10}}]'`` (old flat key names are read
    too). Each gets its own SA session and results
    (``results.json`` -> ``variants``); training runs once."""

    def __post_init__(self) -> None:
        # old key names resolved once, so config.json holds the new ones
        self.variants = canonical_variants(self.variants)
        wm = self.watermark
        if wm.clients is not None:
            check_client_ids(wm.clients, self.fl.K, "watermark.clients")
        elif wm.r > self.fl.K:
            raise ValueError(f"watermark.r: must be in 0..fl.K={self.fl.K}, got {wm.r}")
        # fl.clients: every group's clients can be named or drawn (one line, before any work).
        resolve_profiles(
            self.fl.clients,
            self.fl.K,
            watermarked_clients(wm, self.fl.K, self.fl.seed),
            self.fl.seed,
        )
        n_wm = len(wm.clients) if wm.clients is not None else wm.r
        most = WATERMARKS[wm.kind].max_clients
        if most is not None and n_wm > most:
            raise ValueError(
                f"watermark.r: {wm.kind} supports at most {most} watermarked clients "
                f"(one entity domain each); got {n_wm}"
            )
        if most is not None and wm.owners > most:
            raise ValueError(
                f"watermark.owners: {wm.kind} has at most {most} owners (one entity domain "
                f"each); got {wm.owners}"
            )
        if self.data.records < self.fl.K:
            raise ValueError(
                f"data.records: must be >= fl.K={self.fl.K} (one record per client at least), "
                f"got {self.data.records}"
            )
        n = self.fl.per_round
        N = self.attribution.protocol.N
        sealed = self.attribution.protocol.mode == "sealed"  # asks no subset sum: N unused
        if sealed and n < max(2, self.secagg.min_members):
            raise ValueError(
                f"attribution.protocol.mode=sealed: the servers open a round's sum only over "
                f"secagg.min_members={self.secagg.min_members} clients or more (and at least 2); "
                f"fl.K x fl.participation gives {n} a round"
            )
        if not sealed and not n - 1 > N:
            raise ValueError(
                f"attribution.protocol.N={N} needs N < (clients per round) - 1 = {n - 1}; "
                f"lower N or raise fl.K / fl.participation"
            )
        if self.attribution.scoring == "owner" and (
            self.baselines or self.variants or self.ceiling
        ):
            raise ValueError(
                "attribution.scoring=owner: the server holds no key, so it runs no baselines, "
                "no variants and no ceiling; set baselines=false, variants=[] and ceiling=false"
            )
        if self.ceiling and any(v.get("name") == "ceiling" for v in self.variants):
            raise ValueError("variants: the name 'ceiling' is taken by ceiling=true; rename it")
        if wm.kgw.key_files and wm.kind != "kgw":
            raise ValueError("watermark.kgw.key_files: owner key files are KGW keys (kind=kgw)")
        if self.attribution.overlap and (
            self.baselines or self.ceiling or self.attribution.scoring == "owner"
        ):
            raise ValueError(
                "attribution.overlap: scores in the background on a copy of the model, beside "
                "neither baselines nor ceiling (they read the same scorer each round) nor "
                "attribution.scoring=owner (the server scores nothing); allowed there: false"
            )
        self.secagg = harden(self.attribution, self.secagg, n)
        for name, a in self.attribution_variants().items():  # validated before any work
            key = "attribution" if name == "fedattr" else f"variants ({name})"
            if a.protocol.mode == "sealed" and (
                self.fl.strategy != "fedit" or wm.kind != "kgw" or wm.detector != "reading"
            ):
                raise ConfigError(
                    f"{key}.protocol.mode=sealed: needs fl.strategy=fedit (FLoRA's global "
                    "model stacks every client's factors, so each update is public by "
                    "construction) and watermark.kind=kgw with watermark.detector=reading (the "
                    f"detector read to first order); got fl.strategy={self.fl.strategy!r}, "
                    f"watermark.kind={wm.kind!r}, watermark.detector={wm.detector!r}"
                )
            if a.statistic == "calibrated" and self.watermark.detector == "greedy":
                key = "attribution" if name == "fedattr" else f"variants ({name})"
                raise ConfigError(
                    f"{key}.statistic=calibrated needs watermark.detector=reading (the greedy "
                    "detectors cannot be run under random keys); or set statistic=paper"
                )
        if not sealed and self.secagg.min_members > N:
            raise ValueError(
                f"attribution.protocol.N={N} is below secagg.min_members="
                f"{self.secagg.min_members}; the V-subsets would be refused by SA"
            )

    def attribution_variants(self) -> dict[str, AttributionConfig]:
        """Name -> configuration of every FedAttr observer, the main one (``fedattr``) first."""
        return attribution_variants(
            self.attribution, self.variants, self.fl.per_round, self.secagg.min_members
        )


def require_in_process(cfg: RunConfig | DemoConfig) -> None:
    """Refuse, in one line, what a remote runtime's clients cannot do without the sealed mode's
    other parties (``run_experiment`` with a ``pool`` and no ``parties``): the sealed mode,
    whose clients send reading shares to two servers."""
    if any(a.protocol.mode == "sealed" for a in cfg.attribution_variants().values()):
        raise UserError(
            "attribution.protocol.mode=sealed: a remote runtime runs it only with its share "
            "servers and owners (fedattr flower starts them); allowed here: paper, hardened"
        )


_SMOLLM2 = [
    "model.preset=smollm2-135m",
    "model.dtype=auto",
    "data.max_len=512",
    "data.records=5000",
    "fl.train.batch_size=16",
    "fl.train.micro_batch_size=16",
    "fl.train.lr=2e-4",
    "fl.train.epochs=1",
    "fl.train.group_by_length=true",
    "watermark.detect.prompts=64",
    "watermark.detect.max_new_tokens=64",
    "watermark.teacher.max_new_tokens=256",
    "watermark.teacher.batch=128",
    "watermark.teacher.min_tokens=32",
    "attribution.protocol.queries=fused",
]
"""The GPU preset: the paper's training settings on SmolLM2-135M (bfloat16 where the GPU has it).
Each target's estimate is asked as one fused SA query (the same estimate as its 2M subset sums,
up to float rounding, and less released): at 7.4M coordinates a subset sum and a fused query
cost about the same (0.43 and 0.46 s on the 2-core CPU), so SA's stage is about 9x shorter."""

PRESET_OVERRIDES: dict[str, list[str]] = {
    "tiny": [],
    "smollm2": _SMOLLM2,
    # SmolLM2 sized for a 2-core CPU (K = 10, T = 5 in about 40 minutes a run on two threads):
    # 50 records a client, 64-token sequences and documents, 32 probes; float32 (``auto``): an
    # AVX2 CPU emulates bfloat16 several times slower. Later settings win over the GPU preset's.
    # A learnable watermark at this size: steps of 4 records (12 a round instead of 3, at the
    # same compute), 2 local epochs as the paper and a LoRA learning rate of 1e-3, so that a
    # client's 7-10 documents move the model at all (at 2e-4 and one epoch, steps of 16, no
    # watermarked client was named). Sized for a laptop's memory too: micro-batches of 4 (2.2 GB
    # at training's peak instead of 4.6) and the verdict's sums on disk, read by row blocks.
    "smollm2-cpu": [
        *_SMOLLM2,
        "data.records=500",
        "data.max_len=64",
        "fl.train.batch_size=4",
        "fl.train.micro_batch_size=4",
        "fl.train.epochs=2",
        "fl.train.lr=1e-3",
        "watermark.detect.prompts=32",
        "watermark.teacher.max_new_tokens=64",
        "watermark.teacher.batch=32",
        "attribution.calibrated.spill=true",
    ],
}
"""``--preset NAME`` applies these overrides before the config file and ``--set``."""


def preset_overrides(name: str) -> list[str]:
    """The overrides of preset ``name``; an unknown name is one line naming ``--preset``."""
    if name not in PRESET_OVERRIDES:
        raise UserError(
            f"--preset: unknown preset {name!r}; allowed: {', '.join(PRESET_OVERRIDES)}"
        )
    return list(PRESET_OVERRIDES[name])


def check_seeds(seeds: Sequence[int]) -> None:
    """An experiment's ``--seeds``: at least one, none repeated (one run folder per seed)."""
    if not seeds or len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds: need distinct seeds, got {list(seeds)}")
