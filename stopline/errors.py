"""Errors shared across layers (defined at the bottom so that any layer may raise them)."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but describes a model stopline cannot run."""
