"""The documentation's code runs, and every name it writes exists.

The pages are README.md and every `docs/**/*.md` page. Each page's ```python
blocks are extracted and executed one after the other in one fresh
interpreter per page (a subprocess), sharing one namespace as a reader's
session would. Each block is compiled with the page's path as its file name
and its own line numbers, so a traceback points at the page line that failed.
A `DeprecationWarning` raised by a block's own code (a renamed keyword, say)
is an error there: the docs show the current names.

A block that needs an optional package says so on its first line,
`# needs: torch, transformers`; it is left out of the run when one of them is
not installed (the rest of the page still runs, so no later block may use its
names). Running the pages compiles a great many small programs, so it is in
the slow set, but for the pages in `DEFAULT_RUN`, which run in seconds.

The default run checks, for every page (and `benchmarks/README.md`), that
every dotted `blocklab.x.y` path it writes and every `bl.` name its code uses
exists under its current name, that the API reference's `:::` targets and
their `members` exist, that every docs page is in the site's navigation and
that the relative links of the Markdown files point at files that exist.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

#: Every page whose Python blocks run: the README and the docs site.
PAGES = [
    "README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*.md")),
]

#: Pages whose names and paths are checked, but whose blocks do not run.
NAME_ONLY_PAGES = ["benchmarks/README.md"]

#: Pages whose blocks run in the default run too (seconds each on 2 CPU cores).
DEFAULT_RUN = {"docs/index.md", "docs/guides/refusals.md"}

#: A fenced block that opens with exactly ```python (not ```bash, not ```).
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)

#: The marker of a block that needs optional packages, on its first line.
_NEEDS = re.compile(
    r"\A#\s*needs:\s*([A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*)\s*$", re.M
)

#: Imports of the optional packages that only the tests' extras install.
_OPTIONAL_IMPORT = re.compile(r"^\s*(?:import|from)\s+(torch|transformers)\b", re.M)

#: Runs the blocks given as (first line, source) pairs in one namespace.
_RUNNER = """\
import time, warnings
warnings.filterwarnings("error", category=DeprecationWarning, module="__main__")
namespace = {"__name__": "__main__"}
start = time.perf_counter()
for line, source in BLOCKS:
    print(f"--- {PAGE} block at line {line}", flush=True)
    code = compile("\\n" * (line - 1) + source, PAGE, "exec")
    exec(code, namespace)
    print(f"    done at {time.perf_counter() - start:.1f} s wall,"
          f" {time.process_time():.1f} s CPU", flush=True)
print(f"--- all {PAGE} blocks ran", flush=True)
"""


def python_blocks(markdown: str) -> list[tuple[int, str]]:
    """The ```python blocks of `markdown` as (line of their first code line, source)."""
    return [
        (markdown.count("\n", 0, m.start(1)) + 1, m.group(1))
        for m in _FENCE.finditer(markdown)
    ]


def needs(source: str) -> tuple[str, ...]:
    """The packages a block's first-line `# needs: a, b` marker names (or none)."""
    m = _NEEDS.match(source)
    return tuple(n.strip() for n in m.group(1).split(",")) if m else ()


def runnable(blocks, installed=None):
    """`blocks` without those needing a package that is not installed; and those."""
    installed = installed or (lambda name: importlib.util.find_spec(name) is not None)
    kept, skipped = [], []
    for line, source in blocks:
        ok = all(installed(name) for name in needs(source))
        (kept if ok else skipped).append((line, source))
    return kept, skipped


def run_blocks(blocks, cwd: Path, page: str = "README.md", timeout: float = 600):
    """Run `blocks` of `page` in order in a fresh interpreter; the CompletedProcess."""
    program = f"BLOCKS = {blocks!r}\nPAGE = {page!r}\n{_RUNNER}"
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run(
        [sys.executable, "-c", program],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


# ------------------------------------------------------------ the machinery
def test_blocks_are_extracted_in_order_with_their_line_numbers():
    markdown = (
        "# title\n"  # line 1
        "```bash\n"
        "echo no\n"
        "```\n"
        "```python\n"  # line 5
        "a = 1\n"  # line 6
        "b = a + 1\n"
        "```\n"
        "text\n"
        "```\n"  # an untyped block (shell output) is not Python
        "blocklab census\n"
        "```\n"
        "```python\n"
        "print(b)\n"  # line 14
        "```\n"
    )
    assert python_blocks(markdown) == [(6, "a = 1\nb = a + 1\n"), (14, "print(b)\n")]


def test_a_failing_block_fails_the_run_and_names_its_page_line(tmp_path):
    blocks = [(3, "import math\nx = math.sqrt(4)\n"), (10, "\n\ny = x + undefined\n")]
    result = run_blocks(blocks, tmp_path, "docs/guides/page.md", timeout=60)
    assert result.returncode != 0
    assert 'File "docs/guides/page.md", line 12' in result.stderr
    assert "NameError" in result.stderr
    ok = run_blocks(
        [(3, "import math\nx = math.sqrt(4)\n"), (10, "y = x + 1\n")], tmp_path
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("--- README.md block at line") == 2


def test_a_deprecation_warning_in_a_block_fails_the_run(tmp_path):
    source = "import warnings\nwarnings.warn('old name', DeprecationWarning)\n"
    result = run_blocks([(1, source)], tmp_path, timeout=60)
    assert result.returncode != 0
    assert "DeprecationWarning: old name" in result.stderr


def test_a_needs_marker_leaves_the_block_out_without_its_packages():
    blocks = [
        (2, "# needs: torch, transformers\nimport torch\n"),
        (8, "#needs:no_such_package_here\nx = 1\n"),
        (12, "y = 2  # needs: nothing, not on the first line\n"),
    ]
    assert needs(blocks[0][1]) == ("torch", "transformers")
    assert needs(blocks[1][1]) == ("no_such_package_here",)
    assert needs(blocks[2][1]) == ()
    kept, skipped = runnable(
        blocks, installed=lambda name: name != "no_such_package_here"
    )
    assert kept == [blocks[0], blocks[2]]
    assert skipped == [blocks[1]]


@pytest.mark.parametrize("page", PAGES)
def test_a_block_that_imports_torch_or_transformers_says_so(page):
    for line, source in python_blocks(read(page)):
        for name in _OPTIONAL_IMPORT.findall(source):
            assert name in needs(source), (
                f"{page}:{line} imports {name} without `# needs:`"
            )


# ------------------------------------------------------ names, paths, links
def resolve(dotted: str):
    """The module or attribute that `dotted` (`blocklab.nn.functional.rope`) names."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not (
                module == e.name or module.startswith(e.name + ".")
            ):
                raise  # a module that exists failed to import one of its own imports
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def _documented_paths(markdown: str) -> set[str]:
    """Every dotted `blocklab.x.y` path written in `markdown` (prose and code)."""
    # not a file name in a link or a path (`(blocklab.md)`, `reference/blocklab.md`)
    return set(re.findall(r"(?<![/(])\bblocklab(?:\.[A-Za-z_]\w*)+", markdown))


def _bl_names(markdown: str) -> set[str]:
    """Every `bl.Name` used in the ```python blocks of `markdown`."""
    code = "\n".join(source for _, source in python_blocks(markdown))
    return set(re.findall(r"\bbl\.([A-Za-z_]\w*)", code))


@pytest.mark.parametrize("page", PAGES + NAME_ONLY_PAGES)
def test_every_documented_path_and_name_is_a_current_one(page):
    import blocklab as bl

    markdown = read(page)
    for path in sorted(_documented_paths(markdown)):
        resolve(path)  # raises on a path that does not exist (any more)
    assert sorted(_bl_names(markdown) - set(bl.__all__)) == []
    for line, source in python_blocks(markdown):
        compile("\n" * (line - 1) + source, page, "exec")


def test_the_path_check_can_fail():
    markdown = (
        "`blocklab.nn.nothing_here` and `blocklab.nowhere.at_all`, not"
        " [a page](blocklab.md) or reference/blocklab.md\n"
    )
    assert _documented_paths(markdown) == {
        "blocklab.nn.nothing_here",
        "blocklab.nowhere.at_all",
    }
    with pytest.raises(AttributeError):
        resolve("blocklab.nn.nothing_here")
    with pytest.raises(AttributeError):
        resolve("blocklab.nowhere.at_all")
    assert _bl_names("```python\nbl.gelu(x)\n```\n") == {"gelu"}
    assert resolve("blocklab.nn.functional.rope").__name__ == "rope"
    assert resolve("blocklab.nn").__name__ == "blocklab.nn"


def test_the_reference_lists_every_top_level_name_once():
    import blocklab as bl

    table = read("docs/reference/blocklab.md").split("| names | layer |")[1]
    listed = [
        name
        for row in table.strip().splitlines()[1:]
        for name in re.findall(r"`(\w+)`", row.split("|")[1])
    ]
    assert sorted(listed) == sorted(bl.__all__)


#: A mkdocstrings directive, `::: blocklab.x`, and its indented options below it.
_DIRECTIVE = re.compile(r"^:::[ \t]+(\S+)[ \t]*\n((?:[ \t]+\S.*\n?)*)", re.M)


def _directives(markdown: str) -> list[tuple[str, list[str]]]:
    """The `::: target` directives of a page with their `members:` lists."""
    found = []
    for m in _DIRECTIVE.finditer(markdown):
        options = m.group(2)
        members = re.search(r"members:\s*\[([^\]]*)\]", options)
        names = [n.strip() for n in members.group(1).split(",")] if members else []
        found.append((m.group(1), [n for n in names if n]))
    return found


def test_the_api_reference_targets_and_their_members_exist():
    pages = sorted((DOCS / "reference").rglob("*.md"))
    targets = [d for page in pages for d in _directives(page.read_text("utf-8"))]
    assert len(targets) >= 8  # one page per layer, some with several targets
    for target, members in targets:
        obj = resolve(target)
        for name in members:
            assert hasattr(obj, name), f"::: {target} lists {name}, which it lacks"
    assert _directives(
        "::: blocklab.nn\n    options:\n      members: [Stack, rope]\n"
    ) == [("blocklab.nn", ["Stack", "rope"])]


def test_every_docs_page_is_in_the_site_navigation():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in PAGES:
        if page.startswith("docs/"):
            name = page.removeprefix("docs/")
            assert re.search(rf":\s*{re.escape(name)}\s*$", config, re.M), name


#: A Markdown link or image target: `](target)`, without a scheme.
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of `markdown` (outside code blocks)."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", prose, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_point_at_files_that_exist(page):
    for target in _LINK.findall(read(page)):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the page
        file, _, anchor = target.partition("#")
        path = (ROOT / page).parent / file
        assert path.exists(), f"{page} links to {target}, which does not exist"
        if anchor and page == "README.md":  # mkdocs checks the docs' own anchors
            anchors = _github_anchors(path.read_text(encoding="utf-8"))
            assert anchor in anchors, f"README.md links to {target}: no such heading"


def test_anchors_are_those_github_gives():
    markdown = (
        "# A known crash of jaxlib 0.10.2 (and 0.11.0)\n```\n# not a heading\n```\n"
    )
    assert _github_anchors(markdown) == {"a-known-crash-of-jaxlib-0102-and-0110"}
    assert "what-the-big-ones-need-blocklab-plan" in _github_anchors(
        "## What the big ones need: `blocklab plan`\n"
    )


def test_the_readme_is_a_front_page():
    readme = read("README.md")
    assert readme.count("\n") <= 250
    bash = re.findall(r"^```bash\n(.*?)^```", readme, re.S | re.M)
    assert bash[:2] == [
        "python3 -m pip install . && blocklab report\n",
        'python3 -m pip install -e ".[dev]" && python3 -m pytest\n',
    ]


# ------------------------------------------------------------- the runs
def _page_params():
    for page in PAGES:
        if not python_blocks(read(page)):
            continue
        marks = () if page in DEFAULT_RUN else (pytest.mark.slow,)
        yield pytest.param(page, marks=marks, id=page)


@pytest.mark.parametrize("page", list(_page_params()))
def test_every_python_block_of_the_page_runs_in_order(page, tmp_path):
    blocks, skipped = runnable(python_blocks(read(page)))
    result = run_blocks(blocks, tmp_path, page, timeout=1200)
    if result.returncode != 0:
        pytest.fail(
            f"a {page} block failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}",
            pytrace=False,
        )
    assert result.stdout.count(f"--- {page} block at line") == len(blocks)
    if skipped:
        lines = ", ".join(str(line) for line, _ in skipped)
        pytest.skip(f"{page}: blocks at lines {lines} need packages not installed")


# ------------------------------------------------------------- the site
def _site_config() -> dict:
    import yaml

    return yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))


def _is_remote(url: str) -> bool:
    """A URL with a scheme (`https:`) or protocol-relative (`//host/...`)."""
    return bool(re.match(r"([a-z][a-z0-9+.-]*:|//)", url, re.I))


def test_the_site_loads_no_script_style_or_font_from_the_network():
    config = _site_config()
    assets = [*config.get("extra_javascript", []), *config.get("extra_css", [])]
    assert any("mathjax" in a for a in assets)
    for asset in assets:
        path = asset if isinstance(asset, str) else asset["path"]
        assert not _is_remote(path), f"mkdocs.yml loads {path} from the network"
        assert (DOCS / path).is_file(), f"mkdocs.yml names {path}, not in docs/"
    assert config["theme"].get("font") is False  # no Google Fonts
    assert not _is_remote("javascripts/mathjax/tex-chtml-full.js")
    assert _is_remote("https://unpkg.com/mathjax@3/es5/tex-mml-chtml.js")
    assert _is_remote("//cdn.example/x.js")


#: The assets a built page loads: `<script src=...>` and stylesheet links.
_ASSET = re.compile(
    r"<script[^>]*\bsrc=\"([^\"]+)\"|<link[^>]*rel=\"stylesheet\"[^>]*href=\"([^\"]+)\""
)


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    """The site built with its own settings (less the API reference's plugin,
    which takes a minute), into a temporary folder; its `site/` folder."""
    import json

    tmp_path = tmp_path_factory.mktemp("site")
    site = tmp_path / "site"
    config = tmp_path / "mkdocs.yml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "INHERIT": str(ROOT / "mkdocs.yml"),
                "docs_dir": str(DOCS),
                "site_dir": str(site),
                "plugins": ["search"],
                "hooks": [str(DOCS / "_hooks" / "families.py")],
                "nav": [{"Looking inside": "guides/interp.md"}],
            }
        ),
        encoding="utf-8",
    )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "-q", "-f", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    return site


def test_the_built_site_renders_maths_offline(built_site):
    """A page with formulas loads MathJax and its fonts from files of the
    site, and nothing from the network."""
    page = built_site / "guides" / "interp" / "index.html"
    html = page.read_text(encoding="utf-8")
    assert html.count('class="arithmatex"') >= 5  # the formulas, left for MathJax
    assets = [a or b for a, b in _ASSET.findall(html)]
    for asset in assets:
        assert not _is_remote(asset), f"the page loads {asset} from the network"
        assert (page.parent / asset).resolve().is_file(), asset
    scripts = [a for a in assets if "mathjax" in a]
    assert len(scripts) == 2, scripts  # its settings, then MathJax itself
    mathjax = (page.parent / scripts[-1]).resolve()
    assert mathjax.stat().st_size > 1_000_000  # the whole component, not a stub
    # MathJax's CHTML output loads its fonts from beside the script
    fonts = mathjax.parent / "output" / "chtml" / "fonts" / "woff-v2"
    assert len(list(fonts.glob("MathJax_*.woff"))) >= 20
    assert (fonts / "MathJax_Main-Regular.woff").is_file()
    assert "fontURL" not in (DOCS / "javascripts" / "mathjax.js").read_text("utf-8")


def test_a_browser_typesets_every_formula_offline(built_site):
    """Where a headless Chromium is installed: the page opened from file://
    (no network) ends with one typeset formula per formula of the page."""
    import shutil

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    page = built_site / "guides" / "interp" / "index.html"
    formulas = page.read_text(encoding="utf-8").count('class="arithmatex"')
    dom = subprocess.run(
        [browser, "--headless=new", "--no-sandbox", "--disable-gpu",
         "--disable-dev-shm-usage", "--virtual-time-budget=10000", "--dump-dom",
         page.as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    assert dom.count("<mjx-container") == formulas >= 5


def test_the_stylesheet_wraps_code_and_keeps_names_in_tables_whole():
    css = (DOCS / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    rules = {k.strip(): v for k, v in re.findall(r"([^{}]+?)\{([^}]*)\}", css)}
    assert "white-space: pre-wrap" in rules[".md-typeset pre > code"]
    table = rules[".md-typeset table:not([class]) code"]
    assert "word-break: normal" in table and "overflow-wrap: normal" in table
    first = rules[".md-typeset table:not([class]) td:first-child code"]
    assert "white-space: nowrap" in first  # a site's name is not split at its dots


# ------------------------------------------------ generated from the code
def _families_hook():
    spec = importlib.util.spec_from_file_location(
        "families_hook", DOCS / "_hooks" / "families.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as mkdocs loads it (its dataclass needs it)
    spec.loader.exec_module(module)
    return module


def _registered_classes() -> dict[str, list[str]]:
    """family name -> `transformers` classes, read from the registry."""
    import blocklab  # noqa: F401  (registers every family)
    from blocklab.interop import FAMILIES

    return {name: list(f.classes) for name, f in FAMILIES.items()}


def test_the_families_page_lists_every_registered_family_and_class():
    hook = _families_hook()
    markdown = read("docs/families.md")
    page = hook.on_page_markdown(markdown, None, None, None)  # what the site shows
    assert page == markdown, "docs/families.md is stale: python docs/_hooks/families.py"
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    registered = _registered_classes()
    assert len(rows) == len(registered) >= 19
    for name, classes in registered.items():
        (row,) = [r for r in rows if r.startswith(f"| `{name}` |")]
        for cls in classes:
            assert f"`{cls}`" in row, (name, cls)
    for cls in ("LlamaForCausalLM", "GPT2LMHeadModel", "BertModel", "T5EncoderModel"):
        assert f"`{cls}`" in page  # by hand: a registry that lost them fails
    assert f"blocklab converts {len(registered)} families" in page


def test_the_generated_part_is_replaced_whole():
    hook = _families_hook()
    one = hook.Family("llama", "decoder", ("LlamaForCausalLM",), ("llama",))
    page = f"intro\n{hook.BEGIN}\nold text\n| `gone` |\n{hook.END}\noutro\n"
    out = hook.render(page, [one])
    assert out.startswith(f"intro\n{hook.BEGIN}\nblocklab converts 1 families")
    assert "old text" not in out and "`gone`" not in out
    assert "| `llama` | decoder | `LlamaForCausalLM` | `llama` |" in out
    assert out.endswith(f"{hook.END}\noutro\n")
    assert hook.render(out, [one]) == out
    assert hook.render("no markers\n", [one]) == "no markers\n"


def test_the_readme_counts_the_registered_families():
    families = _families_hook().registered()
    decoders = sum(f.kind == "decoder" for f in families)
    readme = " ".join(read("README.md").split())
    assert f"converts {len(families)} families" in readme
    assert f"{decoders} decoders" in readme
    assert f"{len(families) - decoders} encoders and encoder–decoders" in readme


def test_the_report_pages_count_its_sections():
    """The README and the install page say how many sections the report has,
    and which ones its last timing run did not measure (report_times.json)."""
    from blocklab.cli.commands import REPORT_SECTIONS
    from blocklab.experiments import timing

    measured = timing.measured_report_times("cpu")["sections"]
    unmeasured = [name for name in REPORT_SECTIONS if name not in measured]
    readme = " ".join(read("README.md").split())
    install = " ".join(read("docs/install.md").split())
    assert f"It has {len(REPORT_SECTIONS)} sections" in readme
    assert f"the {len(measured)} it had then" in readme
    assert f"figures: {len(REPORT_SECTIONS)} sections" in install
    assert f"for the {len(measured)} sections the report had then" in install
    for name in REPORT_SECTIONS:
        assert f"`{name}`" in install
    for name in unmeasured:
        assert name in readme and name in install
