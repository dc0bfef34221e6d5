"""The user guide (docs/, README.md) against the code: the site builds with every link and anchor
resolving, the options reference is the one the declarations generate, every command shown parses
with the parser that would run it, every Python example compiles, and every benchmark script says
what it measures and answers --help."""

import ast
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))
NODE_MODULES = ("router", "prefill_node", "decode_node")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(page: Path, *languages: str) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang in languages]


def commands(page: Path) -> list[list[str]]:
    """The commands of a page's shell blocks: each line (continuations joined), split at && | ;,
    without its environment assignments, sudo and redirections."""
    found = []
    for block in blocks(page, "bash", "sh", "shell"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            command: list[str] = []
            redirected = False
            for word in [*words, ";"]:
                if word in ("&&", "||", "|", ";"):
                    while command and (re.fullmatch(r"\w+=.*", command[0]) or command[0] == "sudo"):
                        command.pop(0)
                    if command:
                        found.append(command)
                    command, redirected = [], False
                elif redirected or re.fullmatch(r"\d?(>>?|<).*", word):
                    redirected = True
                else:
                    command.append(word)
    return found


def test_the_site_builds_with_every_link_and_anchor_resolving(tmp_path):
    """mkdocs.yml's validation turns a broken link, anchor or nav entry into a warning, which
    --strict makes an error."""
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-4000:]


def _anchors(page: Path) -> set[str]:
    found = set()
    for title in re.findall(r"^#{1,6} (.+)$", page.read_text(), re.M):
        explicit = re.search(r"\{#([\w-]+)\}\s*$", title)
        found.add(explicit.group(1) if explicit else slugify(title.strip(), "-"))
    return found


def test_every_relative_link_in_the_readme_resolves():
    """The README lives outside docs/, where mkdocs does not look: its links are checked here."""
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"\w+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README.md links to {link}: no such file"
        if anchor:
            assert anchor in _anchors(target), f"README.md links to {link}: no such heading in {path}"


def test_the_options_reference_is_generated_from_the_declarations():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import options_reference
    finally:
        sys.path.pop(0)
    assert (DOCS / "options.md").read_text() == options_reference.render(), (
        "docs/options.md is stale: run .venv/bin/python scripts/options_reference.py"
    )


def _parser(command: list[str]):
    """(the argparse parser that would run this command, its arguments), or None for a command
    that is not pdserve's."""
    name = Path(command[0]).name
    if name == "pdserve":
        from pdserve.cli import parser

        return parser(), command[1:]
    if re.fullmatch(r"python[\d.]*", name) and command[1:2] == ["-m"] and command[2] in NODE_MODULES:
        return importlib.import_module(f"{command[2]}.__main__").ENTRY.parser(), command[3:]
    return None


def test_every_pdserve_command_in_the_docs_parses(capsys):
    """Each `pdserve ...` and `python -m router|prefill_node|decode_node ...` line of a shell block
    goes through the parser that would run it: a flag renamed or removed, or a value it refuses,
    fails here before a reader meets it."""
    checked = 0
    for page in PAGES:
        for command in commands(page):
            found = _parser(command)
            if found is None:
                continue
            parser, argv = found
            try:
                parser.parse_args(argv)
            except SystemExit as e:
                if e.code:
                    pytest.fail(f"{page.relative_to(ROOT)}: `{shlex.join(command)}`: {capsys.readouterr().err}")
            checked += 1
    assert checked >= 30


def test_every_script_command_in_the_docs_names_a_script_and_its_flags():
    """`python benchmarks/X.py --flag ...` (and scripts/, tests/): the file exists and declares
    each flag given."""
    checked = 0
    for page in PAGES:
        for command in commands(page):
            scripts = [w for w in command[1:3] if w.endswith(".py") and not w.startswith("/")]
            if not re.fullmatch(r"python[\d.]*", Path(command[0]).name) or not scripts:
                continue
            script = ROOT / scripts[0]
            where = f"{page.relative_to(ROOT)}: `{shlex.join(command)}`"
            assert script.exists(), f"{where}: no such script"
            source = script.read_text()
            for flag in [w.split("=")[0] for w in command if w.startswith("--")]:
                assert f'"{flag}"' in source, f"{where}: {scripts[0]} has no {flag}"
            checked += 1
    assert checked >= 10


def test_every_make_target_in_the_docs_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for page in PAGES:
        for command in commands(page):
            if command[0] == "make":
                assert set(command[1:]) <= targets, f"{page.relative_to(ROOT)}: `{shlex.join(command)}`"


def test_every_python_example_compiles():
    for page in PAGES:
        for i, block in enumerate(blocks(page, "python")):
            compile(block, f"{page.relative_to(ROOT)} python block {i + 1}", "exec")


def test_the_docs_are_not_dated():
    """Figures and behaviour, not a diary: git keeps the history."""
    for page in PAGES:
        dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", page.read_text())
        assert not dates, f"{page.relative_to(ROOT)} mentions {dates[:3]}"


@pytest.mark.parametrize("script", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_each_benchmark_says_what_it_measures_and_answers_help(script):
    doc = ast.get_docstring(ast.parse(script.read_text()))
    assert doc and len(doc) > 80, f"{script.name} needs a docstring saying what it measures and how to run it"
    r = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-2000:]
