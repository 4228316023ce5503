"""The README and docs/ stay true: short, their Python runs, their links, anchors, paths and
``calc`` names resolve, and the README holds the set-up commands the scripts and CI use."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

import calc
from calc.cli.main import main as calc_main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_LINES = 200
EXAMPLE_MAX_LINES = 12

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.MULTILINE)
TOP_FOLDERS = ("calc", "verify", "webapp", "scripts", "benchmarks", "tests", "hardware", "docs")
REPO_PATH = re.compile(rf"^(?:{'|'.join(TOP_FOLDERS)}|model_cards)/[\w./-]*$")
CALC_NAME = re.compile(r"\bcalc(?:\.[A-Za-z_]\w*)+")


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _blocks(text: str, lang: str) -> list[str]:
    """The bodies of the fenced code blocks of language ``lang``, in order."""
    return [body for found, body in FENCE.findall(text) if found == lang]


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (links and code spans in them are not links)."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text lower-cased, punctuation other than
    ``-`` and ``_`` dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").strip().lower()
    kept = "".join(
        c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN"
    )  # fmt: skip
    return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (a repeated one gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(_prose(_text(path))):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _run(code: str) -> dict[str, object]:
    namespace: dict[str, object] = {"__name__": "docs_example"}
    with contextlib.redirect_stdout(io.StringIO()):
        # The repository's own documentation, never user input.
        exec(compile(code, "<docs example>", "exec"), namespace)
    return namespace


def test_slug_matches_github_on_known_headings() -> None:
    # Anchors as GitHub renders them for headings of this shape.
    assert _slug("How accurate is it?") == "how-accurate-is-it"
    assert _slug("Hand check: Qwen2.5-32B") == "hand-check-qwen25-32b"
    assert _slug("`calc/`: the cost model") == "calc-the-cost-model"
    assert _slug("LoRA and QLoRA") == "lora-and-qlora"


def test_readme_is_at_most_200_lines() -> None:
    assert len(_text(README).splitlines()) <= MAX_LINES


@pytest.mark.parametrize("page", DOCS, ids=_ids(DOCS))
def test_docs_page_is_at_most_200_lines(page: Path) -> None:
    assert len(_text(page).splitlines()) <= MAX_LINES


def test_readme_python_example_is_short_and_runs_with_hand_checked_peaks() -> None:
    blocks = _blocks(_text(README), "python")
    assert len(blocks) == 1, "the README holds one Python example"
    lines = [line for line in blocks[0].splitlines() if line.strip()]
    assert len(lines) <= EXAMPLE_MAX_LINES
    ns = _run(blocks[0])
    model, est, sharded = ns["model"], ns["est"], ns["sharded"]
    assert isinstance(model, calc.ModelSpec)
    assert isinstance(est, calc.Estimate) and isinstance(sharded, calc.Estimate)
    # Hand check (docs/verification.md's, for Llama-3.1-8B): bf16-master AdamW holds at its
    # optimizer step bf16 weights 2 B + bf16 grads 2 B + fp32 master 4 B + fp32 exp_avg and
    # exp_avg_sq 8 B + the fp32 copies of the grads 4 B + foreach AdamW's sqrt temporary 4 B
    # = 24 B per parameter, plus two 32 MiB cuBLAS workspaces; the 512-B rounding of a few
    # hundred tensors adds well under 1 MiB. The count is the published one, not calc's.
    published = json.loads(_text(ROOT / "model_cards" / "llama-3.1-8b" / "published.json"))
    floor = 24 * published["n_params"] + 2 * 32 * 2**20
    assert floor <= est.peak_bytes <= floor + 2**20
    assert est.peak_phase.endswith("optimizer")
    # ZeRO-3 over 8 GPUs shards those 24 B per parameter 8 ways (3 B each) and gathers layers.
    assert 3 * published["n_params"] <= sharded.peak_bytes < est.peak_bytes
    assert sharded.rank in range(8)


DOC_EXAMPLES = [(page, i) for page in DOCS for i, _ in enumerate(_blocks(_text(page), "python"))]


@pytest.mark.parametrize(
    ("page", "index"), DOC_EXAMPLES, ids=[f"{p.name}-{i}" for p, i in DOC_EXAMPLES]
)
def test_docs_python_examples_run(page: Path, index: int) -> None:
    ns = _run(_blocks(_text(page), "python")[index])
    assert any(isinstance(v, calc.Training | calc.Inference) for v in ns.values())


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    prose = _prose(_text(page))
    targets = LINK.findall(prose)
    assert targets or page == README, f"{page.name} links nowhere (not even back)"
    for target in targets:
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        assert dest.exists(), f"{page.name}: {target} -> {dest} does not exist"
        assert ROOT in dest.parents or dest == ROOT, f"{page.name}: {target} leaves the repository"
        if anchor:
            assert dest.suffix == ".md", f"{page.name}: anchor into a non-Markdown file {target}"
            assert anchor in _anchors(dest), f"{page.name}: no heading #{anchor} in {dest.name}"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_repository_paths_named_in_code_spans_exist(page: Path) -> None:
    text = _text(page)
    spans = CODE_SPAN.findall(_prose(text))
    # The architecture page's trees name one path per line, first.
    trees = "\n".join(_blocks(text, "text"))
    firsts = [line.split()[0] for line in trees.splitlines() if line.strip()]
    for word in (*spans, *firsts):
        if REPO_PATH.match(word) and "<" not in word:
            assert (ROOT / word).exists(), f"{page.name} names {word}, which does not exist"


def _resolves(dotted: str) -> bool:
    """Whether ``calc.a.b.c`` is a module, or an attribute of the longest importable prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_calc_names_in_code_spans_resolve(page: Path) -> None:
    names = {n for span in CODE_SPAN.findall(_prose(_text(page))) for n in CALC_NAME.findall(span)}
    missing = sorted(n for n in names if not _resolves(n))
    assert not missing, f"{page.name} names what calc does not have: {missing}"


def _commands(path: Path) -> list[str]:
    lines = (line.strip() for line in _text(path).splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_readme_holds_the_set_up_commands_that_ci_and_the_scripts_use() -> None:
    bash = "\n".join(_blocks(_text(README), "bash"))
    shown = {line.split("#")[0].strip() for line in bash.splitlines()}
    # CI's own command, and the two scripts that set up .venv (the ones that source venv.sh).
    ci = [c for c in _commands(ROOT / ".ci" / "run") if c.startswith("bash ")]
    setup = [
        f"bash scripts/{p.name}"
        for p in sorted((ROOT / "scripts").glob("*.sh"))
        if "ensure_venv " in _text(p)
    ]
    assert ci and setup == ["bash scripts/run.sh", "bash scripts/test.sh"]
    for command in (*ci, *setup):
        assert command in shown, f"README's bash block lacks {command!r}"


def _cli_examples() -> list[str]:
    """The ``python -m calc`` lines of docs/cli.md's bash blocks whose files exist here."""
    lines = [
        line.strip()
        for body in _blocks(_text(ROOT / "docs" / "cli.md"), "bash")
        for line in body.splitlines()
        if line.strip().startswith("python -m calc ") and "./my-model" not in line
    ]
    return lines


@pytest.mark.parametrize("line", _cli_examples())
def test_cli_examples_run(line: str) -> None:
    """Every command-line example of docs/cli.md exits 0 (issue 16: the inference example
    exited 2)."""
    argv = shlex.split(line.split("#", 1)[0])[3:]
    with contextlib.redirect_stdout(io.StringIO()):
        assert calc_main(argv) == 0, line
