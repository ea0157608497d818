"""Who trains on what: client datasets, watermarked clients and their owners' documents, and
the detection data (the data/model stage of a run, before any FL round)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..data.config import DataConfig
from ..data.corpus import generate_corpus
from ..data.loaders import DataError, load_records
from ..data.partition import partition_dirichlet, partition_iid, partition_quantity
from ..data.records import Record
from ..models.text import fits, format_prompt
from ..watermarks.config import WatermarkConfig
from ..watermarks.fictitious import FictitiousEntity
from ..watermarks.registry import WATERMARKS

Progress = Callable[[str], None]


@dataclass
class Federation:
    """Client datasets, who is watermarked with which owner's documents, detection data."""

    shards: list[list[Record]]
    owner_of: dict[int, str]
    owners: dict[str, Any]
    """Owner name -> KGW key scheme, or the owner's fabricated entity (FK)."""
    detect_prompts: list[str]
    detect_records: list[Record]
    wm_docs: dict[int, int]
    doc_target_share: dict[int, float] = field(default_factory=dict)
    """FK: the share of the target attributes each watermarked client's documents state
    (averaged over its documents; 1: every document states every target)."""
    owner_docs: dict[str, list[Record]] = field(default_factory=dict)
    """Owner name -> the documents it watermarked: its clients' (and, read as probes with
    ``watermark.kgw.probes = "documents"``, held-out records it watermarked when it has no
    client)."""

    def truth(self, K: int) -> dict[int, bool]:
        """Client id -> watermarked (the ground truth of the experiment)."""
        return {c: c in self.owner_of for c in range(K)}

    def summary(self) -> dict:
        """JSON-ready description (for results.json)."""
        out: dict = {
            "watermarked": {str(c): o for c, o in self.owner_of.items()},
            "watermarked_docs": {str(c): n for c, n in self.wm_docs.items()},
            "detect_prompts": len(self.detect_prompts),
        }
        if self.owner_docs:
            out["owner_documents"] = {o: len(d) for o, d in self.owner_docs.items()}
        if self.doc_target_share:
            out["doc_target_share"] = {str(c): v for c, v in self.doc_target_share.items()}
        entities = {
            o: e.to_dict() for o, e in self.owners.items() if isinstance(e, FictitiousEntity)
        }
        if entities:  # FK's owners, those no client trained on (r = 0) too
            out["entities"] = entities
        return out


def watermarked_clients(wm: WatermarkConfig, K: int, seed: int) -> list[int]:
    """The watermarked clients: ``watermark.clients``, or ``watermark.r`` drawn by seed."""
    if wm.clients is not None:
        return sorted(wm.clients)
    rng = np.random.default_rng([seed, 7])
    return sorted(int(c) for c in rng.choice(K, wm.r, replace=False))


def detection_records(data: DataConfig, wm: WatermarkConfig) -> list[Record]:
    """The held-out detection texts of a configuration (what its scorers read)."""
    return clean_data(data, wm)[1]


def _held_out(d: DataConfig, wm: WatermarkConfig, n: int) -> int:
    """Records of a loaded file of ``n`` held out as detection texts."""
    return min(wm.detect.prompts, max(1, n // 10))


def check_client_records(d: DataConfig, wm: WatermarkConfig, n: int, K: int) -> None:
    """Refuse a loaded file of ``n`` usable records that leaves some of ``K`` clients none once
    the detection texts are held out, naming the counts and the size it needs."""
    n_detect = _held_out(d, wm, n)
    if n - n_detect >= K:
        return
    need = next(m for m in range(K + 1, K + wm.detect.prompts + 2) if m - _held_out(d, wm, m) >= K)
    raise DataError(
        f"data.path: {d.path!r} holds {n} usable record{'s' if n != 1 else ''}; {n_detect} "
        f"held out as detection texts leave{'s' if n_detect == 1 else ''} {max(0, n - n_detect)} "
        f"for fl.K={K} clients, one each at least: give a file of at least {need} records "
        "or lower fl.K"
    )


def clean_data(
    d: DataConfig, wm: WatermarkConfig, K: int | None = None
) -> tuple[list[Record], list[Record]]:
    """The clients' clean records and the held-out detection texts of a configuration
    (``K``: checked to leave every client records, where the data is a file)."""
    if d.path:
        pool = load_records(d.path, d.split)
        if K is not None:
            check_client_records(d, wm, len(pool), K)
        order = np.random.default_rng(d.seed).permutation(len(pool))
        n_detect = _held_out(d, wm, len(pool))
        detect = [pool[i] for i in order[:n_detect]]
        records = [pool[i] for i in order[n_detect : n_detect + d.records]]
        return records, detect
    # Held out by seed.
    return generate_corpus(d.records, seed=d.seed + 1), generate_corpus(
        wm.detect.prompts, seed=d.seed + 2
    )


def partition_records(records: list[Record], data: DataConfig, K: int) -> list[list[Record]]:
    """``records`` shared out to ``K`` clients as ``data.partition`` says."""
    if data.partition == "iid":
        return partition_iid(records, K, seed=data.seed)
    if data.partition == "quantity":
        return partition_quantity(records, K, data.dirichlet_alpha, seed=data.seed)
    return partition_dirichlet(records, K, data.dirichlet_alpha, seed=data.seed)


def build_federation(
    data: DataConfig,
    wm: WatermarkConfig,
    K: int,
    seed: int,
    model,
    tokenizer,
    say: Progress,
    documents: dict[str, Any] | None = None,
) -> Federation:
    """Load and split data, then give each watermarked client its owner's documents.

    ``documents``: a JSON-ready store of the owners' documents, keyed by owner, client and
    seed: those it holds are taken from it (the teacher does not run again for them: a
    resumed run), the others are written and added to it."""
    records, detect = clean_data(data, wm, K)
    kind = WATERMARKS[wm.kind]
    shards = partition_records(records, data, K)
    clients = watermarked_clients(wm, K, seed)
    texts = [f"{r.instruction} {r.input} {r.output}" for r in records + detect]
    owners = kind.owners(wm, len(tokenizer), len(clients), texts)

    def owner_documents(
        owner: str, client: int | None, source: list[Record], n: int, doc_seed: int
    ) -> tuple[list[Record], float | None]:
        key = f"{owner}/{client}/{doc_seed}"
        if documents is not None and key in documents:
            kept = documents[key]
            whose = f"client {client}'s" if client is not None else "held-out (no client's)"
            say(f"{len(kept['docs'])} of {whose} documents ({owner}) restored from the run folder")
            return [Record(**d) for d in kept["docs"]], kept["share"]
        docs, share = kind.documents(
            wm,
            model,
            tokenizer,
            owner,
            owners[owner],
            client,
            source,
            n,
            doc_seed,
            say,
            lambda rec: fits(tokenizer, rec, data.max_len),
        )
        if documents is not None:
            documents[key] = {"docs": [dataclasses.asdict(d) for d in docs], "share": share}
        return docs, share

    names = sorted(owners)
    owner_of, wm_docs, share = {}, {}, {}
    owner_docs: dict[str, list[Record]] = {o: [] for o in names}
    for k, client in enumerate(clients):
        owner = names[k % len(names)]
        shard = shards[client]
        n = max(1, round(wm.ratio * len(shard)))
        docs, docs_share = owner_documents(owner, client, shard, n, seed * 1000 + client)
        if docs_share is not None:
            share[client] = docs_share
        # Dropped (too short) documents leave their clean originals out: the client's share of
        # watermarked data is len(docs) / (len(shard) - n + len(docs)).
        shards[client] = docs + shard[n:]
        owner_of[client] = owner
        wm_docs[client] = len(docs)
        # read once each (clients drawing from one owner's corpus file may share documents)
        owner_docs[owner].extend(d for d in docs if d not in owner_docs[owner])
    if wm.reads_documents:
        # An owner no client trained on still holds a corpus to read: as many held-out records
        # as a watermarked client's share, watermarked under its key (no client sees them).
        n = max(1, round(wm.ratio * len(records) / K))
        idle = [o for o in names if not owner_docs[o]]
        for k, owner in enumerate(idle):
            source = [detect[(k * n + j) % len(detect)] for j in range(n)]
            docs, _ = owner_documents(owner, None, source, n, seed * 1000 + K + k)
            owner_docs[owner] = docs
    prompts = [format_prompt(tokenizer, r) for r in detect]
    return Federation(shards, owner_of, owners, prompts, list(detect), wm_docs, share, owner_docs)
