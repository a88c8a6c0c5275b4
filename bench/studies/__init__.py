"""One-off studies whose results are in WORKSPACE.md (and the tables of docs/), kept so that those
commands still reproduce (`python -m bench.studies.<name>`); not maintained as user tools. They may
import the kept benchmarks beside `bench/` (`bench.measure`, `bench.eager_torch`); nothing outside
this folder imports them but the tests that keep them working."""
