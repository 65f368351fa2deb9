# Convenience targets; each is the plain command the README documents.
.PHONY: install check test test-all

install:
	pip install torch==2.13.0
	pip install -e ".[dev]"

check:
	ruff check .

test:
	python -m pytest -q -m "not slow"

test-all:
	python -m pytest -q
