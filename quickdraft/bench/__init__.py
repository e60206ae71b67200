"""Benchmarks that ship with the package: the speculative A/B (speculative.py, `quickdraft
bench`), the HTTP serving load test (serving.py, `quickdraft bench --serve`), and what every
benchmark records and writes (report.py). The one-off measurement scripts live in bench/ and use
report.py too. Benchmarks are not tests: nothing here asserts a speed."""
