"""stopline/bench/machine.py: the host and commit every benchmark's results file records."""

from __future__ import annotations

from stopline.bench import machine
from stopline.bench.stop_report import summary
from tests.bench_support import assert_stamped


def test_stamp_names_the_host_its_kernel_flags_and_the_commit() -> None:
    s = machine.stamp()
    assert set(s) == {"machine", "git"}
    assert_stamped(s)
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")),
                 [])
    assert s["machine"]["isa"] == [f for f in machine.KERNEL_FLAGS if f in flags]
    # the host class: AMX advertised or not, and where advertised, whether its tiles are granted
    amx = s["machine"]["amx_granted"]
    if "amx_tile" not in flags:
        assert amx is None and "AMX" not in s["machine"]["summary"]
    else:
        from stopline.model.kernels import native

        assert amx == (native.has_bf16() and "amx_bf16" in flags and native.kernels().stopline_amx_init() == 0)
        assert ("AMX granted" if amx else "AMX advertised but not granted") in s["machine"]["summary"]


def test_an_older_results_file_still_renders() -> None:
    """`bench stop` files written before the stamp hold the machine as a string."""
    assert machine.summary("x86_64, 2 cores, torch 2.13.0+cpu") == "x86_64, 2 cores, torch 2.13.0+cpu"
    assert machine.summary({"summary": "AMD EPYC, 2 cores"}) == "AMD EPYC, 2 cores"
    storm = {"ratio_twins_over_aborts": 1.0, "tokens_after_abort_per_abort": 0.0}
    old = {"machine": "x86_64, 2 cores", "command": "stopline bench stop", "cancel_storm": storm,
           "cancel_storm_under_pressure": storm, "preemption_storm": {"rows": []}}
    assert "on x86_64, 2 cores;" in summary(old, "stop.json")


def test_every_benchmark_module_owns_its_flags_and_run():
    """`stopline bench NAME`: cli.py names the module; the module has configure and main."""
    import argparse
    import importlib

    from stopline.cli import _BENCHES

    assert len(_BENCHES) == len({name for name, *_ in _BENCHES}) == 14
    for name, _help, module in _BENCHES:
        mod = importlib.import_module(module)
        p = argparse.ArgumentParser(prog=f"stopline bench {name}")
        mod.configure(p)
        assert callable(mod.main), module


def test_spec_results_name_their_host_and_commit(tmp_path) -> None:
    import json

    from stopline.bench import spec

    result = {**machine.stamp(), "command": "stopline bench spec", "rows": []}
    spec.write(result, tmp_path)
    assert_stamped(json.loads((tmp_path / "spec.json").read_text()))
    assert (tmp_path / "spec.md").read_text().startswith(
        f"Host: {result['machine']['summary']}, commit {result['git']}; `stopline bench spec`\n\n| workload")
