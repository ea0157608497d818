"""The documentation: generated reference pages up to date, every relative link resolving, the
README short and in step with CI, and the library example runnable."""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedattr.cli import reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]


def _targets(text: str) -> list[str]:
    """Link and image targets outside code blocks and code spans."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", text))
    return _LINK.findall(text)


@pytest.mark.parametrize("name", sorted(reference.pages()))
def test_reference_pages_are_up_to_date(name: str) -> None:
    path = DOCS / "reference" / name
    expected = reference.pages()[name]
    assert path.is_file(), f"{path} is missing: run `{reference.REGENERATE}`"
    assert path.read_text(encoding="utf-8") == expected, (
        f"{path.relative_to(ROOT)} differs from what the code generates: run "
        f"`{reference.REGENERATE}` from the repository root"
    )


def test_every_relative_link_resolves() -> None:
    broken = []
    for page, target in _relative_links():
        if target.startswith("#"):
            continue  # an anchor on the same page: the anchor test's
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not (page.parent / path).exists():
            broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _relative_links() -> Iterator[tuple[Path, str]]:
    """Every page's links to files of this repository (not absolute URLs), as written."""
    for page in _pages():
        for target in _targets(page.read_text(encoding="utf-8")):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                yield page, target


@functools.cache
def _anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page, with GitHub's -1, -2 suffixes for repeats."""
    return _anchors_of(page.read_text(encoding="utf-8"))


def _anchors_of(text: str) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        slug = reference.anchor(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_anchor_names_a_heading() -> None:
    """A link's #anchor names a heading of the page it links to (GitHub's slugs)."""
    broken = []
    for page, target in _relative_links():
        if "#" not in target:
            continue
        path, name = target.split("#", 1)
        linked = (page.parent / path).resolve() if path else page
        if linked.suffix != ".md" or not linked.is_file():
            continue  # a missing file is the link test's to report
        if name not in _anchors(linked):
            broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing headings:\n" + "\n".join(broken)


def test_slugs_are_githubs() -> None:
    text = '# A `b.c = "d"` (e, f)\n## Same\n## Same\n```\n# not a heading\n```\n'
    assert _anchors_of(text) == {"a-bc--d-e-f", "same", "same-1"}
    assert reference.anchor("Few clients (K = 5, 2026-11-29)") == "few-clients-k--5-2026-11-29"
    assert reference.anchor("See [the *page*](x.md)") == "see-the-page"


def test_link_check_sees_links() -> None:
    """The checker finds links and images, and skips code."""
    text = "[a](x.md) ![b](img/y.png) [c](z.md#part) `[d](no.md)`\n```\n[e](no.md)\n```\n"
    assert _targets(text) == ["x.md", "img/y.png", "z.md#part"]


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, (
        f"README.md has {len(lines)} lines; keep it to 250 (move detail to docs/)"
    )


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    start = next(i for i, line in enumerate(ci) if "command 2" in line) + 1
    lines = [ci[start]]
    while lines[-1].rstrip().endswith("\\"):  # a command continued on the next line
        lines.append(ci[start + len(lines)])
    command = " ".join(" ".join(line.rstrip().rstrip("\\").split()) for line in lines)
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert command in readme, (
        "README's test command (Set-up, command 2) must be the command .ci/run runs: " + command
    )


def test_library_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    section = text.split("## As a library", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "docs/getting-started.md: no python example under 'As a library'"
    exec(compile(code.group(1), "getting-started.md", "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    assert "| client |" in out and "**yes**" in out


def test_the_guides_state_what_a_default_run_shows() -> None:
    """Issue 37, item 7: reading-results gave the rank p floor as 0.005 where the default
    3-owner run prints 0.0149 (owners / (null_keys + 1): rank p is Bonferroni-adjusted like p);
    getting started showed only the piped progress lines, where a terminal shows bars."""
    from fedattr.attribution.config import AttributionConfig
    from fedattr.watermarks.config import WatermarkConfig

    floor = min(1.0, WatermarkConfig().owners / (AttributionConfig().calibrated.null_keys + 1))
    reading = (DOCS / "guides" / "reading-results.md").read_text(encoding="utf-8")
    reading = " ".join(reading.split())
    assert f"= {floor:.3g}" in reading and "owners / (null_keys + 1)" in reading
    start = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    run = start[start.index("$ fedattr run\n") :]
    run = run[: run.index("```")]
    assert "%|" in run, "the terminal's progress bar is shown in the run's console"
    words = " ".join(start.split())
    assert "Piped into a file" in words
    assert re.search(r"\[\dm\d\ds\] round 1 local training: client 0 loss", words)


def test_kept_run_records_are_finished_runs_of_the_command_beside_them() -> None:
    """A calibration measured over several sittings keeps its finished runs in the docs; the
    command the records' README gives for each folder must keep them (same configuration)
    rather than run them again."""
    from fedattr.experiments.calibration import CalibrationSpec
    from fedattr.reporting.run_folder import RunFolder

    kept = DOCS / "results" / "records"
    covered = set()
    for block in _FENCE.finditer((kept / "README.md").read_text(encoding="utf-8")):
        command = block.group(0).replace("\\\n", " ")
        name = re.search(r"records/([^/\s]+)/", command).group(1)
        # As a shell splits it: a quoted --set value may hold spaces.
        words = shlex.split(command.split("\n", 1)[1].rsplit("\n", 1)[0])
        bed = words[words.index("--bed") + 1]
        sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        folders = sorted((kept / name).glob("r*-seed*"))
        assert folders, f"no run records kept in {name}"
        for folder in folders:
            r, seed = map(int, re.fullmatch(r"r(\d+)-seed(\d+)", folder.name).groups())
            spec = CalibrationSpec(bed=bed, seeds=(seed,), r=(r,), overrides=sets)
            claimed = RunFolder(folder).claim(spec.run_config(r, seed), reuse=True)
            assert claimed == "finished", folder
            assert sorted(p.name for p in folder.iterdir()) == ["config.json", "results.json"]
        covered.add(name)
    kept_folders = {p.name for p in kept.iterdir() if p.is_dir()}
    assert kept_folders == covered, "every records folder needs its command in the README"
