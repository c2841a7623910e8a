"""`stepscope bench` input errors: one clear line on stderr and exit code 2, before any load is sent."""

import pytest

from loadgen.cli import parse_duration, parse_loads, parse_shift
from stepscope.cli import UsageError, main
from tests.support.net import free_port


@pytest.mark.parametrize(
    ("text", "seconds"), [("2s", 2.0), ("200ms", 0.2), ("1m", 60.0), ("1.5h", 5400.0), ("15", 15.0)]
)
def test_durations_parse_with_units(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "2 secs", "-1s", "0", "ms", "1d", "fast"])
def test_bad_durations_are_usage_errors(text):
    with pytest.raises(UsageError, match="bad duration"):
        parse_duration(text)


def test_step_loads_must_be_increasing_and_integer_for_concurrency():
    assert parse_loads("1,2,4,8", integers=True) == [1, 2, 4, 8]
    assert parse_loads("0.5,1.5", integers=False) == [0.5, 1.5]
    for bad, ints in (("1,x", True), ("4,2", True), ("0,1", True), ("1.5,2", True), ("", False)):
        with pytest.raises(UsageError):
            parse_loads(bad, integers=ints)


def test_shift_specs_parse_into_workload_shifts():
    s = parse_shift("at=30s,prompt_len=2,rate=1.5,prefix_change=0.3")
    assert (s.start_s, s.prompt_len_factor, s.rate_factor, s.prefix_change_fraction) == (30.0, 2.0, 1.5, 0.3)
    assert parse_shift("at=0,rate=2").start_s == 0.0
    for bad in ("at=10s,speed=2", "prompt_len", "at=5s,prefix_change=2"):
        with pytest.raises(UsageError, match="bad --shift"):
            parse_shift(bad)


def _bench(capsys, *args: str) -> tuple[int, str]:
    code = main(["bench", *args])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--slo-ttft", "2 seconds"], "--slo-ttft"),
        (["--slo-tpot", "fast"], "--slo-tpot"),
        (["--duration", "forever"], "bad duration"),
        (["--step-load", "1,two"], "--step-load"),
        (["--rate", "2", "--concurrency", "3"], "not both"),
        (["--workload", "/nonexistent/trace.jsonl"], "neither"),
        (["--rate", "-1"], "rate must be > 0"),
        (["--arrival", "gamma", "--rate", "1", "--burstiness", "0"], "burstiness"),
        (["--slo-target", "2"], "target"),
    ],
)
def test_bad_input_gets_one_line_and_exit_code_2(capsys, tmp_path, args, needle):
    code, err = _bench(
        capsys, "--url", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "r.json"), *args
    )
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and needle in err
    assert not (tmp_path / "r.json").exists()


def test_an_unreachable_url_gets_one_line_and_exit_code_2(capsys, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    code, err = _bench(capsys, "--url", url, "--duration", "1s", "--out", str(tmp_path / "r.json"))
    assert code == 2
    assert err.strip().splitlines() == [err.strip()] and f"cannot reach {url}" in err


def test_a_url_without_a_scheme_is_refused(capsys, tmp_path):
    code, err = _bench(capsys, "--url", "localhost:8000", "--out", str(tmp_path / "r.json"))
    assert code == 2 and "bad --url" in err
