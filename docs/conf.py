"""Sphinx configuration of the tensorwire documentation site (`make docs`).

Pages are Markdown (MyST); the CLI reference comes from the click commands (sphinx-click) and the
API reference from the docstrings (autodoc + napoleon). The build is offline and strict: `make docs`
runs with warnings as errors and nitpicky cross-references, so a broken link between pages, a
missing anchor or a reference to a name that does not exist fails it.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

from sphinx.util.docstrings import prepare_docstring

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE / "_ext"))

import tensorwire  # noqa: E402  (after the path above)

project = "tensorwire"
author = "the tensorwire authors"
copyright = "2026, the tensorwire authors"
release = tensorwire.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_click",
    "tensorwire_config",  # docs/_ext: the configuration table, from the click commands themselves
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]

# MyST: ``:::`` fences for admonitions, definition lists, and an anchor for every heading down to
# ``###`` so that ``[text](page.md#a-heading)`` links are checked like any reference.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Strict cross-references. The build has no network, so there are no intersphinx inventories: a
# reference into torch, Ray, vLLM or the standard library cannot resolve and is not ours to check.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|ray|vllm|transformers|grpc|click|aiohttp|numpy|safetensors)(\..*)?"),
    (
        r"py:.*",
        r"(asyncio|collections|concurrent|contextlib|enum|os|pathlib|ssl|socket|typing"
        r"|types|datetime|threading|logging|io|abc|dataclasses)(\..*)?",
    ),
    (
        r"py:class",
        r"(Path|Tensor|Module|Any|Callable|Iterator|Iterable|Mapping|Sequence|Awaitable"
        r"|AsyncIterator|Self|TracebackType|SSLContext|Literal|Enum|IntEnum|IntFlag|Exception"
        r"|BaseException|memoryview|bytes|bytearray|NoneType|ellipsis|T|_T|P)",
    ),
    # Type hints name classes of the inner layers (store, server, transport, wire, client) that the
    # reference does not document as pages of their own, and names imported only for type checking
    # (torch.distributed's planners, vLLM's types): those are links we did not write.
    (
        r"py:class",
        r"tensorwire\.(_aio|client|server|store|transport|wire|topology|types|ps|dataset"
        r"|ray|sharded|vllm|broadcast)\.[\w.]+",
    ),
    (
        r"py:class",
        r"(Extension|DeviceStaging|SegmentPool|ProcessGroup|Metadata|LoadPlan|LoadPlanner"
        r"|SavePlan|SavePlanner|WriteResult|StorageMeta|Future|ReadItem|WriteItem)",
    ),
]

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"tensorwire {release}"
html_static_path = ["_static"]
html_css_files = ["tensorwire.css"]


def _prose_first_lines(*args: Any) -> None:
    """Napoleon reads a property's first line ``X: Y`` as a Google-style "type: text" and moves X
    to a ``:type:`` field; ours are prose (``The transport this client's calls take: ...``). Run
    after it, this puts the line back as it was written."""
    _, what, _, obj, _, lines = args  # app, what, name, obj, options, lines: Sphinx's event
    if what not in ("property", "attribute", "data") or len(lines) < 2:
        return
    if not (lines[-1].startswith(":type: ") and lines[-2] == ""):
        return
    written = inspect.getdoc(obj) if isinstance(obj, property) else None
    if written:
        lines[:] = prepare_docstring(written)
    else:
        first = lines[-1].removeprefix(":type: ")
        del lines[-2:]
        lines[0] = f"{first}: {lines[0]}" if lines and lines[0] else first


def setup(app: Any) -> None:
    app.connect("autodoc-process-docstring", _prose_first_lines, priority=600)  # napoleon's is 500
