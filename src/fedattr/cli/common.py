"""What the command groups share: ``--config``/``--set``, and how a run's configuration is found.

Everything heavy is imported inside the functions, so that ``fedattr --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:
    from ..pipeline.config import RunConfig
    from ..reporting.run_folder import RunFolder

PRESET_HELP = "tiny (default, CPU), smollm2 (GPU) or smollm2-cpu (SmolLM2 sized for a CPU)"


def config_options(
    parser: argparse.ArgumentParser, config_help: str, set_help: str = "override a setting"
) -> None:
    """``--config FILE`` and the repeatable ``--set KEY=VALUE`` of every configured command."""
    parser.add_argument("--config", help=config_help)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help=f"{set_help} (repeatable)"
    )


def say(message: str) -> None:
    """A progress line: on standard error, so standard output keeps only the results."""
    print(message, file=sys.stderr)


def load_run_config(args: argparse.Namespace, preset: str, extra: Sequence[str] = ()) -> RunConfig:
    """A run's configuration: the preset's overrides, then ``--config``, then ``--set``, then
    ``extra`` (the command's own overrides)."""
    from ..config import load
    from ..pipeline.config import RunConfig, preset_overrides

    return load(RunConfig, args.config, preset_overrides(preset) + args.set + list(extra))


def resolve_run_config(
    args: argparse.Namespace, preset: str, fixed_on_resume: Sequence[str]
) -> tuple[RunConfig, RunFolder | None]:
    """The configuration of a run that may be a ``--resume``: the resumed run folder's own
    ``config.json`` and that folder, else (``--preset``, ``--config``, ``--set``) and no folder,
    which the caller claims once its checks have passed. ``fixed_on_resume`` are the options
    (``--config`` ...) that a resume refuses."""
    if not args.resume:
        return load_run_config(args, preset), None
    from ..config import from_dict
    from ..pipeline.config import RunConfig
    from ..reporting.run_folder import RunFolder

    # The run folder's resolved config is the configuration: nothing may change on resume.
    if any(getattr(args, option.lstrip("-").replace("-", "_")) for option in fixed_on_resume):
        raise UserError(
            f"--resume: takes the run folder's own config.json; drop {'/'.join(fixed_on_resume)}"
        )
    folder = RunFolder(args.resume, "--resume")
    # Written before a key was renamed, it is read by its old names without a note.
    return from_dict(RunConfig, folder.resumable_config(), quiet=True), folder


def default_run_dir(cfg: RunConfig) -> str:
    """``runs/<time>-<strategy>-<model>``: where a run goes without ``--out``."""
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"runs/{stamp}-{cfg.fl.strategy}-{cfg.model.preset}"
