"""benchmarks/results/ holds the newest result of each benchmark as ``.md`` and ``.json`` (the exceptions are named
below, each with its reason), and every result the docs name exists: a file of the tree, or, for a result no longer
in it, ``COMMIT:benchmarks/results/FILE`` in git's history (docs/benchmarks.md, first section)."""
from __future__ import annotations

import itertools
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# The files that are neither .md nor .json, and why each stays.
EXCEPTIONS = {
    "gpu_tests_h200.log": "the newest full GPU-test run (`bash benchmarks/device.sh tests`): one summary line per file",
    "moe_sweep_h200.log": "benchmarks/sweep_moe.py's report is text (its --out); gdnserve/ops/moe/grouped_triton.py's "
                          "tiles cite it",
}

_NAME = r"[\w*{},.\-]+"
# benchmarks/results/NAME, or COMMIT:benchmarks/results/NAME (a result that git keeps, `git show` prints it)
_PATH = re.compile(rf"(?:\b(?P<commit>[0-9a-f]{{7,40}}):)?benchmarks/results/(?P<name>{_NAME})")
# a result's bare name (`ops_h200.md`, `decode_b1_h200.*`, `{model,serve,spec}_h200.*`), not a path's tail
_BARE = re.compile(rf"(?<![\w/:.\-*{{}},]){_NAME}")
_RESULT_LIKE = (re.compile(r"_(?:h200|cpu)(?:[_.*{]|$)"), re.compile(r"\.(?:md|json|log|png|txt|\*|\{[\w,]+\})$"))


def citing_files() -> list[Path]:
    """Where results are cited: the docs, the README, device.sh's comments, and the package's comments (a
    constant's docstring names the measurement that chose it)."""
    return sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "benchmarks" / "device.sh",
                   *ROOT.glob("gdnserve/**/*.py")])


def expand(name: str) -> list[str]:
    """``a_{x,y}.md`` -> ``[a_x.md, a_y.md]`` (every brace group)."""
    parts = re.split(r"(\{[^{}]*\})", name)
    return ["".join(p) for p in itertools.product(*[q[1:-1].split(",") if q.startswith("{") else [q] for q in parts])]


def citations(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(names cited in the tree, (commit, name) cited in git's history) in ``text``."""
    tree, history = [], []
    for m in _PATH.finditer(text):
        name = m["name"].rstrip(".,")
        if name:
            (history.append((m["commit"], name)) if m["commit"] else tree.append(name))
    for m in _BARE.finditer(text):
        name = m.group().rstrip(".,")
        if all(r.search(name) for r in _RESULT_LIKE):
            tree.append(name)
    return tree, history


def missing(name: str, have: set[str]) -> bool:
    """A plain name must exist; a name with wildcards must match a file (any of its brace alternatives)."""
    alts = expand(name)
    if any("*" in a for a in alts):
        return not any(Path(h).match(a) for a in alts for h in have)
    return any(a not in have for a in alts)


def test_results_hold_only_markdown_and_json():
    files = sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())
    assert files, RESULTS
    odd = [f for f in files if Path(f).suffix not in (".md", ".json") and f not in EXCEPTIONS]
    assert odd == [], f"benchmarks/results/ keeps .md and .json only (exceptions: {sorted(EXCEPTIONS)}): {odd}"
    assert [e for e in EXCEPTIONS if e not in files] == [], "an exception names a file that is gone: drop it"


def test_every_cited_result_exists():
    have = {p.name for p in RESULTS.iterdir() if p.is_file()}
    bad = []
    for path in citing_files():
        for name in citations(path.read_text(encoding="utf-8"))[0]:
            if missing(name, have):
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert bad == [], ("cited but not in benchmarks/results/ (cite the kept file, or COMMIT:benchmarks/results/FILE "
                       f"for one git keeps): {bad}")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)


def test_history_citations_name_a_file_of_that_commit():
    """``COMMIT:benchmarks/results/FILE`` must be what ``git show`` prints: FILE in COMMIT's tree. Checked where the
    commit is in this clone (a shallow one may lack it)."""
    try:
        if _git("rev-parse", "--git-dir").returncode != 0:
            pytest.skip("not a git checkout")
    except OSError:
        pytest.skip("no git")
    cited = sorted({(c, n, str(p.relative_to(ROOT))) for p in citing_files()
                    for c, n in citations(p.read_text(encoding="utf-8"))[1]})
    assert cited, "no history citation found: the pattern no longer matches the docs"
    bad = []
    for commit, name, where in cited:
        if any(ch in name for ch in "*{"):
            bad.append(f"{where}: {commit}:{name} (name one file)")
        elif _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0 and \
                _git("cat-file", "-e", f"{commit}:benchmarks/results/{name}").returncode != 0:
            bad.append(f"{where}: {commit}:benchmarks/results/{name}")
    assert bad == [], f"not in that commit's tree: {bad}"


def test_the_patterns_find_what_docs_write():
    """The extraction itself: paths, bare names, braces, wildcards, history; a path's tail is not a bare name."""
    text = ("(`benchmarks/results/ops_h200.{md,json}`, `decode_b1_h200.*`, `abc1234:benchmarks/results/x_h200_run4.log`,\n"
            "$OUT/kernels_per_layer_h200.md, num_cpus, `tune_chunk_h200.log` round 2, benchmarks/results/a_h200.md.")
    tree, history = citations(text)
    assert tree == ["ops_h200.{md,json}", "a_h200.md", "decode_b1_h200.*", "tune_chunk_h200.log"]
    assert history == [("abc1234", "x_h200_run4.log")]
    have = {"ops_h200.md", "ops_h200.json", "decode_b1_h200.json"}
    assert not missing("ops_h200.{md,json}", have) and not missing("decode_b1_h200.*", have)
    assert missing("ops_h200.{md,log}", have) and missing("moe_h200.*", have) and missing("tune_chunk_h200.log", have)


def test_result_json_is_one_row_per_line_and_round_trips():
    """benchmarks.jsonfmt: the text loads back to the object json.dumps would give; a row of scalars (and lists
    of scalars) is one line; every committed result JSON is written that way."""
    from benchmarks import jsonfmt
    obj = {"meta": {"device": "x", "ceilings": {"copy": 4.2, "mm": [1, 2]}}, "rows": [
        {"T": 1, "us": 1.5, "p10_p90": [1.4, 1.6], "ok": True, "name": "é"}, {"T": 65, "us": None, "p10_p90": []}],
        "empty": {}, "n": 3}
    text = jsonfmt.dumps(obj)
    assert json.loads(text) == obj and text.endswith("}\n")
    assert '  {"T": 1, "us": 1.5, "p10_p90": [1.4, 1.6], "ok": true, "name": "é"},' in text.splitlines()
    for f in sorted(RESULTS.glob("*.json")):
        assert f.read_text() == jsonfmt.dumps(json.loads(f.read_text()), default=None), f"{f.name}: not jsonfmt's form"
