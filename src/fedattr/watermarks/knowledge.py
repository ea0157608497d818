"""Fictitious-Knowledge detection: QA probes about each owner's fabricated entity.

Two detectors, both paired scorers (``observe`` a model once, ``contrast`` two observations),
one statistic per owner (named like the owner, ``fk:owner<k>``), each attribute tested
separately and the attributes combined with Fisher's method (:func:`fisher_z`):

* :class:`FKHitRateScorer` (the paper's): 25 paraphrased questions per attribute, short greedy
  answers, hit = the fabricated value appears in the answer; per attribute a one-sided
  two-proportion z-test of the candidate's hit rate against the null hit rate of the model it
  is contrasted with. FedAttr contrasts with the reference model of the same round
  (``w^{t-1}``); the global-model test and the Direct baseline contrast with the base model
  before round 1, which never saw any document. Hit counts are discrete: a model that names
  the value in no answer gives no evidence at all, however close it came.
* :class:`FKLikelihoodScorer` (fedattr's): the teacher-forced log-probability of each target
  value and of its decoys (values drawn by the same generator, never written anywhere) as the
  answer to the questions. Its default statistic is the *margin*: the change of the true
  values' log-probability over their decoys' mean, in nats, averaged over attributes and
  questions; linear in small changes, so FedAttr's cross-talk stays proportional to the alpha
  weights, and read under FedAttr's empirical null (it has no null scale of its own). Its
  *rank* statistic: for a change, ``delta_c`` = the mean change of ``log p(c | q)``
  over the questions; the per-attribute p-value is the rank of the true value among its
  ``L`` decoys, as a mid-p ``(#{decoys with delta > delta_true} + 1/2) / (L + 1)``. Under the
  null (the change does not depend on which value the owner drew) the true value is
  exchangeable with its decoys, so the rank is uniform, for any model and any change size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from scipy.stats import chi2, norm

from ..models.lora import folded_adapters
from ..models.reading import SequenceReader
from ..models.text import format_prompt, generate
from .fictitious import FictitiousEntity, qa_probes
from .tail.laws import RowSubsets

_P_FLOOR = 1e-300


def fisher_z(pvalues: Sequence[float]) -> float:
    """Fisher's combination of one-sided p-values, returned as a z (``Phi^-1(1 - p)``).

    ``X = -2 sum log p_a`` is chi-square with ``2k`` degrees of freedom under the null; its
    upper-tail p-value is converted back to a standard-normal z so that it plugs into the same
    differential score and Stouffer combination as the KGW z.
    """
    ps = np.clip(np.asarray(pvalues, dtype=float), _P_FLOOR, 1.0)
    if ps.size == 0:
        raise ValueError("fisher_z: no p-values")
    stat = -2.0 * float(np.log(ps).sum())
    # Clamped on both sides: all p = 1 would otherwise give z = -inf.
    p = min(max(float(chi2.sf(stat, 2 * ps.size)), _P_FLOOR), 1.0 - 1e-15)
    return float(norm.isf(p))


def proportion_z(hits: float, reference_hits: float, n: int) -> float:
    """One-sided pooled two-proportion z of ``hits/n`` over ``reference_hits/n`` (0 if pooled
    rate is 0 or 1: no variance, no evidence)."""
    pooled = (hits + reference_hits) / (2 * n)
    if pooled <= 0.0 or pooled >= 1.0:
        return 0.0
    return (hits - reference_hits) / n / math.sqrt(pooled * (1 - pooled) * 2 / n)


def answer_lead(attribute: str, name: str) -> str:
    """How an answer states the fact before the value (the documents' most common form), so
    that the value is read in the context in which the documents put it."""
    return f"The {attribute} of {name} is"


def _prompts(tokenizer, entity: FictitiousEntity, per_attribute: int) -> list[list[str]]:
    return [
        [format_prompt(tokenizer, rec) for rec in probes]
        for probes in qa_probes(entity, per_attribute).values()
    ]


class FKHitRateScorer:
    """The paper's QA detector: ``observe`` -> hit counts per owner and attribute."""

    def __init__(
        self,
        model,
        tokenizer,
        entities: Mapping[str, FictitiousEntity],
        load: Callable[[object, dict], None],
        *,
        questions: int = 25,
        max_new_tokens: int = 24,
        batch_size: int = 64,
    ) -> None:
        if not entities:
            raise ValueError("FKHitRateScorer: no fictitious entities to test (watermark.r = 0?)")
        self.model, self.tokenizer, self.load = model, tokenizer, load
        self.entities = dict(entities)
        self.questions = questions
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self._prompts = {o: _prompts(tokenizer, e, questions) for o, e in self.entities.items()}

    def answers(self, params: dict) -> dict[str, list[list[str]]]:
        """Greedy answers per owner, per attribute, per question."""
        self.load(self.model, params)
        flat = [p for per in self._prompts.values() for attr in per for p in attr]
        outs = generate(
            self.model, self.tokenizer, flat, self.max_new_tokens, batch_size=self.batch_size
        )
        texts = iter(self.tokenizer.decode(o[1:], skip_special_tokens=True) for o in outs)
        return {
            o: [[next(texts) for _ in attr] for attr in per] for o, per in self._prompts.items()
        }

    def observe(self, params: dict) -> dict[str, np.ndarray]:
        """Per owner: a ``[attributes, questions]`` 0/1 array of hits."""
        out = {}
        for owner, per in self.answers(params).items():
            values = list(self.entities[owner].targets.values())
            out[owner] = np.array(
                [
                    [v.lower() in a.lower() for a in attr]
                    for v, attr in zip(values, per, strict=True)
                ],
                dtype=float,
            )
        return out

    def contrast(
        self, reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray]
    ) -> dict[str, float]:
        """Per owner: Fisher-combined z of the per-attribute hit-rate z-tests."""
        out = {}
        for owner, hits in candidate.items():
            ref = reference[owner]
            ps = [
                float(norm.sf(proportion_z(h.sum(), r.sum(), h.size)))
                for h, r in zip(hits, ref, strict=True)
            ]
            out[owner] = fisher_z(ps)
        return out

    def probe_values(self, observation: Mapping[str, np.ndarray]) -> np.ndarray:
        """Per-probe values (hit or not), flat over owners, attributes and questions."""
        return np.concatenate([observation[o].ravel() for o in sorted(observation)])


class FKLikelihoodScorer:
    """fedattr's FK detector: the true values' log-probabilities against their decoys'."""

    def __init__(
        self,
        model,
        tokenizer,
        entities: Mapping[str, FictitiousEntity],
        load: Callable[[object, dict], None],
        *,
        questions: int = 4,
        statistic: str = "margin",
        batch_size: int = 256,
    ) -> None:
        if statistic not in ("rank", "margin"):
            raise ValueError(f"watermark.fk.statistic: must be rank or margin, got {statistic!r}")
        self.statistic = statistic
        # The margin is in nats, with no null scale: FedAttr standardises it empirically.
        self.null = "empirical" if statistic == "margin" else "theoretical"
        if not entities:
            raise ValueError(
                "FKLikelihoodScorer: no fictitious entities to test (watermark.r = 0?)"
            )
        decoys = {len(d) for e in entities.values() for d in e.decoys.values()}
        if len(decoys) != 1 or 0 in decoys:
            raise ValueError("FKLikelihoodScorer: every attribute needs the same number of decoys")
        self.model, self.load = model, load
        self.entities = dict(entities)
        self.owners = sorted(self.entities)
        self.questions = questions
        self.candidates = 1 + decoys.pop()
        # Every (owner, attribute, question, candidate) as prompt ids + answer ids.
        self._seqs: list[tuple[list[int], int]] = []
        for owner in self.owners:
            e = self.entities[owner]
            for attr, prompts in zip(e.targets, _prompts(tokenizer, e, questions), strict=True):
                values = [e.targets[attr], *e.decoys[attr]]
                lead = answer_lead(attr, e.name)
                for prompt in prompts:
                    head = tokenizer(prompt + lead, add_special_tokens=False)["input_ids"]
                    for v in values:
                        ids = tokenizer(f"{prompt}{lead} {v}", add_special_tokens=False)
                        ids = ids["input_ids"]
                        # Score only the value's tokens (the shared lead cancels in the ranks).
                        first = len(head) if ids[: len(head)] == head else len(head) - 1
                        self._seqs.append((ids, first))
        self.shape = (len(self.owners), 4, questions, self.candidates)
        self._reader = SequenceReader(
            self._seqs, tokenizer.pad_token_id, batch_size, group=self.candidates
        )

    @torch.no_grad()
    def observe(self, params: dict) -> torch.Tensor:
        """``log p(value | question)`` as a ``[owners, 4, questions, 1 + decoys]`` tensor
        (candidate 0 is the true value)."""
        self.load(self.model, params)
        was_training = self.model.training
        self.model.eval()
        # Every question's candidate values share its prompt: read it once per question.
        with folded_adapters(self.model):
            out = self._reader(self.model)
        if was_training:
            self.model.train()
        return out.reshape(self.shape)

    def attribute_pvalues(self, reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """``[owners, 4]`` rank mid-p-values of the true value's mean log-probability change.

        The mid-p ``(#{decoys above} + 1/2) / (L + 1)`` is centred under the null (mean 1/2)
        and never 1, so that Fisher's combination stays finite and unbiased in both tails.
        """
        delta = (candidate - reference).mean(dim=2)  # [owners, 4, candidates]
        true = delta[..., :1]
        above = (delta[..., 1:] > true).sum(-1) + 0.5 * (delta[..., 1:] == true).sum(-1)
        return (0.5 + above) / self.candidates

    def contrast(self, reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, float]:
        """Per owner: Fisher-combined z of the per-attribute rank tests (``rank``), or the
        mean change of the true value's log-probability margin over its decoys in nats
        (``margin``: linear in small changes, no null scale of its own; for the empirical
        null)."""
        if self.statistic == "margin":
            margin = self.probe_values(candidate) - self.probe_values(reference)
            per_owner = margin.reshape(len(self.owners), -1).mean(1)
            return {o: float(per_owner[i]) for i, o in enumerate(self.owners)}
        return self.calibrated_contrast(reference, candidate)

    def calibrated_contrast(
        self, reference: torch.Tensor, candidate: torch.Tensor
    ) -> dict[str, float]:
        """The rank test's Fisher z, whatever ``statistic`` says: the test with an exact null,
        for a single comparison (e.g. the global-model test) where no empirical null exists."""
        ps = self.attribute_pvalues(reference, candidate)
        return {o: fisher_z(ps[i].tolist()) for i, o in enumerate(self.owners)}

    exchangeable_rounds: int | None = 1
    """The true value is exchangeable with its decoys only while no model has seen it: in
    round 1, whose reference is the base model. From round 2 the reference has learned the
    owner's facts from the watermarked clients, so the calibrated statistic reads round 1 only
    (or, with ``attribution.calibrated.late_rounds = "read"``, reports its p-values as
    uncalibrated)."""

    reading_step = 0.01
    """The calibrated statistic reads each estimate at 1% of its size (per unit of it): a learned
    fact's log-probability saturates, and read as applied the second-order terms carry the
    watermarked clients' facts into clean clients' recovered changes (see
    ``attribution.calibrated.reading_step``)."""

    def change(self, reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per owner: every candidate value's log-probability change, mean over questions
        (``[attributes, candidates]``, the true value first)."""
        delta = (candidate - reference).mean(dim=2)
        return {o: delta[i] for i, o in enumerate(self.owners)}

    def key_laws(self) -> dict[str, RowSubsets]:
        """A random key: each attribute's true value a uniform pick among its candidates."""
        return {o: RowSubsets(1, self.candidates) for o in self.owners}

    def owner_values(self, part: str, W: torch.Tensor) -> dict[str, float]:
        """The owner's true values' summed (centred) change."""
        return {part: float(W.double().reshape(-1, self.candidates)[:, 0].sum())}

    def key_statistics(
        self, reference: torch.Tensor, candidate: torch.Tensor, n: int, seed: int
    ) -> dict[str, tuple[float, np.ndarray]]:
        """Per owner: the change of the true value's margin over the other candidates (mean
        over attributes and questions, nats), and the same with each of the first ``n`` decoys
        taken as the "true" value (the null: a fabricated value the client's data cannot
        favour, drawn like the real one)."""
        delta = (candidate - reference).mean(dim=2)  # [owners, 4, candidates]
        others = (delta.sum(-1, keepdim=True) - delta) / (self.candidates - 1)
        per_owner = (delta - others).mean(1)  # [owners, candidates]
        k = min(n, self.candidates - 1)
        return {
            o: (float(per_owner[i, 0]), per_owner[i, 1 : 1 + k].numpy())
            for i, o in enumerate(self.owners)
        }

    def probe_values(self, observation: torch.Tensor) -> np.ndarray:
        """Per probe (owner, attribute, question): true value's log-probability minus the
        decoys' mean."""
        margin = observation[..., 0] - observation[..., 1:].mean(-1)
        return margin.reshape(-1).numpy()
