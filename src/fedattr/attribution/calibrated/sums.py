"""The evidence sums: each client's standardised changes summed over rounds, and its owners'
values, kept in memory (float64) or spilled to disk by row blocks (float32).

:class:`CalibratedNull` takes one round at a time (:meth:`~CalibratedNull.add_round`, with the
round's :class:`~.plan.RoundPlan`), standardises it (:mod:`.standardise`) or stacks it for
de-mixing (:mod:`.demix`), and adds each target's ``W`` and ``<W, G>`` to its sums; its
:meth:`~CalibratedNull.evidence` is what the verdict (:mod:`.verdict`) reads. It is also the
checkpoint of the statistic, and the sums of a finished run read back from its files
(:meth:`~CalibratedNull.from_results`).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import UserError
from ...rows import DiskRows, Rows, TemporaryFolder
from ...watermarks.tail.laws import KeyLaw, RowSubsets, law_from_dict
from ..config import AttributionConfig
from ..contract import (
    LinearKeyScorer,
    OwnerKeys,
    Parts,
    ReferenceProbabilities,
    RowOwnerValues,
)
from ..design import QueryDesign
from ..stouffer import AttributionReport
from .demix import DeMixer, demixed_evidence
from .plan import RoundPlan, plan_round
from .standardise import (
    STANDARDISE_CELLS,
    Change,
    ChangeRows,
    row_shape,
    standardise_blocks,
    standardise_round,
)
from .verdict import Evidence, report
from .weights import over_vocabulary


class CalibratedNull:
    """Accumulates each client's standardised changes ``W_i`` (per part) and its owners'
    values ``<W_i, G>``; :meth:`report` turns them into exact p-values and flags."""

    def __init__(
        self,
        *,
        alpha: float = 0.01,
        decorrelate: bool = True,
        undo: str = "changes",
        null_keys: int = 200,
        seed: int = 0,
        name_uncalibrated: bool = False,
        token_centring: bool = False,
        late_rounds: str = "read",
        few_cells: str = "shifted-keys",
        spill: str | Path | TemporaryFolder | None = None,
        block_cells: int = STANDARDISE_CELLS,
        across_rounds: str = "demix",
        late_demix: str = "read",
        spread: float = 0.0,
        centre: str = "first",
        cell_weights: str = "first",
    ) -> None:
        """``spill``: a folder where each client's sums ``W_i`` over a row-centred key law
        (KGW's) are kept as float32 files (:class:`~fedattr.rows.DiskRows`) and read by row
        blocks, rounds standardised ``block_cells`` at a time where the detector reads its
        owners' values by rows (:class:`~fedattr.attribution.contract.RowOwnerValues`): memory
        no longer grows with clients x contexts x vocabulary (a
        :class:`~fedattr.rows.TemporaryFolder` is removed after the last of its files).
        ``None``: every sum in memory, in float64. ``undo``: where a round's cross-talk is
        undone (:func:`~.plan.plan_round`; ``updates``: the caller reads each client's own
        update, so :meth:`plan` says the changes are each client's own already). ``centre``,
        ``cell_weights``: see :meth:`centres` and :meth:`round_weights`. ``late_demix``:
        ``uncalibrated`` reports the de-mixed evidence uncalibrated once a stacked round's
        reference may have learned a key (``attribution.calibrated.late_demix``)."""
        self.alpha, self.decorrelate, self.token_centring = alpha, decorrelate, token_centring
        self.undo = undo
        self.few_cells = few_cells
        self.across_rounds = across_rounds
        self.late_demix = late_demix
        # Whether a stacked (de-mixed) round's reference may have learned a key.
        self.late_mixed = False
        self.spread = spread  # spread_weights' exponent (rounds read within the round)
        self.centre = centre  # first, none or every: see centres()
        self.cell_weights = cell_weights  # first or round: see round_weights()
        # The first round's key-free cell weights, where later rounds read with them.
        self.first_round: int | None = None
        self.first_taper: Parts | None = None
        self.first_spread: dict[str, torch.Tensor] = {}
        # Rounds whose cross-talk is kept, stacked for de-mixing across rounds (see DeMixer).
        self.mixed = DeMixer()
        # Each de-mixed client's W and owners' values (recomputed by settle(); not summed).
        self.demixed_W: dict[int, dict[str, torch.Tensor]] = {}
        self.demixed_values: dict[int, dict[str, float]] = {}
        self._reader: LinearKeyScorer | None = None  # reads the de-mixed changes (settle)
        # owner -> its key as a matrix, where the detector lends it (see verdict.shifted)
        self.keys: dict[str, torch.Tensor] = {}
        # A temporary folder is kept alive by the files in it (removed after the last).
        self._folder = spill if isinstance(spill, TemporaryFolder) else None
        where = spill.path if isinstance(spill, TemporaryFolder) else spill
        self.spill: Path | None = None if where is None else Path(where)
        self.block_cells = block_cells
        self.late_rounds = late_rounds
        self.null_keys, self.seed, self.name_uncalibrated = null_keys, seed, name_uncalibrated
        # client -> part -> sum over rounds (in memory, or on disk where spilled)
        self.W: dict[int, dict[str, torch.Tensor | Rows]] = {}
        self.values: dict[int, dict[str, float]] = {}  # client -> owner -> <W, G>
        # client -> owner -> round -> that round's standardised statistic (display)
        self.per_round: dict[int, dict[str, dict[int, float]]] = {}
        self.decorrelated: dict[int, bool] = {}
        self.laws: dict[str, dict] = {}  # part -> KeyLaw.describe()
        self.parts: dict[str, str] = {}  # owner -> part
        self.valid: dict[str, bool] = {}  # owner -> is its key exchangeable with a random one
        self.cross_talk: set[int] = set()  # clients with a round whose cross-talk was kept
        self.rounds_read: dict[str, int] = {}  # owner -> only rounds 1..n read (late skipped)
        # Where the changes were computed (a GPU for an LLM): the rank check's random keys are
        # drawn there. The sums themselves are kept on the CPU (checkpoints load anywhere).
        self.device = torch.device("cpu")

    @classmethod
    def of(cls, config: AttributionConfig) -> CalibratedNull:
        """The sums and verdicts ``config`` (the ``attribution`` section) asks for."""
        c = config.calibrated
        return cls(
            alpha=c.alpha,
            decorrelate=c.decorrelate,
            undo=c.undo,
            null_keys=c.null_keys,
            seed=config.seed,
            name_uncalibrated=c.name_uncalibrated,
            token_centring=c.token_centring,
            late_rounds=c.late_rounds,
            few_cells=c.few_cells,
            spill=TemporaryFolder() if c.spill else None,
            across_rounds=c.across_rounds,
            late_demix=c.late_demix
            or ("uncalibrated" if config.protocol.mode == "hardened" else "read"),
            spread=c.spread,
            centre=c.centre,
            cell_weights=c.cell_weights,
        )

    def centres(self, round_id: int) -> bool:
        """Whether round ``round_id``'s changes are centred by a centre made of the round's clients:
        only in round 1 (``centre = "first"``), whose reference model is the base model that no
        client's update has reached; never (``"none"``); or always (``"every"``). From round 2 the
        reference may have learned a key and every client's change depends on it (a clean client
        forgets what it learned): a centre made of the other clients' changes would carry their
        forgetting into each reading, and a client that updates less than the median would read as
        evidence."""
        return self.centre == "every" or (self.centre == "first" and round_id <= 1)

    def round_weights(self, round_id: int, compute: Callable[[], Parts | None]) -> Parts | None:
        """The key-free cell weights (taper) round ``round_id`` is read with: computed from its
        own reference model (``cell_weights = "round"``), or the first round's, computed from the
        base model and kept (``"first"``)."""
        if self.cell_weights != "first":
            return compute()
        if self.first_round is None or round_id <= self.first_round:
            self.first_round = round_id
            self.first_taper = compute()
        return self.first_taper

    def _spread_memory(
        self, round_id: int
    ) -> tuple[dict[str, torch.Tensor] | None, Callable[[str, int, torch.Tensor], None] | None]:
        """``(frozen spread weights to read round round_id with, a sink that keeps the ones it
        computes)``: round 1's where ``cell_weights = "first"``."""
        if self.cell_weights != "first":
            return None, None
        if self.first_round is not None and round_id > self.first_round and self.first_spread:
            return self.first_spread, None
        kept = self.first_spread

        def keep(part: str, lo: int, w: torch.Tensor) -> None:
            held = kept.get(part)
            if held is None or held.shape[0] < lo + w.shape[0]:
                grown = torch.zeros(lo + w.shape[0], w.shape[1], dtype=torch.float32)
                if held is not None:
                    grown[: held.shape[0]] = held
                kept[part] = held = grown
            held[lo : lo + w.shape[0]] = w.float().cpu()

        return None, keep

    def calibrated_in(self, round_id: int, scorer: LinearKeyScorer) -> bool:
        """Whether round ``round_id``'s reading keeps the p-values calibrated: a round whose
        key is exchangeable with a random one (the detector says how many are: the reference has
        learned no key yet), or a later round read with nothing made of the other clients'
        changes or of that reference (no centre of the clients', round 1's cell weights), so
        that a clean client's reading depends on the key only through its own reaction to the
        reference: forgetting, which reads against the key."""
        if self._exchangeable(round_id, scorer):
            return True
        weighted = isinstance(scorer, ReferenceProbabilities) or (
            self.spread > 0 and any(over_vocabulary(law) for law in scorer.key_laws().values())
        )
        return not self.centres(round_id) and (self.cell_weights == "first" or not weighted)

    def plan(
        self,
        round_id: int,
        participants: Sequence[int],
        targets: Sequence[int],
        designs: Sequence[QueryDesign],
        scorer: Any = None,
    ) -> RoundPlan:
        """How round ``round_id`` is read under these settings (``scorer``: the detector, which
        says whether its owners can be read by rows; by rows where the sums are spilled)."""
        return plan_round(
            round_id,
            participants,
            targets,
            designs,
            decorrelate=self.decorrelate,
            undo=self.undo,
            across_rounds=self.across_rounds,
            by_rows=self.spill is not None and isinstance(scorer, RowOwnerValues),
            centred=self.centres(round_id),
        )

    def hold(self, round_id: int, name: str, change: Parts, laws: Mapping[str, KeyLaw]) -> dict:
        """``change`` with each part over a row-centred law written to a float32 file in the
        spill folder and read back by row blocks (:class:`~.standardise.ChangeRows`): a round
        read by rows then holds none of its K changes whole (a SmolLM2 round's eleven: 1.4 GB).
        The values read back are the float32 values written, so the round's result is the same
        bits. :meth:`release` removes the round's files."""
        if self.spill is None:
            return dict(change)
        folder = self.spill / f"round-{round_id}"
        folder.mkdir(parents=True, exist_ok=True)
        out: dict[str, Change] = {}
        for part, c in change.items():
            law = laws.get(part)
            if not isinstance(law, RowSubsets) or not isinstance(c, torch.Tensor):
                out[part] = c
                continue
            rows = c.numel() // law.cols
            disk = DiskRows(folder / f"{name}-{part}.f32", rows, law.cols)
            disk.write(c.reshape(rows, law.cols))
            out[part] = ChangeRows(rows, law.cols, disk.rows_as_tensor)
        return out

    def release(self, round_id: int) -> None:
        """Remove the files :meth:`hold` wrote for round ``round_id``."""
        if self.spill is not None:
            shutil.rmtree(self.spill / f"round-{round_id}", ignore_errors=True)

    @staticmethod
    def _exchangeable(round_id: int, scorer: LinearKeyScorer) -> bool:
        """Whether ``scorer``'s key is exchangeable with a random one in round ``round_id``."""
        n = scorer.exchangeable_rounds
        return n is None or round_id <= n

    def reads(self, round_id: int, scorer: LinearKeyScorer) -> bool:
        """Whether round ``round_id`` is read with ``scorer`` at all: not a round past the
        detector's exchangeable ones when ``late_rounds`` skips them (the caller then reads no
        model either)."""
        return self._exchangeable(round_id, scorer) or self.late_rounds != "skip"

    def add_round(
        self,
        plan: RoundPlan,
        changes: Sequence[Mapping[str, Change]],
        center: Mapping[str, Change] | None,
        scorer: LinearKeyScorer,
        *,
        weights: Parts | None = None,
        mean_row: bool = True,
    ) -> dict[int, dict[str, float]]:
        """One round's raw changes (one per target of ``plan``; ``center``: the SA mean's,
        needed only where cross-talk is not undone; ``weights``: key-free cell weights, see
        :func:`~.standardise.standardise_round`); returns each target's per-round statistic
        per owner. ``mean_row``: whether ``center`` is the equal-weight mean of every
        participant's submitted update (no dropouts), so that de-mixing may stack it as the
        round's public row (:meth:`DeMixer.add <.demix.DeMixer.add>`)."""
        if not plan.targets or not self.reads(plan.round, scorer):
            return {}
        laws = scorer.key_laws()
        if isinstance(scorer, OwnerKeys) and self.few_cells == "shifted-keys":
            for part in laws:
                self.keys.update({o: G.cpu() for o, G in scorer.owner_keys(part).items()})
        if plan.by_rows:
            return self._add_round_by_rows(plan, changes, center, scorer, weights)
        held: Sequence[Parts] = changes  # type: ignore[assignment]  # whole: tensors
        frozen, keep = self._spread_memory(plan.round)
        standard = standardise_round(
            plan,
            held,
            center,  # type: ignore[arg-type]
            laws,
            token_centring=self.token_centring,
            weights=weights,
            spread=self.spread,
            frozen_spread=frozen,
            keep_spread=keep,
        )
        self.decorrelated[plan.round] = plan.undone
        display: dict[int, dict[str, float]] = {}
        valid = self.calibrated_in(plan.round, scorer)
        n = scorer.exchangeable_rounds
        if plan.demix:
            # Kept raw (weighted) for de-mixing across rounds; the round's own (mixed) values
            # are for display only.
            self.read_with(scorer)
            self.late_mixed |= not self._exchangeable(plan.round, scorer)
            mean = (plan.participants, center) if center is not None and mean_row else None
            self.mixed.add(plan.targets, plan.designs, held, laws, weights, mean)  # type: ignore[arg-type]
        for target, parts in zip(plan.targets, standard, strict=True):
            values: dict[str, float] = {}
            owners: dict[str, str] = {}
            for part, c in parts.items():
                for owner, value in scorer.owner_values(part, c).items():
                    values[owner], owners[owner] = value, part
            self.add(
                plan.round,
                target,
                parts,
                values,
                laws,
                owners,
                valid=valid,
                decorrelated=plan.undone,
                keep=not plan.demix,
            )
            display[target] = values
            if n is not None and self.late_rounds == "skip":
                self.rounds_read.update(dict.fromkeys(owners, n))
        return display

    def _add_round_by_rows(
        self,
        plan: RoundPlan,
        changes: Sequence[Mapping[str, Change]],
        center: Mapping[str, Change] | None,
        scorer: LinearKeyScorer,
        weights: Mapping[str, Change] | None,
    ) -> dict[int, dict[str, float]]:
        """:meth:`add_round` a block of rows at a time (spilled sums): each target's standardised
        rows are added to its file and read by the detector's owners as they come, so no
        change is held whole."""
        assert isinstance(scorer, RowOwnerValues)
        laws = scorer.key_laws()
        self._check_laws(plan.round, laws)
        targets = plan.targets
        values: list[dict[str, float]] = [{} for _ in targets]  # this round's (display)
        increments: list[dict[str, float]] = [{} for _ in targets]  # what <W, G> moved by
        owners: dict[str, str] = {}

        def sink(part: str, lo: int, blocks: list[torch.Tensor]) -> None:
            total = row_shape(laws[part], changes[0][part])[0]
            for i, (target, rows) in enumerate(zip(targets, blocks, strict=True)):
                stored = self._accumulate(target, part, lo, rows, laws[part], total)
                for owner, v in scorer.owner_values_rows(part, rows, lo).items():
                    values[i][owner] = values[i].get(owner, 0.0) + v
                    owners[owner] = part
                if stored is not None:
                    # The owners' sums follow the stored (float32) W itself: the value and the
                    # tail then read the same W, whatever its precision.
                    moved = torch.from_numpy(stored).to(rows.device)
                    for owner, v in scorer.owner_values_rows(part, moved, lo).items():
                        increments[i][owner] = increments[i].get(owner, 0.0) + v

        frozen, keep = self._spread_memory(plan.round)
        standardise_blocks(
            plan,
            changes,
            center,
            laws,
            sink,
            token_centring=self.token_centring,
            weights=weights,
            cells=self.block_cells,
            spread=self.spread,
            frozen_spread=frozen,
            keep_spread=keep,
        )
        self.decorrelated[plan.round] = plan.undone
        valid = self.calibrated_in(plan.round, scorer)
        n = scorer.exchangeable_rounds
        for target, v, moved in zip(targets, values, increments, strict=True):
            self._add_values(plan.round, target, v, owners, valid, plan.undone, moved or None)
            if n is not None and self.late_rounds == "skip":
                self.rounds_read.update(dict.fromkeys(owners, n))
        return dict(zip(targets, values, strict=True))

    def _check_laws(self, round_id: int, laws: Mapping[str, KeyLaw]) -> None:
        for part, law in laws.items():
            desc = law.describe()
            if self.laws.setdefault(part, desc) != desc:
                raise UserError(
                    f"round {round_id}: part {part!r} is read under another key law ({desc}) "
                    f"than the earlier rounds ({self.laws[part]})"
                )

    def _accumulate(
        self, target: int, part: str, lo: int, rows: torch.Tensor, law: KeyLaw, total: int
    ) -> np.ndarray | None:
        """``W[target][part][lo : lo + len(rows)] += rows`` (``total``: the change's rows): on
        disk where spilled (row-centred laws; returns what the stored rows moved by), else in
        memory in float64 (returns ``None``)."""
        acc = self.W.setdefault(target, {})
        self.device = rows.device
        held = acc.get(part)
        if self.spill is not None and isinstance(law, RowSubsets):
            if not isinstance(held, DiskRows):
                self.spill.mkdir(parents=True, exist_ok=True)
                name = f"W-{target}-{part}.f32"
                disk = DiskRows(self.spill / name, total, law.cols, self._folder)
                if held is not None:  # restored from a checkpoint in memory: moved to disk
                    assert isinstance(held, torch.Tensor)
                    disk.add(0, held.reshape(total, law.cols))
                acc[part] = held = disk
            return held.add(lo, rows.reshape(-1, law.cols))
        # On the CPU, in float64: a checkpoint loads on any machine, and the sum over rounds
        # matches the owners' values (summed in float64) to the last digits.
        c = rows.detach().to("cpu", torch.float64)
        assert held is None or isinstance(held, torch.Tensor)
        acc[part] = held + c if held is not None else c.clone()
        return None

    def add(
        self,
        round_id: int,
        target: int,
        parts: Parts,
        values: Mapping[str, float],
        laws: Mapping[str, KeyLaw],
        owner_parts: Mapping[str, str],
        *,
        valid: bool = True,
        decorrelated: bool = True,
        keep: bool = True,
    ) -> None:
        """Add one (target, round)'s standardised changes and its owners' values (each owner's
        value has unit null variance: it is also the round's displayed statistic). ``keep =
        False``: display only (a round de-mixed across rounds: its evidence is in
        :attr:`mixed`, read by :meth:`settle`)."""
        self._check_laws(round_id, laws)
        if keep:
            for part, c in parts.items():
                law = laws.get(part)
                total = row_shape(law, c)[0] if law is not None else 1
                self._accumulate(target, part, 0, c, law, total)  # type: ignore[arg-type]
        self._add_values(round_id, target, values, owner_parts, valid, decorrelated, keep=keep)

    def _add_values(
        self,
        round_id: int,
        target: int,
        values: Mapping[str, float],
        owner_parts: Mapping[str, str],
        valid: bool,
        decorrelated: bool,
        increments: Mapping[str, float] | None = None,
        keep: bool = True,
    ) -> None:
        """Record the round's values (``per_round``) and add them to the owners' sums, or add
        ``increments`` there instead (what ``<W, G>`` of the stored sums moved by); ``keep =
        False`` records the display only."""
        if not decorrelated and keep:
            self.cross_talk.add(target)
        sums = self.values.setdefault(target, {}) if keep else {}
        for owner, value in values.items():
            # An owner of a part held in memory has no increment: its value is the round's.
            step = value if increments is None else increments.get(owner, value)
            sums[owner] = sums.get(owner, 0.0) + float(step)
            self.parts[owner] = owner_parts[owner]
            self.valid[owner] = self.valid.get(owner, True) and valid
            self.per_round.setdefault(target, {}).setdefault(owner, {})[round_id] = float(value)

    def read_with(self, scorer: LinearKeyScorer) -> None:
        """The detector that reads the de-mixed changes with the owners' keys (:meth:`settle`;
        set by :meth:`add_round`, and after a checkpoint is loaded by the caller)."""
        self._reader = scorer

    def settle(self) -> None:
        """Read the rounds kept for de-mixing (:func:`~.demix.demixed_evidence`) into
        :attr:`demixed_W` and :attr:`demixed_values`; a client whose mean is not identifiable
        from the stacked rounds gets no de-mixed evidence and is marked as cross-talk
        (uncalibrated). Idempotent: recomputed from the stacked sums each time."""
        if self._reader is None or not self.mixed.ids:
            return
        laws = {part: law_from_dict(d) for part, d in self.laws.items()}
        self.demixed_W, self.demixed_values, unidentified = demixed_evidence(
            self.mixed, laws, self._reader, self.token_centring, centre=self.centre == "every"
        )
        self.cross_talk.update(unidentified)
        if self.late_mixed and self.late_demix == "uncalibrated":
            # Other clients' key-dependent round-to-round changes reach each de-mixed change.
            self.cross_talk.update(self.demixed_W)

    def evidence(self) -> Evidence:
        """What the verdict reads: every client's ``W`` and owners' values, the sums over
        rounds whose cross-talk was undone plus the de-mixed evidence (as of the last
        :meth:`settle`), each term key-free."""
        W: Mapping[int, Mapping[str, torch.Tensor | Rows]] = self.W
        values: Mapping[int, Mapping[str, float]] = self.values
        if self.demixed_W:
            W, values = self._merged()
        return Evidence(
            W=W,
            values=values,
            laws=self.laws,
            parts=self.parts,
            per_round=self.per_round,
            valid=self.valid,
            cross_talk=frozenset(self.cross_talk),
            rounds_read=self.rounds_read,
            keys=self.keys,
            device=self.device,
        )

    def _merged(
        self,
    ) -> tuple[dict[int, dict[str, torch.Tensor | Rows]], dict[int, dict[str, float]]]:
        """The sums with the de-mixed evidence added (new mappings; the sums stay as they are)."""
        W = {c: dict(parts) for c, parts in self.W.items()}
        values = {c: dict(v) for c, v in self.values.items()}
        for c, parts in self.demixed_W.items():
            acc = W.setdefault(c, {})
            for part, w in parts.items():
                held = acc.get(part)
                if isinstance(held, Rows):  # spilled: this client's sum is read whole here
                    held = torch.from_numpy(held.block(0, held.rows)).reshape(w.shape)
                acc[part] = w if held is None else held + w
        for c, vals in self.demixed_values.items():
            acc_v = values.setdefault(c, {})
            for o, v in vals.items():
                acc_v[o] = acc_v.get(o, 0.0) + v
        return W, values

    def report(self, truth: Mapping[int, bool] | None = None) -> AttributionReport:
        """The verdicts (:func:`~.verdict.report`) on the sums, the rounds kept for de-mixing
        read first (:meth:`settle`)."""
        self.settle()
        return report(
            self.evidence(),
            truth,
            alpha=self.alpha,
            null_keys=self.null_keys,
            seed=self.seed,
            name_uncalibrated=self.name_uncalibrated,
        )

    @classmethod
    def from_results(
        cls,
        results: Mapping[str, Any],
        changes: Mapping[str, torch.Tensor | Rows],
        *,
        seed: int = 0,
        name_uncalibrated: bool = False,
    ) -> CalibratedNull:
        """The sums of a finished run, from its ``results.json`` and ``changes.safetensors``:
        :meth:`report` then reads its verdicts again with this fedattr's tails (no training,
        no model). Each owner's value is its ``Z`` times the change's null standard deviation;
        the saved changes are float32, so p agrees with the run's own to about six digits where
        the tail method is the same. They are kept in float32 (read as float64 a block at a
        time: the same values as converting them whole, in half the memory), or read from the
        file by row blocks (:class:`~fedattr.rows.Rows`, e.g.
        :func:`~fedattr.rows.open_changes` of a large file: the rank check then draws its keys
        by rows, other keys than the run's). ``seed``: the rank check's
        (``attribution.seed``)."""
        laws = results.get("key_laws") or {}
        if results.get("statistic") != "calibrated" or not laws:
            raise UserError(
                "RUN_DIR: the run was not read with the calibrated statistic (no key laws in "
                "its results.json); there is nothing to read again"
            )
        # One law: every owner reads the same part. Several: each owner reads its own part,
        # named as the owner (FK's entities, KGW read on each owner's documents).
        unread = [o for o in results["by_statistic"] if len(laws) > 1 and o not in laws]
        if unread:
            raise UserError(
                f"RUN_DIR: the run's owners read {len(laws)} key laws ({', '.join(laws)}), none "
                f"named as owner {unread[0]}; results.json does not say which it read"
            )
        null = cls(
            alpha=float(results["alpha"]),
            null_keys=int(results.get("null_keys") or 0),
            seed=seed,
            name_uncalibrated=name_uncalibrated,
        )
        null.laws = {part: dict(desc) for part, desc in laws.items()}
        uncalibrated = set(results.get("uncalibrated", []))
        for owner, rows in results["by_statistic"].items():
            part = next(iter(laws)) if len(laws) == 1 else owner
            law = law_from_dict(laws[part])
            null.parts[owner], null.valid[owner] = part, owner not in uncalibrated
            for cid, row in rows.items():
                W = changes.get(f"{cid}/{part}")
                if W is None:
                    continue
                if isinstance(W, Rows) and not isinstance(law, RowSubsets):
                    W = torch.from_numpy(W.block(0, W.rows))  # only row-centred laws by rows
                null.W.setdefault(int(cid), {})[part] = W
                sd = math.sqrt(law.variance(W))
                null.values.setdefault(int(cid), {})[owner] = float(row["Z"]) * sd
        for row in results["clients"]:  # the per-round display of each client's best owner
            null.per_round.setdefault(row["id"], {})[row["statistic"]] = {
                int(t): v for t, v in row.get("z", {}).items()
            }
        null.cross_talk = set(results.get("cross_talk", []))
        null.rounds_read = dict(results.get("rounds_read", {}))
        return null

    def state(self) -> dict:
        """For checkpoints."""
        return {
            "format": 2,
            # Spilled sums are read back whole (a checkpoint holds them in memory).
            "W": {
                c: {p: W.tensor() if isinstance(W, DiskRows) else W for p, W in parts.items()}
                for c, parts in self.W.items()
            },
            "values": self.values,
            "per_round": self.per_round,
            "decorrelated": self.decorrelated,
            "laws": self.laws,
            "parts": self.parts,
            "valid": self.valid,
            "cross_talk": sorted(self.cross_talk),
            "rounds_read": self.rounds_read,
            "keys": self.keys,
            "mixed": self.mixed.state(),
            "late_mixed": self.late_mixed,
            "first": {
                "round": self.first_round,
                "taper": self.first_taper,
                "spread": self.first_spread,
            },
        }

    def load(self, state: Mapping) -> None:
        """Restore :meth:`state`."""
        if state.get("format") != 2:
            raise UserError(
                "the checkpoint holds the calibrated statistic of an earlier fedattr (sums over "
                "random keys, not change matrices); start the run over"
            )
        self.W, self.values = state["W"], state["values"]
        self.per_round, self.decorrelated = state["per_round"], state["decorrelated"]
        self.laws, self.parts, self.valid = state["laws"], state["parts"], state["valid"]
        self.cross_talk = set(state.get("cross_talk", []))
        self.rounds_read = dict(state.get("rounds_read", {}))
        self.keys = dict(state.get("keys", {}))
        self.mixed = DeMixer.from_state(state.get("mixed"))
        self.late_mixed = bool(state.get("late_mixed", False))
        first = state.get("first") or {}
        self.first_round = first.get("round")
        self.first_taper = first.get("taper")
        self.first_spread = dict(first.get("spread") or {})
