"""The documentation: the site builds with no broken link or reference, the API reference documents
every public name, and the README's links lead somewhere.

The site is built with `mkdocs build --strict` (mkdocs.yml), which fails on any warning: a link to
a page, file or anchor that does not exist, a `:::` identifier or a cross-reference that does not
resolve, a docstring that documents a parameter the signature does not have. It needs the `test`
extra's mkdocs packages: without them the test skips, except in CI, where they must be there.
"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The modules the API reference renders (docs/reference/*.md), whose every public name must be
# documented: mkdocstrings leaves out silently what has no docstring or cannot be resolved.
REFERENCE = ["tridist", "tridist.language", "tridist.language.shmem", "tridist.language.ll", "tridist.ops",
             "tridist.ops.collectives", "tridist.ops.gemm", "tridist.ops.moe", "tridist.ops.attention",
             "tridist.ops.norm", "tridist.ops.stencil", "tridist.nn"]


def _require(module: str):
    if os.environ.get("CI"):
        return __import__(module)
    return pytest.importorskip(module, reason="the docs tools come with the test extra: pip install -e .[test]")


def test_site_builds_strict(tmp_path):
    _require("mkdocs")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
                            timeout=300)
    assert result.returncode == 0, result.stderr[-5000:]
    assert (tmp_path / "reference" / "collectives" / "index.html").exists()


def test_reference_documents_every_public_name():
    griffe = _require("griffe")
    package = griffe.load("tridist", search_paths=[ROOT], resolve_aliases=True)
    missing = []
    for path in REFERENCE:
        module = package[path.removeprefix("tridist.")] if path != "tridist" else package
        for name in module.exports or []:
            member = module[name]
            try:
                target = member.final_target if member.is_alias else member
            except griffe.AliasResolutionError:
                missing.append(f"{path}.{name} (cannot be resolved statically)")
                continue
            if target.is_module:
                continue
            if not target.docstring:
                missing.append(f"{path}.{name}")
            if target.is_class:
                missing += [f"{path}.{name}.{m}" for m, method in target.all_members.items()
                            if (not m.startswith("_") or m == "__call__") and method.is_function
                            and not method.docstring]
    assert not missing, "undocumented in the API reference: " + ", ".join(missing)


def test_readme_links_resolve():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert targets, "the README links into the docs"
    broken = [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")
              and not os.path.exists(os.path.join(ROOT, t.split("#")[0]))]
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_every_setting_is_listed():
    """Every TRIDIST_* variable the library reads is in config.SETTINGS, which `tridist info` prints
    and the settings page shows."""
    from tridist.runtime.config import SETTINGS

    used = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "tridist")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    used |= set(re.findall(r"\bTRIDIST_[A-Z_]*[A-Z]\b", f.read()))
    assert used - set(SETTINGS) == set(), f"settings missing from config.SETTINGS: {sorted(used - set(SETTINGS))}"


def test_readme_installs_bring_what_its_run_block_needs():
    """Each of the README's installs of tridist (GPU, offline GPU, CPU) takes the `models` extra, which
    the run block's examples/llm.py needs, and the CPU one the `emulator` extra (the tested Triton)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    install = readme.split("<!-- ci:install -->")[1].split("<!-- /ci:install -->")[0]
    run_block = readme.split("<!-- /ci:test -->")[1].split("```bash")[1].split("```")[0]
    assert "examples/llm.py" in run_block
    users = [line for line in install.splitlines() if re.match(r"pip install .*-e \"\.\[", line) and "[test]" not in line]
    assert len(users) == 3, users
    for line in users:
        assert "models" in re.search(r"\[([a-z,]+)\]", line).group(1).split(","), line
    assert "emulator" in re.search(r"\[([a-z,]+)\]", users[-1]).group(1).split(","), users[-1]


def test_front_pages_stay_short():
    """The README is a front page (at most 15,000 bytes) and the performance page a current table (at
    most 350 lines): older figures go to the lab notebook (benchmarks/NOTES.md)."""
    assert os.path.getsize(os.path.join(ROOT, "README.md")) <= 15000
    with open(os.path.join(ROOT, "docs", "performance.md")) as f:
        assert len(f.read().splitlines()) <= 350


def test_readme_run_block_names_what_exists():
    """Every script and module the README's run block runs is in the repository (the block itself was
    run top to bottom after the CPU install in a fresh environment: benchmarks/NOTES.md)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    run_block = readme.split("<!-- /ci:test -->")[1].split("```bash")[1].split("```")[0]
    scripts = re.findall(r"\s(\S+\.py)\b", run_block)
    modules = re.findall(r"-m ([\w.]+)", run_block)
    assert scripts and modules
    missing = [s for s in scripts if not os.path.exists(os.path.join(ROOT, s))]
    missing += [m for m in modules if not os.path.exists(os.path.join(ROOT, *m.split(".")) + ".py")]
    assert not missing, missing
