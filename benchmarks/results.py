"""Result files of the benchmarks (`stepscope.results`, where `stepscope eval` can import it too): one dated
JSON file per run under benchmarks/results/ with the machine, the load before and after, and the arguments.

    from benchmarks import results
    path = results.write("ingest", result, vars(args), load_before)
"""

from stepscope.results import DIRECTORY, cpu_model, machine, short_commit, write, write_result

__all__ = ["DIRECTORY", "cpu_model", "machine", "short_commit", "write", "write_result"]
