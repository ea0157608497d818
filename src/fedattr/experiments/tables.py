"""``fedattr experiment table NAME``: the paper's ablation tables as presets over ``sweep``.

Each table is a list of axes at the paper's values plus the fixed settings it needs; the sweep
does the running (shared training runs, resume) and writes the files. Where the paper's values
cannot run as they are on the embedded default, the preset says what it changes in its caption.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import UserError
from ..pipeline.config import RunConfig
from .sweep import Axis, SweepSpec


@dataclass(frozen=True)
class TableSpec:
    """One named table: its axes, fixed settings, extra columns and caption."""

    axes: tuple[Axis, ...]
    fixed: tuple[str, ...] = ()
    caption: str = ""
    extra: dict[str, Callable[[dict[str, str], RunConfig], str]] = field(default_factory=dict)
    layout: str = "attribution"


def _variance_factor(point: dict[str, str], cfg: RunConfig) -> str:
    n, k = int(point["attribution.protocol.N"]), cfg.fl.per_round
    return f"{n * (k - 1 - n) / (k - 2):.2f}"


def _expected_rounds(point: dict[str, str], cfg: RunConfig) -> str:
    return f"{cfg.fl.rounds * cfg.fl.per_round / cfg.fl.K:.1f}"


def _query_count(point: dict[str, str], cfg: RunConfig) -> str:
    a = cfg.attribution.protocol
    return f"{2 * a.M * cfg.fl.per_round * cfg.fl.rounds:,}"


def _scalability(k: int, proportional: bool) -> tuple[str, dict[str, str]]:
    n = k // 3 if proportional else 4
    shown = f"K={k}, N={n} ({'⌊K/3⌋' if proportional else 'fixed'})"
    return shown, {
        "fl.K": str(k),
        "watermark.r": str(int(0.3 * k)),
        "attribution.protocol.N": str(n),
    }


_LORA_RANKS = tuple((str(r), {"lora.r": str(r), "lora.alpha": str(2 * r)}) for r in (16, 64, 128))
_PARTITIONS = (
    ("IID", {"data.partition": "iid"}),
    *(
        (f"Dirichlet α={a}", {"data.partition": "dirichlet", "data.dirichlet_alpha": a})
        for a in ("0.5", "0.1", "0.05")
    ),
)

TABLES: dict[str, TableSpec] = {
    "prevalence": TableSpec(
        (Axis.of_key("watermark.r", ["0", "1", "3", "5"]),),
        caption="Prevalence: r watermarked clients of K = 10. ",
    ),
    "subset-size": TableSpec(
        (Axis.of_key("attribution.protocol.N", ["1", "2", "4", "5", "6", "8"]),),
        fixed=("secagg.min_members=1",),
        caption="Subset size N (K = 10; the SA threshold is lowered to 1 so that every N is "
        "admissible; variance factor N(K−1−N)/(K−2)). ",
        extra={"variance factor": _variance_factor},
    ),
    "queries": TableSpec(
        (Axis.of_key("attribution.protocol.M", ["2", "3", "5", "10", "20"]),),
        caption="Queries per side M (2MK SA queries per round). ",
    ),
    "ratio": TableSpec(
        (Axis.of_key("watermark.ratio", ["0.05", "0.10", "0.20", "0.30"]),),
        caption="Watermarked share ρ of a watermarked client's documents. ",
    ),
    "lora-rank": TableSpec(
        (Axis("LoRA rank", _LORA_RANKS),),
        caption="LoRA rank r (alpha = 2r). ",
    ),
    "noniid": TableSpec(
        (Axis("partition", _PARTITIONS),),
        caption="Non-IID client data (Dirichlet over the records' topics). ",
    ),
    "scalability": TableSpec(
        (Axis("K, N", tuple(_scalability(k, p) for k in (10, 20, 50, 100) for p in (0, 1))),),
        # Pairwise masking costs |W|(|W|-1) keystreams per query: with N = 33 at K = 100 one
        # round's 2MK queries took 5.7 min on 2 CPU cores; two-server is linear in |W|.
        fixed=("secagg.min_members=3", "secagg.backend=two-server"),
        caption="Scalability: K clients, r = ⌊0.3K⌋, N fixed at 4 or ⌊K/3⌋ (SA threshold 3 so "
        "that N = 3 at K = 10 is admissible; the same 2,000 records split over K clients; "
        "two-server SA, whose cost is linear in the subset size, where pairwise masking is "
        "quadratic). ",
    ),
    "partial": TableSpec(
        (Axis.of_key("fl.participation", ["0.5", "0.7", "1.0"]),),
        fixed=("fl.K=20", "watermark.r=6", "fl.rounds=10"),
        caption="Partial participation: K = 20, r = 6, T = 10, C of K clients per round "
        "(T·C/K rounds attributed per client on average). ",
        extra={"rounds per client (T·C/K)": _expected_rounds},
    ),
    "noniid-recovery": TableSpec(
        (Axis.of_key("fl.rounds", ["5", "10", "15", "20"]),),
        fixed=("data.partition=dirichlet", "data.dirichlet_alpha=0.1"),
        caption="Recovery under non-IID data (Dirichlet α = 0.1) with more rounds T. ",
    ),
    "overhead": TableSpec(
        (Axis.of_key("fl.K", ["10", "20", "50"]),),
        caption="Overhead (the paper's Tables 12-13): K clients, r = 3, T = 5, N = 5, M = 5; "
        "2MKT is the number of subset queries the protocol asks (the measured count adds one "
        "aggregate per round). ",
        extra={"2MKT": _query_count},
        layout="overhead",
    ),
}
"""Every named table (``fedattr experiment table NAME``)."""


def table_spec(
    name: str, seeds, preset: str = "tiny", config: str | None = None, overrides=()
) -> SweepSpec:
    """The sweep behind table ``name``; its fixed settings come before ``overrides``."""
    table = TABLES.get(name)
    if table is None:
        raise UserError(f"table: unknown table {name!r}; allowed: {', '.join(TABLES)}")
    return SweepSpec(
        list(table.axes),
        seeds,
        preset,
        config,
        [*table.fixed, *overrides],
        name=name,
        caption=table.caption,
        extra=dict(table.extra),
        layout=table.layout,
    )
