"""Turning results into files people use: run folders, Markdown tables, plots (PNG)."""

from .markdown import attribution_table, table
from .plots import plot_attribution
from .run_folder import RunFolder

__all__ = ["RunFolder", "attribution_table", "plot_attribution", "table"]
