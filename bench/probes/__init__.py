"""One-off probes behind a record in bench/results: each module says which record it wrote. Kept so that the record
can be re-run (`python -m bench.ab --before OLD_TREE -- -m bench.probes.<name>`); not part of any suite."""
