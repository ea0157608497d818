"""Scoring as the owner's step: what the server releases to corpus owners, round by round.

With ``attribution.scoring = "owner"`` the server holds no owner key. Each round it runs
FedAttr's phase 1 (SA queries only) and writes what the paper releases to the owner into
``<run>/rounds/round-NNN/``:

- ``reference.safetensors``: the scoring parameters of the global model ``w^{t-1}`` (the
  strategy's update space: FedIT's LoRA factors, FLoRA's merged weights);
- ``estimates.safetensors``: every target's estimate ``Delta_hat_i`` (tensor names
  ``<target>/<parameter>``), and ``center.safetensors``: the round's SA mean;
- ``manifest.json``: round, participants, targets, each target's design (its U and V subsets,
  hence its coefficients), the null-key count and seed every owner must use, and digests of the
  three tensor files.

``<run>/rounds/run.json`` holds the run's configuration without any key (the owner rebuilds the
model and, by default, the held-out detection texts from it). An owner scores round folders with
``fedattr owner score`` (:mod:`fedattr.owner.score`); ``fedattr attribute`` combines every
owner's scores into the run's results (:mod:`fedattr.attribution.offline`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..fl.server import Observer, RoundContext
from .design import DesignStats, QueryDesign
from .protocol import FedAttr, RoundEstimates

ROUND_FORMAT = "fedattr-round/1"
TENSOR_FILES = ("reference.safetensors", "estimates.safetensors", "center.safetensors")


def round_dir(run_dir: str | Path, round_id: int) -> Path:
    """``<run>/rounds/round-NNN``."""
    return Path(run_dir) / "rounds" / f"round-{round_id:03d}"


def _tensors(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in params.items()}


def _save(path: Path, tensors: Mapping[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(dict(tensors), str(tmp))
    os.replace(tmp, path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def design_to_dict(design: QueryDesign) -> dict:
    """JSON-ready form of one target's design."""
    stats = asdict(design.stats)
    stats["alpha"] = {str(k): v for k, v in stats["alpha"].items()}
    return {"target": design.target, "U": [list(u) for u in design.U],
            "V": [list(v) for v in design.V], "participants": list(design.participants),
            "redraws": design.redraws, "stats": stats}  # fmt: skip


def design_from_dict(d: Mapping) -> QueryDesign:
    """Inverse of :func:`design_to_dict`."""
    stats = dict(d["stats"])
    stats["alpha"] = {int(k): float(v) for k, v in stats["alpha"].items()}
    return QueryDesign(int(d["target"]), tuple(tuple(u) for u in d["U"]),
                       tuple(tuple(v) for v in d["V"]), DesignStats(**stats),
                       int(d["redraws"]), tuple(d["participants"]))  # fmt: skip


def write_round(
    folder: Path, estimates: RoundEstimates, reference: Any, center: Any, fedattr: FedAttr
) -> Path:
    """One round's release to the owners (see the module docstring); returns the folder."""
    if not isinstance(reference, Mapping):
        raise UserError("attribution.scoring=owner: exports need a mapping of named tensors "
                        "(an LLM federation); the synthetic federation has none")  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    updates = {}
    for e in estimates.estimates:
        update = estimates.layout.unflatten(e.flat)
        assert isinstance(update, Mapping)  # a mapping reference unflattens to a mapping
        for name, t in update.items():
            updates[f"{e.target}/{name}"] = t
    digests = {
        "reference.safetensors": _save(folder / "reference.safetensors", _tensors(reference)),
        "estimates.safetensors": _save(folder / "estimates.safetensors", _tensors(updates)),
        "center.safetensors": _save(folder / "center.safetensors", _tensors(center)),
    }
    cfg = fedattr.config
    manifest = {
        "format": ROUND_FORMAT, "round": estimates.round,
        "participants": list(estimates.participants),
        "targets": [e.target for e in estimates.estimates],
        "designs": [design_to_dict(e.design) for e in estimates.estimates],
        "skipped": list(estimates.skipped), "dropouts": list(estimates.dropouts),
        "null_keys": cfg.null_keys, "seed": cfg.seed, "sha256": digests,
    }  # fmt: skip
    tmp = folder / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, folder / "manifest.json")  # last: a folder with a manifest is complete
    return folder


class ExportObserver(Observer):
    """FedAttr's phase 1 each round, then the round's release written for the owners; no
    scores (the server holds no key)."""

    def __init__(self, fedattr: FedAttr, run_dir: str | Path, run_config: Mapping,
                 name: str = "fedattr") -> None:  # fmt: skip
        if fedattr.config.statistic != "calibrated":
            raise UserError("attribution.scoring=owner: needs attribution.statistic=calibrated "
                            "(owners return key statistics, not the paper's z)")  # fmt: skip
        self.fedattr, self.run_dir, self.name = fedattr, Path(run_dir), name
        self.records: list[dict] = []
        self.timing = {"sa_s": 0.0, "scoring_s": 0.0}
        rounds = self.run_dir / "rounds"
        rounds.mkdir(parents=True, exist_ok=True)
        (rounds / "run.json").write_text(json.dumps(dict(run_config), indent=2))

    def round_opened(self, ctx: RoundContext) -> None:
        t0 = time.perf_counter()
        with ctx.sa.session(self.name):
            estimates = self.fedattr.query_round(ctx.round, ctx.sa)
        seconds = time.perf_counter() - t0
        ctx.timing.add("sa_s", seconds)
        self.timing["sa_s"] += seconds
        folder = write_round(round_dir(self.run_dir, ctx.round), estimates, ctx.reference,
                             ctx.mean_update, self.fedattr)  # fmt: skip
        self.records.append({"round": ctx.round, "participants": list(estimates.participants),
                             "targets": [e.target for e in estimates.estimates],
                             "dropouts": list(estimates.dropouts),
                             "exported": str(folder.relative_to(self.run_dir))})  # fmt: skip
        ctx.progress(f"[round {ctx.round}/{ctx.rounds}] {len(estimates.estimates)} estimates "
                     f"exported for the owners to {folder}")  # fmt: skip

    def state(self) -> dict:
        return {"records": self.records, "timing": self.timing}

    def load(self, state: dict | None) -> None:
        if state is not None:
            self.records, self.timing = state["records"], state["timing"]
