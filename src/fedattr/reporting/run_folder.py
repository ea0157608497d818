"""A run folder: its files, its configuration, and whether it is new, unfinished or finished.

Every command that writes or reads runs (``run``, ``run --resume``, ``demo-protocol``,
``experiment *``, ``audit``) goes through :class:`RunFolder`, so they agree on file names,
refuse the same mistakes (a folder of another configuration, a finished run, a file) with the
same one-line errors, and never overwrite a run's files before refusing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pickle
import shutil
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..attribution.audit import RoundAudit, audit_file, read_query_log
from ..attribution.crossround import CrossRoundAudit, audit_cross_round
from ..attribution.round_folder import write_atomic
from ..attribution.stouffer import AttributionReport
from ..config import from_dict, to_dict
from ..data.loaders import json_lines
from ..errors import UserError, has_module, not_writable
from .markdown import run_report

CONFIG = "config.json"
ROUNDS = "rounds.jsonl"
QUERIES = "queries.jsonl"
RESULTS = "results.json"
REPORT = "report.md"
PLOT = "attribution.png"
ATTRIBUTION = "attribution.json"
CHECKPOINT_DIR = "checkpoint"
CHECKPOINT = "state.pt"
DOCUMENTS = "teacher-documents.json"


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """One JSON object per line."""
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def _plain(config: dict) -> Any:
    """The configuration as JSON would give it back (tuples -> lists, ...)."""
    return json.loads(json.dumps(config))


class RunFolder:
    """One run's folder (``--out``).

    States: ``new`` (absent or empty), ``started`` (configuration written, no round finished),
    ``interrupted`` (a checkpoint after some round), ``finished`` (``results.json``), ``foreign``
    (other files, no fedattr run).
    """

    def __init__(self, path: str | Path, option: str = "--out") -> None:
        self.path = Path(path)
        self.option = option
        """How the user named the folder, for error messages."""
        self._made: list[Path] | None = None
        """Set by a claim of a new folder: the folders it created, innermost first."""

    def __str__(self) -> str:
        return str(self.path)

    def require_existing(self, written_by: str) -> RunFolder:
        """This folder when it exists (a command that reads a run: ``audit``, ``attribute``);
        else one line naming the option and ``written_by`` (the commands that write one)."""
        where = repr(str(self.path))
        if self.path.is_dir():
            return self
        if self.path.exists():
            raise UserError(f"{self.option}: {where} is a file; give a run folder ({written_by})")
        raise UserError(f"{self.option}: {where} does not exist; give a run folder ({written_by})")

    def file(self, name: str) -> Path:
        """Path of one of the folder's files."""
        return self.path / name

    @property
    def checkpoint_path(self) -> Path:
        """Where the checkpoint of an unfinished run lives."""
        return self.path / CHECKPOINT_DIR / CHECKPOINT

    @property
    def status(self) -> str:
        """``new``, ``started``, ``interrupted``, ``finished`` or ``foreign``."""
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"{self.option}: {str(self.path)!r} is a file; give a folder")
        try:
            if not self.path.exists() or not any(self.path.iterdir()):
                return "new"
        except OSError as exc:  # a folder this user may not list
            raise UserError(
                f"{self.option}: {str(self.path)!r} cannot be read ({exc.strerror}); "
                "choose a folder you can read and write"
            ) from None
        if self.file(RESULTS).is_file() and self.file(CONFIG).is_file():
            return "finished"
        if self.checkpoint_path.is_file():
            return "interrupted"
        if self.file(CONFIG).is_file():
            return "started"
        return "foreign"

    def saved_config(self) -> dict:
        """The configuration the folder was run with."""
        try:
            return json.loads(self.file(CONFIG).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(
                f"{self.option}: {str(self.file(CONFIG))!r} cannot be read ({exc}); the folder "
                "is damaged: choose another folder or remove it"
            ) from exc

    def _saved_as(self, kind: type | None) -> Any:
        """The saved configuration, read as ``kind`` when given (defaults for settings it
        lacks, old key names read as the new ones, without a note); one that ``kind`` cannot
        read is returned as saved (so it differs)."""
        saved = self.saved_config()
        if kind is None:
            return saved
        try:
            return _plain(to_dict(from_dict(kind, saved, quiet=True)))
        except UserError:
            return saved

    def claim(self, config: Any, *, reuse: bool = False) -> str:
        """Take the folder for a run of ``config`` before any work starts.

        Returns ``"new"`` (configuration written), ``"resume"`` (an unfinished run of the same
        configuration) or ``"finished"`` (a finished run of it). Without ``reuse`` only a new
        folder is accepted; with it (experiments) a run of the same configuration is resumed or
        kept. Anything else is refused with one line, and nothing in the folder is touched.
        ``config``: a dict, or a typed configuration (dataclass); with the latter, a folder
        written before a setting existed is read with that setting's default (as a config
        file without it would be), and one written with a key's old name (the flat keys before
        the sections) as the new key, so an experiment re-run after an upgrade keeps its runs.
        """
        kind = type(config) if dataclasses.is_dataclass(config) else None
        if kind is not None:
            config = to_dict(config)
        status = self.status
        where = repr(str(self.path))
        if status == "foreign":
            raise UserError(
                f"{self.option}: {where} is not empty and holds no fedattr run; "
                "choose a new or empty folder"
            )
        if status != "new":
            if self._saved_as(kind) != _plain(config):
                raise UserError(
                    f"{self.option}: {where} holds a run with another configuration; "
                    f"choose another {self.option} or remove it"
                )
            if not reuse:
                if status == "finished":
                    raise UserError(
                        f"{self.option}: {where} holds a finished run ({RESULTS}); choose "
                        f"another {self.option} or remove it"
                    )
                raise UserError(
                    f"{self.option}: {where} holds an unfinished run; continue it with "
                    f"'fedattr run --resume {self.path}' or choose another folder"
                )
            return "finished" if status == "finished" else "resume"
        made = [p for p in (self.path, *self.path.parents) if not p.exists()]
        self._made = made
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.file(CONFIG).write_text(json.dumps(config, indent=2))
        except OSError as exc:  # unwritable, or a file where a parent folder should be
            self.release()  # what this claim made, so the corrected command finds it as it was
            raise not_writable(self.path, self.option, exc) from None
        return "new"

    def release(self) -> bool:
        """Undo this object's claim of a new folder when its run failed before finishing a
        round (no checkpoint, no results): what the claim and the failed start wrote is
        removed, and so are the parent folders the claim created (e.g. ``runs/``) if they are
        empty, so the corrected command can take the same folder. A folder holding a round's
        work, or one this object did not claim new, is kept. True when it removed the run."""
        if self._made is None or self.checkpoint_path.exists() or self.file(RESULTS).exists():
            return False
        made, self._made = self._made, None
        if self.path in made:
            shutil.rmtree(self.path, ignore_errors=True)
        else:  # a folder that was empty before the claim: empty again
            for entry in self.path.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        for parent in made:
            if parent != self.path:
                try:
                    parent.rmdir()  # only when empty: another run may have written there since
                except OSError:
                    break
        return True

    @contextlib.contextmanager
    def released_on_failure(self) -> Iterator[RunFolder]:
        """Around a claimed run's work: when it fails (bad input, a bug, an interrupt) before
        its first round is saved, :meth:`release` the folder, then let the exception go on."""
        try:
            yield self
        except BaseException:
            self.release()
            raise

    def resumable_config(self) -> dict:
        """The configuration of the unfinished run to continue (``--resume``)."""
        status = self.status
        where = repr(str(self.path))
        if status == "finished":
            raise UserError(
                f"{self.option}: {where} is already finished (results in {RESULTS}); "
                "nothing to resume"
            )
        if status in ("new", "foreign"):
            raise UserError(f"{self.option}: {where} holds no fedattr run to resume")
        return self.saved_config()

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, payload: dict) -> None:
        """Write then rename: a kill during the write leaves the previous checkpoint intact."""
        self.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.checkpoint_path, lambda tmp: torch.save(payload, tmp))

    def load_checkpoint(self) -> dict | None:
        """The last checkpoint, or ``None``; a damaged one is one clear error."""
        path = self.checkpoint_path
        if not path.is_file():
            return None
        try:
            payload = torch.load(path, weights_only=False)
        except (
            OSError,
            EOFError,
            RuntimeError,
            ValueError,
            pickle.UnpicklingError,
            zipfile.BadZipFile,
        ) as exc:
            raise UserError(
                f"{self.option}: the checkpoint {str(path)!r} is damaged ({type(exc).__name__}); "
                f"remove {str(path.parent)!r} to restart the run from round 1"
            ) from exc
        keys = {"round", "state", "history", "queries", "rng", "timing", "observers"}
        if not isinstance(payload, dict) or not keys <= set(payload):
            raise UserError(
                f"{self.option}: {str(path)!r} is not a checkpoint of this fedattr version; "
                f"remove {str(path.parent)!r} to restart the run from round 1"
            )
        return payload

    @property
    def documents_path(self) -> Path:
        """Where an unfinished run keeps the documents its teacher wrote (removed with the
        checkpoint when the run finishes)."""
        return self.path / CHECKPOINT_DIR / DOCUMENTS

    def save_documents(self, documents: dict) -> None:
        """Keep the teacher's documents of this run (:func:`~fedattr.fl.federation.
        build_federation`'s ``documents``), so a resume restores them rather than running the
        teacher again. Write then rename, as the checkpoint."""
        self.documents_path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(documents, ensure_ascii=False)
        write_atomic(self.documents_path, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    def load_documents(self) -> dict:
        """The teacher's documents an earlier session of this run kept; ``{}`` when there are
        none (a new run, or a checkpoint from before they were kept) or they cannot be read
        (the teacher then writes them again: it is deterministic)."""
        try:
            documents = json.loads(self.documents_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return {}
        return documents if isinstance(documents, dict) else {}

    def clear_checkpoint(self) -> None:
        """Finished: the results supersede the checkpoint."""
        shutil.rmtree(self.path / CHECKPOINT_DIR, ignore_errors=True)

    # -- results ----------------------------------------------------------------------------
    def write_results(
        self,
        *,
        rounds: list[dict],
        queries: list[dict],
        results: dict,
        report_md: str,
        report: Any,
    ) -> None:
        """``rounds.jsonl``, ``queries.jsonl`` (coefficients, never results), ``report.md``
        with a link to ``attribution.png``, the plot, then ``results.json`` last (its presence
        marks the run finished)."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_jsonl(self.file(ROUNDS), rounds)
        write_jsonl(self.file(QUERIES), queries)
        self._write_report(report_md, report)
        self.file(RESULTS).write_text(json.dumps(results, indent=2))

    def _write_report(self, report_md: str, report: Any) -> None:
        # The plot is the one part of a run's results that needs the optional plots extra.
        if not has_module("matplotlib"):
            note = f"({PLOT} not drawn: pip install 'fedattr[plots]')"
            self.file(REPORT).write_text(report_md + f"\n\n{note}\n")
            return
        from .plots import plot_attribution

        self.file(REPORT).write_text(report_md + f"\n\n![attribution]({PLOT})\n")
        plot_attribution(report, self.file(PLOT))

    def write_owner_scored(self, report: AttributionReport, owners: list[str]) -> None:
        """The verdicts ``fedattr attribute`` combined from the owners' scores:
        ``attribution.json`` (that report alone), merged into ``results.json`` (when the run
        finished), and ``report.md`` and the plot rewritten with them."""
        data = report.to_dict()
        data["owners"] = owners
        self.file(ATTRIBUTION).write_text(json.dumps(data, indent=2))
        results = self.file(RESULTS)
        if results.is_file():
            merged = {**json.loads(results.read_text()), **data, "scoring": "owner"}
            results.write_text(json.dumps(merged, indent=2))
        md = self.file(REPORT)
        title = md.read_text().split("\n\n")[0] if md.is_file() else "# FedAttr run"
        summary = [f"Scored by the owners ({', '.join(owners)}), combined by fedattr attribute."]
        self._write_report(run_report(title, summary, report), report)

    def audit(self) -> list[RoundAudit]:
        """What the run's SA answers reveal, per round (``queries.jsonl``)."""
        return audit_file(self.file(QUERIES))

    def audit_cross_round(self) -> list[CrossRoundAudit]:
        """What the run's SA answers reveal across rounds, per SA session (``queries.jsonl``),
        with the simulation's measured reconstruction where ``results.json`` holds one."""
        audits = audit_cross_round(read_query_log(self.file(QUERIES)))
        measured: Any = {}
        if self.file(RESULTS).is_file():
            try:
                measured = self.results().get("cross_round", {})
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
                raise UserError(
                    f"{self.option}: {str(self.file(RESULTS))!r} cannot be read ({exc}); the "
                    "folder is damaged: re-run or restore it"
                ) from exc
        for a in audits:
            found = measured.get(a.session) if isinstance(measured, dict) else None
            a.reconstruction = found if isinstance(found, dict) else None
        return audits

    def results(self) -> dict:
        """``results.json`` of a finished run."""
        return json.loads(self.file(RESULTS).read_text())

    def read_rounds(self) -> list[dict]:
        """``rounds.jsonl`` as dicts."""
        lines = json_lines(self.file(ROUNDS).read_text(encoding="utf-8"))
        return [json.loads(line) for line in lines if line.strip()]


def audit_run(run_dir: str | Path) -> list[RoundAudit]:
    """:meth:`RunFolder.audit` of the folder ``run_dir`` (``fedattr audit RUN_DIR``)."""
    folder = RunFolder(run_dir, "RUN_DIR").require_existing(
        "written by 'fedattr run --out' or 'fedattr demo-protocol --out'"
    )
    return folder.audit()


def audit_run_cross_round(run_dir: str | Path) -> list[CrossRoundAudit]:
    """:meth:`RunFolder.audit_cross_round` of the folder ``run_dir`` (``fedattr audit``)."""
    folder = RunFolder(run_dir, "RUN_DIR").require_existing(
        "written by 'fedattr run --out' or 'fedattr demo-protocol --out'"
    )
    return folder.audit_cross_round()
