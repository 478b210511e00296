"""benchmarks/llama_cpp_compare.py gives llama.cpp and lane the same thread count: --threads
reaches llama-bench, llama-server and both lane sides, and defaults to the CPUs this process
may use (its affinity, not the machine's core count)."""
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def test_threads_reach_both_sides_and_default_to_the_affinity():
    cpus = sorted(os.sched_getaffinity(0))
    code = ("import os, sys, json; os.sched_setaffinity(0, {%d}); sys.path.insert(0, %r); "
            "import llama_cpp_compare as m; a = m.parser().parse_args([]); "
            "print(json.dumps([a.threads, m.parser().parse_args(['--threads', '3']).threads, "
            "m.llama_server_argv('bin', 'x.gguf', 1, 3, 64), m.lane_serve_argv('x.gguf', 1, 3), "
            "m.lane_speed_code('float32', 'none', 'x.gguf', 3)]))") % (cpus[0], BENCH)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    default, given, llama, lane, speed = json.loads(r.stdout.strip().splitlines()[-1])
    assert default == 1 and given == 3  # one CPU allowed: one thread each, whatever the machine has
    assert llama[llama.index("-t") + 1] == "3"
    assert lane[lane.index("--threads") + 1] == "3"
    assert "threads=3, show_progress=False" in speed
    compile(speed, "lane_speed", "exec")  # the lane side's program still parses
