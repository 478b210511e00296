"""benchmarks/llama_cpp_compare.py gives llama.cpp and lane the same thread count: --threads
reaches llama-bench, llama-server and both lane sides, and defaults to the CPUs this process
may use (its affinity, not the machine's core count)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_threads_reach_both_sides_and_default_to_the_affinity():
    import llama_cpp_compare as m

    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})  # one CPU allowed, whatever the machine has
    try:
        assert m.parser().parse_args([]).threads == 1
    finally:
        os.sched_setaffinity(0, cpus)
    assert m.parser().parse_args([]).threads == len(cpus)
    assert m.parser().parse_args(["--threads", "3"]).threads == 3
    llama = m.llama_server_argv("bin", "x.gguf", 1, 3, 64)
    assert llama[llama.index("-t") + 1] == "3"
    lane = m.lane_serve_argv("x.gguf", 1, 3)
    assert lane[lane.index("--threads") + 1] == "3"
    speed = m.lane_speed_code("float32", "none", "x.gguf", 3)
    assert "threads=3, show_progress=False" in speed
    compile(speed, "lane_speed", "exec")  # the lane side's program still parses
