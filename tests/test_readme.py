"""Every command the README and docs/ quote still runs as written: each is parsed by its own script's argument
parser (nothing is run), so a renamed or removed flag fails here instead of in a reader's terminal. The
README's layout block names every file and folder of the top level and every bench script, and only those."""

import argparse
import re
import runpy
import shlex
import subprocess
import sys

import pytest
from conftest import ROOT

RECIPES = re.findall(r"^  ([a-z0-9-]+)\)", (ROOT / "run.sh").read_text(), flags=re.M)
PLACEHOLDER = re.compile(r"^(\[.*\]|<.*>|\.\.\.|…)$")


def quoted_commands(text: str) -> list[str]:
    """Command lines in the README: lines of fenced blocks (continuations joined) and inline code spans (over
    line breaks too), split at `;` and `&&`, that start a Python script, accelerate launch or run.sh."""
    pieces = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        pieces += block.replace("\\\n", " ").splitlines()
    pieces += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]
    commands = []
    for piece in pieces:
        for part in re.split(r";|&&", piece.split("#")[0]):
            part = " ".join(part.split())
            if re.match(r"(\S*python3?|accelerate launch|\./run\.sh)(\s|$)", part) and ".py" in part + ".py" * (
                    part.startswith("./run.sh")):
                commands.append(part)
    return sorted(set(commands))


def script_and_args(command: str) -> tuple[str, list[str]]:
    words = [w for w in shlex.split(command) if not PLACEHOLDER.match(w)]
    if words[0] == "./run.sh":
        recipe = words[1] if len(words) > 1 and not words[1].startswith("-") else "default"
        assert recipe in RECIPES, f"run.sh has no recipe {recipe!r}"
        args = words[2:] if len(words) > 1 and not words[1].startswith("-") else words[1:]
        if recipe in ("test", "lint"):
            return "", []
        return "lanpo.py", [a for a in args if a != "--dry-run"] if recipe == "ablate" else args
    script = next(w for w in words if w.endswith(".py"))
    return script, words[words.index(script) + 1:]


class Parsed(Exception):
    pass


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = sorted({c for doc in DOCUMENTS for c in quoted_commands(doc.read_text())})


def test_the_readme_quotes_commands():
    assert len(COMMANDS) > 20 and any(c.startswith("./run.sh") for c in COMMANDS)
    assert quoted_commands("Run `python bench/x.py --a 1; python lanpo.py --b` and\n```bash\naccelerate launch "
                           "--config_file c.yaml lanpo.py \\\n  --steps 2\n```\n") == [
        "accelerate launch --config_file c.yaml lanpo.py --steps 2", "python bench/x.py --a 1", "python lanpo.py --b"]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[:70])
def test_every_readme_command_parses(command, monkeypatch):
    script, args = script_and_args(command)
    if not script:
        return
    path = ROOT / script
    assert path.is_file(), f"{command}: no {script}"
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        real(self, argv, namespace)  # an unknown flag or a bad value exits here, with argparse's message
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])
    with pytest.raises(SystemExit if "--help" in args else Parsed) as stopped:
        runpy.run_path(str(path), run_name="__main__")
    assert stopped.type is Parsed or stopped.value.code == 0  # --help prints and exits 0


def test_an_unknown_flag_fails(monkeypatch):
    with pytest.raises(SystemExit):
        test_every_readme_command_parses("python lanpo.py --no-such-flag 1", monkeypatch)
    with pytest.raises(AssertionError, match="no recipe 'grpo-70b'"):
        test_every_readme_command_parses("./run.sh grpo-70b --steps 1", monkeypatch)


def layout_block() -> str:
    section = (ROOT / "README.md").read_text().split("\n## Layout\n", 1)[1]
    return re.search(r"```\n(.*?)```", section, flags=re.S).group(1)


def test_the_layout_block_names_every_module_and_folder_and_nothing_else():
    listed = {line.split()[0].split("/")[0] for line in layout_block().splitlines() if line and not line[0].isspace()}
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    top = {path.split("/")[0] for path in tracked}
    needed = {name for name in top if name.endswith(".py") or (ROOT / name).is_dir()} | {"run.sh"}
    assert needed - listed == set(), f"not in the README's layout block: {sorted(needed - listed)}"
    assert listed - top == set(), f"in the layout block but not in the repository: {sorted(listed - top)}"
    bench = layout_block().split("bench/", 1)[1].split("\ndata/", 1)[0]
    unnamed = [p.stem for p in (ROOT / "bench").glob("*.py") if not re.search(rf"\b{p.stem}\b", bench)]
    assert unnamed == [], f"bench scripts the layout block does not name: {unnamed}"


def test_every_file_in_docs_is_linked_from_the_readme_or_another_page():
    pages = {doc: doc.read_text() for doc in DOCUMENTS}
    orphans = [p.name for p in (ROOT / "docs").iterdir()
               if not any(p.name in text for doc, text in pages.items() if doc != p)]
    assert orphans == [], f"docs/ files no page links: {orphans}"


def test_every_relative_link_resolves():
    """Each [text](path) of the README, docs/ and data/README.md names a file or folder of the repository."""
    broken = []
    for doc in [*DOCUMENTS, ROOT / "data" / "README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if not re.match(r"[a-z]+:|#", target) and not (doc.parent / target.split("#")[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


# bench scripts that run or time the trainer's own steps (setup and the loop, its problem order, its prompts)
TRAINER_ENTRY_POINTS = {"bench/work.py", "bench/vs_trl.py", "bench/teacher_eos.py"}


def project_imports() -> dict[str, set[str]]:
    """Each tracked Python file outside tests/ -> the top-level project modules it imports (anywhere in it)."""
    import ast

    modules = {p.stem for p in ROOT.glob("*.py")}
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    graph = {}
    for path in tracked:
        if path.startswith("tests/"):
            continue
        names = set()
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        graph[path] = names & modules - {path.removesuffix(".py")}
    return graph


def test_modules_import_downward_and_only_the_trainers_entry_points_import_lanpo():
    """No import cycle among the top-level modules; settings come from config.py, so evaluate.py, the other
    modules and the bench scripts that do not run the trainer never import lanpo.py."""
    graph = project_imports()
    importers = {path for path, names in graph.items() if "lanpo" in names}
    assert importers == TRAINER_ENTRY_POINTS, importers ^ TRAINER_ENTRY_POINTS
    top = {path.removesuffix(".py"): names for path, names in graph.items() if "/" not in path}
    done, active = set(), []

    def visit(module):
        assert module not in active, f"import cycle: {' -> '.join(active[active.index(module):] + [module])}"
        if module in done:
            return
        active.append(module)
        for name in sorted(top.get(module, ())):
            visit(name)
        active.pop()
        done.add(module)

    for module in sorted(top):
        visit(module)


def test_the_readmes_ablation_table_is_the_matrix_run_sh_runs():
    """configs/ablations.tsv is the one ablation matrix: run.sh reads it, and the README's table lists its arms,
    flags and descriptions in its order."""
    arms = [line.split("\t") for line in (ROOT / "configs" / "ablations.tsv").read_text().splitlines()
            if not line.startswith("#")]
    assert all(len(arm) == 3 and all(arm) for arm in arms), arms
    section = (ROOT / "README.md").read_text().split("\n## Ablations\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\S+) \| `([^`]*)` \| (.*) \|$", section, flags=re.M)
    assert [list(row) for row in rows] == arms
    listed = subprocess.run(["bash", str(ROOT / "run.sh"), "ablate", "--dry-run"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.splitlines()[1:]
    assert [line.split()[0] for line in listed] == [name for name, _, _ in arms]
    assert all(line.split(": ", 1)[1].endswith(f"--lr 2e-5 {flags} ") for line, (_, flags, _) in zip(listed, arms))


def test_the_docs_state_the_suites_test_count():
    """README and docs/tests.md say how many tests there are; the number is this suite's, not a kept note."""
    from conftest import SUITE_SIZE

    if "all" not in SUITE_SIZE:
        pytest.skip("counted only when the whole suite runs (./run.sh test)")
    n = SUITE_SIZE["all"]
    assert f"what the {n} tests cover" in (ROOT / "README.md").read_text()
    assert f"({n} tests;" in (ROOT / "docs" / "tests.md").read_text()
