"""Turning attribution reports into files people read: plots (PNG)."""

from .plots import plot_attribution

__all__ = ["plot_attribution"]
