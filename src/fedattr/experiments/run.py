"""``fedattr run``: federated LoRA fine-tuning with watermarked clients, SA, and FedAttr.

Data flows one way: config -> data and model -> FL rounds (every update only through SA) ->
FedAttr on each round's SA queries -> report files.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..attribution.protocol import FedAttr, resolve_scorer_null
from ..attribution.stouffer import AttributionReport
from ..baselines import BaselineRecorder, BaselineResult
from ..config import to_dict
from ..fl import sa_scales
from ..models.loading import load_model
from ..models.lora import attach_lora, trainable_lora_parameters
from ..models.text import encode_examples
from ..models.training import train
from ..reporting.run_folder import write_run_folder
from ..secagg import make_aggregator
from .config import RunConfig
from .federation import build_federation, make_scorer, make_strategy

Progress = Callable[[str], None]


@dataclass
class RunResult:
    """Everything a run produced."""

    config: RunConfig
    report: AttributionReport
    rounds: list[dict]
    sa_queries: int
    timing: dict[str, float]
    federation: dict
    queries: list[dict] = field(default_factory=list)
    baselines: list[BaselineResult] = field(default_factory=list)
    null: str = "theoretical"
    """The null the differential scores were read under (``attribution.null`` resolved)."""

    def to_dict(self) -> dict:
        """JSON-ready form (``results.json``)."""
        out = self.report.to_dict()
        out.update(
            mode=self.config.attribution.mode,
            null=self.null,
            sa_queries=self.sa_queries,
            timing=self.timing,
            federation=self.federation,
            strategy=self.config.fl.strategy,
            watermark=self.config.watermark.kind,
            detector=self.config.watermark.detector,
            sa_backend=self.config.secagg.backend,
            baselines=[b.to_dict() for b in self.baselines],
        )
        return out

    def write(self, out_dir: str | Path) -> Path:
        """Write config.json, rounds.jsonl, results.json, report.md and attribution.png."""
        t, c = self.timing, self.config
        report_md = (
            f"# FedAttr run: {c.fl.strategy}, {c.watermark.kind.upper()} "
            f"({c.watermark.detector} detector), {c.model.preset} ({c.attribution.mode} mode)"
            f"\n\nK={c.fl.K}, T={c.fl.rounds}, N={c.attribution.N}, M={c.attribution.M}, "
            f"{self.null} null, "
            f"SA backend `{c.secagg.backend}` ({self.sa_queries} SA queries).\n\n"
            + self.report.to_markdown()
            + "\n\n| stage | seconds |\n|---|---|\n"
            + "".join(f"| {k} | {v:.1f} |\n" for k, v in t.items())
            + f"\nFedAttr overhead over FL training: {100 * t['overhead']:.1f}% "
            "((SA + scoring) / training)" + baseline_markdown(self.baselines)
        )
        return write_run_folder(
            out_dir,
            config=to_dict(c),
            rounds=self.rounds,
            queries=self.queries,
            results=self.to_dict(),
            report=self.report,
            report_md=report_md,
        )


def baseline_markdown(results: list[BaselineResult]) -> str:
    """The baselines' verdicts as a Markdown section (empty without baselines)."""
    if not results:
        return ""
    pct = lambda r: "–" if r is None else f"{100 * r:.0f}%"  # noqa: E731
    rows = [
        f"| {b.name} | {'✓' if b.respects_sa else '✗'} | "
        + ("(names nobody)" if b.flagged is None else ", ".join(map(str, b.flagged)) or "none")
        + f" | {pct(b.tpr)} | {pct(b.fpr)} | {'–' if b.p is None else f'{b.p:.2e}'} |"
        for b in results
    ]
    return (
        "\n\n## Baselines (same training run)\n\n| baseline | respects SA | flagged | TPR | FPR "
        "| p |\n|---|---|---|---|---|---|\n" + "\n".join(rows)
    )


CHECKPOINT = "state.pt"


def _save_checkpoint(directory: Path, payload: dict) -> None:
    # Write then rename: a kill during the write leaves the previous checkpoint intact.
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (CHECKPOINT + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, directory / CHECKPOINT)


def load_checkpoint(directory: Path) -> dict | None:
    """The last checkpoint in ``directory``, or ``None``."""
    path = directory / CHECKPOINT
    return torch.load(path, weights_only=False) if path.is_file() else None


def run_experiment(
    cfg: RunConfig, progress: Progress | None = None, checkpoint_dir: str | Path | None = None
) -> RunResult:
    """Run one configured experiment end to end.

    With ``checkpoint_dir``, the run saves its state after every round (global state, FedAttr
    scores, records, query log, timings, the participant sampler's RNG) and, if a checkpoint is
    already there, resumes after its round. Everything else (data, teacher documents, training
    and design randomness) is a deterministic function of the configuration and the round, so a
    resumed run ends with the same results as an uninterrupted one.
    """
    say = progress or (lambda m: tqdm.write(m, file=sys.stderr))
    timing = {"load_s": 0.0, "teacher_s": 0.0, "train_s": 0.0, "sa_s": 0.0, "scoring_s": 0.0}
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    saved = load_checkpoint(ckpt_dir) if ckpt_dir is not None else None
    start = time.perf_counter()
    model, tokenizer = load_model(cfg.model, say)
    timing["load_s"] = time.perf_counter() - start

    t0 = time.perf_counter()
    fed = build_federation(cfg, model, tokenizer, say)
    timing["teacher_s"] = time.perf_counter() - t0

    model = attach_lora(model, cfg.lora, seed=cfg.fl.seed)
    strategy = make_strategy(cfg)
    state = strategy.initial_state(model)
    examples = [encode_examples(tokenizer, s, cfg.data.max_len) for s in fed.shards]
    sizes = [len(e) for e in examples]
    if min(sizes) == 0:
        raise ValueError("data: a client has no usable training example; raise data.records")
    scorer = make_scorer(cfg, model, tokenizer, fed, strategy)
    fedattr = FedAttr(cfg.attribution)
    fedattr.scorer_null = resolve_scorer_null(scorer)  # also right when resuming a finished run
    recorder = None
    if cfg.baselines:
        t0 = time.perf_counter()
        probe = scorer
        if not callable(getattr(scorer, "probe_values", None)):
            probe = make_scorer(cfg, model, tokenizer, fed, strategy, detector="reading")
        recorder = BaselineRecorder(
            scorer, probe, strategy.apply_estimate, strategy.scoring_params(state),
            gamma=cfg.attribution.gamma, seed=cfg.fl.seed,
            null=fedattr.null,
        )  # fmt: skip
        timing["baselines_s"] = time.perf_counter() - t0
    sa = make_aggregator(cfg.secagg)
    rng = np.random.default_rng([cfg.fl.seed, 11])
    per_round = max(1, round(cfg.fl.participation * cfg.fl.K))
    records: list[dict] = []
    queries: list[dict] = []
    first = 1
    if saved is not None:
        state, records, queries = saved["state"], saved["records"], saved["queries"]
        fedattr.scores = saved["scores"]
        rng.bit_generator.state = saved["rng"]
        timing = {k: timing[k] + saved["timing"].get(k, 0.0) for k in timing}
        if recorder is not None:
            recorder.load(saved["baselines"])
        start -= saved["elapsed"]
        first = saved["round"] + 1
        say(f"resuming after round {saved['round']} of {cfg.fl.rounds}")
    params = trainable_lora_parameters(model)
    for t in range(first, cfg.fl.rounds + 1):
        participants = sorted(int(c) for c in rng.choice(cfg.fl.K, per_round, replace=False))
        scales = dict(zip(participants, sa_scales([sizes[c] for c in participants]), strict=True))
        sa.open_round(t, participants)
        t0 = time.perf_counter()
        losses = {}
        plain = {}  # plaintext updates: only for the baselines, which do not respect SA
        bar = tqdm(
            participants,
            desc=f"round {t}/{cfg.fl.rounds} local training",
            leave=False,
            disable=None,
            file=sys.stderr,
        )
        for c in bar:
            strategy.client_start(model, state, t, c)
            stats = train(
                model,
                params,
                examples[c],
                cfg.fl.train,
                tokenizer.pad_token_id,
                seed=cfg.fl.seed * 100_003 + t * 101 + c,
            )
            losses[c] = stats["loss"]
            update = strategy.client_update(model, state)
            # Only the scaled update leaves the client, and only into secure aggregation.
            sa.submit(c, {k: v.detach().float().cpu() * scales[c] for k, v in update.items()})
            if recorder is not None:
                plain[c] = {k: v.detach().float().cpu() for k, v in update.items()}
        timing["train_s"] += time.perf_counter() - t0
        # The round's aggregate first: training needs it whatever the release policy admits.
        t0 = time.perf_counter()
        total, answered = sa.sum_of_available(participants)
        # Clients submitted n * p_i * Delta_i: dividing by the answering clients' sum of n * p_i
        # gives the sample-weighted mean over whoever answered (all of them without dropouts).
        weight = sum(scales[c] for c in answered)
        mean_update = {k: v / weight for k, v in total.items()}
        timing["sa_s"] += time.perf_counter() - t0
        reference = strategy.scoring_params(state)
        bar = tqdm(
            total=len(participants),
            desc=f"round {t}/{cfg.fl.rounds} FedAttr",
            leave=False,
            disable=None,
            file=sys.stderr,
        )

        def on_target(rec, bar=bar) -> None:
            timing["sa_s"] += rec.sa_seconds
            timing["scoring_s"] += rec.score_seconds
            bar.update(1)

        t0 = time.perf_counter()
        record = fedattr.attribute_round(
            t, sa, reference, scorer, apply=strategy.apply_estimate, on_target=on_target,
            center=mean_update,
        )  # fmt: skip
        bar.close()
        # The reference model's scoring happens inside attribute_round, outside any target.
        timing["scoring_s"] += (time.perf_counter() - t0) - sum(
            r.sa_seconds + r.score_seconds for r in record.targets
        )
        if recorder is not None:
            t0 = time.perf_counter()
            recorder.record_round(t, reference, plain, mean_update)
            timing["baselines_s"] += time.perf_counter() - t0
        state = strategy.apply_aggregate(state, mean_update)
        sa.close_round()
        rec = record.to_dict()
        rec["train_loss"] = {str(c): v for c, v in losses.items()}
        records.append(rec)
        line = " ".join(
            f"{r.target}{'*' if r.target in fed.owner_of else ''}:{max(r.z.values()):+.1f}"
            for r in record.targets
        )
        say(f"[round {t}/{cfg.fl.rounds}] max-owner differential z (* = watermarked): {line}")
        queries.extend(q.to_dict() for q in sa.log)
        sa.log.clear()
        if ckpt_dir is not None:
            _save_checkpoint(ckpt_dir, {
                "round": t, "state": state, "records": records, "queries": queries,
                "scores": fedattr.scores, "rng": rng.bit_generator.state, "timing": timing,
                "elapsed": time.perf_counter() - start,
                "baselines": recorder.state() if recorder is not None else None,
            })  # fmt: skip
    truth = {c: c in fed.owner_of for c in range(cfg.fl.K)}
    baselines = []
    if recorder is not None:
        t0 = time.perf_counter()
        recorder.global_test(strategy.scoring_params(state))
        baselines = recorder.results(truth)
        timing["baselines_s"] += time.perf_counter() - t0
    timing["total_s"] = time.perf_counter() - start
    timing["overhead"] = (timing["sa_s"] + timing["scoring_s"]) / max(timing["train_s"], 1e-9)
    report = fedattr.report(truth)
    federation = {**fed.summary(), "client_sizes": sizes}
    return RunResult(
        replace(cfg),
        report,
        records,
        len(queries),
        timing,
        federation,
        queries,
        baselines,
        fedattr.null,
    )
