"""Turning a tuning report into something people read: markdown for CI logs, one HTML file."""

from .html import render_html
from .markdown import render_markdown

__all__ = ["render_html", "render_markdown"]
