"""The layout's rules, checked over the source (standard library only: runs in either environment).

* The import graph: nothing under dtrain/remote/ imports the operator side (it is installed on hosts,
  standard library only), and the Azure path (dtrain/cluster/, dtrain/jobs/) reaches nothing of the
  embedded local cluster (dtrain/local/), directly or through the modules it imports; the modules of
  dtrain/jobs/ import no circle and, with dtrain/cluster/, no argparse; the CLI's entry helpers
  (dtrain/cli_entry.py) are the verbs' alone. In training/, the vocabulary (config/), the run's
  bookkeeping (run/) and the world (world/) load no framework, and config/ reaches no framework code.
* One exit-status table (training/exit_status.py): the host tools that stand alone repeat its values,
  and match it; no other module writes 75 or 4 as an exit status.
* Every command and path that README.md and docs/ name exists: `python -m MODULE` resolves to a module,
  a repository path is a file or folder, and `make TARGET` is a target of the Makefile; every link
  between them reaches a file, and a heading where it names one.
* Every code block of theirs names its language, and a command block that does not run as written
  says why (tests/doc_blocks.py; tests/scripts/test_doc_commands.py runs the others).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from tests import doc_blocks
from training.exit_status import ExitCode

REPO = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("dtrain", "training", "infra", "bench", "tests")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The first-party modules a file imports (`from pkg import name` counts pkg.name when it is a module)."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in FIRST_PARTY}


def existing(name: str) -> str | None:
    """The module file behind a dotted name, or None when it names no module (an attribute)."""
    path = REPO.joinpath(*name.split("."))
    if (path / "__init__.py").is_file() or path.with_suffix(".py").is_file():
        return name
    return None


GRAPH = {
    module_name(path): {m for m in map(existing, imports_of(path)) if m}
    for top in ("dtrain", "training", "infra", "bench")
    for path in sorted((REPO / top).rglob("*.py"))
}


def reached(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for name in GRAPH.get(todo.pop(), ()):
            # importing a.b.c runs a/__init__ and a/b/__init__ too
            for prefix in (".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)):
                if prefix not in seen:
                    seen.add(prefix)
                    todo.append(prefix)
    return seen


def test_the_graph_was_read() -> None:
    assert "dtrain.cluster.ssh" in GRAPH["dtrain.jobs.submit"] or GRAPH["dtrain.jobs.submit"]
    assert "dtrain.local.slurm" in GRAPH["dtrain.local.cluster"]


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("dtrain.remote")))
def test_nothing_installed_on_hosts_imports_the_project(module: str) -> None:
    assert GRAPH[module] == set(), f"{module} imports {sorted(GRAPH[module])}: host tools are standard library only"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith(("dtrain.cluster", "dtrain.jobs"))))
def test_the_azure_path_reaches_nothing_of_the_local_cluster(module: str) -> None:
    local = sorted(name for name in reached(module) if name.startswith("dtrain.local"))
    assert local == [], f"{module} reaches {local}"


# Commands of their own that the local cluster starts (slurmctld's power saving, `local up`'s daemons): their
# main() is an entry point like a verb's, with the same parser and error path.
LOCAL_PROGRAMS = ("dtrain.local.metadata", "dtrain.local.power", "dtrain.local.reconcile")


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if "dtrain.cli_entry" in GRAPH[m]))
def test_only_the_verbs_use_the_cli_entry_helpers(module: str) -> None:
    """The rest raises OperatorError and takes plain checks from dtrain/checks.py: it can be called without a
    command line, and a command's flags are read in one place."""
    assert module.startswith("dtrain.cli.") or module in ("dtrain.__main__", *LOCAL_PROGRAMS)


def imports_argparse(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(alias.name == "argparse" for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "argparse":
            return True
    return False


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith(("dtrain.cluster", "dtrain.jobs"))))
def test_the_azure_path_knows_nothing_of_command_lines(module: str) -> None:
    """cluster/ and jobs/ take typed requests (dtrain/jobs/launch_request.py): a verb in dtrain/cli/ reads the
    flags, once, and anything else (a test, the demo) calls them without building a command line."""
    path = REPO.joinpath(*module.split(".")).with_suffix(".py")
    path = path if path.is_file() else path.with_suffix("") / "__init__.py"
    assert not imports_argparse(path), f"{module} imports argparse: its flags belong to a verb in dtrain/cli/"


def circles(package: str) -> list[list[str]]:
    """Each import circle among the modules of package (TYPE_CHECKING imports too), once, from its least module."""
    members = {m for m in GRAPH if m.startswith(package + ".")}
    found = []
    for start in sorted(members):
        todo = [[start]]
        while todo:
            path = todo.pop()
            for name in sorted(GRAPH[path[-1]] & members):
                if name == start:
                    found.append([*path, start])
                elif name > start and name not in path:
                    todo.append([*path, name])
    return found


def test_the_jobs_modules_import_no_circle() -> None:
    """A feature of job.sh returns its lines (dtrain/jobs/job_spec.py's ScriptLines) rather than importing
    the script that imports it: a circle would mean two modules that cannot be read, or changed, apart."""
    assert [" -> ".join(circle) for circle in circles("dtrain.jobs")] == []


FRAMEWORKS = ("torch", "tensorflow", "horovod", "keras")
FRAMEWORK_FREE = ("training.config", "training.run", "training.world")


def top_level_imports(path: Path) -> set[str]:
    """The top-level packages a module imports as it loads: its own statements, not a function's, not
    under `if TYPE_CHECKING:`."""
    found: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith(FRAMEWORK_FREE)))
def test_the_trainers_vocabulary_runs_and_world_load_no_framework(module: str) -> None:
    """Settings, the run's bookkeeping and the world's liveness are read by every framework's job (and by
    the operator's checks): a framework they need is imported where it is used, inside a function."""
    path = REPO.joinpath(*module.split(".")).with_suffix(".py")
    path = path if path.is_file() else path.with_suffix("") / "__init__.py"
    loaded = sorted(top_level_imports(path) & set(FRAMEWORKS))
    assert loaded == [], f"{module} imports {loaded} as it loads"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("training.config")))
def test_the_config_reaches_no_framework_code(module: str) -> None:
    """training/config/ is the vocabulary: the framework packages (training/torch/, training/tf/) build on
    it, never the other way round, even inside a function."""
    allowed = ("training.config", "training.world", "training.errors", "training.exit_status")
    beyond = sorted(name for name in reached(module) if name.startswith("training.") and not name.startswith(allowed))
    assert beyond == [], f"{module} reaches {beyond}"


# --- the exit-status table -----------------------------------------------------------------------

STANDALONE = {  # host tools that cannot import the table: their copies of its values
    "dtrain/remote/boot/spot_agent.py": {"PREEMPTED_EXIT_CODE": ExitCode.PREEMPTED},
    "dtrain/remote/job/record_run.py": {"PREEMPTED_EXIT_CODE": ExitCode.PREEMPTED},
    "dtrain/remote/boot/blob_pull.py": {
        "EXIT_FAILED": ExitCode.FAILED,
        "EXIT_BAD_INPUT": ExitCode.BAD_INPUT,
        "EXIT_NOT_READY": ExitCode.NOT_READY,
        "EXIT_INTERRUPTED": ExitCode.INTERRUPTED,
    },
}


def constants(path: Path) -> dict[str, object]:
    tree = ast.parse(path.read_text())
    return {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


@pytest.mark.parametrize("path", sorted(STANDALONE))
def test_the_standalone_host_tools_repeat_the_table(path: str) -> None:
    values = constants(REPO / path)
    assert {name: values.get(name) for name in STANDALONE[path]} == STANDALONE[path]


def exit_literals(path: Path) -> list[str]:
    """Where 75 or 4 is written as an exit status: sys.exit/os._exit/SystemExit arguments, `return N` in
    main(), and constants or keywords whose name says exit status."""
    found = []
    wanted = {int(ExitCode.PREEMPTED), int(ExitCode.TIMED_OUT)}

    def literal(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Constant) and type(node.value) is int and node.value in wanted

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("sys.exit", "exit", "os._exit", "SystemExit") and any(map(literal, node.args)):
                found.append(f"{path.name}:{node.lineno} {name}")
            keywords = [k.arg for k in node.keywords if "exit" in (k.arg or "") and literal(k.value)]
            found += [f"{path.name}:{node.lineno} {keyword}=" for keyword in keywords]
        elif isinstance(node, ast.Assign) and literal(node.value):
            names = [ast.unparse(t) for t in node.targets]
            found += [f"{path.name}:{node.lineno} {n}" for n in names if re.search("exit|status|code", n, re.I)]
        elif isinstance(node, ast.FunctionDef) and node.name == "main":
            returns = [r for r in ast.walk(node) if isinstance(r, ast.Return) and literal(r.value)]
            found += [f"{path.name}:{r.lineno} return" for r in returns]
    return found


def test_no_exit_status_is_written_as_a_number_outside_the_table() -> None:
    allowed = {REPO / "training" / "exit_status.py", *(REPO / path for path in STANDALONE)}
    found = [
        hit
        for top in ("dtrain", "training", "infra", "bench")
        for path in sorted((REPO / top).rglob("*.py"))
        if path not in allowed
        for hit in exit_literals(path)
    ]
    assert found == []


# --- what the documentation names exists ---------------------------------------------------------

MODULE_RUN = re.compile(r"python3? -m ((?:dtrain|training|bench)(?:\.[A-Za-z_][\w]*)*)(?!\.?[<{])(?!\w)")
REPO_PATH = re.compile(
    r"(?<![\w/.~$-])((?:dtrain|training|bench|infra|tests|tools|docs|examples|\.ci)/[\w./-]*[\w/])(?![\w{*<])"
)
MAKE_TARGET = re.compile(r"(?:^|`)make ([a-z][a-z-]*)", re.MULTILINE)
# What a documented command writes, not kept in the repository.
GENERATED = {"bench/results/results-gpu", "bench/results/results-gpu.json", "bench/results/results-gpu.md"}


def documented(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    return sorted({(doc.name, match[1]) for doc in DOCS for match in pattern.finditer(doc.read_text())})


@pytest.mark.parametrize(("doc", "module"), documented(MODULE_RUN))
def test_every_documented_module_runs(doc: str, module: str) -> None:
    path = REPO.joinpath(*module.split("."))
    runnable = path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()
    assert runnable, f"{doc}: `python -m {module}` names no module with a main"
    assert importlib.util.find_spec(module) is not None


@pytest.mark.parametrize(("doc", "path"), documented(REPO_PATH))
def test_every_documented_path_exists(doc: str, path: str) -> None:
    assert (REPO / path).exists() or path in GENERATED, f"{doc} names {path}, which is not in the repository"


@pytest.mark.parametrize(("doc", "target"), documented(MAKE_TARGET))
def test_every_documented_make_target_exists(doc: str, target: str) -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(rf"^{re.escape(target)}:", makefile, re.MULTILINE), f"{doc}: no `make {target}`"


VERB = re.compile(
    r"(?:^|`)\s*(?:\.venv/bin/)?(?:python -m dtrain|dtrain)(?: --cluster \S+)? ([a-z][a-z-]*)", re.MULTILINE
)


@pytest.mark.parametrize(("doc", "verb"), documented(VERB))
def test_every_documented_dtrain_verb_exists(doc: str, verb: str) -> None:
    pytest.importorskip("pydantic", reason="the operator environment's test")
    from dtrain.__main__ import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert verb in commands, f"{doc}: `dtrain {verb}` is not a command ({sorted(commands)})"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("training")))
def test_the_jobs_import_nothing_of_the_operator_side(module: str) -> None:
    """The images hold training/ alone (Dockerfile: COPY training)."""
    outside = sorted(name for name in reached(module) if not name.startswith("training"))
    assert outside == [], f"{module} reaches {outside}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith(("dtrain", "infra"))))
def test_the_product_imports_no_benchmark_or_test(module: str) -> None:
    outside = sorted(name for name in reached(module) if name.startswith(("bench", "tests")))
    assert outside == [], f"{module} reaches {outside}"


# --- links between the documents ---------------------------------------------------------------

FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)


def prose(doc: Path) -> str:
    """The text a reader follows links in: no code blocks, no inline code."""
    return INLINE_CODE.sub("", FENCED.sub("", doc.read_text()))


def anchors(doc: Path) -> set[str]:
    """The fragments GitHub gives a document's headings: lower case, punctuation dropped, spaces as
    hyphens, and -1, -2 after a repeated one."""
    found: set[str] = set()
    repeats: dict[str, int] = {}
    for heading in HEADING.findall(FENCED.sub("", doc.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(f"{slug}-{repeats[slug]}" if slug in repeats else slug)
        repeats[slug] = repeats.get(slug, 0) + 1
    return found


def relative_links() -> list[tuple[str, str]]:
    return sorted(
        {
            (str(doc.relative_to(REPO)), target)
            for doc in DOCS
            for target in LINK.findall(prose(doc))
            if not re.match(r"[a-z][a-z+.-]*:", target)
        }
    )


@pytest.mark.parametrize(("doc", "target"), relative_links())
def test_every_link_between_the_documents_arrives(doc: str, target: str) -> None:
    path, _, fragment = target.partition("#")
    file = (REPO / doc).parent / path if path else REPO / doc
    assert file.exists(), f"{doc} links to {target}: no such file"
    if fragment and file.suffix == ".md":
        assert fragment in anchors(file), f"{doc} links to {target}: {file.name} has no such heading"


# --- code blocks: a language each, and why a command block does not run -------------------------


def test_every_code_block_names_its_language_and_a_command_block_not_run_says_why() -> None:
    found = [block for doc in DOCS for block in doc_blocks.blocks(doc)]
    assert len(found) == sum(len(FENCED.findall(doc.read_text())) for doc in DOCS)  # none missed
    problems = [
        f"{block.where}: no language (bash for commands; text for output, a synopsis, a tree)"
        for block in found
        if not block.language
    ]
    problems += [
        f"{block.where}: {mark!r} is not a reason a command block does not run: {sorted(doc_blocks.NOT_RUN)}"
        for block in found
        if block.language == doc_blocks.COMMANDS
        for mark in block.marks
        if mark not in doc_blocks.NOT_RUN
    ]
    problems += [
        f"{block.where}: {block.language} {' '.join(block.marks)}: only command blocks ({doc_blocks.COMMANDS}) "
        "carry a reason not to run"
        for block in found
        if block.marks and block.language != doc_blocks.COMMANDS
    ]
    assert problems == []
