"""Moved to :mod:`mpsim.views` (``html``, ``markdown``); the names old code imports from here."""

from mpsim.views.html import table_html
from mpsim.views.markdown import markdown_html

__all__ = ["markdown_html", "table_html"]
