"""The written documentation against the tree: relative links and anchors resolve, every path in
backticks names a file that exists, every results folder has a row in ``results/INDEX.md`` and
every row a folder (and its successor, when superseded), and no text names a file outside the
repository."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"

#: ``[text](target)`` and ``![alt](target)``; the target ends at the first blank or ``)``.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)")
#: a results folder named anywhere in the text, linked or not
RESULTS_FOLDER = re.compile(r"results/(\d{4}-\d{2}-\d{2}-[A-Za-z0-9_.-]+?)(?=[/)`'\"\s,;:]|$)")
#: paths of the developers' machines, never of a user's checkout
PRIVATE = ("shared/gpu", "../shared", ".gpu-bundle", "/work/")
#: ``code`` spans of Markdown
CODE_SPAN = re.compile(r"`([^`\n]+)`")
#: a word that names a file of ours (a path, or a bare name of a script or module)
PATH_WORD = re.compile(r"(?<![\w$/.:-])((?:[\w.-]+/)+[\w.*-]*|[\w-]+\.(?:py|sh))(?![\w/])")
#: the status cell of an INDEX row
STATUS = re.compile(r"current|superseded by \[([^\]]+)\]\(\1/\)")


def written_docs() -> list[Path]:
    """The hand-written Markdown: README, docs/, benchmarks/, tests/ and the results READMEs and
    index (not the reports the commands generated inside a results folder)."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md",
             REPO / "tests" / "README.md", RESULTS / "INDEX.md"]
    files += sorted(p for p in RESULTS.rglob("*.md") if p.name in ("README.md", "COMMANDS.md"))
    return [p for p in files if p.is_file()]


def anchors(md: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces to ``-``."""
    out = set()
    for line in md.read_text().splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return out


def link_errors(md: Path) -> list[str]:
    """``file: target (why)`` for each relative link of ``md`` that points at nothing."""
    errors = []
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)  # code blocks hold no links
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        where = f"{md.relative_to(REPO)}: {target}"
        if not dest.exists():
            errors.append(f"{where} (no such file)")
        elif REPO not in dest.parents and dest != REPO:
            errors.append(f"{where} (outside the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            errors.append(f"{where} (no heading with this anchor)")
    return errors


def _index_rows() -> list[tuple[str, ...]]:
    """``(claim, folder, status, command, commit, date)`` of every row of ``results/INDEX.md``."""
    lines = (RESULTS / "INDEX.md").read_text().splitlines()
    return [tuple(c.strip() for c in line.strip().strip("|").split(" | "))
            for line in lines if line.startswith("|") and "](" in line]


def _path_roots() -> dict[str, list[Path]]:
    """First path component -> the folders a backticked path starting with it is read from: the
    repository's top-level folders, the package's subpackages (``integration/dtype.py``) and, where
    vLLM is installed, vLLM's (``v1/kv_cache_interface.py``: the docs name the vLLM code they hook)."""
    roots: dict[str, list[Path]] = {}
    bases = [REPO, REPO / "vllm_nvfp4"]
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin:
        bases.append(Path(spec.origin).parent)
    for base in bases:
        for d in base.iterdir():
            if d.is_dir() and not d.name.startswith((".", "_")):
                roots.setdefault(d.name, []).append(base)
    return roots


def path_errors(md: Path, roots: dict[str, list[Path]], names: set[str]) -> list[str]:
    """``file: `path``` for each path in a code span of ``md`` that names nothing: a path whose
    first folder is one of ``roots`` must exist below one of its bases (or next to ``md``, or in the
    INDEX row's folder); a bare ``*.py`` / ``*.sh`` name must be the name of a file of the tree.
    Other words (``MODEL/nvfp4_policy.json``, ``$OUT/x.json``, ``REV:path``) are the user's."""
    errors = []
    for line in md.read_text().splitlines():
        folder = re.search(r"\]\(([^)/]+)/?\)", line) if md.name == "INDEX.md" else None
        for span in CODE_SPAN.findall(line):
            for word in PATH_WORD.findall(span):
                word = word.rstrip(".,;:")
                if "/" not in word:
                    ok = word in names
                elif word.split("/")[0] not in roots:
                    continue
                else:
                    bases = [*roots[word.split("/")[0]], md.parent]
                    if folder:
                        bases.append(RESULTS / folder.group(1))
                    ok = any(next(b.glob(word.rstrip("/")), None) is not None for b in bases)
                if not ok:
                    where = md.relative_to(REPO) if REPO in md.parents else md.name
                    errors.append(f"{where}: `{word}` (in `{span[:60]}`)")
    return errors


def _file_names() -> set[str]:
    """The names of the tree's files, and of vLLM's sources where vLLM is installed."""
    names = {p.name for p in REPO.rglob("*") if ".git" not in p.parts}
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin:
        names |= {p.name for p in Path(spec.origin).parent.rglob("*.py")}
    return names


def test_backticked_paths_exist():
    roots, names = _path_roots(), _file_names()
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md",
             REPO / "tests" / "README.md", RESULTS / "INDEX.md"]
    errors = [e for md in files for e in path_errors(md, roots, names)]
    assert not errors, "backticked paths that name nothing:\n" + "\n".join(errors)


def test_path_check_catches_a_deleted_file(tmp_path):
    md = tmp_path / "a.md"
    md.write_text("`benchmarks/time_gluon_qk.py` and `compile_gluon_sm90.py`; `scripts/gpu_*.sh`, "
                  "`vllm_nvfp4/kernels/attention.py`, `MODEL/nvfp4_policy.json`, "
                  "`git show 092df1c:benchmarks/gluon_qk.py`, `integration/hooks.py`\n")
    errors = path_errors(md, _path_roots(), _file_names())
    assert [e.split(" ")[1] for e in errors] == ["`benchmarks/time_gluon_qk.py`", "`compile_gluon_sm90.py`"]


def test_anchors_follow_github(tmp_path):
    md = tmp_path / "a.md"
    md.write_text("# Compatibility: vLLM releases\n## K centering (`--k-center`) for models\nx # y\n")
    assert anchors(md) == {"compatibility-vllm-releases", "k-centering---k-center-for-models"}


def test_relative_links_resolve():
    docs = written_docs()
    assert REPO / "README.md" in docs and len(docs) > 8
    errors = [e for md in docs for e in link_errors(md)]
    assert not errors, "broken links:\n" + "\n".join(errors)


def test_named_results_folders_exist():
    missing = []
    for md in written_docs():
        for name in RESULTS_FOLDER.findall(md.read_text()):
            if not (RESULTS / name).is_dir():
                missing.append(f"{md.relative_to(REPO)}: results/{name}")
    assert not missing, "results folders named but absent:\n" + "\n".join(missing)


def test_results_index_lists_every_folder_once():
    linked = [re.search(r"\]\(([^)/]+)/?\)", row[1]).group(1) for row in _index_rows()]
    folders = sorted(p.name for p in RESULTS.iterdir() if p.is_dir())
    assert folders, "no results folders"
    assert sorted(set(linked)) == folders, (
        f"folders without a row: {sorted(set(folders) - set(linked))}; "
        f"rows without a folder: {sorted(set(linked) - set(folders))}")
    assert len(linked) == len(set(linked)), f"folders with two rows: {linked}"


def test_docs_name_no_private_paths():
    found = [f"{md.relative_to(REPO)}:{i}: {line.strip()}"
             for md in written_docs() for i, line in enumerate(md.read_text().splitlines(), 1)
             if any(p in line for p in PRIVATE)]
    assert not found, "paths outside the repository:\n" + "\n".join(found)


def test_sources_name_no_private_paths():
    """Scripts and the packages: every instruction works in a plain checkout (an offline vLLM
    bundle only through ``VLLM_BUNDLE``, never a default folder outside the repository)."""
    sources = [p for d in ("scripts", "benchmarks", "vllm_nvfp4") for p in sorted((REPO / d).rglob("*"))
               if p.suffix in (".py", ".sh", ".toml", ".yaml", ".txt") and p.is_file()
               and "__pycache__" not in p.parts]
    assert len(sources) > 20
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
             for p in sources for i, line in enumerate(p.read_text().splitlines(), 1)
             if any(s in line for s in PRIVATE)]
    assert not found, "paths outside the repository:\n" + "\n".join(found)


def test_shell_scripts_parse():
    scripts = sorted((REPO / "scripts").glob("*.sh"))
    assert len(scripts) > 5
    for sh in scripts:
        res = subprocess.run(["bash", "-n", str(sh)], capture_output=True, text=True)
        assert res.returncode == 0, f"{sh.name}: {res.stderr}"


def test_results_index_rows_name_status_command_commit_and_date():
    """Each row: claim | folder | status | command | commit | date (UTC), the date that of the
    folder's name; the claim one short line; a superseded row names an existing, current folder."""
    rows = _index_rows()
    assert rows
    current = {re.search(r"\]\(([^)/]+)/?\)", r[1]).group(1) for r in rows if r[2] == "current"}
    for row in rows:
        claim, folder, status, command, commit, date = row
        name = re.search(r"\]\(([^)/]+)/?\)", folder).group(1)
        assert claim and "`" in command, row
        assert len(claim) <= 200, f"{name}: the claim is {len(claim)} characters; one short line"
        m = STATUS.fullmatch(status)
        assert m, f"{name}: status {status!r} is neither current nor superseded by [folder](folder/)"
        assert m.group(1) is None or m.group(1) in current, f"{name}: superseded by a folder that is not current"
        assert re.search(r"\b[0-9a-f]{7,40}\b", commit), f"{name}: no commit hash in {commit!r}"
        assert date.startswith(name[:10]), f"{name}: date {date!r} is not the folder's"


def test_results_folders_are_cited_where_the_index_says():
    """Each results folder is named by a doc outside ``results/``, and every doc in its row's
    "(quoted in)" names it."""
    docs = {"README": REPO / "README.md", "benchmarks/README": REPO / "benchmarks" / "README.md"}
    docs.update({p.stem: p for p in (REPO / "docs").glob("*.md")})
    texts = {k: p.read_text() for k, p in docs.items()}
    for claim, folder, *_ in _index_rows():
        name = re.search(r"\]\(([^)/]+)/?\)", folder).group(1)
        quoted = re.search(r"\(([A-Za-z_/, ]+)\)$", claim)
        assert quoted, f"{name}: the claim does not end with (the docs that quote it)"
        named = [d.strip() for d in quoted.group(1).split(",")]
        assert all(d in docs for d in named), f"{name}: unknown doc in {named}"
        assert [d for d in named if name not in texts[d]] == [], f"{name}: not named in all of {named}"
