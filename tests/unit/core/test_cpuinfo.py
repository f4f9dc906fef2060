from harness.core.cpuinfo import cpu_flags


def test_flags_of_the_first_cpu(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(p) == frozenset({"fpu", "sse", "avx512f"})
    assert cpu_flags(tmp_path / "missing") is None
