"""The owner's scoring step: each client's standardised change and its value under the key.

For every round folder (see :mod:`fedattr.attribution.round_folder`) the owner rebuilds the run's
model from ``rounds/run.json``, reads the reference ``w^{t-1}``, each estimate applied to it and
(where the round's cross-talk is not undone) the round's SA mean with its detector, and turns
them into each target's standardised change exactly as a server that scores in process does
(:func:`~fedattr.attribution.calibrated.standardise.standardise_round`). It writes
``scores-<fingerprint>.json`` (each target's value under the owner's key, and the key law) and
``changes-<fingerprint>.safetensors`` (the standardised changes, key-free: ``fedattr attribute``
sums them over rounds for the exact tail) beside the round's files. Neither reveals the key
beyond the one number per estimate the verdict needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..attribution.round_folder import (
    read_center,
    read_manifest,
    read_round_tensors,
    read_run,
    write_scores,
)
from ..config import from_dict
from ..errors import UserError
from ..pipeline.config import RunConfig
from ..watermarks.keys import OwnerKey

if TYPE_CHECKING:
    import torch

Say = Callable[[str], None]


def run_config_of(folder: Path) -> RunConfig:
    """The run's configuration (``rounds/run.json`` above the round folder)."""
    return from_dict(RunConfig, read_run(folder), quiet=True)


class OwnerScorer:
    """The owner's detector over one run's model: built once, scores many rounds."""

    def __init__(
        self,
        key: OwnerKey,
        run_config: RunConfig,
        texts: Sequence | None = None,
        say: Say | None = None,
    ) -> None:
        from ..fl.federation import detection_records
        from ..fl.registry import make_strategy
        from ..models.loading import load_model
        from ..models.lora import attach_lora, candidate_stacker, load_state
        from ..models.text import encode_examples
        from ..watermarks.radioactivity import KGWReadingScorer

        key.require("kgw")
        cfg = self.config = run_config
        if cfg.watermark.detector != "reading":
            raise UserError(
                "watermark.detector: owner scoring runs the reading detector "
                "(the calibrated statistic's); the run says "
                f"{cfg.watermark.detector!r}"
            )
        documents = cfg.watermark.reads_documents
        if documents and texts is None:  # before the model is loaded
            raise UserError(
                "--texts: this run reads each owner's own watermarked documents "
                "(watermark.kgw.probes=documents); give yours (.jsonl/.json)"
            )
        self.key, self.name = key, f"kgw:{key.fingerprint}"
        self._first: tuple[dict | None, dict] | None = None  # round 1's cell weights
        model, tokenizer = load_model(cfg.model, say)
        key.check_tokenizer(
            tokenizer,
            f"the run's model (model.preset={cfg.model.preset})",
            "score with the key made for this run's model's tokenizer",
        )
        records = list(texts) if texts is not None else detection_records(cfg.data, cfg.watermark)
        model = attach_lora(model, cfg.lora, seed=cfg.fl.seed)
        server, _ = make_strategy(cfg.fl, cfg.lora)
        self.apply = server.apply_estimate
        examples = encode_examples(tokenizer, records, cfg.data.max_len)
        stack = candidate_stacker(model)
        self.scorer = KGWReadingScorer(
            model,
            examples,
            {self.name: key.kgw_scheme(len(tokenizer))},
            load_state,
            pad_id=tokenizer.pad_token_id,
            stack=stack,
            first_only=documents,  # a key's own texts: first occurrences only
        )

    def score(self, folder: str | Path, manifest: dict | None = None) -> Path:
        """Score one round folder (``manifest``: its :func:`read_manifest`, when the caller
        has already checked it); returns the scores file written there."""
        from ..attribution.calibrated.plan import plan_round, undo_updates
        from ..attribution.calibrated.standardise import standardise_round
        from ..attribution.calibrated.weights import taper_weights
        from ..attribution.round_folder import design_from_dict
        from ..attribution.scoring import observe_all

        folder = Path(folder)
        manifest = manifest if manifest is not None else read_manifest(folder)
        reference, updates = read_round_tensors(folder, manifest)
        scorer = self.scorer
        attribution = self.config.attribution
        # Planned from the same manifest and run configuration as the server's in-process
        # scoring: the SA mean's change serves only a round whose cross-talk is not undone
        # (otherwise its model is not read), and with undo = "updates" each model read is the
        # client's own update.
        plan = plan_round(
            int(manifest["round"]),
            manifest["participants"],
            manifest["targets"],
            [design_from_dict(d) for d in manifest["designs"]],
            decorrelate=attribution.calibrated.decorrelate,
            undo=attribution.calibrated.undo,
            # A centre of the clients' only in round 1, whose reference no update has reached.
            centred=attribution.calibrated.centre == "every"
            or (attribution.calibrated.centre == "first" and int(manifest["round"]) <= 1),
        )
        updates = undo_updates(plan, updates)
        # The same reads, in the same order, as the server's in-process scoring.
        ref_obs = scorer.observe(reference)
        observed = list(observe_all(scorer, (self.apply(reference, u) for u in updates)))
        if plan.reads_center:
            observed.append(scorer.observe(self.apply(reference, read_center(folder))))
        changes = [scorer.change(ref_obs, o) for o in observed]
        middle = changes.pop() if plan.reads_center else None
        laws = scorer.key_laws()
        t = int(manifest["round"])
        # As the server's in-process scoring (CalibratedNull): round 1's cell weights, read
        # every later round with.
        first = attribution.calibrated.cell_weights == "first" and t > 1
        if first:
            weights, spread = self._first_weights(folder)
        else:
            weights = taper_weights(
                scorer, ref_obs, attribution.calibrated.taper, attribution.calibrated.taper_from
            )
            spread = {}
        standard = standardise_round(
            plan,
            changes,
            middle,
            laws,
            token_centring=attribution.calibrated.token_centring,
            weights=weights,
            spread=attribution.calibrated.spread,
            frozen_spread=spread if first else None,
            keep_spread=None if first else (lambda part, lo, w: spread.__setitem__(part, w)),
        )
        if attribution.calibrated.cell_weights == "first" and t <= 1:
            self._keep_first_weights(folder, weights, spread)
        values, tensors = {}, {}
        for target, parts in zip(manifest["targets"], standard, strict=True):
            values[str(target)] = scorer.owner_values("probes", parts["probes"])[self.name]
            tensors[str(target)] = parts["probes"].contiguous()
        out = {
            "round": manifest["round"],
            "owner": self.name,
            "fingerprint": self.key.fingerprint,
            "texts": scorer.positions,
            "targets": values,
            "law": laws["probes"].describe(),
            "decorrelated": plan.undone,
        }
        return write_scores(folder, out, tensors)

    def _weights_file(self, folder: Path) -> Path:
        return folder / f"weights-{self.key.fingerprint}.safetensors"

    def _keep_first_weights(
        self, folder: Path, taper: dict | None, spread: dict[str, torch.Tensor]
    ) -> None:
        """Round 1's key-free cell weights, kept in memory and beside its scores (a later
        round scored in another call reads them there)."""
        from safetensors.torch import save_file

        from ..attribution.round_folder import write_atomic

        self._first = (taper, dict(spread))
        tensors = {f"taper/{k}": v.float().contiguous() for k, v in (taper or {}).items()}
        tensors.update({f"spread/{k}": v.float().contiguous() for k, v in spread.items()})
        write_atomic(self._weights_file(folder), lambda tmp: save_file(tensors, str(tmp)))

    def _first_weights(self, folder: Path) -> tuple[dict | None, dict[str, torch.Tensor]]:
        """Round 1's key-free cell weights: kept from scoring it, or read beside its scores."""
        if self._first is not None:
            return self._first
        from safetensors.torch import load_file

        for sibling in sorted(folder.parent.glob("round-*")):
            path = self._weights_file(sibling)
            if path.is_file() and int(read_manifest(sibling)["round"]) == 1:
                tensors = load_file(str(path))
                taper = {k[6:]: v for k, v in tensors.items() if k.startswith("taper/")}
                spread = {k[7:]: v for k, v in tensors.items() if k.startswith("spread/")}
                self._first = (taper or None, spread)
                return self._first
        raise UserError(
            f"ROUND_DIR: {str(folder)!r} is read with round 1's cell weights "
            "(attribution.calibrated.cell_weights=first); score round 1 first, with the same key"
        )


def score_rounds(
    key: OwnerKey,
    folders: Sequence[str | Path],
    texts: Sequence | None = None,
    say: Say | None = None,
) -> list[Path]:
    """Score every round folder (all of one run) with ``key``; the scores files written."""
    say = say or (lambda _m: None)
    paths = [Path(f) for f in folders]
    if not paths:
        raise UserError("ROUND_DIR: give at least one round folder")
    manifests = [read_manifest(p) for p in paths]  # every folder checked before any work
    # In round order: round 1's key-free cell weights read the later rounds.
    order = sorted(range(len(paths)), key=lambda i: int(manifests[i]["round"]))
    paths, manifests = [paths[i] for i in order], [manifests[i] for i in order]
    configs = {str(p.parent.resolve()) for p in paths}
    if len(configs) != 1:
        raise UserError("ROUND_DIR: round folders of one run at a time (one rounds/ folder)")
    scorer = OwnerScorer(key, run_config_of(paths[0]), texts, say)
    written = []
    for p, manifest in zip(paths, manifests, strict=True):
        written.append(scorer.score(p, manifest))
        say(f"scored {p} -> {written[-1].name}")
    return written
