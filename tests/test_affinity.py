"""`--cpus`: taskset-style CPU lists read with one-line errors, and pinning that reaches every thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from orpheus_tts_plugin.cli import main
from orpheus_tts_plugin.runtime.affinity import allowed_cpus, parse_cpus

CPUS = sorted(allowed_cpus())


def test_a_cpu_list_reads_like_tasksets() -> None:
    first, last = CPUS[0], CPUS[-1]
    assert parse_cpus(str(first)) == parse_cpus(f"{first}-{first}") == {first}
    assert parse_cpus(f" {last} , {first}") == {first, last}
    assert parse_cpus(",".join(map(str, CPUS))) == set(CPUS)
    if CPUS == list(range(first, last + 1)):
        assert parse_cpus(f"{first}-{last}") == set(CPUS)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a", "'a' is not a CPU number or a range like 0-3"),
        ("", "'' is not a CPU number"),
        ("0,,1", "'' is not a CPU number"),
        ("-1", "'-1' is not a CPU number"),
        ("3-1", "the range '3-1' runs backwards"),
        ("100000", "CPU 100000 is not one this process may use"),
    ],
)
def test_a_bad_cpu_list_is_refused_in_one_line_naming_its_bad_part(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        parse_cpus(text)
    assert "\n" not in str(caught.value)


def test_serve_refuses_a_cpu_it_may_not_use_before_loading_anything(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--backend", "synthetic", "--model", "", "--cpus", "100000"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("orpheus-tts serve: error: argument --cpus: CPU list '100000': CPU 100000 is not one")


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="Linux only")
def test_pinning_moves_every_running_thread_and_what_the_process_starts_later() -> None:
    code = textwrap.dedent(
        f"""
        import os, subprocess, sys, threading
        from orpheus_tts_plugin.runtime.affinity import pin_process
        started = threading.Event(); stop = threading.Event()
        def wait():
            started.set(); stop.wait()
        early = threading.Thread(target=wait); early.start(); started.wait()
        pin_process({{{CPUS[-1]}}})
        late = threading.Thread(target=stop.wait); late.start()
        seen = {{os.sched_getaffinity(int(t)) == {{{CPUS[-1]}}} for t in os.listdir("/proc/self/task")}}
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True).stdout.strip()
        stop.set(); early.join(); late.join()
        print(len(os.listdir("/proc/self/task")), seen, child)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split(maxsplit=1)[1].strip() == f"{{True}} [{CPUS[-1]}]"
