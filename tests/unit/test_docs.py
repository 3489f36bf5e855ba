"""The README and docs/*.md: every relative link reaches a file (and a heading of it, for a #anchor), and every
`make <target>` they show in code exists in the Makefile. Pure file parsing: no process is started."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
_EXTERNAL = re.compile(r"^(https?:|mailto:)", re.IGNORECASE)
_MAKE = re.compile(r"(?<![\w./$-])make\s+(.*)")
_TARGET = re.compile(r"^([a-zA-Z0-9_-]+):", re.MULTILINE)
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*[:+?]?=")
# make's options that take the next word as their value (-C dir, -f file, ...); -j's value is optional.
_OPTIONS_WITH_VALUE = {"-C", "-f", "-I", "-o", "-W", "--directory", "--file", "--include-dir", "--old-file"}


@dataclass
class Page:
    path: Path
    lines: list[str]
    fenced: list[bool]  # the line is inside a fenced code block (or is its fence)

    @classmethod
    def read(cls, path: Path) -> Page:
        lines = path.read_text(encoding="utf-8").splitlines()
        fenced, fence = [], None
        for line in lines:
            m = _FENCE.match(line)
            if fence is None and m:
                fence = m[1]
                fenced.append(True)
            elif fence is not None:
                fenced.append(True)
                if m and m[1][0] == fence[0] and len(m[1]) >= len(fence) and not line.strip(" `~"):
                    fence = None
            else:
                fenced.append(False)
        return cls(path, lines, fenced)

    @property
    def name(self) -> str:
        return str(self.path.relative_to(REPO))

    def prose(self) -> str:
        """The text outside fenced code, those lines left empty so that offsets keep their line numbers."""
        return "\n".join("" if f else line for line, f in zip(self.lines, self.fenced, strict=True))

    def code_blocks(self):
        """(line number, text) of every line inside a fenced code block."""
        for i, (line, f) in enumerate(zip(self.lines, self.fenced, strict=True), 1):
            if f and not _FENCE.match(line):
                yield i, line


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def blank_code_spans(text: str) -> str:
    """``text`` with every inline code span replaced by spaces (newlines kept): links in code are not links."""
    return _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lowercased, punctuation other than hyphens and
    spaces dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Page) -> set[str]:
    """Every heading's anchor in ``page``; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line, f in zip(page.lines, page.fenced, strict=True):
        m = None if f else _HEADING.match(line)
        if m is None:
            continue
        base = slug(m[2])
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Page):
    """(line number, target) of every link and link reference definition outside code."""
    text = blank_code_spans(page.prose())
    for m in _LINK.finditer(text):
        yield line_of(text, m.start()), m[1]
    for m in _REFERENCE.finditer(text):
        yield line_of(text, m.start()), m[1]


def broken_links(page: Page) -> list[str]:
    problems = []
    for line, target in links(page):
        if not target or _EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.path.parent / unquote(path_part)).resolve() if path_part else page.path
        where = f"{page.name}:{line}: link ({target})"
        if not dest.exists():
            problems.append(f"{where}: the file does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(Page.read(dest)):
            problems.append(f"{where}: no heading of {dest.name} has the anchor #{anchor}")
    return problems


def make_target(command: str) -> str | None:
    """The target of ``make ...`` (the text after 'make'): the first word that is neither an option, an
    option's value nor a VAR=value; None when there is none (make's default goal)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote in what follows the command
        words = command.split()
    i = 0
    while i < len(words):
        word = words[i]
        if word in _OPTIONS_WITH_VALUE or (word == "-j" and i + 1 < len(words) and words[i + 1].isdigit()):
            i += 2
        elif word.startswith("-") or _ASSIGNMENT.match(word):
            i += 1
        else:
            m = re.match(r"[A-Za-z0-9_.-]*", word)
            return m[0].rstrip(".") or None
    return None


def make_commands(page: Page):
    """(line number, the text after 'make') of every make command in inline code or a fenced code block."""
    text = page.prose()
    found = [
        (line_of(text, s.start(2) + m.start()), m[1]) for s in _CODE_SPAN.finditer(text) for m in _MAKE.finditer(s[2])
    ]
    found += [(line, m[1]) for line, code in page.code_blocks() for m in _MAKE.finditer(code)]
    return sorted(found)


def makefile_targets() -> set[str]:
    return set(_TARGET.findall((REPO / "Makefile").read_text()))


def unknown_targets(page: Page, targets: set[str]) -> list[str]:
    problems = []
    for line, command in make_commands(page):
        target = make_target(command)
        if target is not None and target not in targets:
            problems.append(f"{page.name}:{line}: `make {command.strip()}`: the Makefile has no target '{target}'")
    return problems


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_heading(path):
    problems = broken_links(Page.read(path))
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_make_target_shown_exists_in_the_makefile(path):
    problems = unknown_targets(Page.read(path), makefile_targets())
    assert not problems, "unknown make targets:\n" + "\n".join(problems)


def test_the_readme_links_every_docs_page():
    readme = Page.read(REPO / "README.md")
    linked = {(REPO / t.partition("#")[0]).resolve() for _, t in links(readme) if t.startswith("docs/")}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md links no page of docs/ named {missing}"


def test_github_slugs():
    assert slug("Time steps and initial_step") == "time-steps-and-initial_step"
    assert slug("`invalid override`: an error in a `--set` override") == "invalid-override-an-error-in-a---set-override"
    assert slug("On a GPU: `make gpu-check`") == "on-a-gpu-make-gpu-check"
    assert slug("The Well's demo") == "the-wells-demo"
    assert slug("Experiment tracking (W&B)") == "experiment-tracking-wb"


def test_make_targets_skip_options_and_assignments():
    assert make_target("train CONFIG=configs/x.yaml") == "train"
    assert make_target('CONFIG=x SET="a=1" -j 4 bench BENCH_ARGS=well') == "bench"
    assert make_target("-C sub --no-print-directory test-unit") == "test-unit"
    assert make_target("-j8 -k doctor,") == "doctor"
    assert make_target('SET="a=1 b=2" CPU=1 up') == "up"
    assert make_target("NPROC=2  # the default goal") is None


def test_the_checks_report_file_line_and_culprit(tmp_path, monkeypatch):
    """A page with a missing file, a missing anchor and a missing target is reported line by line, while a
    good link, an external one, one in code and a make word in prose pass."""
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A `code` heading: yes\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-code-heading-yes) [web](https://example.org/x#y) [self](#page)\n"
        "`[not a link](gone.md)` and make no mistake\n"
        "[gone](gone.md)\n\n[bad anchor](other.md#nowhere)\n\n"
        "```bash\nDEBUG=1 make -C . train  # fine\nmake shipit\n```\n\nRun `make\nfly` now.\n"
    )
    loaded = Page.read(page)
    assert broken_links(loaded) == [
        "docs/page.md:5: link (gone.md): the file does not exist",
        "docs/page.md:7: link (other.md#nowhere): no heading of other.md has the anchor #nowhere",
    ]
    assert unknown_targets(loaded, {"train"}) == [
        "docs/page.md:11: `make shipit`: the Makefile has no target 'shipit'",
        "docs/page.md:14: `make fly`: the Makefile has no target 'fly'",
    ]
