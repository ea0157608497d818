"""Watermark kinds by name (``watermark.kind``): who the owners are, how their documents are
written, and which detector scores a model for them.

A kind is one object with three steps, used in this order by the federation builder and the
run: ``owners`` (one secret per corpus owner), ``documents`` (a watermarked client's share of
its owner's documents), ``scorer`` (the detector, ``reading`` or ``greedy``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from ..data.records import Record
from ..models.text import encode_examples
from .documents import KGWDocumentScorer
from .fictitious import DOMAINS, FictitiousEntity, make_entities, target_share, template_documents
from .keys import load_key
from .kgw import SCHEMES
from .knowledge import FKHitRateScorer, FKLikelihoodScorer
from .radioactivity import KGWModelScorer, KGWReadingScorer
from .teacher import watermark_records, write_fk_documents

if TYPE_CHECKING:  # the config module validates kinds against this registry
    from .config import WatermarkConfig

Say = Callable[[str], None]
Detector = Literal["reading", "greedy"]


@dataclass(frozen=True)
class DetectionSetup:
    """What a kind's detector is built from (:meth:`WatermarkKind.scorer`)."""

    config: WatermarkConfig
    model: Any
    """The model the detector reads (LoRA attached: candidates are loaded into it)."""
    tokenizer: Any
    owners: Mapping[str, Any]
    """Owner name -> the owner's secret (a key scheme, or a fabricated entity)."""
    detect_records: Sequence[Record]
    """Held-out clean records the reading detector reads."""
    detect_prompts: Sequence[str]
    """Prompts the greedy detector generates from."""
    load_state: Callable[[Any, Mapping], Any]
    """How one candidate's parameters are loaded into ``model``."""
    max_len: int
    """Token limit of a read record (``data.max_len``)."""
    stack: Callable[[Any, Sequence[Mapping]], AbstractContextManager] | None = None
    """A context running several candidates' parameters in one forward pass, for detectors
    that can use it (:func:`fedattr.models.lora.candidate_stacker`)."""
    owner_documents: Mapping[str, Sequence[Record]] | None = None
    """Owner name -> its watermarked documents (``watermark.kgw.probes = "documents"``)."""


class WatermarkKind:
    """One watermark scheme's steps (see the module docstring)."""

    name: ClassVar[str]
    max_clients: ClassVar[int | None] = None
    """Most watermarked clients the kind supports (``None``: no limit)."""

    def owners(
        self, wm: WatermarkConfig, vocab_size: int, n_clients: int, clean_texts: Sequence[str]
    ) -> dict:
        """Owner name -> the owner's secret (a key scheme, or a fabricated entity)."""
        raise NotImplementedError

    def documents(
        self,
        wm: WatermarkConfig,
        model: Any,
        tokenizer: Any,
        owner: str,
        secret: Any,
        client: int | None,
        shard: list[Record],
        n: int,
        seed: int,
        say: Say,
        fits: Callable[[Record], bool] | None = None,
    ) -> tuple[list[Record], float | None]:
        """``n`` of ``client``'s records replaced by its owner's documents (some may be dropped),
        and the share of them carrying every target (FK) or ``None``. ``client`` is ``None``
        for an owner's documents that no client is given (its probes, ``watermark.kgw.probes``).
        ``fits``: whether training keeps a whole record (written documents are made to fit)."""
        raise NotImplementedError

    def scorer(self, setup: DetectionSetup, detector: Detector) -> Any:
        """The detector (``watermark.detector``) over every owner's secret."""
        raise NotImplementedError


class KGW(WatermarkKind):
    """Kirchenbauer et al.'s green lists: the teacher rewrites responses under the owner's key."""

    name = "kgw"

    def owners(self, wm, vocab_size, n_clients, clean_texts):
        if wm.kgw.key_files:
            keys = [load_key(path, "kgw", "watermark.kgw.key_files") for path in wm.kgw.key_files]
            return {f"kgw:{k.fingerprint}": k.kgw_scheme(vocab_size) for k in keys}

        def key(owner: int) -> int:
            drawn = int(np.random.default_rng([wm.key_seed, owner]).integers(2**62))
            # the reference codes take an integer hash key below 2^31
            return drawn if wm.kgw.scheme == "fedattr" else 1 + drawn % (2**31 - 2)

        return {
            f"kgw:owner{o}": SCHEMES[wm.kgw.scheme](key(o), vocab_size, wm.kgw.gamma, wm.kgw.delta)
            for o in range(wm.owners)
        }

    def documents(
        self, wm, model, tokenizer, owner, secret, client, shard, n, seed, say, fits=None
    ):
        if wm.kgw.documents:
            docs = owner_documents(wm.kgw.documents, n, seed)
            whom = f"client {client}" if client is not None else f"{owner} (no client)"
            say(f"{whom}: {len(docs)} documents from the owner's corpus {wm.kgw.documents}")
            return docs, None
        whose = f"client {client}'s" if client is not None else "held-out (no client's)"
        say(f"teacher: watermarking {n} of {len(shard)} {whose} documents ({owner})")
        docs = watermark_records(
            model,
            tokenizer,
            shard[:n],
            secret,
            max_new_tokens=wm.teacher.max_new_tokens,
            min_tokens=wm.teacher.min_tokens,
            temperature=wm.teacher.temperature,
            top_p=wm.teacher.top_p,
            seed=seed,
            batch_size=wm.teacher.batch,
        )
        return docs, None

    def scorer(self, setup: DetectionSetup, detector: Detector) -> Any:
        s, wm = setup, setup.config
        if detector == "greedy":
            return KGWModelScorer(
                s.model,
                s.tokenizer,
                s.detect_prompts,
                s.owners,
                s.load_state,
                max_new_tokens=wm.detect.max_new_tokens,
                dedupe=wm.detect.dedupe,
            )
        if wm.reads_documents:
            if s.owner_documents is None:
                raise ValueError(
                    "watermark.kgw.probes=documents: the owners' documents are not given"
                )
            return KGWDocumentScorer(
                s.model,
                s.tokenizer,
                s.owner_documents,
                s.owners,
                s.load_state,
                max_len=s.max_len,
                stack=s.stack,
            )
        examples = encode_examples(s.tokenizer, s.detect_records, s.max_len)
        return KGWReadingScorer(
            s.model,
            examples,
            s.owners,
            s.load_state,
            pad_id=s.tokenizer.pad_token_id,
            stack=s.stack,
        )


class FictitiousKnowledge(WatermarkKind):
    """One fabricated entity per watermarked client, each its own owner, in its own domain; at
    least ``watermark.owners`` of them (an owner no client trained on still has facts to read:
    the level at r = 0)."""

    name = "fk"
    max_clients = len(DOMAINS)

    def owners(self, wm, vocab_size, n_clients, clean_texts):
        # Its values occur in no clean record.
        n = max(n_clients, wm.owners)
        entities = make_entities(n, wm.key_seed, clean_texts, decoys=wm.fk.decoys)
        return {f"fk:owner{k}": e for k, e in enumerate(entities)}

    def documents(
        self,
        wm,
        model,
        tokenizer,
        owner,
        secret: FictitiousEntity,
        client,
        shard,
        n,
        seed,
        say,
        fits=None,
    ):
        say(f"FK: {n} documents about {secret.name} for client {client} ({wm.fk.writer})")
        if wm.fk.writer == "teacher":
            docs = write_fk_documents(
                model,
                tokenizer,
                secret,
                n,
                max_new_tokens=wm.teacher.max_new_tokens,
                temperature=wm.teacher.temperature,
                top_p=wm.teacher.top_p,
                seed=seed,
                batch_size=wm.teacher.batch,
            )
        else:
            docs = template_documents(secret, n, seed, fits)
        return docs, target_share(docs, secret)

    def scorer(self, setup: DetectionSetup, detector: Detector) -> Any:
        s, wm = setup, setup.config
        if detector == "greedy":
            return FKHitRateScorer(
                s.model,
                s.tokenizer,
                s.owners,
                s.load_state,
                questions=wm.fk.questions,
                max_new_tokens=wm.fk.answer_tokens,
            )
        return FKLikelihoodScorer(
            s.model,
            s.tokenizer,
            s.owners,
            s.load_state,
            questions=wm.fk.reading_questions,
            statistic=wm.fk.statistic,
        )


def owner_documents(path: str, n: int, seed: int) -> list[Record]:
    """``n`` documents drawn (seeded, without replacement) from an owner's watermarked corpus;
    all of them when it holds fewer."""
    from ..data.loaders import load_records

    docs = load_records(path, option="watermark.kgw.documents")
    order = np.random.default_rng([seed, 0xD0C5]).permutation(len(docs))[:n]
    return [docs[i] for i in sorted(order)]


WATERMARKS: dict[str, WatermarkKind] = {k.name: k() for k in (KGW, FictitiousKnowledge)}
"""``watermark.kind`` -> its steps."""
