"""The round-folder format: what the server releases to corpus owners each round, and what the
owners write back. Written, checked and read here only.

``<run>/rounds/run.json``: the run's configuration without any key. ``<run>/rounds/round-NNN/``:

- ``reference.safetensors``: the scoring parameters of the global model ``w^{t-1}``;
- ``estimates.safetensors``: every target's estimate (tensor names ``<target>/<parameter>``);
- ``center.safetensors``: the round's SA mean;
- ``manifest.json`` (written last: a folder with a manifest is complete): round, participants,
  targets, each target's design (its U and V subsets), the null-key count and seed, and the
  SHA-256 digests of the three tensor files;
- per owner, ``scores-<fingerprint>.json`` (each target's value under the owner's key, the key
  law) and ``changes-<fingerprint>.safetensors`` (the standardised changes, key-free).

The page ``docs/reference/round-folder.md`` describes the same fields for readers.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from .design import DesignStats, QueryDesign
from .protocol import FedAttr
from .records import RoundEstimates

ROUND_FORMAT = "fedattr-round/1"
SCORES_FORMAT = "fedattr-scores/2"
TENSOR_FILES = ("reference.safetensors", "estimates.safetensors", "center.safetensors")
RUN_FILE = "run.json"


class RoundFolderError(UserError):
    """A round folder that is missing, incomplete or altered."""


def round_dir(run_dir: str | Path, round_id: int) -> Path:
    """``<run>/rounds/round-NNN``."""
    return Path(run_dir) / "rounds" / f"round-{round_id:03d}"


def round_folders(run_dir: str | Path) -> list[Path]:
    """Every ``rounds/round-*`` folder of a run, in round order."""
    return sorted((Path(run_dir) / "rounds").glob("round-*"))


def read_json(path: Path) -> Any:
    """A JSON file of a run's exports; a damaged one is one line naming it."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RoundFolderError(f"{str(path)!r} is damaged ({exc.msg})") from None


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Write then rename: a kill leaves the previous file (or none), never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def write_json_durably(path: Path, data: Any) -> None:
    """Write ``data`` as JSON whole, flushed to disk and renamed in place, the rename synced too.

    For records a later call must find after a crash (a client's ledger, a server's openings):
    a rename alone can be lost with the power.
    """

    def write(temporary: Path) -> None:
        with open(temporary, "w") as handle:
            handle.write(json.dumps(data))
            handle.flush()
            os.fsync(handle.fileno())

    write_atomic(path, write)
    try:
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:  # a platform that cannot open a folder (Windows) keeps the rename as is
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


def _tensors(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in params.items()}


def _save(path: Path, tensors: Mapping[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    write_atomic(path, lambda tmp: save_file(dict(tensors), str(tmp)))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def design_to_dict(design: QueryDesign) -> dict:
    """JSON-ready form of one target's design."""
    stats = asdict(design.stats)
    stats["alpha"] = {str(k): v for k, v in stats["alpha"].items()}
    return {
        "target": design.target,
        "U": [list(u) for u in design.U],
        "V": [list(v) for v in design.V],
        "participants": list(design.participants),
        "redraws": design.redraws,
        "stats": stats,
    }


def design_from_dict(d: Mapping) -> QueryDesign:
    """Inverse of :func:`design_to_dict`."""
    stats = dict(d["stats"])
    stats["alpha"] = {int(k): float(v) for k, v in stats["alpha"].items()}
    return QueryDesign(
        int(d["target"]),
        tuple(tuple(u) for u in d["U"]),
        tuple(tuple(v) for v in d["V"]),
        DesignStats(**stats),
        int(d["redraws"]),
        tuple(d["participants"]),
    )


def write_run(run_dir: str | Path, run_config: Mapping) -> None:
    """``<run>/rounds/run.json``: the configuration the owners rebuild the model from."""
    rounds = Path(run_dir) / "rounds"
    rounds.mkdir(parents=True, exist_ok=True)
    (rounds / RUN_FILE).write_text(json.dumps(dict(run_config), indent=2))


def read_run(folder: Path) -> dict:
    """The run's configuration as saved above the round folder ``folder`` (a dict: the caller
    types it)."""
    path = folder.parent / RUN_FILE
    if not path.is_file():
        raise RoundFolderError(
            f"{str(path)!r} is missing: the run's configuration comes with its round folders"
        )
    return read_json(path)


def write_round(
    folder: Path, estimates: RoundEstimates, reference: Any, center: Any, fedattr: FedAttr
) -> Path:
    """One round's release to the owners (see the module docstring); returns the folder."""
    if not isinstance(reference, Mapping):
        raise UserError(
            "attribution.scoring=owner: exports need a mapping of named tensors "
            "(an LLM federation); the synthetic federation has none"
        )
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
        "format": ROUND_FORMAT,
        "round": estimates.round,
        "participants": list(estimates.participants),
        "targets": [e.target for e in estimates.estimates],
        "designs": [design_to_dict(e.design) for e in estimates.estimates],
        "skipped": list(estimates.skipped),
        "dropouts": list(estimates.dropouts),
        "null_keys": cfg.calibrated.null_keys,
        "seed": cfg.seed,
        "sha256": digests,
    }
    write_atomic(
        folder / "manifest.json", lambda tmp: tmp.write_text(json.dumps(manifest, indent=2))
    )
    return folder


def read_manifest(folder: Path) -> dict:
    """A round folder's manifest, its tensor files checked against their digests."""
    path = folder / "manifest.json"
    if not path.is_file():
        raise RoundFolderError(
            f"round folder {str(folder)!r}: no manifest.json (not a round "
            "folder, or its export did not finish)"
        )
    manifest = read_json(path)
    if manifest.get("format") != ROUND_FORMAT:
        raise RoundFolderError(f"{str(path)!r}: not a fedattr round manifest ({ROUND_FORMAT})")
    for name in TENSOR_FILES:
        if not (folder / name).is_file():
            raise RoundFolderError(f"round folder {str(folder)!r}: {name} is missing")
    for name in TENSOR_FILES:
        file = folder / name
        if hashlib.sha256(file.read_bytes()).hexdigest() != manifest["sha256"][name]:
            raise RoundFolderError(
                f"round folder {str(folder)!r}: {name} does not match its "
                "manifest digest (altered or truncated)"
            )
    return manifest


def read_round_tensors(folder: Path, manifest: Mapping) -> tuple[dict, list[dict]]:
    """The reference and each target's estimate (in the manifest's target order)."""
    from safetensors.torch import load_file

    reference = load_file(str(folder / "reference.safetensors"))
    flat = load_file(str(folder / "estimates.safetensors"))
    updates = []
    for target in manifest["targets"]:
        prefix = f"{target}/"
        updates.append({k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)})
    return reference, updates


def read_center(folder: Path) -> dict:
    """The round's SA mean (read only where a round's cross-talk is kept)."""
    from safetensors.torch import load_file

    return load_file(str(folder / "center.safetensors"))


def write_scores(
    folder: Path, scores: Mapping[str, Any], changes: Mapping[str, torch.Tensor]
) -> Path:
    """An owner's ``changes-<fp>.safetensors`` then ``scores-<fp>.json`` (``scores`` without
    its ``format``, which is added here); returns the scores file."""
    from safetensors.torch import save_file

    fp = scores["fingerprint"]
    tensors = {k: v.contiguous() for k, v in changes.items()}
    write_atomic(folder / f"changes-{fp}.safetensors", lambda tmp: save_file(tensors, str(tmp)))
    path = folder / f"scores-{fp}.json"
    out = {"format": SCORES_FORMAT, **scores}
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(out)))
    return path


def read_scores(folder: Path, round_id: int) -> dict[str, dict]:
    """Every owner's scores of one round folder: owner name -> scores."""
    files = sorted(folder.glob("scores-*.json"))
    if not files:
        raise UserError(
            f"round folder {str(folder)!r} holds no scores-*.json: the owners "
            "score it first (fedattr owner score --key KEY ROUND_DIR)"
        )
    out = {}
    for f in files:
        data = read_json(f)
        if data.get("format") != SCORES_FORMAT:
            raise UserError(
                f"{str(f)!r} was written by an earlier fedattr (format "
                f"{data.get('format')!r}); score the round again"
            )
        if data.get("round") != round_id:
            raise UserError(f"{str(f)!r} scores round {data.get('round')}, not {round_id}")
        out[data["owner"]] = data
    return out


def read_changes(folder: Path, scores: Mapping) -> dict[str, torch.Tensor]:
    """The standardised changes an owner's scores file goes with."""
    from safetensors.torch import load_file

    path = folder / f"changes-{scores['fingerprint']}.safetensors"
    if not path.is_file():
        raise UserError(
            f"round folder {str(folder)!r}: {path.name} is missing (it is written "
            "with the owner's scores); score the round again"
        )
    return load_file(str(path))
