"""The documentation stays honest: the README stays a short manual, every relative link
(and #anchor) in README.md and docs/*.md resolves, the flag table in docs/commands.md is
the one the config fields render, and every `ray-ddp COMMAND` and `--flag` the pages name
exists. No Ray: the commands are read from `python -m ray_ddp ... --help`, in one
subprocess, so this test does not depend on the package's internal module paths."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from functools import lru_cache

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300

# docs/performance.md is rendered by scripts/render_benchmarks.py from the benchmarks'
# results (another owner's page). The README and docs/README.md link to it, and links to
# it must resolve like any other: it has to exist before the suite runs. Its text is
# generated, so its own commands and flags are not checked here (its links are).
GENERATED = {DOCS / "performance.md"}

# The marker line above the generated flag table in docs/commands.md (the one
# scripts/regen_flag_table.py looks for); the table is the run of `|` lines after it.
FLAG_TABLE_MARKER = re.compile(r"<!-- generated from ray_ddp/config\.py[^\n]*-->\n")

# Flags of other tools that the pages show beside ray-ddp's own, by tool.
OTHER_TOOLS_FLAGS = {
    "pip install": {"--index-url"},
    "ray job submit": {"--address", "--working-dir"},
    "ray drain-node": {"--node-id", "--reason", "--reason-message", "--deadline-remaining-seconds"},
    "torchrun": {"--nproc-per-node", "--standalone", "--tee", "--max-restarts"},
    "kubectl create secret": {"--from-literal"},
    "tensorboard": {"--logdir"},
    "mlflow server": {"--backend-store-uri", "--host", "--port"},
    "ray start": {"--metrics-export-port"},
    "examples/torchrun_script.py, the launch example": {"--steps", "--out", "--epochs"},
    "benchmarks/throughput.py, named in docs/testing.md": {"--preset"},
    "pytest, in docs/testing.md": {"--durations"},
    "pip and benchmarks/install_time.py, in docs/testing.md": {"--no-compile", "--rounds"},
    "benchmarks/suite_time.py, in docs/testing.md": {"--by-process", "--skip-ci"},
}


def pages() -> list[pathlib.Path]:
    return [README] + sorted(DOCS.glob("*.md"))


def own_pages() -> list[pathlib.Path]:
    """The pages written by hand (not generated)."""
    return [p for p in pages() if p not in GENERATED]


# ---------------------------------------------------------------------------------------
# markdown, as far as these checks need it


_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)


def split_code(text: str) -> tuple[str, list[str]]:
    """(the prose, with fenced blocks blanked and inline code spans replaced by `x`;
    every code chunk: each fenced block, each inline span)."""
    prose, chunks = split_fences(text)
    chunks += [m.group(2) for m in _CODE_SPAN.finditer(prose)]
    return _CODE_SPAN.sub("x", prose), chunks


def split_fences(text: str) -> tuple[str, list[str]]:
    """(the text with fenced code blocks blanked, line for line; each block's text)."""
    prose_lines, chunks, block, fence = [], [], [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence, block = m.group(1), []
            prose_lines.append("")
        elif fence is not None and line.strip().startswith(fence):
            chunks.append("\n".join(block))
            fence = None
            prose_lines.append("")
        elif fence is not None:
            block.append(line)
            prose_lines.append("")
        else:
            prose_lines.append(line)
    if fence is not None:
        chunks.append("\n".join(block))
    return "\n".join(prose_lines), chunks


_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def links(text: str) -> list[str]:
    """Every link target in the prose: inline links and images, reference definitions."""
    prose, _ = split_code(text)
    return [m.group(1) for m in _INLINE_LINK.finditer(prose)] + _REF_DEF.findall(prose)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text, lower case, without
    punctuation other than `-` and `_`, spaces as `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "")
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)  # emphasis, not snake_case
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(page: pathlib.Path) -> frozenset[str]:
    """The anchors of a page's ATX headings (outside code blocks), with GitHub's `-1`,
    `-2` ... for repeats."""
    prose, _ = split_fences(page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", prose, re.MULTILINE):
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def test_slugs_are_githubs():
    assert github_slug("`ray-ddp export RUN [--storage PATH] [--step N] [--out FILE]`") == \
        "ray-ddp-export-run---storage-path---step-n---out-file"
    assert github_slug("Models bigger than one GPU: `--strategy fsdp`") == \
        "models-bigger-than-one-gpu---strategy-fsdp"
    assert github_slug("`metrics.parquet`") == "metricsparquet"
    assert github_slug("Kubernetes (KubeRay)") == "kubernetes-kuberay"
    assert github_slug("GPUs: `CUDA_VISIBLE_DEVICES` and `ray_ddp.device()`") == \
        "gpus-cuda_visible_devices-and-ray_ddpdevice"


# ---------------------------------------------------------------------------------------
# (a) the README is the short manual


def test_readme_is_at_most_300_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; it is the short manual (at most {README_MAX_LINES}): "
        "move the rest into a page under docs/ and link to it")


# ---------------------------------------------------------------------------------------
# (b) every relative link resolves


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page.read_text()):
        if not target or _SCHEME.match(target):  # http(s), mailto: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: {dest.name} has no heading with anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)} has unresolved links:\n  " + "\n  ".join(broken)


def test_every_docs_page_is_in_the_index():
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in links((DOCS / "README.md").read_text())
              if not _SCHEME.match(t)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.name != "README.md" and p.resolve() not in linked]
    assert not missing, f"docs/README.md does not link to: {', '.join(missing)}"
    assert (DOCS / "README.md").resolve() in {(ROOT / t).resolve() for t in links(README.read_text())
                                               if not _SCHEME.match(t)}, \
        "README.md does not link to the docs index, docs/README.md"


# ---------------------------------------------------------------------------------------
# (c) the flag table is generated from the config fields


def flag_table(text: str) -> str:
    """The `|` lines right after the marker (the same span regen_flag_table.py rewrites)."""
    marker = FLAG_TABLE_MARKER.search(text)
    assert marker, "docs/commands.md has no flag-table marker (<!-- generated from ray_ddp/config.py ... -->)"
    rows = []
    for line in text[marker.end():].splitlines():
        if not line.startswith("|"):
            break
        rows.append(line)
    return "\n".join(rows)


def test_commands_flag_table_is_generated_from_the_fields():
    from ray_ddp.config import render_flag_table

    assert flag_table((DOCS / "commands.md").read_text()) == render_flag_table(), (
        "the flag table in docs/commands.md is stale: run .venv/bin/python scripts/regen_flag_table.py")


# ---------------------------------------------------------------------------------------
# (d) every command and flag the pages name exists

_HELP_SCRIPT = r"""
import contextlib, io, json, re, runpy, sys
helps, todo = {}, [[]]
while todo:
    argv = todo.pop(0)
    out = io.StringIO()
    sys.argv = ["ray-ddp", *argv, "--help"]
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module("ray_ddp", run_name="__main__", alter_sys=True)
        except SystemExit:
            pass
    text = helps[" ".join(argv)] = out.getvalue()
    usage = text.split("\n\n", 1)[0]
    sub = re.search(r"\{([^{}]*)\} \.\.\.", usage)  # subcommands: "{train,demo,...} ..."
    if sub:
        todo += [argv + [name] for name in sub.group(1).split(",")]
print(json.dumps(helps))
"""


@lru_cache(maxsize=None)
def cli_help() -> dict[str, str]:
    """`ray-ddp [COMMAND ...] --help` of every command and subcommand, by command path
    ("" for the top level, "data synth" for a subcommand)."""
    env = dict(os.environ, COLUMNS="1000")  # argparse wraps to the terminal: one line each
    proc = subprocess.run([sys.executable, "-c", _HELP_SCRIPT], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, f"python -m ray_ddp ... --help failed:\n{proc.stderr[-3000:]}"
    helps = json.loads(proc.stdout.strip().splitlines()[-1])
    assert helps.get("") and "train" in helps, f"no help from python -m ray_ddp --help: {helps}"
    return helps


def positional_choices(help_text: str) -> set[str]:
    """The choices of a command's positional argument: its subcommands (`{synth} ...`) or
    the values it takes (`{basic,checkpoint,model-parallel}`)."""
    usage = help_text.split("\n\n", 1)[0]
    usage = re.sub(r"\[[^\[\]]*\]", "", usage)  # options and their choices
    found = re.search(r"\{([^{}]*)\}", usage)
    return set(found.group(1).split(",")) if found else set()


def command_flags(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", help_text))


_INVOCATION = re.compile(r"(?<![\w/.-])(?:ray-ddp|-m ray_ddp)(?![\w:.-])((?:[ \t]+[a-z][a-z0-9-]*)*)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# where a command's own arguments end on a line: a comment, a pipe or list operator, or
# (for launch) the script, whose own flags follow
_END = re.compile(r"\s#|&&|\|\||;|\s\|\s|\s\S+\.py\b|\s--\s|\n|$")


def named_invocations(text: str):
    """What every `ray-ddp ...` or `python -m ray_ddp ...` in the page's code names:
    ``(command path, word, the choices there)`` for each word that picks a subcommand or
    a positional's value, then ``(command path, None, the flags given to it)``."""
    helps = cli_help()
    _, chunks = split_code(text)
    for chunk in chunks:
        chunk = re.sub(r"\\\n\s*", " ", chunk)  # shell line continuations
        for m in _INVOCATION.finditer(chunk):
            path: list[str] = []
            known = True
            for word in m.group(1).split():
                choices = positional_choices(helps[" ".join(path)])
                if not choices:
                    break
                yield " ".join(path), word, choices
                known = word in choices
                if not known or " ".join(path + [word]) not in helps:
                    break  # a wrong word, or a positional's value (a demo's name)
                path.append(word)
            if known:  # the flags of a command that does not exist say nothing more
                rest = chunk[m.end():]
                rest = rest[:_END.search(rest).start()]
                yield " ".join(path), None, set(_FLAG.findall(rest))


@pytest.mark.parametrize("page", own_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_command_exists(page):
    helps = cli_help()
    wrong = []
    for path, word, found in named_invocations(page.read_text()):
        if word is not None and word not in found:
            wrong.append(f"`ray-ddp {(path + ' ' + word).strip()}`: not one of {sorted(found)}")
        elif word is None:
            own = command_flags(helps[path])
            wrong += [f"`ray-ddp {path} {flag}`: ray-ddp {path} has no {flag}"
                      for flag in sorted(found - own)]
    assert not wrong, f"{page.relative_to(ROOT)} names commands or flags that do not exist:\n  " + \
        "\n  ".join(wrong)


@pytest.mark.parametrize("page", own_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_flag_exists(page):
    helps = cli_help()
    known = set().union(*(command_flags(h) for h in helps.values()), *OTHER_TOOLS_FLAGS.values())
    text = page.read_text()
    text = re.sub(r"https?://\S+", "", text)
    unknown = sorted(set(_FLAG.findall(text)) - known)
    assert not unknown, (f"{page.relative_to(ROOT)} names flags no ray-ddp command has: {unknown} "
                         "(a flag of another tool the page shows goes into OTHER_TOOLS_FLAGS)")


def test_the_readme_names_the_ci_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = ".venv/bin/python -m pytest"
    assert command in ci, f".ci/run no longer runs {command}: update the README's test command"
    assert f"bash scripts/install.sh && {command}" in README.read_text()
