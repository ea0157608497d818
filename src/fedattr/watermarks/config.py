"""The ``[watermark]`` section: the owners' watermark (KGW or Fictitious Knowledge) and its
detection, with the sections ``kgw``, ``fk``, ``teacher`` and ``detect``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ..config import check_choice, check_literal
from .registry import WATERMARKS


@dataclass
class KGWConfig:
    """KGW green lists: the owners' keys, their documents and what the reading detector
    reads."""

    gamma: float = 0.25
    """The green fraction: each context's green list holds ``gamma`` of the vocabulary, in
    (0, 1) (Kirchenbauer et al.'s gamma)."""
    delta: float = 3.0
    """The logit bias the teacher adds to green tokens when it writes an owner's documents
    (Kirchenbauer et al.'s delta), >= 0."""
    scheme: str = "fedattr"
    """Seeding of the simulated owners' keys: ``fedattr`` (keyed SHA-256 PRF),
    ``lm-watermarking`` or ``markllm`` (the reference codes' seedings, hash keys drawn from
    ``watermark.key_seed``)."""
    probes: Literal["documents", "held-out"] = "documents"
    """What the KGW reading detector reads (FK and the greedy detectors read their own probes).
    ``documents``: each owner's own watermarked documents (those its clients were given; an owner
    with no client watermarks as many held-out records, which no client is given), read only
    with that owner's key, at the first position of each previous token in a document (a later
    one could copy in context a green token seen after it): a model fine-tuned on the documents
    predicts their text, as in the radioactivity tests of Sander et al. (2024). ``held-out``:
    the held-out clean records, every owner's key over the same contexts."""
    key_files: list[str] = field(default_factory=list)
    """Owners' key files (``fedattr owner keygen``), one owner each, instead of keys drawn
    from ``watermark.key_seed``: the server scores with them (the simulation plays the owners)."""
    documents: str = ""
    """An owner's watermarked corpus (``fedattr owner watermark``, .jsonl/.json): watermarked
    clients take their documents from it (a seeded draw per client) instead of the teacher."""

    def __post_init__(self) -> None:
        check_literal(self, "watermark.kgw")
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"watermark.kgw.gamma: must be in (0, 1), got {self.gamma}")
        if self.delta < 0:
            raise ValueError(f"watermark.kgw.delta: must be >= 0, got {self.delta}")
        # a registry (kgw.SCHEMES), which plugins may extend
        from .kgw import SCHEMES

        check_choice(self.scheme, SCHEMES, "watermark.kgw.scheme")


@dataclass
class FKConfig:
    """Fictitious Knowledge: how the documents are written and how the detectors question the
    model."""

    writer: Literal["template", "teacher"] = "template"
    """Documents: ``template`` (varied templates) or ``teacher`` (the model writes each
    document from templated facts, sampled as ``[watermark.teacher]`` says; the share of the
    targets they keep is reported). Template documents are made to fit ``data.max_len``: a
    target past the limit would never be trained on."""
    questions: int = 25
    """Paraphrased QA probes per attribute for the greedy FK detector, in 1..25."""
    answer_tokens: int = 24
    """Tokens the greedy FK detector generates per answer, >= 1."""
    reading_questions: int = 2
    """Questions per attribute read by the FK reading detector (its noise is in the decoys),
    in 1..25."""
    statistic: Literal["margin", "rank"] = "margin"
    """The FK reading detector's statistic: ``margin`` (the true value's log-probability margin
    over its decoys, in nats; the paper statistic standardises it with the empirical null,
    ``attribution.paper.null = "auto"``) or ``rank`` (exact rank test per attribute, Fisher;
    scale-free, so cross-talk flips its sign rather than shrinking it: see README Finding 5)."""
    decoys: int = 31
    """Decoy values per attribute for the FK reading detector's rank test, >= 1."""

    def __post_init__(self) -> None:
        check_literal(self, "watermark.fk")
        for name in ("questions", "reading_questions"):
            if not 1 <= getattr(self, name) <= 25:
                raise ValueError(
                    f"watermark.fk.{name}: must be in 1..25, got {getattr(self, name)}"
                )
        for name in ("decoys", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"watermark.fk.{name}: must be >= 1, got {getattr(self, name)}")


@dataclass
class TeacherConfig:
    """The teacher: the base model writing the owners' documents by sampling (KGW: each
    record's response rewritten under the owner's green lists; FK with ``fk.writer =
    "teacher"``: documents from templated facts)."""

    temperature: float = 0.8
    """Sampling temperature."""
    top_p: float = 0.95
    """Nucleus sampling: the smallest set of tokens whose probability reaches ``top_p``."""
    max_new_tokens: int = 96
    """Tokens generated per document at most."""
    min_tokens: int = 8
    """KGW: a rewritten response shorter than this (in generated tokens) is dropped, too short
    to carry a detectable signal."""
    batch: int = 32
    """Prompts sampled together (one ``generate`` call): on a GPU a step costs about the same
    for 32 rows as for 128, so larger batches write documents faster. Sampling draws differ with
    the batching, so the documents (and results) depend on it."""

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"watermark.teacher.batch: must be >= 1, got {self.batch}")


@dataclass
class DetectConfig:
    """The held-out detection records and the greedy detectors' generations."""

    prompts: int = 128
    """Held-out detection records: prompts to generate from (greedy) or texts to read (the KGW
    reading detector with ``watermark.kgw.probes = "held-out"``), >= 1."""
    max_new_tokens: int = 48
    """Greedy KGW detector: tokens generated per prompt, >= 1."""
    dedupe: bool = True
    """Greedy KGW detector: score each distinct ``(previous token, token)`` pair once per
    detection call (a repeated pair is the same trial seen twice; counting it again inflates
    ``z`` on repetitive greedy text)."""

    def __post_init__(self) -> None:
        for name in ("prompts", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"watermark.detect.{name}: must be >= 1, got {getattr(self, name)}"
                )


@dataclass
class WatermarkConfig:
    """The owners' watermark (KGW or Fictitious Knowledge) and its detection: who is watermarked
    and how much, with a section per concern: KGW's keys (``kgw``), FK's documents and questions
    (``fk``), the teacher that writes documents (``teacher``) and the detection records
    (``detect``)."""

    ALIASES: ClassVar[dict[str, str]] = {
        "gamma": "kgw.gamma",
        "delta": "kgw.delta",
        "scheme": "kgw.scheme",
        "probes": "kgw.probes",
        "key_files": "kgw.key_files",
        "documents": "kgw.documents",
        "fk_writer": "fk.writer",
        "fk_questions": "fk.questions",
        "fk_answer_tokens": "fk.answer_tokens",
        "fk_reading_questions": "fk.reading_questions",
        "fk_statistic": "fk.statistic",
        "fk_decoys": "fk.decoys",
        "temperature": "teacher.temperature",
        "top_p": "teacher.top_p",
        "doc_max_new_tokens": "teacher.max_new_tokens",
        "min_tokens": "teacher.min_tokens",
        "teacher_batch": "teacher.batch",
        "detect_prompts": "detect.prompts",
        "detect_max_new_tokens": "detect.max_new_tokens",
        "dedupe": "detect.dedupe",
    }
    """The flat keys before the sections (old key -> its place now): still read, with a note."""

    kind: str = "kgw"
    """``kgw`` (teacher-rewritten responses under the owner's green lists) or ``fk``
    (Fictitious Knowledge: documents about a fabricated entity per watermarked client; every
    watermarked client is its own owner, so ``owners`` is ignored)."""
    r: int = 3
    """Watermarked clients, chosen by seed (ignored when ``clients`` is given)."""
    clients: list[int] | None = None
    """The watermarked clients by id (distinct, in ``0..fl.K-1``) instead of ``r`` drawn by
    seed."""
    owners: int = 3
    """Corpus owners, each with a secret key; watermarked client k uses owner k mod owners (FK:
    one entity per watermarked client, at least ``owners`` of them)."""
    ratio: float = 0.20
    """Share of a watermarked client's records replaced by its owner's documents (rho_wm)."""
    key_seed: int = 1234
    """Seed of the simulated owners' secrets: KGW keys (unless ``kgw.key_files``) and FK's
    fabricated entities and decoys."""
    detector: Literal["reading", "greedy"] = "reading"
    """``reading``: fedattr's teacher-forced tests of the change (KGW: ``KGWReadingScorer``;
    FK: ``FKLikelihoodScorer``, rank of the true value among decoys); ``greedy``: the paper's
    (KGW: greedy generations, z on green counts; FK: QA hit rates of greedy answers)."""
    kgw: KGWConfig = field(default_factory=KGWConfig)
    """Read where ``kind = "kgw"``."""
    fk: FKConfig = field(default_factory=FKConfig)
    """Read where ``kind = "fk"``."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """Unused where the documents come from an owner's corpus (``kgw.documents``) or from
    templates (FK's ``writer = "template"``)."""
    detect: DetectConfig = field(default_factory=DetectConfig)
    """Every detector holds out ``prompts`` records; the greedy ones generate from them."""

    @property
    def reads_documents(self) -> bool:
        """Whether the detector reads each owner's own documents (``kgw.probes``: KGW reading)."""
        return self.kgw.probes == "documents" and self.kind == "kgw" and self.detector == "reading"

    def __post_init__(self) -> None:
        # kind names a registry (WATERMARKS), which plugins may extend.
        check_choice(self.kind, WATERMARKS, "watermark.kind")
        check_literal(self, "watermark")
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"watermark.ratio: must be in (0, 1], got {self.ratio}")
        if self.owners < 1:
            raise ValueError(f"watermark.owners: must be >= 1, got {self.owners}")
        if self.r < 0:
            raise ValueError(f"watermark.r: must be >= 0, got {self.r}")
