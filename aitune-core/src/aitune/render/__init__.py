"""Rendering a tuning report (the data of :mod:`aitune.report`) for people: markdown for CI logs, one HTML file."""

from .html import render_html
from .markdown import render_markdown

__all__ = ["render_html", "render_markdown"]
