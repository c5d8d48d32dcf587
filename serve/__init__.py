"""Manyfold: serve many fine-tuned variants of one base model from one copy of the base."""

__version__ = "0.1.0"
