"""Research sweeps: a grid of config overrides, one process and workdir per point, resumable, and
turned into a table (CSV, markdown) and charts. `python -m sweep --sweep=sweeps/NAME.py
--workdir=DIR`; sweep files live in `sweeps/`."""
