"""Factories, harnesses and servers the tests share (pytest's `pythonpath` setting puts tests/ on sys.path)."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent  # the repository checkout
