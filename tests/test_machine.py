import platform

from attnzoo.machine import cpu_name


def test_cpu_name_is_linuxs_model_name_else_platforms(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B14\nflags\t: fpu\n")
    assert cpu_name(str(info)) == "AMD EPYC 9B14"
    monkeypatch.setattr(platform, "processor", lambda: "x86_64 by platform")
    info.write_text("processor\t: 0\n")  # no model name (some ARM kernels)
    assert cpu_name(str(info)) == "x86_64 by platform"
    assert cpu_name(str(tmp_path / "absent")) == "x86_64 by platform"
    monkeypatch.setattr(platform, "processor", lambda: "")  # platform may not know either
    assert cpu_name(str(tmp_path / "absent")) == platform.machine()
