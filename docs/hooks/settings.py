"""MkDocs hook: the table of TRIDIST_* settings, from `SETTINGS` in tridist/runtime/config.py (the
list `tridist info` prints), in place of the marker on the settings page. config.py is loaded on
its own (it imports only `os`), so building the docs needs neither torch nor triton.
"""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARKER = "<!-- settings -->"


def settings() -> dict:
    spec = importlib.util.spec_from_file_location("tridist_config", ROOT / "tridist" / "runtime" / "config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SETTINGS


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    rows = ["| setting | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{name}` | {default} | {meaning} |" for name, (default, meaning) in settings().items()]
    return markdown.replace(MARKER, "\n".join(rows))
