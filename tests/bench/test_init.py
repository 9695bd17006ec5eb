"""qwen35_lib.bench: every benchmark module has the protocol `python -m qwen35_lib.bench` calls."""

from qwen35_lib.bench import BENCHMARKS, load


def test_every_benchmark_module_has_the_protocol():
    for name in BENCHMARKS:
        module = load(name)
        assert module.DESCRIPTION and callable(module.add_arguments) and callable(module.run), name
