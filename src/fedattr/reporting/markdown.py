"""Markdown for people: one table builder, and the tables every command prints or writes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..attribution.audit import RoundAudit
from ..attribution.crossround import CrossRoundAudit
from ..attribution.stouffer import AttributionReport


def _cell(value: Any) -> str:
    # A bare "|" would split the cell.
    return str(value).replace("|", "\\|")


def table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table (cells are written with ``str``, pipes escaped)."""
    lines = ["| " + " | ".join(_cell(h) for h in head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def percent(rate: float | None) -> str:
    """``12.5%``, or ``n/a`` for no rate."""
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def p_value(p: float | None, log10_p: float | None = None) -> str:
    """A p-value; an underflowed one as ``1e-NNN`` from its log, or ``<1e-300``."""
    if p is None:
        return "–"
    if p > 0:
        return f"{p:.2e}"
    return f"1e{log10_p:.0f}" if log10_p is not None else "<1e-300"


UPPER_BOUNDS = ("patterns", "chernoff")
"""The calibrated statistic's tail methods that give an upper bound on the tail, not the tail
(``attribution.calibrated.verdict.BOUNDS``): a p from one is conservative."""


def tail_label(method: str | None) -> str:
    """A tail method as the report names it: ``exact``, ``saddlepoint``, ``shifted-keys``, or
    ``chernoff (upper bound)`` / ``patterns (upper bound)``; ``–`` for none."""
    if method is None:
        return "–"
    return f"{method} (upper bound)" if method in UPPER_BOUNDS else method


def attribution_table(report: AttributionReport) -> str:
    """One row per client, one column per round, Z, p, flag; then the rule, TPR and FPR.

    Under the calibrated statistic each row also names the owner whose key gives the client's
    smallest p (the accusing owner), how that p was obtained, and the random keys' rank check.
    """
    rounds = sorted({t for c in report.clients for t in c.z})
    calibrated = report.statistic == "calibrated"
    rows = []
    for c in report.clients:
        truth = "?" if c.watermarked is None else ("yes" if c.watermarked else "no")
        zs = [f"{c.z[t]:+.2f}" if t in c.z else "–" for t in rounds]
        flag = "**yes**" if c.flagged else "no"
        row = [c.id, truth, *zs, f"{c.Z:+.2f}", p_value(c.p, c.log10_p), flag]
        if calibrated:
            tail = tail_label(c.tail) + ("" if c.calibrated else " (uncalibrated)")
            rank = "–" if c.p_rank is None else f"{c.p_rank:.3g}"
            row += [f"`{c.statistic}`", tail, rank]
        rows.append(row)
    head = ["client", "watermarked", *[f"z (t={t})" for t in rounds], "Z", "p", "flagged"]
    if calibrated:
        head += ["owner", "tail", "rank p"]
        K = max(1, len(report.clients))
        bounded = any(c.tail in UPPER_BOUNDS for c in report.clients)
        bound = " (or an upper bound on it, where the tail says so: conservative)"
        rule = (
            "calibrated statistic: each client's summed change read with the owner's key, p from "
            f"its exact tail under a random key{bound if bounded else ''}"
            " (Bonferroni over owners); named when p < α/K = "
            f"{p_value((report.alpha or 0) / K)}, family-wise α = {report.alpha} over clients × "
            "owners. z: each round's statistic (unit variance under the null); Z: the sum's, "
            "for reading only (the verdict reads p)"
        )
        sealed = any(c.tail == "random-keys" for c in report.clients)
        if sealed:
            rule = (
                "sealed mode: each client's summed first-order change, held as two servers' "
                "shares, read with the owner's key and with "
                f"{report.null_keys} random keys of the same law; p = the owner key's rank "
                "among them (exact; Bonferroni over owners); named when p < α/K = "
                f"{p_value((report.alpha or 0) / K)}, family-wise α = {report.alpha} over "
                "clients × owners. Z: the owner's value against the random keys' mean and "
                "spread, for reading only"
            )
            if 1 / (report.null_keys + 1) >= (report.level or 0):
                rule += (
                    f". With {report.null_keys} random keys no p can fall below the level "
                    f"{p_value(report.level or 0)}: raise attribution.sealed.random_keys"
                )
        elif report.null_keys:
            floor = max(1, len(report.components)) / (report.null_keys + 1)
            rule += f". Rank p: the same change read with {report.null_keys} random keys, a check"
            if floor >= (report.alpha or 0) / K:
                rule += f" whose resolution ({floor:.3g}) cannot reach α/K"
        if report.cross_talk:
            rule += (
                f". Not calibrated: clients {', '.join(map(str, report.cross_talk))}, whose "
                "rounds kept cross-talk (hardened mode, a round with dropouts): their estimates "
                "carry α-weighted copies of other clients' updates, watermarked ones included, "
                "and de-mixing across rounds does not make them key-free (not de-mixed: "
                "attribution.calibrated.across_rounds = keep, or too few rounds to identify the "
                "client; or de-mixed over rounds whose reference may have learned a key, where "
                "the other clients' changes vary with it: attribution.calibrated.late_demix = "
                "uncalibrated, hardened mode's default); reported, never named unless "
                "attribution.calibrated.name_uncalibrated = true"
            )
        if report.rounds_read:
            spans: dict[int, list[str]] = {}
            for owner, n in report.rounds_read.items():
                spans.setdefault(n, []).append(owner)
            read = "; ".join(
                f"{', '.join(owners)}: {'round 1' if n == 1 else f'rounds 1-{n}'} only"
                for n, owners in sorted(spans.items())
            )
            rule += (
                f". Read only where the key is exchangeable with a random one ({read}): later, "
                "the reference model has learned the owner's facts from its watermarked "
                "clients (attribution.calibrated.late_rounds)"
            )
        if report.uncalibrated:
            rule += (
                f". Not calibrated: {', '.join(report.uncalibrated)} (a key the reference model "
                "has learned is not exchangeable with a random one): reported, never named "
                "unless attribution.calibrated.name_uncalibrated = true"
            )
    else:
        rule = f"paper statistic: γ = {report.gamma:g}"
    rates = f"TPR = {percent(report.tpr)}; FPR = {percent(report.fpr)}"
    return table(head, rows) + f"\n\n{rule}; {rates}"


def baselines_table(baselines: Sequence[Mapping[str, Any]]) -> str:
    """The baselines' verdicts (``BaselineResult.to_dict()`` rows); empty without baselines."""
    if not baselines:
        return ""

    def pct(r: float | None) -> str:
        return "–" if r is None else f"{100 * r:.0f}%"

    def named(b: Mapping[str, Any]) -> str:
        if b["flagged"] is None:
            return "(names nobody)"
        return ", ".join(map(str, b["flagged"])) or "none"

    rows = [
        [
            b["name"],
            "✓" if b["respects_sa"] else "✗",
            named(b),
            pct(b["tpr"]),
            pct(b["fpr"]),
            "–" if b["p"] is None else f"{b['p']:.2e}",
        ]
        for b in baselines
    ]
    return table(["baseline", "respects SA", "flagged", "TPR", "FPR", "p"], rows)


def stages_table(timing: Mapping[str, Any], memory: Mapping[str, float] | None = None) -> str:
    """Seconds per stage, and each stage's peak resident memory where ``memory`` (GB, keyed by
    the stage without ``_s``) has it; with a device profile (``timing["stages"]`` of a CUDA
    run), the device's peak memory and how busy it was."""
    seconds = {k: v for k, v in timing.items() if isinstance(v, int | float)}
    profile = timing.get("stages") or {}
    device = any("device_peak_gb" in row for row in profile.values())
    head = ["stage", "seconds"] + (["peak RSS GB"] if memory else [])
    head += ["device peak GB", "device busy"] if device else []
    rows = []
    for k, v in seconds.items():
        stage = k.removesuffix("_s")
        row = [k, f"{v:.1f}"]
        if memory:
            row.append(f"{memory[stage]:.2f}" if stage in memory else "")
        if device:
            p = profile.get(stage, {})
            peak, busy = p.get("device_peak_gb"), p.get("device_busy")
            row += ["" if peak is None else f"{peak:.2f}", "" if busy is None else f"{busy:.0%}"]
        rows.append(row)
    return table(head, rows)


def variants_table(variants: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per extra FedAttr configuration watching the same run."""
    rows = [
        [
            name,
            ", ".join(f"{k}={v}" for k, v in v["differs"].items()) or "(same)",
            ", ".join(map(str, v["flagged"])) or "none",
            percent(v["tpr"]),
            percent(v["fpr"]),
            v["sa_queries"],
        ]
        for name, v in variants.items()
    ]
    return table(["configuration", "differs in", "flagged", "TPR", "FPR", "SA queries"], rows)


def audit_table(rounds: Sequence[RoundAudit], budget: float | None = None) -> str:
    """One row per (round, SA session): queries, rank, exactly recoverable clients, max L_j."""
    sessions = any(r.session for r in rounds)
    rows = []
    for r in rounds:
        rec = ", ".join(map(str, r.recoverable)) or "none"
        m = "∞" if math.isinf(r.max_leakage) else f"{r.max_leakage:.4f}"
        rows.append(
            [
                r.round,
                *([r.session or "–"] if sessions else []),
                r.queries,
                r.rank,
                len(r.clients),
                rec,
                m,
            ]
        )
    head = [
        "round",
        *(["session"] if sessions else []),
        "queries",
        "rank",
        "clients",
        "exactly recoverable",
        "max L_j (nats/dim)",
    ]
    out = table(head, rows)
    if budget is not None:
        out += f"\n\nbudget (paper's single-estimate bound): {budget:.4f} nats per dimension"
    return out


def cross_round_table(audit: CrossRoundAudit) -> str:
    """One row per client of one SA session stacked over all rounds: exact recovery in a
    single round, identifiability across rounds, the GLS variance factor and what it is
    worth in plain updates, and (a simulation) the measured relative reconstruction errors."""
    measured = (audit.reconstruction or {}).get("clients", {})
    rows = []
    for c in audit.clients:
        v = audit.variance_factor[c]
        row = [
            c,
            audit.rounds_present[c],
            "yes" if c in audit.recoverable_in_a_round else "no",
            "yes" if c in audit.identifiable else "no",
            f"{v:.4f}" if math.isfinite(v) else "∞",
            f"{1 / v:.2f}" if math.isfinite(v) and v > 0 else "0",
        ]
        if measured:
            m = measured.get(str(c), {})
            row += [
                "–" if m.get(k) is None else f"{m[k]:.4f}"
                for k in ("error_gls", "error_ols", "error_public_mean")
            ]
        rows.append(row)
    head = [
        "client",
        "rounds",
        "exactly recoverable in a round",
        "identifiable across rounds",
        "variance factor [F⁺]_jj",
        "worth (plain updates)",
    ]
    if measured:
        head += ["rel. error GLS", "rel. error OLS", "rel. error public mean"]
    return table(head, rows)


def run_report(
    title: str,
    summary: Sequence[str],
    report: AttributionReport,
    *,
    timing: Mapping[str, Any] | None = None,
    memory: Mapping[str, float] | None = None,
    variants: Mapping[str, Mapping[str, Any]] | None = None,
    baselines: Sequence[Mapping[str, Any]] = (),
) -> str:
    """``report.md`` of a run (every writer of it comes here): the title, what ran, the
    attribution table, then the stages, the other configurations and the baselines where the
    run has them."""
    parts = [title, *summary, attribution_table(report)]
    if timing is not None:
        parts += [
            stages_table(timing, memory),
            f"FedAttr overhead over FL training: {100 * timing['overhead']:.1f}% "
            "((SA + scoring + verdict) / training)",
        ]
    if variants:
        parts += [
            "## Other attribution configurations (same training run)",
            variants_table(variants),
        ]
    if baselines:
        parts += ["## Baselines (same training run)", baselines_table(baselines)]
    return "\n\n".join(parts)
