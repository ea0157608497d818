"""The configuration of ``fedattr run``: one typed tree, loadable from a file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..attribution.protocol import AttributionConfig
from ..config import check_client_ids
from ..models.config import LoRAConfig, ModelConfig
from ..models.training import TrainSettings
from ..secagg import SecAggConfig, single_estimate_budget


@dataclass
class DataConfig:
    """Where the clients' instruction data comes from and how it is split."""

    path: str = ""
    """Local .json/.jsonl (Alpaca or chat form) or a Hugging Face dataset id; empty: the
    embedded procedural corpus."""
    split: str = "train"
    records: int = 2000
    """Records drawn for the clients (embedded corpus size, or a cap on a loaded file)."""
    partition: str = "iid"
    """``iid`` or ``dirichlet``."""
    dirichlet_alpha: float = 0.5
    max_len: int = 128
    """Longest training sequence in tokens."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.partition not in ("iid", "dirichlet"):
            raise ValueError(f"data.partition: must be iid or dirichlet, got {self.partition!r}")
        if self.records < 1:
            raise ValueError(f"data.records: must be >= 1, got {self.records}")
        if self.max_len < 8:
            raise ValueError(f"data.max_len: must be >= 8, got {self.max_len}")
        p = Path(self.path)
        # Only a .json/.jsonl path is surely a local file: "owner/name" may be a hub dataset id.
        if self.path and p.suffix in (".json", ".jsonl") and not p.exists():
            # Checked here, before any model is loaded or trained.
            raise ValueError(f"data.path: file {self.path!r} does not exist")


@dataclass
class WatermarkConfig:
    """The owners' watermark (KGW or Fictitious Knowledge) and its detection."""

    kind: str = "kgw"
    """``kgw`` (teacher-rewritten responses under the owner's green lists) or ``fk``
    (Fictitious Knowledge: documents about a fabricated entity per watermarked client; every
    watermarked client is its own owner, so ``owners`` is ignored)."""
    r: int = 3
    """Watermarked clients, chosen by seed (ignored when ``clients`` is given)."""
    clients: list[int] | None = None
    owners: int = 3
    """Corpus owners, each with a secret key; watermarked client k uses owner k mod owners."""
    ratio: float = 0.20
    """Share of a watermarked client's records replaced by its owner's documents (rho_wm)."""
    gamma: float = 0.25
    delta: float = 3.0
    key_seed: int = 1234
    temperature: float = 0.8
    top_p: float = 0.95
    doc_max_new_tokens: int = 96
    min_tokens: int = 8
    detector: str = "reading"
    """``reading``: fedattr's teacher-forced tests of the change (KGW: ``KGWReadingScorer``;
    FK: ``FKLikelihoodScorer``, rank of the true value among decoys); ``greedy``: the paper's
    (KGW: greedy generations, z on green counts; FK: QA hit rates of greedy answers)."""
    fk_writer: str = "template"
    """FK documents: ``template`` (varied templates) or ``teacher`` (the model writes each
    document from templated facts; the share that keeps every target is reported)."""
    fk_questions: int = 25
    """Paraphrased QA probes per attribute for the greedy FK detector."""
    fk_reading_questions: int = 2
    """Questions per attribute read by the FK reading detector (its noise is in the decoys)."""
    fk_statistic: str = "margin"
    """FK reading detector: ``margin`` (the true value's log-probability margin over its
    decoys, in nats; FedAttr standardises it with the empirical null, ``attribution.null =
    "auto"``) or ``rank`` (exact rank test per attribute, Fisher; scale-free, so cross-talk
    flips its sign rather than shrinking it: see README Finding 5)."""
    fk_decoys: int = 31
    """Decoy values per attribute for the FK reading detector's rank test."""
    fk_answer_tokens: int = 24
    detect_prompts: int = 128
    """Held-out detection records: prompts to generate from (greedy) or texts to read."""
    detect_max_new_tokens: int = 48
    dedupe: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("kgw", "fk"):
            raise ValueError(f"watermark.kind: must be kgw or fk, got {self.kind!r}")
        if self.fk_statistic not in ("rank", "margin"):
            raise ValueError(
                f"watermark.fk_statistic: must be rank or margin, got {self.fk_statistic!r}"
            )
        if self.fk_writer not in ("template", "teacher"):
            raise ValueError(
                f"watermark.fk_writer: must be template or teacher, got {self.fk_writer!r}"
            )
        if not 1 <= self.fk_questions <= 25 or not 1 <= self.fk_reading_questions <= 25:
            raise ValueError("watermark.fk_questions and fk_reading_questions: must be in 1..25")
        if self.fk_decoys < 1 or self.fk_answer_tokens < 1:
            raise ValueError("watermark.fk_decoys and fk_answer_tokens: must be >= 1")
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"watermark.ratio: must be in (0, 1], got {self.ratio}")
        if self.detector not in ("reading", "greedy"):
            raise ValueError(
                f"watermark.detector: must be reading or greedy, got {self.detector!r}"
            )
        if self.owners < 1:
            raise ValueError(f"watermark.owners: must be >= 1, got {self.owners}")
        if self.r < 0:
            raise ValueError(f"watermark.r: must be >= 0, got {self.r}")
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"watermark.gamma: must be in (0, 1), got {self.gamma}")
        if self.detect_prompts < 1 or self.detect_max_new_tokens < 1:
            raise ValueError("watermark.detect_prompts and detect_max_new_tokens: must be >= 1")


@dataclass
class FLConfig:
    """Federated training."""

    K: int = 10
    rounds: int = 5
    participation: float = 1.0
    """Fraction C/K of clients sampled each round."""
    strategy: str = "fedit"
    """``fedit`` or ``flora``."""
    train: TrainSettings = field(default_factory=lambda: TrainSettings(lr=1e-3, epochs=2))
    """Local training. The tiny default trains 2 epochs at peak LR 1e-3 (a from-scratch 2-layer
    model learns little in the paper's 1 epoch at 2e-4); the smollm2 preset uses 1 at 2e-4."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.K < 3:
            raise ValueError(f"fl.K: must be >= 3, got {self.K}")
        if self.rounds < 1:
            raise ValueError(f"fl.rounds: must be >= 1, got {self.rounds}")
        if not 0.0 < self.participation <= 1.0:
            raise ValueError(f"fl.participation: must be in (0, 1], got {self.participation}")
        if self.strategy not in ("fedit", "flora"):
            raise ValueError(f"fl.strategy: must be fedit or flora, got {self.strategy!r}")


def harden(attribution: AttributionConfig, secagg: SecAggConfig, K: int) -> None:
    """Hardened mode without an explicit budget gets the paper's single-estimate bound at
    (K, N, M): no client may leak more jointly than one accepted estimate may alone."""
    if attribution.mode == "hardened" and secagg.release_budget == 0:
        secagg.release_budget = single_estimate_budget(K, attribution.N, attribution.M)


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
    baselines: bool = False
    """Also run the baselines (global-model test, Direct, FLDetector, FLForensics) on the same
    training run; they read plaintext updates, which FedAttr never does."""

    def __post_init__(self) -> None:
        wm = self.watermark
        if wm.clients is not None:
            check_client_ids(wm.clients, self.fl.K, "watermark.clients")
        elif wm.r > self.fl.K:
            raise ValueError(f"watermark.r: must be in 0..fl.K={self.fl.K}, got {wm.r}")
        n_wm = len(wm.clients) if wm.clients is not None else wm.r
        if wm.kind == "fk" and n_wm > 6:
            raise ValueError(
                f"watermark.r: FK has 6 entity domains, one per watermarked client; got {n_wm}"
            )
        n = max(1, round(self.fl.participation * self.fl.K))
        if not n - 1 > self.attribution.N:
            raise ValueError(
                f"attribution.N={self.attribution.N} needs N < (clients per round) - 1 = {n - 1}; "
                f"lower N or raise fl.K / fl.participation"
            )
        harden(self.attribution, self.secagg, n)
        if self.secagg.min_members > self.attribution.N:
            raise ValueError(
                f"attribution.N={self.attribution.N} is below secagg.min_members="
                f"{self.secagg.min_members}; the V-subsets would be refused by SA"
            )


PRESET_OVERRIDES: dict[str, list[str]] = {
    "tiny": [],
    "smollm2": [
        "model.preset=smollm2-135m",
        "model.dtype=bfloat16",
        "data.max_len=512",
        "data.records=5000",
        "fl.train.batch_size=16",
        "fl.train.micro_batch_size=16",
        "fl.train.lr=2e-4",
        "fl.train.epochs=1",
        "watermark.detect_prompts=64",
        "watermark.detect_max_new_tokens=64",
        "watermark.doc_max_new_tokens=256",
        "watermark.min_tokens=32",
    ],
}
"""``--preset NAME`` applies these overrides before the config file and ``--set``."""
