"""The documentation stays true: the site builds strictly (every link, anchor, page and API
reference resolves), and the reference pages name what the code has — every constructor argument
with its default, every public error and warning, every command-line subcommand and flag."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import os
import re
import signal
import subprocess
import sys

import pytest

import distckpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")


def _page(*parts: str) -> str:
    with open(os.path.join(DOCS, *parts), encoding="utf-8") as f:
        return f.read()


def _table_rows(text: str) -> dict[str, list[str]]:
    """The rows of a page's Markdown tables whose first cell is one code span: name -> cells."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")] if line.startswith("| `") else []
        match = re.fullmatch(r"`([^`]+)`", cells[0]) if cells else None
        if match:
            rows[match.group(1)] = cells
    return rows


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="the docs extra: pip install -e '.[docs]'")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", os.path.join(ROOT, "mkdocs.yml"),
                           "-d", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (site / "reference" / "api" / "index.html").read_text().count("CheckpointManager") > 3
    assert "load_latest" in (site / "reference" / "api" / "index.html").read_text()


def _shown(default: object) -> str:
    if default is inspect.Parameter.empty:
        return "required"
    if isinstance(default, tuple) and default and all(isinstance(s, signal.Signals) for s in default):
        return "`(" + ", ".join(f"signal.{s.name}" for s in default) + ",)`"
    return f"`{default!r}`"


def test_every_manager_argument_is_in_the_settings_table_with_its_default():
    rows = _table_rows(_page("reference", "settings.md"))
    parameters = {name: p for name, p in inspect.signature(distckpt.CheckpointManager.__init__).parameters.items()
                  if name != "self"}
    missing = [name for name in parameters if name not in rows]
    assert missing == [], f"docs/reference/settings.md has no row for {missing}"
    wrong = {name: (rows[name][1], _shown(p.default)) for name, p in parameters.items()
             if _shown(p.default) not in rows[name][1]}
    assert wrong == {}, f"defaults in docs/reference/settings.md (table, code) differ: {wrong}"
    extra = [name for name in rows if re.fullmatch(r"[a-z_]+", name) and name not in parameters]
    assert extra == [], f"docs/reference/settings.md documents arguments CheckpointManager does not take: {extra}"
    assert all(len(cells) >= 3 and cells[2] for cells in rows.values()), "every setting says what it is for"


def test_every_public_error_and_warning_is_on_the_errors_page():
    rows = _table_rows(_page("reference", "errors.md"))
    public = [name for name in distckpt.__all__ if name.endswith(("Error", "Warning"))]
    assert len(public) > 15
    missing = [name for name in public if name not in rows]
    assert missing == [], f"docs/reference/errors.md has no row for {missing}"
    unknown = [name for name in rows if not hasattr(distckpt, name)]
    assert unknown == [], f"docs/reference/errors.md names what distckpt does not export: {unknown}"


def _cli_module():
    """The module that builds the command line's parser (its subcommands)."""
    for name in ("distckpt.tools.cli", "distckpt.cli"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name not in (name, name.rpartition(".")[0]):
                raise
    raise AssertionError("no distckpt.tools.cli or distckpt.cli module")


def _sections(text: str) -> dict[str, str]:
    """The CLI page's `### name` sections: name -> its text."""
    parts = re.split(r"^### (\S+)\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_every_cli_subcommand_and_flag_is_on_the_cli_page():
    cli = _cli_module()
    parser = cli.build_parser()
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(subparsers) == 1
    commands = subparsers[0].choices
    assert {"ls", "inspect", "verify", "export", "doctor"} <= set(commands)
    sections = _sections(_page("reference", "cli.md"))
    missing = sorted(set(commands) - set(sections))
    assert missing == [], f"docs/reference/cli.md has no '### name' section for {missing}"
    flags = {name: [o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
             for name, sub in commands.items()}
    out = io.StringIO()  # doctor has a parser of its own: its --help lists its flags
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["doctor", "--help"])
    flags["doctor"] = sorted(set(re.findall(r"(--[a-z][a-z-]*)", out.getvalue())) - {"--help"})
    assert "--kill-at" in flags["doctor"]
    undocumented = {name: [f for f in names if not re.search(re.escape(f) + r"(?![a-z-])", sections[name])]
                    for name, names in flags.items()}
    undocumented = {name: names for name, names in undocumented.items() if names}
    assert undocumented == {}, f"flags missing from their section of docs/reference/cli.md: {undocumented}"


def test_every_subpackage_is_on_the_architecture_page():
    page = _page("design", "architecture.md")
    package = os.path.join(ROOT, "distckpt")
    subpackages = sorted(d for d in os.listdir(package) if os.path.isfile(os.path.join(package, d, "__init__.py")))
    assert subpackages, "distckpt has subpackages"
    missing = [d for d in subpackages if f"`{d}/" not in page]
    assert missing == [], f"docs/design/architecture.md does not describe {missing}"


def test_the_readme_stays_short_and_keeps_its_two_commands():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 300, "the README is a front page: the rest belongs in docs/"
    for command in ("make demo", "make test"):
        assert command in readme
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        makefile = f.read()
    for target in ("demo", "test", "docs"):
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"Makefile has no {target} target"
    linked = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert linked and all(os.path.isfile(os.path.join(ROOT, p)) for p in linked), \
        [p for p in linked if not os.path.isfile(os.path.join(ROOT, p))]
