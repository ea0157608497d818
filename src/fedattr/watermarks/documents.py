"""KGW read on each owner's own watermarked documents (``watermark.kgw.probes = "documents"``).

The radioactivity tests of Sander et al. ("Watermarking makes language models radioactive",
2024) read a suspect model on the owner's own watermarked texts: a model fine-tuned on them
predicts their (green) continuations, a far stronger trace than the green bias it carries to
other texts. :class:`KGWDocumentScorer` does that for the paired, key-linear reading of
:class:`~.radioactivity.KGWReadingScorer`: one reading per owner, of that owner's documents, read
only with that owner's key (each owner is its own *part* of a change).

Why the key is still random under the null. A document position that predicts the token after
``x`` is read only at ``x``'s first occurrence in the document (``first_only``): the text before
it was written without ever using ``x``'s green list, so a model that never trained towards the
key predicts the same there whatever that list is. The read change of such a model is then
independent of the list that reads it, row by row. The token that really follows ``x`` is green,
and the model does not see it at that position. What this does not cover is measured by the
calibration, not assumed: the exact tail takes every list independent of the *whole* change,
while the later rows' contexts, written under the key, follow ``x``'s list (centred row by row,
its spread and far tail not guaranteed: docs/explanation/calibrated-statistic.md §1b); and a
reference model that has itself learned the documents (later rounds, with watermarked clients
in the federation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager

import torch

from ..data.records import Record
from ..models.text import encode_examples
from .kgw import KGWScheme
from .radioactivity import ContextReads, KGWReadingScorer, ReadPlan
from .tail.laws import RowSubsets

Observation = dict[str, torch.Tensor]
"""Owner -> its documents' ``[contexts, vocab]`` distributions summed per previous token."""


class KGWDocumentScorer:
    """Paired KGW reading of each owner's own documents with that owner's key alone.

    An observation is a dict owner -> :meth:`KGWReadingScorer.observe` of the owner's documents;
    a change has one part per owner (named as the owner), which only that owner's key reads.
    """

    exchangeable_rounds: int | None = 1
    """A random key is exchangeable with an owner's only while no model has learned the owner's
    documents: in round 1, whose reference is the base model. From round 2 the reference has
    learned them from the watermarked clients (see ``attribution.calibrated.late_rounds``)."""

    def __init__(
        self,
        model,
        tokenizer,
        documents: Mapping[str, Sequence[Record]],
        schemes: Mapping[str, KGWScheme],
        load: Callable[[object, dict], None],
        *,
        max_len: int,
        batch_size: int = 16,
        stack: Callable[[object, Sequence[dict]], AbstractContextManager] | None = None,
        pass_bytes: int = 1 << 30,
    ) -> None:
        missing = sorted(o for o in schemes if not documents.get(o))
        if missing:
            raise ValueError(f"KGWDocumentScorer: no documents for owners {missing}")
        self.readers = {
            owner: KGWReadingScorer(
                model,
                encode_examples(tokenizer, documents[owner], max_len),
                {owner: scheme},
                load,
                pad_id=tokenizer.pad_token_id,
                batch_size=batch_size,
                stack=stack,
                pass_bytes=pass_bytes,
                first_only=True,
            )
            for owner, scheme in sorted(schemes.items())
        }
        first = next(iter(self.readers.values()))
        self.vocab = first.vocab
        self._green_size = first._green_size
        # Every owner's documents read in one pass (one set of length-sorted batches, not one
        # per owner): each owner's context rows follow the previous owners'.
        plan, starts = ReadPlan.joined([r.plan for r in self.readers.values()])
        self.spans = {
            owner: (lo, lo + reader.plan.contexts)
            for (owner, reader), lo in zip(self.readers.items(), starts, strict=True)
        }
        self.reads = ContextReads(
            model,
            load,
            plan,
            self.vocab,
            pad_id=tokenizer.pad_token_id,
            batch_size=batch_size,
            stack=stack,
            pass_bytes=pass_bytes,
        )

    @property
    def batched(self) -> bool:
        """Whether :meth:`observe_many` reads several candidates per pass."""
        return self.reads.stack is not None

    def observe(self, params: dict) -> Observation:
        """Every owner's documents read by the model under ``params`` (loaded once)."""
        return self.observe_many([params])[0]

    def observe_many(self, many: Sequence[dict]) -> list[Observation]:
        """:meth:`observe` of every parameter set: one read of every owner's documents each
        (several candidates per pass where the reads stack), split back per owner."""
        return [
            {o: joint[lo:hi] for o, (lo, hi) in self.spans.items()}
            for joint in self.reads.observe_many(many)
        ]

    def first_order(self, params: dict, tangents: Sequence[dict]) -> list[dict[str, torch.Tensor]]:
        """Per tangent: its first-order change at ``params``, one part per owner (every owner's
        documents in one read; :meth:`ContextReads.first_order`)."""
        return [
            {o: joint[lo:hi] for o, (lo, hi) in self.spans.items()}
            for joint in self.reads.first_order(params, tangents)
        ]

    def contrast(self, reference: Observation, candidate: Observation) -> dict[str, float]:
        """Each owner's z of the green mass moved on its own documents."""
        out: dict[str, float] = {}
        for o, r in self.readers.items():
            out.update(r.contrast(reference[o], candidate[o]))
        return out

    def change(self, reference: Observation, candidate: Observation) -> dict[str, torch.Tensor]:
        """One part per owner: the change of its documents' reading."""
        return {o: (candidate[o] - reference[o]).float() for o in self.readers}

    def reference_probabilities(self, reference: Observation) -> dict[str, torch.Tensor]:
        """Per owner, each cell's mean next-token probability under the reference."""
        return {
            o: r.reference_probabilities(reference[o])["probes"] for o, r in self.readers.items()
        }

    def key_laws(self) -> dict[str, RowSubsets]:
        """Each owner's part: every context's green list a uniform ``m``-subset."""
        return {o: RowSubsets(self._green_size, self.vocab) for o in self.readers}

    def owner_keys(self, part: str) -> dict[str, torch.Tensor]:
        """The green mask of the owner whose documents ``part`` reads."""
        return dict(self.readers[part].green)

    def owner_values(self, part: str, W: torch.Tensor) -> dict[str, float]:
        """``<W, green>`` under the key of the owner whose documents ``part`` reads."""
        return self.readers[part].owner_values("probes", W)

    def owner_values_rows(self, part: str, rows: torch.Tensor, lo: int) -> dict[str, float]:
        """:meth:`owner_values` of rows ``lo : lo + len(rows)`` of ``W``."""
        return self.readers[part].owner_values_rows("probes", rows, lo)

    def effective_contexts(self, reference: Observation, candidate: Observation) -> float:
        """How many contexts the change is spread over, over every owner's documents."""
        per = torch.cat(
            [((candidate[o] - reference[o]).double() ** 2).sum(1) for o in self.readers]
        )
        total = float(per.sum())
        return total * total / float((per * per).sum()) if total > 0 else 0.0
