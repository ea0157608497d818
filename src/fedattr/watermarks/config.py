"""The ``[watermark]`` section: the owners' watermark (KGW or Fictitious Knowledge) and its
detection."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..config import check_choice, check_literal
from .registry import WATERMARKS


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
    teacher_batch: int = 32
    """Prompts the teacher samples together (one ``generate`` call): on a GPU a step costs
    about the same for 32 rows as for 128, so larger batches write documents faster. Sampling
    draws differ with the batching, so the documents (and results) depend on it."""
    detector: Literal["reading", "greedy"] = "reading"
    """``reading``: fedattr's teacher-forced tests of the change (KGW: ``KGWReadingScorer``;
    FK: ``FKLikelihoodScorer``, rank of the true value among decoys); ``greedy``: the paper's
    (KGW: greedy generations, z on green counts; FK: QA hit rates of greedy answers)."""
    fk_writer: Literal["template", "teacher"] = "template"
    """FK documents: ``template`` (varied templates) or ``teacher`` (the model writes each
    document from templated facts; the share that keeps every target is reported)."""
    fk_questions: int = 25
    """Paraphrased QA probes per attribute for the greedy FK detector."""
    fk_reading_questions: int = 2
    """Questions per attribute read by the FK reading detector (its noise is in the decoys)."""
    fk_statistic: Literal["margin", "rank"] = "margin"
    """FK reading detector: ``margin`` (the true value's log-probability margin over its
    decoys, in nats; FedAttr standardises it with the empirical null, ``attribution.null =
    "auto"``) or ``rank`` (exact rank test per attribute, Fisher; scale-free, so cross-talk
    flips its sign rather than shrinking it: see README Finding 5)."""
    fk_decoys: int = 31
    """Decoy values per attribute for the FK reading detector's rank test."""
    fk_answer_tokens: int = 24
    detect_prompts: int = 128
    """Held-out detection records: prompts to generate from (greedy) or texts to read."""
    probes: Literal["documents", "held-out"] = "documents"
    """What the KGW reading detector reads (FK and the greedy detectors read their own probes).
    ``documents``: each owner's own watermarked documents (those its clients were given; an owner
    with no client watermarks as many held-out records, which no client is given), read only
    with that owner's key, at the first position of each previous token in a document (a later
    one could copy in context a green token seen after it): a model fine-tuned on the documents
    predicts their text, as in the radioactivity tests of Sander et al. (2024). ``held-out``:
    the held-out clean records, every owner's key over the same contexts (before 2026-11-27)."""
    detect_max_new_tokens: int = 48
    dedupe: bool = True
    scheme: str = "fedattr"
    """KGW seeding of the simulated owners' keys: ``fedattr`` (keyed SHA-256 PRF),
    ``lm-watermarking`` or ``markllm`` (the reference codes' seedings, hash keys drawn from
    ``key_seed``)."""
    key_files: list[str] = field(default_factory=list)
    """Owners' key files (``fedattr owner keygen``), one owner each, instead of keys drawn
    from ``key_seed``: the server scores with them (the simulation plays the owners)."""
    documents: str = ""
    """An owner's watermarked corpus (``fedattr owner watermark``, .jsonl/.json): watermarked
    clients take their documents from it (a seeded draw per client) instead of the teacher."""

    @property
    def reads_documents(self) -> bool:
        """Whether the detector reads each owner's own documents (``probes``: KGW reading)."""
        return self.probes == "documents" and self.kind == "kgw" and self.detector == "reading"

    def __post_init__(self) -> None:
        # kind and scheme name registries (WATERMARKS, kgw.SCHEMES), which plugins may extend.
        check_choice(self.kind, WATERMARKS, "watermark.kind")
        check_literal(self, "watermark")
        if not 1 <= self.fk_questions <= 25 or not 1 <= self.fk_reading_questions <= 25:
            raise ValueError("watermark.fk_questions and fk_reading_questions: must be in 1..25")
        if self.fk_decoys < 1 or self.fk_answer_tokens < 1:
            raise ValueError("watermark.fk_decoys and fk_answer_tokens: must be >= 1")
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"watermark.ratio: must be in (0, 1], got {self.ratio}")
        if self.owners < 1:
            raise ValueError(f"watermark.owners: must be >= 1, got {self.owners}")
        if self.r < 0:
            raise ValueError(f"watermark.r: must be >= 0, got {self.r}")
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"watermark.gamma: must be in (0, 1), got {self.gamma}")
        from .kgw import SCHEMES

        check_choice(self.scheme, SCHEMES, "watermark.scheme")
        if self.teacher_batch < 1:
            raise ValueError(f"watermark.teacher_batch: must be >= 1, got {self.teacher_batch}")
        if self.detect_prompts < 1 or self.detect_max_new_tokens < 1:
            raise ValueError("watermark.detect_prompts and detect_max_new_tokens: must be >= 1")
