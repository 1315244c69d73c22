"""The commands' console: every message printed as it is, only the labels we add styled.

Messages carry file names, section names and values from the data (`dataset.toml: [general]: ...`,
`photo[v2].png`), which rich would read as markup and drop; so the console reads no markup at all,
and a label is styled by passing the style, never by a tag in the text.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text


def make_console() -> Console:
    """Console output, markup off; when piped, 160 columns wide so bucket signatures and paths stay on one line."""
    console = Console(soft_wrap=True, markup=False, highlight=False)
    return console if console.is_terminal else Console(soft_wrap=True, width=160, markup=False, highlight=False)


def labelled(label: str, style: str, message: object) -> Text:
    """`label message`, the label in `style`, the message exactly as given."""
    return Text.assemble((label, style), " ", str(message))
