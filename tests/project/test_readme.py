"""Every code block of README.md and docs/*.md runs as written, or says why not and is checked as far as it can be.

Every fenced block is tagged `python`, `bash` or `text` (output and messages: not code); an untagged block fails.

* A python block is saved to a file and run the way its first line says (`# run: torchrun --standalone
  --nproc-per-node 2 NAME.py`), else with `python NAME.py`.
* A bash block runs as one `bash -euo pipefail` script, in a scratch directory where `tests/`, `bench/` and `.ci/`
  are the repository's, with this interpreter's bin directory first on PATH (so `python`, `gpucoll-bench`, ... are
  the ones under test).

Both must exit 0 without a traceback, and a bash block must print something. Nothing is edited before running.
The runnable blocks start together when the module's first test needs one, a few at a time (most of their time is
process start-up: torchrun, torch's import, spawned ranks), and each test then checks its own block's result.

A block that cannot run here (it needs a GPU, installs packages, takes minutes) says so on the line above its
fence, `<!-- not run: REASON -->` (an HTML comment: readers of the rendered page do not see it). Such a block is
still checked: python must compile; bash must pass `bash -n`, every option a gpucoll tool is given (gpucoll-bench,
gpucoll-topo, gpucoll-tune, `python -m gpucoll[.algo]`, `python bench/*.py`, `bash .ci/gpu`) must be one its
`--help` lists, and every extra `pip install -e ".[x]"` names must exist in pyproject.toml.

The pages' prose is checked too: relative links and their #anchors resolve, every GPUCOLL_* name is a registered
variable (csrc/core/config.cc) and docs/configuration.md lists exactly the registered ones, each docs page starts
with a summary paragraph, and the README stays a front page that links every page.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import helpers
import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
EXPECTED_PAGES = {"api", "backends", "torch", "algorithms", "benchmark", "topology", "reliability", "elasticity",
                  "configuration", "testing", "gpu-ci", "status", "layout"}
README_MAX_LINES = 120  # a front page: the details belong in docs/
LANGS = ("python", "bash", "text")
NOT_RUN = re.compile(r"\s*<!-- not run: (.*?) -->\s*")
# What the scratch directory of a block borrows from the repository (paths the docs' commands name).
BORROWED = ("tests", "bench", ".ci")
CONCURRENT = max(2, min(4, os.cpu_count() or 2))  # runnable blocks at a time


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    not_run: str | None  # the reason of a <!-- not run: ... --> marker, or None
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2).strip(), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i].removeprefix(indent))
            i += 1
        marker = NOT_RUN.fullmatch(lines[start - 1]) if start > 0 else None
        out.append(Block(str(path.relative_to(ROOT)), start + 1, lang if i < len(lines) else "<unclosed>",
                         marker.group(1).strip() if marker else None, "\n".join(body) + "\n"))
        i += 1
    return out


def _prose(path: Path) -> str:
    """The page without its fenced blocks (their lines blanked, so line numbers stay)."""
    lines, inside = path.read_text().splitlines(), False
    for i, line in enumerate(lines):
        fence = line.strip().startswith("```")
        if fence or inside:
            lines[i] = ""
        if fence:
            inside = not inside
    return "\n".join(lines)


BLOCKS = [b for page in PAGES for b in _blocks(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
BASH = [b for b in BLOCKS if b.lang == "bash"]

# Launcher variables of an enclosing job would describe the wrong processes.
_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_",
         "OMPI_", "PMI_", "SLURM_", "GPUCOLL_")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP)}
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _workdir(tmp_path: Path) -> Path:
    for name in BORROWED:
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _failed(block: Block, proc) -> str:
    return (f"{block.where}: the {block.lang} block failed (exit {proc.returncode}):\n{block.text}"
            f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}")


# -- the pages ----------------------------------------------------------------------------------------------------

def test_the_pages_and_their_blocks_are_there():
    assert {p.stem for p in DOCS.glob("*.md")} >= EXPECTED_PAGES
    runnable = [b for b in PYTHON + BASH if b.not_run is None]
    assert len([b for b in runnable if b.lang == "python"]) >= 6 and len([b for b in runnable if b.lang == "bash"]) >= 4
    assert any(b.page == "README.md" and b.not_run is None for b in PYTHON), "the README's example runs"


def test_every_block_is_tagged_and_every_marker_has_a_reason():
    bad = [f"{b.where}: fence tagged {b.lang!r} (python, bash or text)" for b in BLOCKS if b.lang not in LANGS]
    bad += [f"{b.where}: a text block is not code; drop its marker" for b in BLOCKS if b.lang == "text" and b.not_run]
    bad += [f"{b.where}: say why the block is not run" for b in BLOCKS if b.not_run == ""]
    for page in PAGES:  # a marker that does not sit right above a fence would silently do nothing
        lines = page.read_text().splitlines()
        bad += [f"{page.relative_to(ROOT)}:{i + 1}: a not-run marker must sit on the line above a fence"
                for i, line in enumerate(lines) if line.lstrip().startswith("<!-- not run")
                and not (NOT_RUN.fullmatch(line) and i + 1 < len(lines) and lines[i + 1].startswith("```"))]
    assert not bad, "\n".join(bad)


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, (
        f"README.md has {len(text.splitlines())} lines; keep it a front page (at most {README_MAX_LINES}) and put "
        f"the details in docs/")
    commands = {line for b in BLOCKS if b.page == "README.md" and b.lang == "bash" for line in b.text.splitlines()}
    for command in ('pip install -e . && gpucoll-bench all_reduce --nranks 4',
                    'pip install -e ".[test]" && python -m pytest -q'):
        assert command in commands, f"the README's set-up command {command!r} is missing"
    linked = set(re.findall(r"\]\(docs/([\w-]+)\.md", text))
    assert linked == {p.stem for p in DOCS.glob("*.md")}, "the README's table links every docs page"


def test_each_docs_page_starts_with_a_summary_paragraph():
    bad = []
    for page in sorted(DOCS.glob("*.md")):
        lines = page.read_text().splitlines()
        if len(lines) < 3 or not lines[0].startswith("# ") or lines[1].strip() \
                or not lines[2].strip() or lines[2].lstrip().startswith(("#", "|", "```", "<!--", "- ", "* ", "!")):
            bad.append(str(page.relative_to(ROOT)))
    assert not bad, f"these pages do not start with '# Title', a blank line and a summary paragraph: {bad}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_and_anchors_resolve():
    bad = []
    for page in PAGES:
        prose = re.sub(r"`[^`\n]*`", "", _prose(page))
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", _prose(dest), re.MULTILINE)}
                if anchor not in slugs:
                    bad.append(f"{page.relative_to(ROOT)}: {target}: no heading with that anchor")
    assert not bad, "\n".join(bad)


def _registered() -> set:
    from gpucoll import config

    return {v["name"] for v in config.variables()}


def test_every_variable_the_pages_name_is_registered():
    names = _registered()
    cmake = set(re.findall(r"option\((GPUCOLL_\w+)", (ROOT / "CMakeLists.txt").read_text()))
    unknown = set()
    for page in PAGES:
        for name in re.findall(r"GPUCOLL_[A-Z0-9_]*[A-Z0-9]", page.read_text()):
            if name not in names | cmake and not any(n.startswith(name + "_") for n in names):
                unknown.add(f"{page.relative_to(ROOT)}: {name}")
    assert not unknown, f"not in csrc/core/config.cc's registry (nor a CMake option): {sorted(unknown)}"
    listed = set(re.findall(r"^\| `(GPUCOLL_\w+)` \|", (DOCS / "configuration.md").read_text(), re.MULTILINE))
    assert listed == names, (f"docs/configuration.md's tables and the registry differ: missing "
                             f"{sorted(names - listed)}, not registered {sorted(listed - names)}")


# -- python blocks ------------------------------------------------------------------------------------------------

def _command(block: str, path: Path) -> list[str]:
    first = block.splitlines()[0]
    if not first.startswith("# run: "):
        return [sys.executable, str(path)]
    words = shlex.split(first[len("# run: "):])
    assert words[-1].endswith(".py"), f"the run line must end with the script's name: {first}"
    if words[0] == "torchrun":
        helpers.require("torch.distributed", "the snippet runs under torchrun")
        words = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    elif words[0] == "python":
        words[0] = sys.executable
    else:
        raise AssertionError(f"a run line starts with torchrun or python: {first}")
    return [*words[:-1], str(path)]


def _run(block: Block, workdir: Path) -> subprocess.CompletedProcess:
    if block.lang == "python":
        first = block.text.splitlines()[0]
        path = workdir / (first.split()[-1] if first.startswith("# run: ") else "snippet.py")
        path.write_text(block.text)
        argv = _command(block.text, path)
    else:
        argv = ["bash", "-euo", "pipefail", "-c", block.text]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=_env(), cwd=workdir, check=False)


def _runnable_here(block: Block) -> bool:
    return block.not_run is None and ("torch" not in block.text or helpers.have("torch"))


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """The selected runnable blocks, started CONCURRENT at a time (torchrun's first: they take longest), as
    {block: future of its CompletedProcess}. Not under xdist, whose workers would each run every block."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield {}
        return
    mine = [item for item in request.session.items if item.module is sys.modules[__name__]]
    params = [getattr(getattr(item, "callspec", None), "params", {}) for item in mine]
    todo = [p["block"] for p in params if "block" in p]
    todo = sorted((b for b in todo if _runnable_here(b)), key=lambda b: "# run: torchrun" not in b.text)
    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        yield {b: pool.submit(_run, b, _workdir(tmp_path_factory.mktemp("block"))) for b in todo}


def _result(block: Block, started: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    if "torch" in block.text:
        helpers.require("torch", "the block uses torch")
    future = started.get(block)
    return future.result() if future is not None else _run(block, _workdir(tmp_path))


@pytest.mark.spawns
@pytest.mark.parametrize("block", PYTHON, ids=[b.where for b in PYTHON])
def test_python_block(block, started, tmp_path):
    if block.not_run is not None:
        first = block.text.splitlines()[0]
        compile(block.text, f"{block.where} ({first})", "exec")  # a SyntaxError names the page and line
        return
    proc = _result(block, started, tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, _failed(block, proc)


# -- bash blocks --------------------------------------------------------------------------------------------------

def _commands(script: str) -> list[list[str]]:
    """The simple commands of a script, as words: continuations joined, comments dropped, split at && || | ;,
    redirections and leading VAR=value assignments removed."""
    out = []
    for line in script.replace("\\\n", " ").splitlines():
        words, cmd, skip = shlex.split(line, comments=True), [], False
        for w in [*words, ";"]:
            if skip:
                skip = False
            elif w in ("&&", "||", "|", ";"):
                while cmd and re.fullmatch(r"[A-Za-z_]\w*=.*", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            elif re.fullmatch(r"\d?>>?|<", w):
                skip = True  # the redirection's file
            elif not re.fullmatch(r"\d?>>?\S+|\d>&\d", w):
                cmd.append(w)
    return out


def _tool(words: list[str]) -> tuple[list[str], list[str]] | None:
    """(the tool's command, its arguments) for gpucoll's own tools; None for anything else."""
    if words[0] in ("gpucoll-bench", "gpucoll-topo", "gpucoll-tune"):
        n = 2 if words[0] == "gpucoll-bench" and words[1:2] in (["report"], ["--health-check"]) else 1
        return words[:n], words[n:]
    if words[:3] in (["python", "-m", "gpucoll.algo"], ["python", "-m", "gpucoll"]):
        return words[:4], words[4:]
    if words[0] == "python" and len(words) > 1 and words[1].startswith("bench/"):
        return words[:2], words[2:]
    if words[:2] == ["bash", ".ci/gpu"]:
        return words[:2], words[2:]
    return None


@functools.cache
def _help(tool: tuple) -> str:
    argv = [sys.executable if w == "python" else w for w in tool]
    proc = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT,
                          check=False)
    assert proc.returncode == 0, f"{' '.join(tool)} --help failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


def _extras() -> set:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^(\w+) = \[", section, re.MULTILINE))


def _check_without_running(block: Block) -> list[str]:
    proc = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return [f"bash -n: {proc.stderr.strip()}"]
    problems = []
    for words in _commands(block.text):
        if words[:2] == ["pip", "install"]:
            for spec in words[2:]:
                m = re.fullmatch(r"\.\[([\w,]+)\]", spec)
                missing = set(m.group(1).split(",")) - _extras() if m else set()
                problems += [f"pip install {spec}: pyproject.toml has no extra {x!r}" for x in sorted(missing)]
            continue
        found = _tool(words)
        if found is None:
            continue
        tool, args = found
        text = _help(tuple(tool))
        for arg in args:
            option = arg.split("=", 1)[0]
            if option.startswith("-") and option != "-" and not re.fullmatch(r"-[\d.]+", option) \
                    and not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text):
                problems.append(f"{' '.join(tool)}: {option} is not an option its --help lists")
    return problems


@pytest.mark.spawns
@pytest.mark.parametrize("block", BASH, ids=[b.where for b in BASH])
def test_bash_block(block, started, tmp_path):
    if block.not_run is not None:
        problems = _check_without_running(block)
        assert not problems, f"{block.where} (not run: {block.not_run}):\n{block.text}" + "\n".join(problems)
        return
    proc = _result(block, started, tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and proc.stdout.strip(), _failed(block, proc)
