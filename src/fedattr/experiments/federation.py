"""Who trains on what: client datasets, watermarked clients and their owners' documents, and
the watermark detector (the data/model stage of a run, before any FL round)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..data.corpus import generate_corpus
from ..data.loaders import load_records
from ..data.partition import partition_dirichlet, partition_iid
from ..data.records import Record
from ..fl import FedIT, FLoRA, Strategy
from ..models.text import encode_examples, format_prompt
from ..watermarks.fictitious import (
    FictitiousEntity,
    make_entities,
    target_share,
    template_documents,
)
from ..watermarks.kgw import KGWScheme
from ..watermarks.knowledge import FKHitRateScorer, FKLikelihoodScorer
from ..watermarks.radioactivity import KGWModelScorer, KGWReadingScorer
from ..watermarks.teacher import watermark_records, write_fk_documents
from .config import RunConfig

Progress = Callable[[str], None]


@dataclass
class Federation:
    """Client datasets, who is watermarked with which owner's documents, detection data."""

    shards: list[list[Record]]
    owner_of: dict[int, str]
    owners: dict[str, KGWScheme | FictitiousEntity]
    """Owner name -> KGW key scheme, or the owner's fabricated entity (FK)."""
    detect_prompts: list[str]
    detect_records: list[Record]
    wm_docs: dict[int, int]
    doc_target_share: dict[int, float] = field(default_factory=dict)
    """FK: share of each watermarked client's documents stating every target attribute."""

    def summary(self) -> dict:
        """JSON-ready description (for results.json)."""
        out: dict = {
            "watermarked": {str(c): o for c, o in self.owner_of.items()},
            "watermarked_docs": {str(c): n for c, n in self.wm_docs.items()},
            "detect_prompts": len(self.detect_prompts),
        }
        if self.doc_target_share:
            out["doc_target_share"] = {str(c): v for c, v in self.doc_target_share.items()}
            out["entities"] = {
                o: e.to_dict() for o, e in self.owners.items() if isinstance(e, FictitiousEntity)
            }
        return out


def watermarked_clients(cfg: RunConfig) -> list[int]:
    """The watermarked clients: ``watermark.clients``, or ``watermark.r`` drawn by seed."""
    wm = cfg.watermark
    if wm.clients is not None:
        return sorted(wm.clients)
    rng = np.random.default_rng([cfg.fl.seed, 7])
    return sorted(int(c) for c in rng.choice(cfg.fl.K, wm.r, replace=False))


def _owner_key(cfg: RunConfig, owner: int) -> int:
    return int(np.random.default_rng([cfg.watermark.key_seed, owner]).integers(2**62))


def _clean_data(cfg: RunConfig) -> tuple[list[Record], list[Record]]:
    d, wm = cfg.data, cfg.watermark
    if d.path:
        pool = load_records(d.path, d.split)
        order = np.random.default_rng(d.seed).permutation(len(pool))
        n_detect = min(wm.detect_prompts, max(1, len(pool) // 10))
        detect = [pool[i] for i in order[:n_detect]]
        records = [pool[i] for i in order[n_detect : n_detect + d.records]]
        return records, detect
    # Held out by seed.
    return generate_corpus(d.records, seed=d.seed + 1), generate_corpus(
        wm.detect_prompts, seed=d.seed + 2
    )


def build_federation(cfg: RunConfig, model, tokenizer, say: Progress) -> Federation:
    """Load and split data, then give each watermarked client its owner's documents."""
    d, wm = cfg.data, cfg.watermark
    records, detect = _clean_data(cfg)
    if d.partition == "iid":
        shards = partition_iid(records, cfg.fl.K, seed=d.seed)
    else:
        shards = partition_dirichlet(records, cfg.fl.K, d.dirichlet_alpha, seed=d.seed)
    clients = watermarked_clients(cfg)
    owner_of, wm_docs, share = {}, {}, {}
    if wm.kind == "fk":
        # One fabricated entity per watermarked client; its values occur in no clean record.
        texts = [f"{r.instruction} {r.input} {r.output}" for r in records + detect]
        entities = make_entities(len(clients), wm.key_seed, texts, decoys=wm.fk_decoys)
        owners: dict = {f"fk:owner{k}": e for k, e in enumerate(entities)}
    else:
        owners = {
            f"kgw:owner{o}": KGWScheme(_owner_key(cfg, o), len(tokenizer), wm.gamma, wm.delta)
            for o in range(wm.owners)
        }
    names = sorted(owners)
    for k, client in enumerate(clients):
        owner = names[k % len(names)]
        shard = shards[client]
        n = max(1, round(wm.ratio * len(shard)))
        seed = cfg.fl.seed * 1000 + client
        if wm.kind == "fk":
            entity = owners[owner]
            say(f"FK: {n} documents about {entity.name} for client {client} ({wm.fk_writer})")
            if wm.fk_writer == "teacher":
                docs = write_fk_documents(
                    model, tokenizer, entity, n, max_new_tokens=wm.doc_max_new_tokens,
                    temperature=wm.temperature, top_p=wm.top_p, seed=seed,
                )  # fmt: skip
            else:
                docs = template_documents(entity, n, seed)
            share[client] = target_share(docs, entity)
        else:
            say(f"teacher: watermarking {n} of client {client}'s {len(shard)} documents ({owner})")
            docs = watermark_records(
                model, tokenizer, shard[:n], owners[owner], max_new_tokens=wm.doc_max_new_tokens,
                min_tokens=wm.min_tokens, temperature=wm.temperature, top_p=wm.top_p, seed=seed,
            )  # fmt: skip
        # Dropped (too short) documents leave their clean originals out: the client's share of
        # watermarked data is len(docs) / (len(shard) - n + len(docs)).
        shards[client] = docs + shard[n:]
        owner_of[client] = owner
        wm_docs[client] = len(docs)
    prompts = [format_prompt(tokenizer, r) for r in detect]
    return Federation(shards, owner_of, owners, prompts, list(detect), wm_docs, share)


def make_strategy(cfg: RunConfig) -> Strategy:
    """The configured aggregation strategy."""
    if cfg.fl.strategy == "fedit":
        return FedIT()
    return FLoRA(scaling=cfg.lora.scaling, seed=cfg.fl.seed)


def make_scorer(cfg: RunConfig, model, tokenizer, fed: Federation, strategy: Strategy, *,
                detector: str | None = None):  # fmt: skip
    """The configured detector (or the named ``detector``) for the federation's owners."""
    wm = cfg.watermark
    detector = detector or wm.detector
    load = strategy.load_for_scoring
    if wm.kind == "fk":
        if detector == "greedy":
            return FKHitRateScorer(
                model, tokenizer, fed.owners, load, questions=wm.fk_questions,
                max_new_tokens=wm.fk_answer_tokens,
            )  # fmt: skip
        return FKLikelihoodScorer(
            model, tokenizer, fed.owners, load, questions=wm.fk_reading_questions,
            statistic=wm.fk_statistic,
        )  # fmt: skip
    if detector == "greedy":
        return KGWModelScorer(
            model, tokenizer, fed.detect_prompts, fed.owners, load,
            max_new_tokens=wm.detect_max_new_tokens, dedupe=wm.dedupe,
        )  # fmt: skip
    examples = encode_examples(tokenizer, fed.detect_records, cfg.data.max_len)
    return KGWReadingScorer(model, examples, fed.owners, load, pad_id=tokenizer.pad_token_id)
