"""MkDocs hook: what the benchmarks wrote, on the site.

- Every file of benchmarks/results/ (JSON, plots, logs) is served as results/<name>, so the
  performance page shows the plots and links the JSON with plain relative links, which the strict
  build checks like any other (a renamed result file fails the build instead of leaving a dead
  link). The files stay where the benchmarks write them; nothing is copied into docs/.
- The performance page lists them all, by benchmark, in place of its marker `<!-- results -->`.
- benchmarks/NOTES.md, the lab notebook, becomes the page notes.md. It is written as plain notes
  (lists straight after a paragraph, sub-items indented by two spaces), which Python-Markdown
  would run together; `readable` adds the blank lines and indentation it needs.
"""
import pathlib
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
NOTES = ROOT / "benchmarks" / "NOTES.md"
LIST_MARKER = "<!-- results -->"


def readable(notes: str) -> str:
    out = []
    for line in notes.splitlines():
        nested = re.match(r"^  (- |\| )", line)
        if nested:
            line = "    " + line[2:]
        starts_block = re.match(r"^\s*(- |\| |\d+\. )", line)
        previous = out[-1] if out else ""
        if starts_block and previous.strip() and not re.match(r"^\s*(- |\| |\d+\. )|^\s{2,}\S", previous):
            out.append("")
        out.append(line)
    return "\n".join(out) + "\n"


def on_files(files, config):
    for path in sorted(RESULTS.iterdir()):
        if path.is_file():
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    files.append(File.generated(config, "notes.md", content=readable(NOTES.read_text())))
    return files


def listing() -> str:
    """A line per benchmark (the name before `-<device>x<ranks>-<date>`), linking each of its files."""
    groups = {}
    for path in sorted(RESULTS.iterdir()):
        benchmark = re.sub(r"-[a-z0-9]+(x\d+)?(-shared\d+)?-\d{4}-\d{2}-\d{2}(-\d+)?\.\w+$", "", path.name)
        groups.setdefault(benchmark, []).append(path.name)
    return "\n".join(f"- **{name}**: " + ", ".join(f"[{file}](results/{file})" for file in files)
                     for name, files in groups.items())


def on_page_markdown(markdown, page, config, files):
    return markdown.replace(LIST_MARKER, listing()) if LIST_MARKER in markdown else markdown
