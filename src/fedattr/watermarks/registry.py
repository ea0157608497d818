"""Watermark kinds by name (``watermark.kind``): who the owners are, how their documents are
written, and which detector scores a model for them.

A kind is one object with three steps, used in this order by the federation builder and the
run: ``owners`` (one secret per corpus owner), ``documents`` (a watermarked client's share of
its owner's documents), ``scorer`` (the detector, ``reading`` or ``greedy``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from ..data.records import Record
from ..models.text import encode_examples
from .fictitious import DOMAINS, FictitiousEntity, make_entities, target_share, template_documents
from .keys import load_key
from .kgw import SCHEMES
from .knowledge import FKHitRateScorer, FKLikelihoodScorer
from .radioactivity import KGWModelScorer, KGWReadingScorer
from .teacher import watermark_records, write_fk_documents

Say = Callable[[str], None]


class WatermarkKind:
    """One watermark scheme's steps (see the module docstring)."""

    name: ClassVar[str]
    max_clients: ClassVar[int | None] = None
    """Most watermarked clients the kind supports (``None``: no limit)."""

    def owners(self, wm, vocab_size: int, n_clients: int, clean_texts: Sequence[str]) -> dict:
        """Owner name -> the owner's secret (a key scheme, or a fabricated entity)."""
        raise NotImplementedError

    def documents(
        self, wm, model, tokenizer, owner: str, secret: Any, client: int, shard: list[Record],
        n: int, seed: int, say: Say,
    ) -> tuple[list[Record], float | None]:  # fmt: skip
        """``n`` of ``client``'s records replaced by its owner's documents (some may be dropped),
        and the share of them carrying every target (FK) or ``None``."""
        raise NotImplementedError

    def scorer(
        self, wm, model, tokenizer, owners: Mapping[str, Any], detect_records: Sequence[Record],
        detect_prompts: Sequence[str], load: Callable, detector: str, max_len: int,
        stack: Callable | None = None,
    ) -> Any:  # fmt: skip
        """The detector over every owner's secret. ``stack(model, states)``: a context that runs
        several candidates' parameters in one forward pass, for detectors that can use it."""
        raise NotImplementedError


class KGW(WatermarkKind):
    """Kirchenbauer et al.'s green lists: the teacher rewrites responses under the owner's key."""

    name = "kgw"

    def owners(self, wm, vocab_size, n_clients, clean_texts):
        if wm.key_files:
            keys = [load_key(path, "kgw", "watermark.key_files") for path in wm.key_files]
            return {f"kgw:{k.fingerprint}": k.kgw_scheme(vocab_size) for k in keys}

        def key(owner: int) -> int:
            drawn = int(np.random.default_rng([wm.key_seed, owner]).integers(2**62))
            # the reference codes take an integer hash key below 2^31
            return drawn if wm.scheme == "fedattr" else 1 + drawn % (2**31 - 2)

        return {
            f"kgw:owner{o}": SCHEMES[wm.scheme](key(o), vocab_size, wm.gamma, wm.delta)
            for o in range(wm.owners)
        }

    def documents(self, wm, model, tokenizer, owner, secret, client, shard, n, seed, say):
        if wm.documents:
            docs = owner_documents(wm.documents, n, seed)
            say(f"client {client}: {len(docs)} documents from the owner's corpus {wm.documents}")
            return docs, None
        say(f"teacher: watermarking {n} of client {client}'s {len(shard)} documents ({owner})")
        docs = watermark_records(
            model, tokenizer, shard[:n], secret, max_new_tokens=wm.doc_max_new_tokens,
            min_tokens=wm.min_tokens, temperature=wm.temperature, top_p=wm.top_p, seed=seed,
            batch_size=wm.teacher_batch,
        )  # fmt: skip
        return docs, None

    def scorer(self, wm, model, tokenizer, owners, detect_records, detect_prompts, load,
               detector, max_len, stack=None):  # fmt: skip
        if detector == "greedy":
            return KGWModelScorer(
                model, tokenizer, detect_prompts, owners, load,
                max_new_tokens=wm.detect_max_new_tokens, dedupe=wm.dedupe,
            )  # fmt: skip
        examples = encode_examples(tokenizer, detect_records, max_len)
        return KGWReadingScorer(model, examples, owners, load, pad_id=tokenizer.pad_token_id,
                                stack=stack)  # fmt: skip


class FictitiousKnowledge(WatermarkKind):
    """One fabricated entity per watermarked client, each its own owner, in its own domain."""

    name = "fk"
    max_clients = len(DOMAINS)

    def owners(self, wm, vocab_size, n_clients, clean_texts):
        # Its values occur in no clean record.
        entities = make_entities(n_clients, wm.key_seed, clean_texts, decoys=wm.fk_decoys)
        return {f"fk:owner{k}": e for k, e in enumerate(entities)}

    def documents(self, wm, model, tokenizer, owner, secret: FictitiousEntity, client, shard, n,
                  seed, say):  # fmt: skip
        say(f"FK: {n} documents about {secret.name} for client {client} ({wm.fk_writer})")
        if wm.fk_writer == "teacher":
            docs = write_fk_documents(
                model, tokenizer, secret, n, max_new_tokens=wm.doc_max_new_tokens,
                temperature=wm.temperature, top_p=wm.top_p, seed=seed,
                batch_size=wm.teacher_batch,
            )  # fmt: skip
        else:
            docs = template_documents(secret, n, seed)
        return docs, target_share(docs, secret)

    def scorer(self, wm, model, tokenizer, owners, detect_records, detect_prompts, load,
               detector, max_len, stack=None):  # fmt: skip
        if detector == "greedy":
            return FKHitRateScorer(
                model, tokenizer, owners, load, questions=wm.fk_questions,
                max_new_tokens=wm.fk_answer_tokens,
            )  # fmt: skip
        return FKLikelihoodScorer(
            model, tokenizer, owners, load, questions=wm.fk_reading_questions,
            statistic=wm.fk_statistic,
        )  # fmt: skip


def owner_documents(path: str, n: int, seed: int) -> list[Record]:
    """``n`` documents drawn (seeded, without replacement) from an owner's watermarked corpus;
    all of them when it holds fewer."""
    from ..data.loaders import load_records

    docs = load_records(path, option="watermark.documents")
    order = np.random.default_rng([seed, 0xD0C5]).permutation(len(docs))[:n]
    return [docs[i] for i in sorted(order)]


WATERMARKS: dict[str, WatermarkKind] = {k.name: k() for k in (KGW, FictitiousKnowledge)}
"""``watermark.kind`` -> its steps."""
