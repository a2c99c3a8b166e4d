"""MkDocs hook: a page for every tutorials/NN-slug.py, listed in the nav and on tutorials/index.md.

A tutorial is one runnable file (format: docs/tutorials/index.md): its module docstring is
Markdown, then cells separated by lines that are exactly `# %%`; a cell's leading block of `#`
comment lines is prose, the rest is code. The page shows the prose as Markdown and the code in
Python blocks, in file order, and links the file itself, which is copied next to the page. A new
tutorial needs no edit here nor in mkdocs.yml.
"""
import ast
import pathlib

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDER = ROOT / "tutorials"
INDEX = "tutorials/index.md"
LIST_MARKER = "<!-- tutorials -->"
CELL = "# %%"


def tutorials() -> list[pathlib.Path]:
    return sorted(FOLDER.glob("[0-9][0-9]-*.py"))


def to_markdown(path: pathlib.Path) -> str:
    """The page of one tutorial: its docstring, then each cell's prose and code."""
    source = path.read_text()
    module = ast.parse(source)
    docstring = ast.get_docstring(module, clean=True)
    if not docstring or not docstring.startswith("# "):
        raise ValueError(f"{path.name}: a tutorial opens with a docstring whose first line is '# NN. Title'")
    lines = source.splitlines()[module.body[0].end_lineno:]
    parts = [docstring, f"Source: [`{path.name}`]({path.name})"]
    cells, cell = [], []
    for line in lines:
        if line == CELL:
            cells.append(cell)
            cell = []
        else:
            cell.append(line)
    cells.append(cell)
    for cell in cells:
        prose = []
        while cell and (cell[0] == "#" or cell[0].startswith("# ")):
            prose.append(cell.pop(0)[2:])
        code = "\n".join(cell).strip("\n")
        if prose:
            parts.append("\n".join(prose))
        if code:
            parts.append(f"```python\n{code}\n```")
    return "\n\n".join(parts) + "\n"


def on_config(config):
    """Each tutorial's page goes into the nav after tutorials/index.md."""
    pages = [f"tutorials/{path.stem}.md" for path in tutorials()]

    def expand(items):
        for index, item in enumerate(items):
            if item == INDEX:
                items[index + 1:index + 1] = pages
                return True
            if isinstance(item, dict) and any(isinstance(v, list) and expand(v) for v in item.values()):
                return True
        return False

    if not expand(config.nav):
        raise ValueError(f"mkdocs.yml: the nav must list {INDEX}; the tutorial pages go after it")
    return config


def on_files(files, config):
    for path in tutorials():
        files.append(File.generated(config, f"tutorials/{path.stem}.md", content=to_markdown(path)))
        files.append(File.generated(config, f"tutorials/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != INDEX:
        return markdown
    titles = [f"- [{ast.get_docstring(ast.parse(path.read_text())).splitlines()[0][2:]}]({path.stem}.md)"
              for path in tutorials()]
    return markdown.replace(LIST_MARKER, "\n".join(titles))
